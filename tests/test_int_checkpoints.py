"""Weight-only integer checkpoints (quant/int_scheme.py, models/int_checkpoint.py): `redline quantize
--scheme int4|int8` writes what transformers' compressed-tensors reader decompresses to the very weights
redline multiplies, and GPTQ (v1 zeros, symmetric or not, act order, 8 bits) and AWQ checkpoints packed as
AutoGPTQ / AutoAWQ pack them load to the weights their codes stand for, on the C++ kernel's path and off
it; variants redline does not read are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model
from int_checkpoints import AWQ_ORDER, pack_rows, write_int_checkpoint
from safetensors.torch import load_file, save_file

from redline import LLM
from redline.cli import main
from redline.config import ConfigError
from redline.evaluate.run import EvalConfig, parse_config
from redline.kernels import cpu_ops
from redline.kernels.quantized_layout import dequantize, is_quantized
from redline.layers.input_order import InputOrdered
from redline.models.build import skeleton
from redline.models.int_checkpoint import CheckpointLinear, loaded_linear
from redline.models.quantize import QUANTIZED
from redline.models.quantized_checkpoint import quantize_checkpoint
from redline.models.tensor_files import CheckpointError
from redline.quant.int4 import Int4Linear
from redline.quant.int_packing import awq_unpack, pack_int32, unpack_int32
from redline.quant.weight_only_gpu import GpuWeightOnlyLinear
from redline.sampling import SamplingParams
from redline.train.random_init import write_random_draft

kernels = pytest.mark.skipif(not cpu_ops.load(), reason="needs AVX-512 BF16 and VNNI, C++ and ninja")


@pytest.fixture(scope="module")
def source(tmp_path_factory, tokenizer_dir):
    """A bf16 checkpoint (its scales then are bf16, which fp16 holds exactly); head_dim 32 (one call)."""
    config = llama3_hf_config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                              tie_word_embeddings=True)  # fmt: skip
    model = build_hf_model(config, seed=11).to(torch.bfloat16)
    return save_hf_model(model, tmp_path_factory.mktemp("int") / "src", tokenizer_dir)


def effective_weight(module: torch.nn.Module) -> torch.Tensor:  # [N, K] fp32, in the input's own order
    order = module.order if isinstance(module, InputOrdered) else None
    inner = module.linear if order is not None else module
    if isinstance(inner, Int4Linear):  # its kernel times the identity: W^T, exact in fp32
        w = inner(torch.eye(inner.in_features, dtype=inner.scales_and_zeros.dtype)).t().float()
    else:
        w = dequantize(inner.weight)
    if order is None:
        return w
    back = torch.empty_like(w)
    back[:, order] = w
    return back


def twin_error(llm: LLM, source, reference: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Largest |log-prob| gap over a 300-token text between llm and an fp32 model holding `reference`,
    and bf16's own gap from fp32 on the source checkpoint."""
    twin = LLM(source, dtype="float32", max_batch=1, max_seq_len=512)
    for key, weight in reference.items():
        twin.model.get_submodule(key.removesuffix(".weight")).weight.data.copy_(weight)
    tokens = torch.randint(5, 384, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    error = (llm.log_probs(tokens).float() - twin.log_probs(tokens)).abs().max()
    plain = LLM(source, dtype="bfloat16", max_batch=1, max_seq_len=512), LLM(source, dtype="float32")
    return float(error), float((plain[0].log_probs(tokens).float() - plain[1].log_probs(tokens)).abs().max())


def test_packing_puts_codes_where_the_formats_say():
    """Code j of a word in bits 4 j (compressed-tensors, GPTQ); AWQ's word 0x76543210 is columns [0, 4, 1,
    5, 2, 6, 3, 7]; random codes round-trip."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_int32(word, 4).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert awq_unpack(word).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    for bits in (4, 8):
        codes = torch.randint(0, 1 << bits, (6, 64), dtype=torch.int32)
        assert torch.equal(unpack_int32(pack_int32(codes, bits), bits), codes)
    codes = torch.randint(0, 16, (6, 64), dtype=torch.int32)
    assert torch.equal(awq_unpack(torch.from_numpy(pack_rows(codes.numpy(), 4, AWQ_ORDER))), codes)


@pytest.mark.parametrize("scheme, group", [("int4", 64), ("int8", None)])
def test_redline_quantize_writes_what_transformers_reads(source, tmp_path, scheme, group):
    """compressed-tensors pack-quantized (int4 with zero points, int8 symmetric): transformers decompresses
    each linear to the weight redline multiplies (bf16 scales, exact in fp16), up to its rounding to bf16
    (its scales' dtype) and, for int4, fp16's rounding of redline's zero (zero point times scale); redline
    runs every layer in one call and its log-probabilities
    sit as near an fp32 model of those weights as bf16 sits near fp32."""
    out = tmp_path / scheme
    counts = quantize_checkpoint(source, out, scheme=scheme, group=group)
    layer = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 256 * 128  # q, o; k, v; gate, up, down
    assert counts["quantized_parameters"] == 3 * layer
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert config["format"] == "pack-quantized" and weights["group_size"] == group
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    decompressed = CompressedTensorsConfig(dequantize=True)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, quantization_config=decompressed)
    llm = LLM(out, dtype="bfloat16", max_batch=1, max_seq_len=512)
    blocks = cpu_ops.quantized_kernel(torch.bfloat16)  # else int4 is torch's kernel: zero + 8 scale in bf16
    one_call = cpu_ops.load()  # the AVX-512 BF16 kernels: a layer in one call
    assert all((layer.one_call is cpu_ops.dense_layer_bf16) == one_call for layer in llm.model.model.layers)
    reference = {}
    for name, module in llm.model.named_modules():
        if name.rpartition(".")[2] in QUANTIZED:
            ours, theirs = effective_weight(module), hf.get_submodule(name).weight.detach()
            theirs = theirs.float()
            # int4's zero, up to 15 steps of at most 2 max |w| / 15, moves by 2^-11 of itself in fp16
            zeros = 0 if scheme == "int8" else theirs.abs().max() * (2**-10 if blocks else 2**-8)
            assert ((ours - theirs).abs() <= theirs.abs() * 2**-8 + zeros).all(), name  # theirs: in bf16
            reference[f"{name}.weight"] = ours
    error, bf16 = twin_error(llm, source, reference)
    assert error <= 1.5 * bf16, (error, bf16)


GPTQ_AWQ = [
    dict(method="gptq", bits=4, group=32, sym=True, biases=True),  # AutoGPTQ's zero biases, skipped
    dict(method="gptq", bits=4, group=64, sym=False, act_order=True),
    dict(method="gptq", bits=8, group=128, sym=False),
    dict(method="gptq", bits=4, group=None, sym=False, v2=True),  # per channel, zeros as they are
    dict(method="awq", bits=4, group=64),
    dict(method="compressed-tensors", bits=4, group=32, sym=False, act_order=True),
]
NAMES = ["gptq-sym-biases", "gptq-act-order", "gptq-int8", "gptq-v2-channel", "awq", "ct-act-order"]


@pytest.mark.parametrize("variant", GPTQ_AWQ, ids=NAMES)
def test_gptq_and_awq_checkpoints_load_to_the_weights_their_codes_stand_for(source, tmp_path, variant):
    """bf16: each linear multiplies the checkpoint's dequantized weight, in its input order (act order:
    sorted, the input permuted to match), up to storing scale and zero: fp16 in the C++ kernel's layout
    (zero times scale to 2^-11 of its up to 2^bits steps; symmetric: exact), bf16 in torch's int4 kernel (2^-9
    of zero + 8 scale, and of the scale's 16 steps); log-probabilities as near the fp32 twin as bf16 is to
    fp32. With the kernel, act order keeps its linears unfused and runs op by op, the others run each
    layer in one call."""
    path, reference = write_int_checkpoint(source, tmp_path / "q", **variant)
    llm = LLM(path, dtype="bfloat16", max_batch=1, max_seq_len=512)
    ordered, blocks = variant.get("act_order", False), cpu_ops.quantized_kernel(torch.bfloat16)
    if cpu_ops.load():  # the one-call layer
        assert all((layer.one_call is None) == ordered for layer in llm.model.model.layers)
    for key, weight in reference.items():
        module = llm.model.get_submodule(key.removesuffix(".weight"))
        assert isinstance(module, InputOrdered) == ordered and getattr(module, "bias", None) is None
        levels = 2 ** variant["bits"]
        step = weight.abs().max() * 2 / (levels - 1)  # at least the largest scale (ranges: up to 2 max |w|)
        if blocks or variant["bits"] == 8:
            bound = 0 if variant.get("sym") else step * levels * 2**-11
        else:
            bound = step * 48 * 2**-9
        assert (effective_weight(module) - weight).abs().max() <= bound, key
    error, bf16 = twin_error(llm, source, reference)
    assert error <= 1.5 * bf16, (error, bf16)


@pytest.mark.parametrize("variant", GPTQ_AWQ, ids=NAMES)
def test_fp32_models_of_int_checkpoints_compute_their_weights(source, tmp_path, variant, without_cpu_kernels):
    """fp32 with no C++ kernel: int4 linears are Int4Linears of the checkpoint's weights (int8: the layout,
    multiplied dequantized, its zeros in fp16 as on the kernel's path), and the model's log-probabilities
    are those of an fp32 twin holding the weights multiplied, within fp32 rounding."""
    path, reference = write_int_checkpoint(source, tmp_path / "q", **variant)
    llm = LLM(path, dtype="float32", max_batch=1, max_seq_len=512)
    multiplied = {}
    for key, weight in reference.items():
        module = llm.model.get_submodule(key.removesuffix(".weight"))
        inner = module.linear if isinstance(module, InputOrdered) else module
        assert isinstance(inner, Int4Linear) == (variant["bits"] == 4)
        step = weight.abs().max() * 2 / 255
        bound = 1e-6 if variant["bits"] == 4 or variant.get("sym") else step * 256 * 2**-11
        multiplied[key] = effective_weight(module)
        assert (multiplied[key] - weight).abs().max() <= bound, key
    error, _ = twin_error(llm, source, multiplied)
    assert error < 1e-4


@pytest.mark.parametrize("variant", GPTQ_AWQ, ids=NAMES)
def test_int_checkpoints_load_into_the_gpu_kernels_layout(source, tmp_path, variant):
    """On CUDA each linear's tensors are read on the CPU into a GpuWeightOnlyLinear (act order: inside an
    InputOrdered) whose codes, fp16 scales and zeros stand for the checkpoint's weights as closely as the
    C++ layout's; its product over a verify step's 4 rows (the Triton kernel, interpreted here) is x
    times those weights, to bf16's rounding of the result."""
    pytest.importorskip("triton")
    from redline.kernels.weight_only_mm import dequantize_codes

    path, reference = write_int_checkpoint(source, tmp_path / "q", **variant)
    tensors, model = load_file(path / "model.safetensors"), skeleton(path)
    placeholders = [(n, m) for n, m in model.named_modules() if isinstance(m, CheckpointLinear)]
    assert {f"{name}.weight" for name, _ in placeholders} == set(reference)
    x = torch.randn(4, source_hidden(source), dtype=torch.bfloat16)
    for name, placeholder in placeholders:
        for key, _ in list(placeholder.named_parameters()):
            # a g_idx only where the checkpoint holds one; without act order as if it held none (meta)
            if f"{name}.{key}" in tensors and (key != "g_idx" or variant.get("act_order")):
                setattr(placeholder, key, torch.nn.Parameter(tensors[f"{name}.{key}"], requires_grad=False))
        module, _ = loaded_linear(placeholder, False, torch.bfloat16, gpu=torch.device("cpu"))
        ordered = isinstance(module, InputOrdered)
        inner = module.linear if ordered else module
        assert ordered == variant.get("act_order", False) and isinstance(inner, GpuWeightOnlyLinear), name
        assert inner.codes.dtype == (torch.int32 if variant["bits"] == 4 else torch.uint8)
        w = dequantize_codes(inner.codes, inner.scales, inner.zeros)  # [N, K], sorted inputs if ordered
        if ordered:
            w = torch.empty_like(w).index_copy_(1, module.order, w)
        weight = reference[f"{name}.weight"]
        step = weight.abs().max() * 2 / (2 ** variant["bits"] - 1)
        bound = 0 if variant.get("sym") else step * 2 ** variant["bits"] * 2**-11
        assert (w - weight).abs().max() <= bound, name
        if placeholder.in_features == x.shape[1]:
            exact = x.float() @ w.t()
            scale = exact.abs().max()
            torch.testing.assert_close(module(x).float(), exact, rtol=2**-8, atol=scale * 2**-8)


