"""Each Triton kernel against its torch reference: fresh random inputs, several shapes, tolerances by
dtype. On CPU they run under TRITON_INTERPRET=1 (conftest sets it)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from redline.kernels.attention_core import decode_attention_reference
from redline.kernels.decode_attention import decode_attention
from redline.kernels.paged_kv import BLOCK, gather_blocks
from redline.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from redline.kernels.rms_norm import add_rms_norm, add_rms_norm_reference
from redline.kernels.swiglu import swiglu, swiglu_reference
from redline.kernels.weight_only_mm import weight_only_mm, weight_only_mm_reference
from redline.quant.fp8 import quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: both sides accumulate in fp32 in different orders (a few ulp); bf16: outputs are rounded to
# 8 mantissa bits, one bf16 ulp is 2^-8 relative
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 96), (5, 256)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, shape, with_residual):
    x = torch.randn(shape, device=DEVICE).to(dtype)
    residual = torch.randn(shape, device=DEVICE).to(dtype) if with_residual else None
    weight = torch.rand(shape[1], device=DEVICE) + 0.5
    out, res_out, _ = add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_res = add_rms_norm_reference(x, residual, weight, 1e-5)
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(res_out, ref_res, atol=TOL[dtype], rtol=TOL[dtype])


def _fp8_rms_norm():
    x, residual = torch.randn(4, 128, device=DEVICE), torch.randn(4, 128, device=DEVICE)
    weight = torch.rand(128, device=DEVICE) + 0.5
    out, _, (q, scale) = add_rms_norm(x, residual, weight, 1e-6, quantize=True)
    return q, scale, *quantize(out)  # the reference: per-row FP8 quantization of the normed output


def test_add_rms_norm_fp8_scales():
    _, scale, _, ref_scale = _fp8_rms_norm()
    torch.testing.assert_close(scale, ref_scale, atol=0, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a GPU: triton 3.6's interpreter mis-rounds "
    "fp32 -> e4m3 casts that round up to the next power of two (126.2 -> 64, not 128)",
)
def test_add_rms_norm_fp8_codes():
    q, _, ref_q, _ = _fp8_rms_norm()
    # the same fp32 value rounds to the same e4m3 code, except at a rounding boundary (1 code apart)
    codes = (q.view(torch.uint8).int() - ref_q.view(torch.uint8).int()).abs()
    assert int(codes.max()) <= 1 and (codes == 0).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 32), (4, 200), (3, 2048)])
def test_swiglu(dtype, shape):
    gate_up = torch.randn(shape, device=DEVICE).to(dtype)
    torch.testing.assert_close(
        swiglu(gate_up, block=64), swiglu_reference(gate_up), atol=TOL[dtype], rtol=TOL[dtype]
    )


SHAPES = [(1, 64, 128, 32), (4, 96, 256, 64), (17, 40, 512, 128), (33, 48, 128, 32), (100, 64, 64, 32)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m, n, k, group", SHAPES)
def test_weight_only_mm(bits, m, n, k, group):
    """int4 / int8 codes (fresh random, the whole code range) with random fp16 scales and zeros: the
    kernel equals the reference (weights rounded to bf16 on a GPU, fp32 under the interpreter) within one
    bf16 ulp of the output (both accumulate in fp32, in different orders), for a decode row, a verify
    step's rows and past one 16-row tile."""
    from redline.quant.int_packing import pack_int32

    if bits == 4:
        codes = pack_int32(torch.randint(0, 16, (n, k), dtype=torch.int32), 4).to(DEVICE)
    else:
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=DEVICE)
    scales = (torch.rand(n, k // group, device=DEVICE) * 0.02).half()
    zeros = (torch.randn(n, k // group, device=DEVICE) * 0.05).half()
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    got = weight_only_mm(x, codes, scales, zeros)  # block_n_for's choice; 33 and 100 rows: tiles of 64
    want = weight_only_mm_reference(x, codes, scales, zeros, rounded=DEVICE == "cuda")
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_weight_only_linear_multiplies_the_cpu_rounding(bits):
    """quant/weight_only_gpu.py: the weight rounded as the CPU layout rounds it (kernels/quantized_layout),
    a step's rows through the kernel and a prompt's (past KERNEL_ROWS) through the dequantized weight, both
    the dequantized product within one bf16 ulp; the bias added."""
    from redline.kernels.quantized_layout import dequantize, quantize
    from redline.quant.weight_only_gpu import KERNEL_ROWS, GpuWeightOnlyLinear

    linear = torch.nn.Linear(256, 96, device=DEVICE).bfloat16()
    module = GpuWeightOnlyLinear.from_linear(linear, bits, 64, torch.bfloat16)
    weight = dequantize(quantize(linear.weight.detach().cpu(), bits, 64)).to(DEVICE)
    for rows in (3, 100, KERNEL_ROWS + 6):  # one tile, tiles of 64 rows, the dequantized weight
        x = torch.randn(2, rows, 256, device=DEVICE).bfloat16()[:1]
        want = (x.float() @ weight.t() + linear.bias.float()).bfloat16()
        torch.testing.assert_close(module(x), want, atol=2e-2, rtol=1e-2)


def paged(
    keys: torch.Tensor,  # [B, Hkv, L, D] each row's keys (and values) by position
    values: torch.Tensor,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # k, v [blocks, Hkv, BLOCK, D], tables [B, n] int32
    """Each row's positions scattered over blocks in random order among 3 spare blocks of noise: row b's
    position p lands in block tables[b, p // BLOCK] at row p % BLOCK."""
    b, hkv, length, d = keys.shape
    n = -(-length // BLOCK)
    tables = torch.randperm(b * n + 3, generator=gen)[: b * n].view(b, n).to(torch.int32)
    stores = []
    for rows in (keys, values):
        store = torch.randn(b * n + 3, hkv, BLOCK, d, generator=gen)
        padded = torch.cat((rows, torch.randn(b, hkv, n * BLOCK - length, d, generator=gen)), dim=2)
        store[tables.long()] = padded.view(b, hkv, n, BLOCK, d).transpose(1, 2)
        assert torch.equal(gather_blocks(store, tables, length), rows)
        stores.append(store)
    return *stores, tables


@pytest.mark.parametrize(
    "b,t,hq,hkv,kv_len,chunk,splits",
    [
        (1, 1, 4, 4, 32, 0, 1),  # plain decode, MHA
        (2, 4, 4, 2, 64, 0, 4),  # K = 3 verify, GQA 2
        (3, 4, 8, 2, 96, 24, 3),  # chunked mask across a chunk boundary, GQA 4
        (2, 2, 2, 1, 48, 0, 8),  # more splits than needed: some splits see no key
    ],
)
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.bfloat16)],
)
def test_decode_attention(b, t, hq, hkv, kv_len, chunk, splits, dtype, cache_dtype):
    d, max_len = 16, kv_len + 8
    gen = torch.Generator().manual_seed(b * 100 + t)
    q = torch.randn(b, t, hq, d, generator=gen).to(DEVICE, dtype)
    k_cache, v_cache, tables = paged(*torch.randn(2, b, hkv, max_len, d, generator=gen).unbind(0), gen)
    # FP8 entries are upcast in the kernel
    k_cache, v_cache, tables = (
        k_cache.to(DEVICE, cache_dtype),
        v_cache.to(DEVICE, cache_dtype),
        tables.to(DEVICE),
    )
    # per-row lengths: each row's queries sit at its own positions, consecutive over its T tokens
    last = torch.randint(t, kv_len, (b,), generator=gen).to(DEVICE)
    positions = last[:, None] - torch.arange(t - 1, -1, -1, device=DEVICE)[None]
    got = decode_attention(q, k_cache, v_cache, positions, tables, kv_len, chunk, num_splits=splits)
    expected = decode_attention_reference(q, k_cache, v_cache, positions, tables, kv_len, chunk)
    torch.testing.assert_close(got, expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("chunk", [0, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_a_token_tree(dtype, chunk):
    """A decode step's token tree (speculative/tree.py): 8 rows at slots base .. base + 7, each seeing
    every key before its base (from its root's chunk's start, with Llama 4's chunk) and its ancestors'
    slots (random trees, per row of the batch), against the reference under attention_core.tree_visible;
    GQA 2 over 3 splits."""
    from test_tree import random_parents

    from redline.speculative.tree import structure

    b, t, hq, hkv, d, kv_len = 3, 8, 4, 2, 16, 96
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(b, t, hq, d, generator=gen).to(DEVICE, dtype)
    k_cache, v_cache, tables = paged(*torch.randn(2, b, hkv, kv_len + 8, d, generator=gen).unbind(0), gen)
    k_cache, v_cache, tables = k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), tables.to(DEVICE)
    base = torch.randint(30 if chunk else 0, kv_len - t, (b,), generator=gen).to(DEVICE)  # past chunk 0
    _, bits = structure(random_parents(b, t, 4), 4)
    bits = bits.to(DEVICE)
    positions = base[:, None] + torch.arange(t, device=DEVICE)  # unread with a tree
    got = decode_attention(q, k_cache, v_cache, positions, tables, kv_len, chunk, base, bits, num_splits=3)
    expected = decode_attention_reference(q, k_cache, v_cache, positions, tables, kv_len, chunk, base, bits)
    torch.testing.assert_close(got, expected, atol=TOL[dtype], rtol=TOL[dtype])
    causal = decode_attention_reference(q, k_cache, v_cache, positions, tables, kv_len)
    assert not torch.allclose(expected, causal, atol=TOL[dtype]), "the tree's mask must differ from causal"
    if chunk:
        whole = decode_attention_reference(q, k_cache, v_cache, positions, tables, kv_len, 0, base, bits)
        assert not torch.allclose(expected, whole, atol=TOL[dtype]), "the chunk must matter here"


def _prefill_inputs(b, t, hq, hkv, kv_len, d, dtype, cache_dtype, seed):
    """Random q and block caches for b rows (their blocks in random order among spare ones); row i's t
    queries sit at consecutive positions starting at a random offset (0: a fresh prompt, > 0: a prompt
    continued in the cache)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=gen).to(DEVICE, dtype)
    # entries past each query's position hold stale values the mask must hide: all random
    k_cache, v_cache, tables = paged(*torch.randn(2, b, hkv, kv_len + 8, d, generator=gen).unbind(0), gen)
    start = torch.randint(0, kv_len - t + 1, (b, 1), generator=gen)
    start[0] = 0
    positions = (start + torch.arange(t)[None]).to(DEVICE)
    k_cache, v_cache = k_cache.to(DEVICE, cache_dtype), v_cache.to(DEVICE, cache_dtype)
    return q, k_cache, v_cache, positions, tables.to(DEVICE)


@pytest.mark.parametrize(
    "b,t,hq,hkv,kv_len,chunk,block_m,block_n",
    [
        (1, 40, 4, 4, 64, 0, 16, 16),  # MHA, T not a multiple of the query tile
        (2, 37, 8, 2, 96, 0, 16, 32),  # GQA 4, two slots at different offsets, T < kv_len
        (2, 50, 4, 2, 80, 24, 16, 16),  # chunked mask: chunk starts 24, 48, 72 fall inside tiles
        (1, 64, 6, 3, 64, 16, 32, 16),  # chunk = block: every tile starts a chunk, T = kv_len
        (1, 21, 2, 1, 48, 0, 64, 64),  # one tile larger than T and than kv_len: masked rows and keys
    ],
)
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.bfloat16)],
)
def test_prefill_attention(b, t, hq, hkv, kv_len, chunk, block_m, block_n, dtype, cache_dtype):
    q, k_cache, v_cache, positions, tables = _prefill_inputs(
        b, t, hq, hkv, kv_len, 16, dtype, cache_dtype, b * 1000 + t
    )
    got = prefill_attention(q, k_cache, v_cache, positions, tables, kv_len, chunk, block_m=block_m,
                            block_n=block_n)  # fmt: skip
    expected = prefill_attention_reference(q, k_cache, v_cache, positions, tables, kv_len, chunk)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(
    "t, steps, first, chunk", [(16, 3, 0, 0), (40, 6, 0, 0), (63, 8, 0, 0), (12, 4, 36, 0), (40, 6, 0, 24)]
)  # 63: every slot of draft_tree.TREE_SLOTS; first 36: a draft frontier past earlier steps' slots
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_over_a_token_tree(t, steps, first, chunk, dtype):
    """A tree of more rows than the decode kernel's tile holds (CUDA's Backends.tree_rows) takes the
    prefill kernel under its mask: random trees per row of the batch at random bases, the rows at slots
    base + first + row (the positions attention passes; a draft frontier of topk 12 at its fourth step sits
    at base + 36 .., its ancestors at lower slots), 16 x 16 tiles (several query tiles and key blocks, one
    straddling the base), GQA 2, against the reference under attention_core.tree_visible; with Llama 4's
    chunk, the keys from the root's chunk's start (the loop's first key block)."""
    from test_tree import random_parents

    from redline.speculative.tree import structure

    b, hq, hkv, d, kv_len = 2, 4, 2, 16, 120
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(b, t, hq, d, generator=gen).to(DEVICE, dtype)
    k_cache, v_cache, tables = paged(*torch.randn(2, b, hkv, kv_len + 8, d, generator=gen).unbind(0), gen)
    k_cache, v_cache, tables = k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), tables.to(DEVICE)
    lowest = 30 if chunk else 1  # a base past the first chunk
    base = torch.randint(lowest, kv_len - t - first, (b,), generator=gen).to(DEVICE)
    _, bits = structure(random_parents(b, first + t, steps), steps)  # rows [first, first + t) queried
    bits = bits[:, first:].contiguous().to(DEVICE)
    positions = base[:, None] + first + torch.arange(t, device=DEVICE)
    got = prefill_attention(q, k_cache, v_cache, positions, tables, kv_len, chunk, base, bits, block_m=16,
                            block_n=16)  # fmt: skip
    expected = prefill_attention_reference(q, k_cache, v_cache, positions, tables, kv_len, chunk, base, bits)
    torch.testing.assert_close(got, expected, atol=TOL[dtype], rtol=TOL[dtype])
    if chunk:
        unchunked = prefill_attention_reference(q, k_cache, v_cache, positions, tables, kv_len, 0, base, bits)
        assert not torch.allclose(expected, unchunked, atol=TOL[dtype]), "the chunk must matter here"
    causal = prefill_attention_reference(q, k_cache, v_cache, positions, tables, kv_len)
    assert not torch.allclose(expected, causal, atol=TOL[dtype]), "the tree's mask must differ from causal"


def test_prefill_attention_at_4000_tokens():
    """A 4,000-token prompt against a 4,096-position cache bucket, GQA 2, Llama 4's chunked mask with a
    chunk of 1,536 (chunk starts 1,536 and 3,072 inside query tiles). Interpreted, 128 x 128 tiles: its
    cost is per block visited (7 s here, 53 s with the engine's fp32 64 x 32); compiled, the engine's."""
    from redline.layers.backends import prefill_tiles

    tiles = prefill_tiles(torch.float32) if DEVICE == "cuda" else {"block_m": 128, "block_n": 128}
    q, k_cache, v_cache, positions, tables = _prefill_inputs(
        1, 4000, 2, 1, 4096, 16, torch.float32, torch.float32, 7
    )
    got = prefill_attention(q, k_cache, v_cache, positions, tables, 4096, 1536, **tiles)
    expected = prefill_attention_reference(q, k_cache, v_cache, positions, tables, 4096, 1536)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,e,h,i", [(1, 4, 32, 24), (3, 8, 96, 40), (5, 16, 64, 128)])
def test_moe_top1(dtype, n, e, h, i):
    from redline.kernels.moe_top1 import moe_top1, moe_top1_reference

    x = torch.randn(n, h, device=DEVICE).to(dtype)
    expert = torch.randint(0, e, (n,), device=DEVICE)
    weight = torch.rand(n, device=DEVICE)
    gate_up = (torch.randn(e, h, 2 * i, device=DEVICE) * 0.1).to(dtype)
    down = (torch.randn(e, i, h, device=DEVICE) * 0.1).to(dtype)
    got = moe_top1(x, expert, weight, gate_up, down, block_k=16, block_j=16)
    torch.testing.assert_close(
        got, moe_top1_reference(x, expert, weight, gate_up, down), atol=TOL[dtype], rtol=TOL[dtype]
    )


def test_engine_with_triton_attention_matches_sdpa(tmp_path, tokenizer_dir, monkeypatch):
    """Greedy decoding of a Llama 4 model (chunked attention, chunk 24, top-1 MoE over 8 experts, so a
    step's 2 x 3 tokens take the few-token path) with speculation: the Triton split-KV attention, fused
    residual + RMSNorm, fused gate/up + SwiGLU and top-1 MoE dispatch give the torch path's tokens. The
    engines are built as on any device, with the backends of each kind handed to their layers."""
    from conftest import build_hf_model, llama4_hf_config, save_hf_model

    from redline import LLM, SamplingParams
    from redline.layers.backends import TORCH, Backends
    from redline.layers.mlp import MLP
    from redline.layers.moe import MoE
    from redline.runner import build
    from redline.train.random_init import write_random_draft

    config = llama4_hf_config(num_local_experts=8)
    target = save_hf_model(build_hf_model(config, seed=4), tmp_path / "t", tokenizer_dir)
    draft = write_random_draft(target, tmp_path / "d")
    prompts = [list(range(5, 25)), list(range(30, 37))]  # the first crosses the chunk boundary at 24
    params = SamplingParams(max_tokens=10, ignore_eos=True)

    def engine(backends: Backends) -> LLM:
        monkeypatch.setattr(build, "backends_of", lambda config, device: backends)
        return LLM(target, dtype="float32", device=DEVICE, max_batch=2, max_seq_len=64, draft=draft,
                   num_draft_tokens=2)  # fmt: skip

    expected = [c.token_ids for c in engine(TORCH).generate(prompts, params)]
    llm = engine(Backends.choose(torch.device("cuda"), torch.float32, compiled=False))
    assert all(layer.add_norm is not None for layer in llm.model.model.layers)
    mlps = [m for m in llm.model.modules() if isinstance(m, MLP)]
    assert mlps and all(m.swiglu is not None for m in mlps)
    moes = [m for m in llm.model.modules() if isinstance(m, MoE)]
    assert moes and all(m.top1 is not None for m in moes)
    gate = mlps[0].gate_proj.weight
    assert gate.data_ptr() == mlps[0].gate_up_weight.data_ptr()  # a view: no second copy
    assert "decode_attention" in repr(llm.model) and "decode_attention" in repr(llm.draft)
    assert [c.token_ids for c in llm.generate(prompts, params)] == expected


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launch needs a Hopper or newer GPU",
)
def test_decode_attention_with_pdl():
    q = torch.randn(2, 4, 8, 64, device="cuda")
    k_cache, v_cache = torch.randn(2, 48, 2, BLOCK, 64, device="cuda").unbind(0)  # 48 blocks, 2 kv heads
    tables = torch.randperm(48, device="cuda")[:32].view(2, 16).int()
    positions = torch.tensor([[100, 101, 102, 103], [7, 8, 9, 10]], device="cuda")
    got = decode_attention(q, k_cache, v_cache, positions, tables, 256, pdl=True)
    torch.testing.assert_close(
        got, decode_attention_reference(q, k_cache, v_cache, positions, tables, 256), atol=1e-4, rtol=1e-4
    )
