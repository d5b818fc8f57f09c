"""Split-KV decode attention (flash-decoding): the K + 1 query tokens of each slot against its cached
keys, GQA, per-slot lengths (keys after a query's position are masked) and Llama 4's chunked mask.

Grid (slot x kv head, split): a program takes every query row that shares its kv head (T tokens x G
query heads) and one contiguous split of the cache positions, and keeps an online softmax over it
(running max m, sum l, unnormalised output acc). The splits then combine:
    out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,   M = max_s m_s.
Row r of a program is token r // G of query head kv_head * G + r % G (G = 2: rows 0, 1 are token 0 of
heads 2h and 2h + 1).

The tile holds T * G rows, so this kernel is for the few queries of a decode step (K + 1 <= 9);
longer forwards (prompts) go through prefill_attention.py. T, kv_len and the split length are runtime
arguments: one compiled variant serves every kv_len (a dynamic dimension of the compiled step) and
every T with the same tile height.

Products run in the query's dtype with fp32 accumulation (tensor cores for bf16 / fp16; FP8 keys and
values upcast to it), fp32 queries as "tf32x3" and everything in fp32 under the interpreter, as in
prefill_attention.py. fp32 FMA tiles spill: at 32 rows x D = 128, 250-300 bytes of stack per thread
(ptxas, sm_90), 5 KB at 64 rows.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import triton_op
from triton.language.extra.cuda import gdc_wait

from redline.kernels.launch import is_interpreted, traceable
from redline.kernels.tree_mask import tree_seen


# ints that change from call to call: not specialized (Triton would compile a variant for values that are
# 1 or multiples of 16, and a new variant mid-serving is a latency spike)
@triton.jit(do_not_specialize=["kv_len", "split_len"])
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    table_ptr,
    tree_base_ptr,  # [B] with TREE: a token tree's first slot
    tree_bits_ptr,  # [B, T] int64 with TREE: bit j set -> the row sees slot base + j
    acc_ptr,
    m_ptr,
    l_ptr,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_tb,
    num_tokens,  # T
    kv_len,
    chunk,
    sm_scale,
    num_kv_heads,
    num_splits,
    split_len,  # cache positions per split, a multiple of BLOCK_N
    INTERPRETED_SPLIT_LEN: tl.constexpr,  # split_len under the interpreter, 0 compiled (see the loop)
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_BLOCK: tl.constexpr,  # positions per cache block
    DOT_FP32: tl.constexpr,  # products in fp32 (fp32 queries, the interpreter), else in q's dtype
    PRECISION: tl.constexpr,  # of fp32 products (prefill_attention.py)
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (Hopper+)
    TREE: tl.constexpr,  # the rows are a token tree: keys before its base, then their ancestors' slots
):
    if USE_PDL:  # the launch may overlap the previous kernel: wait for its writes (q, the KV cache)
        gdc_wait()
    pid, split = tl.program_id(0), tl.program_id(1)
    b, h = pid // num_kv_heads, pid % num_kv_heads
    rows = tl.arange(0, BLOCK_M)
    token, head = rows // G, h * G + rows % G
    row_ok = rows < num_tokens * G
    dims = tl.arange(0, D)
    q = tl.load(
        q_ptr + b * stride_qb + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = tl.load(pos_ptr + b * num_tokens + token, mask=row_ok, other=0).to(tl.int32)
    lowest = tl.where(chunk > 0, q_pos - q_pos % tl.maximum(chunk, 1), 0)
    if TREE:
        tree_base = tl.load(tree_base_ptr + b).to(tl.int32)
        tree_bits = tl.load(tree_bits_ptr + b * num_tokens + token, mask=row_ok, other=0)  # [BLOCK_M] int64
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    start = split * split_len
    # the interpreter's range() takes no runtime bound (int() of its 1-element scalars, refused by numpy
    # >= 2.4): it gets the length as a constant
    for offset in range(0, INTERPRETED_SPLIT_LEN if INTERPRETED_SPLIT_LEN else split_len, BLOCK_N):
        n = start + offset + tl.arange(0, BLOCK_N)
        n_ok = (n < kv_len) & (n < start + split_len)
        # position n sits in block table[b, n // KV_BLOCK], row n % KV_BLOCK; int64: large caches pass 2^31
        block = tl.load(table_ptr + b * stride_tb + n // KV_BLOCK, mask=n_ok, other=0).to(tl.int64)
        row = (n % KV_BLOCK)[:, None] * stride_kn
        kv_offsets = block[:, None] * stride_kb + h * stride_kh + row + dims[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=n_ok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # [BLOCK_M, BLOCK_N]
        if TREE:
            seen = tree_seen(n, tree_base, tree_bits, chunk)
        else:
            seen = (n[None, :] <= q_pos[:, None]) & (n[None, :] >= lowest[:, None])
        visible = n_ok[None, :] & seen & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_offsets, mask=n_ok[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m = m_new
    out_row = (pid * num_splits + split) * BLOCK_M + rows
    tl.store(acc_ptr + out_row[:, None] * D + dims[None, :], acc)
    tl.store(m_ptr + out_row, m)
    tl.store(l_ptr + out_row, denom)


@triton_op("redline::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    tables: torch.Tensor,
    kv_len: int,
    chunk: int = 0,
    tree_base: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
    num_splits: int = 4,
    block_n: int = 16,
    pdl: bool = False,
) -> torch.Tensor:
    """Same arguments and result as decode_attention_reference; the caches share strides and are
    contiguous in their last dimension. kv_len may be a SymInt (the compiled step's dynamic kv bucket).
    With pdl (Hopper or newer GPUs), launched with programmatic dependent launch."""
    tree = tree_base is not None and tree_bits is not None
    q = q.contiguous()  # interleaved RoPE leaves head_dim strided (Llama 4: stride 3 over a [T, H, D] view)
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    block_m = max(16, triton.next_power_of_2(t * g))  # tl.dot needs >= 16 rows
    split_len = triton.cdiv(triton.cdiv(kv_len, num_splits), block_n) * block_n  # SymInt-safe arithmetic
    acc = torch.empty(b * hkv, num_splits, block_m, d, dtype=torch.float32, device=q.device)
    m = torch.empty(b * hkv, num_splits, block_m, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    launch = {"launch_pdl": True} if pdl else {}
    interpreted, fp32 = is_interpreted(_split_kernel), q.dtype == torch.float32
    traceable(_split_kernel)[(b * hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        positions.contiguous(),
        tables,
        tree_base.contiguous() if tree else positions,  # unread without TREE
        tree_bits.contiguous() if tree else positions,
        acc,
        m,
        denom,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        t,
        kv_len,
        chunk,
        1.0 / math.sqrt(d),
        hkv,
        num_splits,
        split_len,
        INTERPRETED_SPLIT_LEN=split_len if interpreted else 0,
        G=g,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        KV_BLOCK=k_cache.shape[2],
        DOT_FP32=fp32 or interpreted,
        PRECISION="tf32x3" if fp32 and not interpreted else "ieee",  # 16-bit products ignore it
        USE_PDL=pdl,
        TREE=tree,
        **launch,
    )
    top = m.amax(dim=1, keepdim=True)  # [B * Hkv, 1, BLOCK_M]
    weight = torch.exp(m - top.nan_to_num(neginf=0.0))  # splits that saw no key weigh 0
    out = (weight[..., None] * acc).sum(1) / (weight * denom).sum(1)[..., None]  # [B * Hkv, BLOCK_M, D]
    out = out[:, : t * g].view(b, hkv, t, g, d).permute(0, 2, 1, 3, 4)  # row r = (token r // G, head r % G)
    return out.reshape(b, t, hq, d).to(q.dtype)
