"""int4 / int8 weight-only in the C++ kernels' layout (kernels/quantized_layout.py,
csrc/quantized_rows_bf16.cpp, csrc/int8_rows_vnni.cpp, and AVX2's csrc_avx2/quantized_rows_avx2.cpp): the
layout's bytes, the rounding's bound, the kernels against their dequantized reference at SmolLM2's sizes
with each row independent of the others, and models quantized on load: their dequantized twin's
log-probabilities, greedy tokens of compiled and EAGLE-3 steps equal to plain ones, and the dequantized
product where no kernel is used."""

from __future__ import annotations

import pytest
import torch
from conftest import build_hf_model, greedy_divergence_is_a_near_tie, llama3_hf_config, save_hf_model

from redline import LLM, SamplingParams
from redline.kernels import cpu_ops
from redline.kernels.quantized_layout import (
    dequantize,
    from_blocks,
    is_quantized,
    quantize,
    rows_of,
    to_blocks,
)
from redline.models.quantize import QUANTIZED
from redline.quant.int4 import Int4Linear
from redline.train.random_init import write_random_draft

kernels = pytest.mark.skipif(not cpu_ops.load(), reason="needs AVX-512 BF16 and VNNI, C++ and ninja")
avx2 = pytest.mark.skipif(not cpu_ops.load_avx2(), reason="needs AVX2, C++ and ninja")
CODES = {4: (0, 16), 8: (0, 256)}


def random_blocks(bits: int, n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Fresh random codes, scales and zeros (exact in fp16) and their layout."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(*CODES[bits], (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(n, k // group, generator=g).half().float()
    zero = torch.randn(n, k // group, generator=g).half().float()
    return q, scale, zero, to_blocks(q, scale, zero, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_layout_holds_each_code_where_the_doc_says(bits):
    """The module doc's example (int4, G = 32: byte 640 + 3 * 32 + 5 of block 0 holds q[2, 39] and
    q[18, 39]; int8: the same pair's second half), its shape and dtype; from_blocks inverts it, and rows_of
    reads rows back as dequantize does."""
    q, scale, zero, blocks = random_blocks(bits, 64, 128, 32, seed=bits)
    group_bytes = 32 * 32 * bits // 8 + 128
    assert blocks.shape == (2, 4, group_bytes) and blocks.dtype == (torch.uint8 if bits == 4 else torch.int8)
    raw = blocks.view(torch.uint8)
    if bits == 4:
        byte = int(raw[0, 1, 3 * 32 + 5])
        assert (byte & 15, byte >> 4) == (q[2, 39], q[18, 39])
    else:
        assert int(raw[0, 1, 3 * 64 + 5]) == q[2, 39] and int(raw[0, 1, 3 * 64 + 32 + 5]) == q[18, 39]
    fp16 = raw[1, 2, -128:].contiguous().view(torch.float16).float()  # block 1, group 2: rows 32 .. 63
    assert torch.equal(fp16[:32], scale[32:, 2]) and torch.equal(fp16[32:], zero[32:, 2])
    back = from_blocks(blocks)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, scale, zero), strict=True))
    ids = torch.randint(0, 64, (3, 5))  # a tied table's lookup
    assert torch.equal(rows_of(blocks, ids), dequantize(blocks)[ids].bfloat16())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_a_weight_reads_back_within_half_a_step(bits, group):
    """Fresh random weights, and a narrow group far from zero: every weight within scale / 2 of its
    read-back, plus fp16's rounding of the zero (2^-11 relative) and of the scale over 15 steps (int4) or
    255 (int8); codes in range."""
    narrow = torch.linspace(0.50, 0.52, 32).repeat(32, 4)  # [32, 128]
    for w in (torch.randn(64, 256) * 0.05, narrow):
        q, scale, zero = from_blocks(quantize(w, bits, group))
        back = dequantize(quantize(w, bits, group))
        step, shift = (t.repeat_interleave(group, dim=1) for t in (scale, zero.abs()))
        steps = (1 << bits) - 1
        bound = step / 2 + 2**-11 * (steps * step + shift) + 1e-7
        assert ((back - w).abs() <= bound).all()
        assert int(q.min()) >= 0 and int(q.max()) <= steps