def source_hidden(source) -> int:
    return json.loads((source / "config.json").read_text())["hidden_size"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", [GPTQ_AWQ[1], GPTQ_AWQ[2]], ids=["act-order", "int8"])
def test_int_checkpoints_run_on_cuda(source, tmp_path, variant):
    """On a GPU (benchmarks/gpu_check.sh): log-probabilities as near the fp32 twin as bf16 is to fp32, and
    greedy decoding through the weight-only kernel, as the same checkpoint on the CPU decodes it."""
    path, reference = write_int_checkpoint(source, tmp_path / "q", **variant)
    llm = LLM(path, dtype="bfloat16", device="cuda", max_batch=1, max_seq_len=512)
    error, bf16 = twin_error(llm, source, reference)
    assert error <= 1.5 * bf16, (error, bf16)
    cpu = LLM(path, dtype="bfloat16", max_batch=1, max_seq_len=512)
    prompt, params = [[5, 6, 7, 8]], SamplingParams(max_tokens=16)
    tokens = llm.generate(prompt, params)[0].token_ids
    assert len(tokens) == 16 and tokens[:4] == cpu.generate(prompt, params)[0].token_ids[:4]


def test_variants_redline_does_not_read_are_refused_by_name(source, tmp_path):
    """3-bit GPTQ, AWQ's gemv layout, marlin, a quantized lm_head, activation quantization, act order
    without g_idx or over tensor-parallel ranks, a torn tensor and --quantization over a quantized
    checkpoint each name the problem."""
    path, _ = write_int_checkpoint(source, tmp_path / "q", "gptq", bits=4, group=32)
    config = json.loads((path / "config.json").read_text())
    cases = {
        "GPTQ with 3 bits is not supported": {"quant_method": "gptq", "bits": 3, "group_size": 128},
        "AWQ version 'gemv' is not supported": {"quant_method": "awq", "bits": 4, "version": "gemv"},
        "quantizes activations": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 8}, "input_activations": {"num_bits": 8}}},
        },
        "group size 256 is not supported": {"quant_method": "gptq", "bits": 4, "group_size": 256},
        "checkpoint_format 'marlin'": {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
        "a quantized lm_head": {"quant_method": "gptq", "bits": 4, "group_size": 32, "lm_head": True},
    }
    for message, quant in cases.items():
        (path / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
        with pytest.raises(ConfigError, match=message):
            LLM(path, dtype="float32")
    ordered = config["quantization_config"] | {"desc_act": True}
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": ordered}))
    with pytest.raises(ValueError, match=r"act order checkpoint runs in one process \(no tensor parallel\)"):
        from redline.parallel.group import TensorParallel

        skeleton(path, TensorParallel(0, 2))
    missing = {k: v for k, v in load_file(path / "model.safetensors").items() if not k.endswith(".g_idx")}
    save_file(missing, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"in act order \(desc_act\) but holds no g_idx"):
        LLM(path, dtype="float32")
    (path / "config.json").write_text(json.dumps(config))  # without act order, no g_idx is needed
    llm = LLM(path, dtype="float32", max_batch=1, max_seq_len=64)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=4))[0].token_ids
    with pytest.raises(ValueError, match=r"holds gptq int4, groups of 32, zero points weights: --quantiz"):
        LLM(path, dtype="float32", quantization="int4")
    tensors = load_file(path / "model.safetensors")
    torn = "model.layers.1.mlp.up_proj.qweight"
    tensors[torn] = tensors[torn][:, :-8].contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.up_proj.qweight"):
        LLM(path, dtype="float32")


