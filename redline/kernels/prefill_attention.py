"""Prefill attention (flash-attention forward) over the slot-indexed KV cache: the T queries of a prompt
against cache positions [0, kv_len) of their slot, GQA, causal by absolute position, Llama 4's chunked
mask, fp32 softmax and accumulation, FP8 cache entries upcast in registers.

Why a kernel, not SDPA over the cache slice (the torch path, which stays the CPU path and the reference):
on CUDA, SDPA's flash kernel takes no mask (only is_causal, which cannot express positions that are
not 0..T-1, nor Llama 4's chunks); with the boolean mask torch falls back to the memory-efficient
kernel, which reads the mask as an additive bias in the query dtype ([B, 1, T, S], padded and
broadcast over heads) and, on releases whose efficient kernel lacks GQA, to the math kernel, which
materializes the [B, Hq, T, S] scores: 2 GB of fp32 per layer at T = S = 4,096 and 32 heads. It also
needs the whole FP8 cache slice upcast to bf16 first. This kernel derives the mask from positions in
registers, maps query head h to kv head h // G without copying keys, skips key blocks that no query of
its tile can see (half the work under the causal mask, more under chunks), and reads the cache where
it lies, so it is also what will read paged blocks.

Grid (query tile, batch x query head): a program takes BLOCK_M consecutive queries of one head and
loops over the key blocks between the lowest key any of them can see (the chunk start, or 0) and the
highest (its last query's position), with an online softmax (running max m, sum l):
    m' = max(m, max_j s_j),  l' = l exp(m - m') + sum_j exp(s_j - m'),  acc' = acc exp(m - m') + P V
in base 2 (scores pre-multiplied by log2(e)). Example: BLOCK_M = BLOCK_N = 64, queries at positions
128..191, chunk 0: key blocks 0, 64, 128 (192 and beyond are invisible to every row), three of the
kv_len / 64 blocks.

A token tree of more rows than the decode kernel's tile holds (a verification tree, or the draft's frontier
at topk >= 10: speculative/tree.py) comes here too, under the tree's mask (attention_core.tree_visible):
each row sees every key before the base and its ancestors' slots. Its positions are the rows' cache slots,
each past its ancestors', so the loop runs over [0, the last row's slot] as for a causal prompt; in Llama 4's
chunked layers from the start of the root's chunk (tree_lowest) instead of 0.

Products run on tensor cores in the query's dtype (bf16 / fp16; FP8 keys and values are upcast to it)
with fp32 accumulation, as flash-attention does. fp32 queries (tests) multiply as "tf32x3": three
TF32 tensor-core products that keep ~fp32 accuracy (plain fp32 FMA tiles spill registers: 6.8 KB of
stack per thread at 64 x 32, D = 128, ptxas for sm_90). Under the interpreter, whose tl.dot is wrong
on bf16, everything multiplies in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from redline.kernels.attention_core import decode_attention_reference
from redline.kernels.launch import is_interpreted, traceable
from redline.kernels.tree_mask import tree_lowest, tree_seen

LOG2E = 1.4426950408889634


def prefill_attention_reference(
    q: torch.Tensor,  # [B, T, Hq, D]
    k_cache: torch.Tensor,  # [blocks, Hkv, BLOCK, D]
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [B, T] absolute positions of the queries
    tables: torch.Tensor,  # [B, blocks per sequence] int32
    kv_len: int,
    chunk: int = 0,
    tree_base: torch.Tensor | None = None,  # [B] with tree_bits [B, T]: a token tree's mask (tree_visible)
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, T, Hq, D]
    """SDPA over the rows' cache positions, fp32: the same function as the decode kernel's reference."""
    return decode_attention_reference(
        q, k_cache, v_cache, positions, tables, kv_len, chunk, tree_base, tree_bits
    )


# ints that change from prompt to prompt: not specialized (Triton would compile a variant for values that
# are 1 or multiples of 16, and a new variant mid-serving is a latency spike)
@triton.jit(do_not_specialize=["num_tokens", "kv_len"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    table_ptr,
    tree_base_ptr,  # [B] with TREE: a token tree's first slot
    tree_bits_ptr,  # [B, T] int64 with TREE: bit j set -> the row sees slot base + j
    out_ptr,
    stride_qb,  # q and out: contiguous [B, T, Hq, D]
    stride_qt,
    stride_kb,  # caches: [blocks, Hkv, KV_BLOCK, D], last dimension contiguous
    stride_kh,
    stride_kn,
    stride_tb,  # tables: [B, blocks per sequence]
    num_tokens,  # T
    num_heads,  # Hq
    kv_len,
    chunk,
    qk_scale,  # log2(e) / sqrt(D)
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_BLOCK: tl.constexpr,  # positions per cache block
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,  # of fp32 products: "tf32x3" (tensor cores, ~fp32 accuracy), "ieee"
    INTERPRETED_LEN: tl.constexpr,  # kv_len under the interpreter, 0 compiled (see the loop)
    TREE: tl.constexpr,  # the rows are a token tree: keys before its base, then their ancestors' slots
):
    tile, bh = tl.program_id(0), tl.program_id(1)
    b, head = bh // num_heads, bh % num_heads
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_tokens
    dims = tl.arange(0, D)
    q_offsets = b * stride_qb + rows[:, None] * stride_qt + head * D + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = tl.load(pos_ptr + b * num_tokens + rows, mask=row_ok, other=-1).to(tl.int32)
    # chunk 8192: a query at 8195 sees keys 8192..8195 only
    lowest = tl.where(chunk > 0, q_pos - q_pos % tl.maximum(chunk, 1), 0)
    # the keys any row of this tile can see: [lo, hi), lo aligned down to a key block
    hi = tl.minimum(tl.max(q_pos) + 1, kv_len)
    if TREE:  # positions are the rows' slots, each past its ancestors'; the lowest key is the root's chunk's
        tree_base = tl.load(tree_base_ptr + b).to(tl.int32)
        tree_bits = tl.load(tree_bits_ptr + b * num_tokens + rows, mask=row_ok, other=0)  # [BLOCK_M] int64
        lo = tree_lowest(tree_base, chunk)
    else:
        lo = tl.min(tl.where(row_ok, lowest, kv_len))
    lo = lo - lo % BLOCK_N
    if INTERPRETED_LEN:
        # the interpreter's range() takes no runtime bound (int() of its 1-element scalars, refused by
        # numpy >= 2.4): it visits every block and masks those outside [lo, hi)
        first, last = 0, INTERPRETED_LEN
    else:
        first, last = lo, hi
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(first, last, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = (n >= lo) & (n < hi)  # the interpreter computes exactly what the skipping loop sees
        # position n sits in block table[b, n // KV_BLOCK] at row n % KV_BLOCK; int64: a cache of 16 x
        # 131,072 positions x 8 kv heads x 128 holds 2^31 entries
        block = tl.load(table_ptr + b * stride_tb + n // KV_BLOCK, mask=n_ok, other=0).to(tl.int64)
        row = (n % KV_BLOCK)[:, None] * stride_kn
        kv_offsets = block[:, None] * stride_kb + (head // G) * stride_kh + row + dims[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=n_ok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if TREE:
            seen = tree_seen(n, tree_base, tree_bits, chunk)
        else:
            seen = (n[None, :] <= q_pos[:, None]) & (n[None, :] >= lowest[:, None])
        visible = n_ok[None, :] & seen
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m - m_safe)
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_offsets, mask=n_ok[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]  # padding rows saw nothing: 0
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton_op("redline::prefill_attention", mutates_args=())
def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    tables: torch.Tensor,
    kv_len: int,
    chunk: int = 0,
    tree_base: torch.Tensor | None = None,  # [B] with tree_bits [B, T]: a token tree's mask (tree_visible)
    tree_bits: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Same arguments and result as prefill_attention_reference; the caches share strides and are
    contiguous in their last dimension. T and kv_len may be SymInts (the compiled prefill's dynamic
    prompt length). With tree_base and tree_bits: a token tree of more rows than the decode kernel's tile
    holds (Backends.tree_rows)."""
    tree = tree_base is not None and tree_bits is not None
    q = q.contiguous()  # interleaved RoPE leaves head_dim strided
    b, t, hq, d = q.shape
    out = torch.empty_like(q)
    interpreted, fp32 = is_interpreted(_prefill_kernel), q.dtype == torch.float32
    wide = not fp32 and block_m >= 128  # 16-bit tiles of 128 rows: 8 warps share them
    traceable(_prefill_kernel)[(triton.cdiv(t, block_m), b * hq)](
        q,
        k_cache,
        v_cache,
        positions.contiguous(),
        tables,
        tree_base.contiguous() if tree else positions,  # unread without TREE
        tree_bits.contiguous() if tree else positions,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        t,
        hq,
        kv_len,
        chunk,
        LOG2E / math.sqrt(d),
        G=hq // k_cache.shape[1],
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        KV_BLOCK=k_cache.shape[2],
        DOT_FP32=fp32 or interpreted,
        PRECISION="tf32x3" if fp32 and not interpreted else "ieee",  # 16-bit products ignore it
        INTERPRETED_LEN=kv_len if interpreted else 0,
        TREE=tree,
        num_warps=8 if wide else 4,
        num_stages=2 if fp32 else 3,
    )
    return out