def test_int8_in_groups_of_32_keeps_a_q4_1_grid():
    """Weights on Q4_1's grid (fresh random fp16 d and m per 32, codes c spanning 0 .. 15, as SmolLM2's only
    release): int8 g32 rounds each to code 17 c (scale d / 17, zero m), so it adds no error of its own
    beyond fp16's rounding of the scale (255 of its 2^-11 steps at most)."""
    g = torch.Generator().manual_seed(17)
    c = torch.randint(0, 16, (64, 8, 32), generator=g, dtype=torch.int32)
    c[..., 0], c[..., 1] = 0, 15  # each block spans the grid
    d = (torch.rand(64, 8, 1, generator=g) * 0.01 + 2e-3).half().float()  # d / 17 a normal fp16
    m = (-8 * d + torch.randn(64, 8, 1, generator=g) * 1e-3).half().float()
    w = (c * d + m).reshape(64, 256)
    q, scale, zero = from_blocks(quantize(w, 8, 32))
    assert torch.equal(q, 17 * c.reshape(64, 256)) and torch.equal(zero, m[..., 0])
    back = dequantize(quantize(w, 8, 32))
    assert ((back - w).abs() <= 255 * 2**-11 * scale.repeat_interleave(32, dim=1)).all()


@kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k, group", [(960, 576, 32), (576, 1536, 64), (3072, 576, 32), (64, 256, 128)])
def test_the_kernel_computes_the_dequantized_product_each_row_alone(bits, n, k, group):
    """SmolLM2's fused q/k/v, down and gate/up shapes: 1 to 130 rows (past the kernel's 64-row chunk) and a
    2,048-token prompt's rows (int8's x rounded on both threads) against
    x @ dequantized^T in fp32, within 2^-8 of the largest output (the output rounded to bf16, 2^-9, fp32
    sums, and int8's x in int16: 2^-16 of a group's largest); and every row equals its one-row product, bit
    for bit."""
    *_, blocks = random_blocks(bits, n, k, group, seed=n + k + bits)
    weight = dequantize(blocks)
    for rows in (1, 3, 4, 37, 130, 2048):
        x = torch.randn(rows, k).bfloat16()
        want = x.float() @ weight.t()
        got = cpu_ops.few_rows_bf16(x, blocks)
        assert (got.float() - want).abs().max() <= 2**-8 * want.abs().max()
        if rows in (4, 37, 130):
            alone = torch.cat([cpu_ops.few_rows_bf16(x[i : i + 1], blocks) for i in range(rows)])
            assert torch.equal(alone, got)


def in_int16(x: torch.Tensor, group: int) -> torch.Tensor:  # [M, K] -> [M, K] fp64
    """x as csrc/int8_rows_vnni.cpp multiplies it: each row's group rounded to int16 with t = max |x| / 32767
    (a group of zeros stays 0)."""
    groups = x.double().reshape(x.shape[0], -1, group)
    t = (groups.abs().amax(-1, keepdim=True).float() / 32767).double()  # in fp32, as the kernel divides
    q = torch.where(t > 0, (groups.float() / torch.where(t > 0, t, 1).float()).double(), 0).round()
    return (q * t).reshape(x.shape)


