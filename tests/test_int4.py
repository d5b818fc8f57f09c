"""int4 weight-only linears (quant/int4.py): the group quantization, the CPU kernel against its dequantized
reference, and a model quantized on load computing what the same model with dequantized weights does,
eager, compiled and under EAGLE-3."""

from __future__ import annotations

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model

from redline import LLM, SamplingParams
from redline.kernels import cpu_ops
from redline.models.quantize import QUANTIZED
from redline.quant.int4 import Int4Linear, dequantize_int4, quantize_int4
from redline.train.random_init import write_random_draft


def test_a_group_reads_back_within_half_a_step():
    """The docstring's group, then fresh random weights and a narrow group far from zero: in fp32 every
    weight within scale / 2 of its read-back; with scale and zero rounded to bf16, within scale / 2 plus
    the grid's shift (8 steps' worth of bf16 rounding, 8 * 2^-9 of the scale, and the zero's 2^-9)."""
    q, scale, zero = quantize_int4(torch.tensor([[-0.3, 0.0, 0.3, 0.6]]), 4)
    assert q.tolist() == [[0, 5, 10, 15]]
    assert abs(float(dequantize_int4(q, scale, zero, 4)[0, 1])) < 1e-6
    narrow = torch.linspace(0.50, 0.52, 32).repeat(16, 4)  # [16, 128]
    for w in (torch.randn(48, 256), narrow):
        for group in (32, 64, 128):
            for dtype, slack in ((torch.float32, 1e-6), (torch.bfloat16, 2**-9)):
                q, scale, zero = quantize_int4(w, group, dtype)
                back = dequantize_int4(q, scale, zero, group)
                step, shift = (t.repeat_interleave(group, dim=1) for t in (scale, zero.abs()))
                bound = step / 2 + slack * (8 * step + shift) + 1e-7
                assert int(q.min()) >= 0 and int(q.max()) <= 15
                assert ((back - w).abs() <= bound).all(), (dtype, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_kernel_computes_the_dequantized_product(dtype, group):
    """Int4Linear against x @ dequantized^T in fp32, for 1, 4 and 37 rows and a bias: fp32 within fp32
    summation error; bf16 within 2^-6 of the largest output: the kernel rounds each dequantized weight to
    bf16 (2^-9 relative, over 256 products), then the sum, the bias added and the output (2^-9 each)."""
    linear = torch.nn.Linear(256, 96, bias=True).to(dtype)
    layer = Int4Linear.from_linear(linear, group)
    weight = dequantize_int4(*quantize_int4(linear.weight.detach(), group, dtype), group)
    for rows in (1, 4, 37):
        x = torch.randn(rows, 256).to(dtype)
        want = x.float() @ weight.t() + linear.bias.float()
        got = layer(x).float()
        tol = 1e-4 if dtype == torch.float32 else 2**-6
        assert (got - want).abs().max() <= tol * want.abs().max()


def test_shapes_the_kernel_cannot_take_name_the_layer():
    with pytest.raises(
        ValueError, match=r"size 64 does not divide down's 96 inputs .* sizes that do: \[32\]"
    ):
        Int4Linear.from_linear(torch.nn.Linear(96, 32), 64, "down")
    with pytest.raises(ValueError, match="sizes that do: none"):
        Int4Linear.from_linear(torch.nn.Linear(80, 32), 32, "o")
    with pytest.raises(ValueError, match="up has 40 outputs; torch's int4 weights take multiples of 16"):
        Int4Linear.from_linear(torch.nn.Linear(64, 40), 32, "up")


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("int4")
    config = llama3_hf_config(intermediate_size=128)
    return save_hf_model(build_hf_model(config, seed=4), root / "t", tokenizer_dir)


def dequantized_twin(llm: LLM, group: int) -> LLM:
    """llm (high precision) with each decoder linear's weight replaced by its int4 read-back."""
    for name, module in llm.model.named_modules():
        if name.rpartition(".")[2] in QUANTIZED and isinstance(module, torch.nn.Linear):
            q, scale, zero = quantize_int4(module.weight.detach(), group)
            module.weight.data.copy_(dequantize_int4(q, scale, zero, group))
    return llm


@pytest.mark.parametrize("group", [32, 64])
def test_a_model_quantized_on_load_is_its_dequantized_twin(target, group, without_cpu_kernels):
    """fp32 with no C++ kernel (which would take the layout: tests/test_quantized_weights.py): every
    next-token log-probability over a 300-token text within fp32 error of the twin's, every decoder linear
    an Int4Linear (embeddings and the head kept), greedy tokens the same."""
    int4 = LLM(target, dtype="float32", max_batch=2, max_seq_len=512, quantization="int4",
               quantization_group_size=group)  # fmt: skip
    twin = dequantized_twin(LLM(target, dtype="float32", max_batch=2, max_seq_len=512), group)
    kinds = {type(m).__name__ for n, m in int4.model.named_modules() if n.rpartition(".")[2] in QUANTIZED}
    assert kinds == {"Int4Linear"} and type(int4.model.lm_head).__name__ != "Int4Linear"
    tokens = torch.randint(5, 384, (300,), generator=torch.Generator().manual_seed(group)).tolist()
    assert torch.allclose(int4.log_probs(tokens), twin.log_probs(tokens), atol=1e-4)
    prompts = [tokens[:20], tokens[40:47]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert [c.token_ids for c in int4.generate(prompts, params)] == [
        c.token_ids for c in twin.generate(prompts, params)
    ]


def test_int4_compiled_and_with_eagle3_decodes_what_plain_int4_does(target, tmp_path, without_cpu_kernels):
    """The compiled step (every graph the warm-up makes, at batch 1 and on the argmax path: batch 2 and
    the logits path quadruple the step graphs for the same Int4Linear calls) and EAGLE-3 K = 3 on
    Int4Linears (at batch 1 and 2): greedy tokens of plain eager int4 decoding."""
    kw = dict(dtype="float32", max_batch=2, max_seq_len=256, quantization="int4")
    plain = LLM(target, **kw)
    draft = write_random_draft(target, tmp_path / "d", draft_vocab=200)
    compiled = LLM(target, compile=True, **{**kw, "max_batch": 1, "compile_sampling": False})
    fast = LLM(target, draft=draft, num_draft_tokens=3, adaptive_draft_length=False, **kw)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (9, 30)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    for llm in (compiled, fast):
        assert [c.token_ids for c in llm.generate(prompts, params)] == want
        assert [c.token_ids for c in llm.generate(prompts[:1], params)] == want[:1]


def test_int4_options_that_cannot_work_are_refused_before_loading(target):
    """An unknown group size, fp8 weights, gguf on a CUDA device; and a bf16 model from an fp32 checkpoint
    computes in bf16: in the C++ kernels' layout where this CPU runs one (AVX-512 BF16's or AVX2's:
    tests/test_quantized_weights.py), else an Int4Linear with scales in the model's dtype, not the
    checkpoint's."""
    with pytest.raises(ValueError, match="quantization_group_size 48: 32|64|128"):
        LLM(target, quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="int4 quantization takes high-precision weights"):
        LLM(target, quantization="int4", dtype="fp8")
    with pytest.raises(ValueError, match=r"gguf quantization takes high-precision weights \(gguf: CPU\)"):
        LLM(target, quantization="gguf", device="cuda")
    llm = LLM(target, dtype="bfloat16", max_batch=1, max_seq_len=64, quantization="int4")
    layer = llm.model.model.layers[0].mlp.down_proj
    if cpu_ops.load() or cpu_ops.load_avx2():
        assert (
            layer.weight.dtype == torch.uint8 and layer(torch.ones(1, 128).bfloat16()).dtype == torch.bfloat16
        )
    else:
        assert isinstance(layer, Int4Linear) and layer.scales_and_zeros.dtype == torch.bfloat16