@kernels
def test_an_int_checkpoints_eagle3_draft_is_quantized_and_lossless(source, tmp_path):
    """On the kernel's path the draft of an int4 checkpoint is quantized with it, and EAGLE-3 K = 3 greedy
    tokens equal plain greedy ones at batch 2 (verify rows are one-token steps bit for bit; compiled steps on
    these layouts: tests/test_quantized_weights.py)."""
    path, _ = write_int_checkpoint(source, tmp_path / "q", "gptq", bits=4, group=32)
    draft = write_random_draft(path, tmp_path / "d", draft_vocab=200)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (9, 30)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    kw = dict(dtype="bfloat16", max_batch=2, max_seq_len=256, compile=False)
    want = [c.token_ids for c in LLM(path, **kw).generate(prompts, params)]
    fast = LLM(path, draft=draft, num_draft_tokens=3, adaptive_draft_length=False, **kw)
    assert is_quantized(fast.runner.draft.fc.weight)
    assert [c.token_ids for c in fast.generate(prompts, params)] == want


def test_eval_and_quantize_take_the_int_schemes(source, tmp_path):
    """`redline eval --compare int4` is the base quantized on load; `redline quantize --scheme int4` picks
    the largest group that divides every layer's inputs and refuses a group size with fp8 and a quantized
    source."""
    base = EvalConfig("bf16", source, "bfloat16")
    assert parse_config("int4", base) == EvalConfig("int4", source, "bfloat16", quantization="int4")
    assert main(["quantize", "--model", str(source), "--out", str(tmp_path / "w"), "--scheme", "int4"]) == 0
    weights = json.loads((tmp_path / "w" / "config.json").read_text())["quantization_config"]
    assert weights["config_groups"]["group_0"]["weights"]["group_size"] == 128  # 128 and 256 inputs
    with pytest.raises(ValueError, match="a group size applies to the int4 and int8 schemes"):
        quantize_checkpoint(source, tmp_path / "f", scheme="fp8", group=64)
    with pytest.raises(ConfigError, match="quantized already"):
        quantize_checkpoint(tmp_path / "w", tmp_path / "again", scheme="int8")