@kernels
@pytest.mark.parametrize("group", [32, 128])
def test_int8_products_carry_x_in_int16_per_group(group):
    """Rows with a group of zeros, a group whose magnitudes span 2^-24 .. 2^10, and fresh random groups: the
    int8 kernel equals x rounded to int16 per group (t = max |x| / 32767) times the dequantized weight within
    bf16's rounding of each output (2^-8 of it) plus 2^-14 of the row's largest (fp32 sums, whose zero and
    code terms cancel); and the exact x's product within that plus sum_k t / 2 |w_k|, the bound the kernel's
    doc gives."""
    n, k = 96, 512
    *_, blocks = random_blocks(8, n, k, group, seed=group)
    weight = dequantize(blocks).double()
    x = torch.randn(3, k)
    x[0, :group] = 0
    signs = torch.randint(0, 2, (group,)) * 2 - 1
    x[1, group : 2 * group] = signs * 2.0 ** torch.linspace(-24, 10, group)
    x = x.bfloat16()
    got = cpu_ops.few_rows_bf16(x, blocks).double()
    for want, slack in ((in_int16(x, group) @ weight.t(), 0), (x.double() @ weight.t(), None)):
        if slack is None:  # t / 2 per x of each group, times that group's |w|
            t = x.double().abs().reshape(3, -1, group).amax(-1) / 32767  # [3, groups]
            slack = (t / 2) @ weight.abs().reshape(n, -1, group).sum(-1).t()  # [3, N]
        bound = 2**-8 * want.abs() + 2**-14 * want.abs().amax(1, keepdim=True) + slack
        assert ((got - want).abs() <= bound).all()


@avx2
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, group", [(960, 576, 32), (576, 1536, 64), (64, 512, 128)])
def test_the_avx2_kernel_multiplies_x_in_int16_by_the_codes(bits, dtype, n, k, group):
    """cpu_ops.quantized_rows at SmolLM2's q/k/v and down shapes, over 1 to 130 rows and a 2,048-token
    prompt's, rows with a group of zeros and a group spanning 2^-24 .. 2^10 among them: x rounded to int16
    per group (in_int16) times the dequantized weight, within the output's rounding (bf16 2^-8 of it; fp32
    2^-20) plus 2^-14 of the row's largest (fp32 sums, whose zero and code terms cancel); every row equal to
    its one-row product, bit for bit."""
    *_, blocks = random_blocks(bits, n, k, group, seed=n + bits + group)
    weight = dequantize(blocks).double()
    for rows in (1, 3, 37, 130, 2048):
        x = torch.randn(rows, k)
        x[0, :group] = 0
        if rows > 1:
            signs = torch.randint(0, 2, (group,)) * 2 - 1
            x[1, group : 2 * group] = signs * 2.0 ** torch.linspace(-24, 10, group)
        x = x.to(dtype)
        got = cpu_ops.quantized_rows(x, blocks)
        assert got.dtype == dtype and got.shape == (rows, n)
        want = in_int16(x, group) @ weight.t()
        rounding = 2**-8 if dtype == torch.bfloat16 else 2**-20
        bound = rounding * want.abs() + 2**-14 * want.abs().amax(1, keepdim=True)
        assert ((got.double() - want).abs() <= bound).all(), (rows, (got.double() - want).abs().max())
        if rows in (3, 37):
            alone = torch.cat([cpu_ops.quantized_rows(x[i : i + 1], blocks) for i in range(rows)])
            assert torch.equal(alone, got)


@avx2
def test_the_avx2_kernel_refuses_what_it_cannot_take():
    """A bf16 weight, an fp16 x, x of another width and groups past 256 name the problem."""
    *_, blocks = random_blocks(8, 32, 512, 32, seed=3)
    with pytest.raises(RuntimeError, match="not quantized|int4 .uint8. or int8"):
        cpu_ops.quantized_rows(torch.randn(1, 64), torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x is fp32 or bf16"):
        cpu_ops.quantized_rows(torch.randn(1, 512).half(), blocks)
    with pytest.raises(RuntimeError, match=r"x is a contiguous CPU \[M, 512\]"):
        cpu_ops.quantized_rows(torch.randn(1, 256), blocks)
    *_, wide = random_blocks(8, 32, 512, 512, seed=4)
    with pytest.raises(RuntimeError, match="groups of 16 .. 256"):
        cpu_ops.quantized_rows(torch.randn(1, 512), wide)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    """head_dim 32: the one-call layer's (a multiple of 32); the head tied to the embedding table."""
    root = tmp_path_factory.mktemp("quantized")
    config = llama3_hf_config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                              tie_word_embeddings=True)  # fmt: skip
    return save_hf_model(build_hf_model(config, seed=7), root / "t", tokenizer_dir)


def dequantized_twin(target, bits: int, group: int, head: bool) -> LLM:
    """An fp32 model whose decoder linears hold the quantized weights read back, and its head (tied to the
    embedding table) the int8 one's if `head`."""
    twin = LLM(target, dtype="float32", max_batch=2, max_seq_len=512)
    for name, module in twin.model.named_modules():
        if name.rpartition(".")[2] in QUANTIZED and isinstance(module, torch.nn.Linear):
            module.weight.data.copy_(dequantize(quantize(module.weight.detach(), bits, group)))
    if head:
        twin.model.lm_head.weight.data.copy_(
            dequantize(quantize(twin.model.lm_head.weight.detach(), 8, group))
        )
    return twin


@kernels
@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64)])
def test_a_bf16_model_quantized_on_load_is_its_dequantized_twin(target, bits, group):
    """Every decoder linear in the layout, every layer in one call, the tied head and table in int8 (the
    lookup reads its rows back: quantized_layout.rows_of); next-token log-probabilities over a
    300-token random text as close to the fp32 twin's as bf16 is to fp32 without quantization (activations
    rounded to bf16 at each op; the kernel's weights are exact, bf16's are rounded): the mean difference
    within 2x bf16's own, the largest within 2.5x. Measured over 4 texts, before and after int8 became
    asymmetric: means 1.3-1.6x bf16's, largest 1.2-2.1x (a maximum over 115,200 values is noisy)."""
    llm = LLM(target, dtype="bfloat16", max_batch=2, max_seq_len=512, quantization=f"int{bits}",
              quantization_group_size=group)  # fmt: skip
    layers = llm.model.model.layers
    assert all(layer.one_call is cpu_ops.dense_layer_bf16 for layer in layers)
    assert all(is_quantized(layer.mlp.gate_up_weight) for layer in layers)
    assert is_quantized(llm.model.lm_head.weight) and llm.model.lm_head.weight.dtype == torch.int8  # tied
    tokens = torch.randint(5, 384, (300,), generator=torch.Generator().manual_seed(bits)).tolist()
    twin = dequantized_twin(target, bits, group, head=True)
    error = (llm.log_probs(tokens).float() - twin.log_probs(tokens)).abs()
    plain = (LLM(target, dtype="bfloat16", max_batch=1, max_seq_len=512), LLM(target, dtype="float32"))
    bf16_error = (plain[0].log_probs(tokens).float() - plain[1].log_probs(tokens)).abs()
    print(f"int{bits}: mean {error.mean():.4f}, largest {error.max():.4f} from its fp32 twin; bf16's "
          f"{bf16_error.mean():.4f}, {bf16_error.max():.4f} from fp32")  # fmt: skip
    assert error.mean() <= 2 * bf16_error.mean() and error.max() <= 2.5 * bf16_error.max()


ON_THE_KERNELS = [pytest.param("bfloat16", 4, marks=kernels), pytest.param("bfloat16", 8, marks=kernels),
                  pytest.param("float32", 4, marks=avx2)]  # fmt: skip


@pytest.mark.parametrize("dtype, bits", ON_THE_KERNELS)
def test_compiled_and_eagle3_steps_decode_what_plain_steps_do(target, tmp_path, dtype, bits):
    """bf16 on the AVX-512 kernels, fp32 on AVX2's (int4: both widths' rows are checked alone in the
    kernel's own test): EAGLE-3 K = 3 (its draft quantized too) greedy equals plain greedy, bit for bit
    (verify rows are one-token steps): eager at batch 1 and 2, and compiled (every graph the warm-up
    makes, the argmax path's: compile_sampling off) at batch 1. Batch 2 and the logits path compiled
    quadruple the step graphs (the test took 729 s cold with them on a 2-core AVX2 CPU) for the same
    kernel calls that the eager engines make."""
    draft = write_random_draft(target, tmp_path / "d", draft_vocab=200)
    spec = dict(draft=draft, num_draft_tokens=3, adaptive_draft_length=False)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (9, 30)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    eager = dict(compile=False, max_batch=2)
    for built in (eager, dict(compile=True, max_batch=1, compile_sampling=False)):
        kw = dict(dtype=dtype, max_seq_len=256, quantization=f"int{bits}", **built)
        want = [c.token_ids for c in LLM(target, **kw).generate(prompts, params)]
        fast = LLM(target, **spec, **kw)
        assert is_quantized(fast.runner.draft.fc.weight)  # the draft quantized with its target
        assert [c.token_ids for c in fast.generate(prompts, params)] == want
        assert [c.token_ids for c in fast.generate(prompts[:1], params)] == want[:1]


@avx2
@pytest.mark.parametrize("bits, group", [(4, 64), (8, 32)])
def test_an_fp32_model_on_the_avx2_kernel_is_its_dequantized_twin(target, bits, group, monkeypatch):
    """fp32 off the AVX-512 BF16 kernels: every decoder linear and the tied head and table (int8) in the
    layout, every product through the AVX2 kernel, x carried in int16 (2^-16 of a group's largest, 128
    times finer than bf16 there). Next-token log-probabilities over a 300-token text as close to the fp32
    twin's as 1/32 of bf16's own distance from fp32 (mean and largest; measured over 3 texts: 1/200 to
    1/130), and greedy tokens the twin's but for near ties. A bf16 model there computes in bf16 (its
    tied table's rows read back in bf16)."""
    calls = []
    kernel = cpu_ops.quantized_rows
    monkeypatch.setattr(cpu_ops, "quantized_rows", lambda x, w: calls.append(x.shape) or kernel(x, w))
    llm = LLM(target, dtype="float32", max_batch=2, max_seq_len=512, quantization=f"int{bits}",
              quantization_group_size=group)  # fmt: skip
    assert is_quantized(llm.model.model.layers[0].mlp.gate_up_weight)  # fused: one call for both
    assert is_quantized(llm.model.lm_head.weight) and llm.model.lm_head.weight.dtype == torch.int8  # tied
    twin = dequantized_twin(target, bits, group, head=True)
    tokens = torch.randint(5, 384, (300,), generator=torch.Generator().manual_seed(bits)).tolist()
    want = twin.log_probs(tokens)
    calls.clear()
    error = (llm.log_probs(tokens) - want).abs()
    assert len(calls) == 4 * llm.model.config.num_layers + 1  # q/k/v, o, gate/up and down a layer, the head
    plain = (LLM(target, dtype="bfloat16", max_batch=1, max_seq_len=512), LLM(target, dtype="float32"))
    bf16_error = (plain[0].log_probs(tokens).float() - plain[1].log_probs(tokens)).abs()
    assert error.mean() <= bf16_error.mean() / 32 and error.max() <= bf16_error.max() / 32
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [tokens[:12], tokens[100:130]]
    got, want = (m.generate(prompts, params) for m in (llm, twin))
    for ours, theirs, prompt in zip(got, want, prompts, strict=True):
        tie = 4 * float(error.max())  # two logits, each moved by up to about the largest log-prob change
        assert greedy_divergence_is_a_near_tie(twin.model, prompt, ours.token_ids, theirs.token_ids, atol=tie)
    bf16 = LLM(target, dtype="bfloat16", max_batch=1, max_seq_len=64, quantization=f"int{bits}")
    assert bf16.model.model.embed_tokens(torch.tensor([5, 6])).dtype == torch.bfloat16
    assert bf16.log_probs(tokens[:20]).isfinite().all()


def test_int8_without_the_kernel_multiplies_the_dequantized_weights(target, without_cpu_kernels):
    """fp32 with no C++ kernel: int8 linears hold the layout and compute what the twin does, within fp32
    error; the greedy tokens are the twin's."""
    llm = LLM(target, dtype="float32", max_batch=2, max_seq_len=512, quantization="int8")
    assert is_quantized(llm.model.model.layers[0].self_attn.q_proj.weight)
    twin = dequantized_twin(target, 8, 32, head=False)
    tokens = torch.randint(5, 384, (200,), generator=torch.Generator().manual_seed(8)).tolist()
    assert torch.allclose(llm.log_probs(tokens), twin.log_probs(tokens), atol=1e-4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    assert [c.token_ids for c in llm.generate([tokens[:12]], params)] == [
        c.token_ids for c in twin.generate([tokens[:12]], params)
    ]


def test_shapes_and_options_the_layout_cannot_take_are_refused_before_loading(
    target, tokenizer_dir, tmp_path
):
    """Outputs not in blocks of 32 rows (k/v of 48 here), and int8 on fp8 weights or CUDA, name the
    problem."""
    config = llama3_hf_config(hidden_size=96, num_attention_heads=4, intermediate_size=128)
    odd = save_hf_model(build_hf_model(config), tmp_path / "o", tokenizer_dir)
    with pytest.raises(ValueError, match=r"k_proj has 48 outputs; quantized weights take multiples of 32"):
        LLM(odd, dtype="float32", quantization="int8")
    with pytest.raises(ValueError, match="int8 quantization takes high-precision weights"):
        LLM(target, quantization="int8", dtype="fp8")


@pytest.mark.parametrize("bits", [4, 8])
def test_tensor_parallel_ranks_hold_one_process_codes(tmp_path, tokenizer_dir, bits):
    """int4 / int8 on load over 2 ranks: a column-parallel rank holds whole rows and a row-parallel one
    whole groups (its 64 inputs of 128 are 2 groups of 32), so each rank's codes, scales and zeros are
    one process's bit for bit, and the logits are one process's up to the all-reduce's fp32 order: 1e-4
    with fp32 products; 2e-3 on the AVX2 kernel, where that order's last-bit changes can move an x across
    a step of its int16 grid (2^-15 of its group's largest; measured 3e-4 on logits up to 4.4)."""
    import torch.multiprocessing as mp
    from test_tensor_parallel import _rank_logits

    from redline.models.build import load_target
    from redline.parallel.group import TensorParallel

    config = llama3_hf_config(hidden_size=128, intermediate_size=256, num_attention_heads=4)
    target = save_hf_model(build_hf_model(config, seed=13), tmp_path / "t", tokenizer_dir)
    tokens = torch.randint(5, 384, (1, 48))
    one = load_target(target, torch.float32, quantization=f"int{bits}")
    with torch.inference_mode():
        want = one.logits(one(tokens, torch.arange(48)[None])[0])
    args = (2, False, str(tmp_path / "init"), str(target), tokens, str(tmp_path), f"int{bits}")
    mp.start_processes(_rank_logits, args=args, nprocs=2, start_method="spawn")
    got = torch.load(tmp_path / "rank0.pt")
    tolerance = 2e-3 if cpu_ops.quantized_rows_loaded() else 1e-4
    assert torch.allclose(got, want, atol=tolerance, rtol=tolerance)
    rank1 = load_target(target, torch.float32, quantization=f"int{bits}", tp=TensorParallel(1, 2))
    for name in ("self_attn.q_proj", "mlp.down_proj"):  # column- and row-parallel
        mine, whole = (m.model.layers[1].get_submodule(name) for m in (rank1, one))
        if isinstance(whole, Int4Linear):  # no CPU kernel: scales and zeros [K / group, N, 2]
            sz, n, k = whole.scales_and_zeros, mine.out_features, mine.in_features
            part = sz[:, n:] if name.endswith("q_proj") else sz[k // 32 :]
            assert torch.equal(mine.scales_and_zeros, part)
        else:
            full, n, k = dequantize(whole.weight), mine.out_features, mine.in_features
            part = full[n:] if name.endswith("q_proj") else full[:, k:]
            assert torch.equal(dequantize(mine.weight), part)
