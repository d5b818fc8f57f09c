"""Attention for the few queries of a decode step, written as reductions for inductor on CPU, and the
definition every decode attention kernel is tested against (decode_attention_reference).

SDPA's CPU kernel costs ~100 us per call for one query over 64 keys (BENCHMARKS.md "Compiled bf16
decode"), more than the layer's weights take to stream. Written as broadcast products and sums,
inductor fuses scores, mask, softmax and the weighted sum into loops inside the step's one C++
kernel. Eager torch would materialize the [B, Hkv, G, T, S, D] products, so outside a compiled graph
this is SDPA, and so are forwards of more than STEP_QUERIES queries (prefill), where SDPA's
flash kernel is the faster.

GQA by grouping: query head h reads kv head h // G (G = Hq / Hkv), so q [B, T, Hq, D] is viewed as
[B, T, Hkv, G, D] and permuted to [B, Hkv, G, T, D]. Example: Hq = 8, Hkv = 2, G = 4: query heads 0-3
read kv head 0, 4-7 read kv head 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from redline.draft_tree import TREE_SLOTS
from redline.kernels.paged_kv import gather_blocks

STEP_QUERIES = 9  # a decode step's queries: K + 1, K <= 8 draft tokens; more is a prompt


def sdpa_attention(
    q: torch.Tensor,  # [B, T, Hq, D]
    keys: torch.Tensor,  # [B, Hkv, S, D]
    values: torch.Tensor,  # [B, Hkv, S, D]
    mask: torch.Tensor,  # [B or 1, 1, T, S] bool, True = attend
) -> torch.Tensor:  # [B, T, Hq, D]
    """On CPU (torch 2.13) SDPA runs this, GQA and boolean mask included, in its flash kernel: the mask
    becomes one additive fp32 [B, 1, T, S] plane and no [B, Hq, T, S] scores exist (a 4,000-token prompt:
    tests/test_long_prompt.py). CUDA prompts take the Triton kernel instead (kernels/prefill_attention.py
    says why)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


def attention_by_reductions(
    q: torch.Tensor,  # [B, T, Hq, D]
    keys: torch.Tensor,  # [B, Hkv, S, D]
    values: torch.Tensor,  # [B, Hkv, S, D]
    mask: torch.Tensor,  # [B or 1, 1, T, S] bool; every query attends to at least its own position
) -> torch.Tensor:  # [B, T, Hq, D], as sdpa_attention (fp32 scores and softmax)
    if not torch.compiler.is_dynamo_compiling() or q.shape[1] > STEP_QUERIES:
        return sdpa_attention(q, keys, values, mask)
    b, t, hq, d = q.shape
    hkv = keys.shape[1]
    grouped = q.view(b, t, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4).float()  # [B, Hkv, G, T, D]
    k = keys.float()[:, :, None, None]  # [B, Hkv, 1, 1, S, D]
    scores = (grouped[..., None, :] * k).sum(-1) * d**-0.5  # [B, Hkv, G, T, S]
    probs = scores.masked_fill(~mask[:, :, None], float("-inf")).softmax(-1)
    out = (probs[..., None] * values.float()[:, :, None, None]).sum(-2)  # [B, Hkv, G, T, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, hq, d).to(q.dtype)


def step_mask(positions: torch.Tensor, kv_len: int, chunk: int = 0) -> torch.Tensor:
    """[B, 1, T, kv_len] bool: query (b, t) sees keys up to its position (positions [B, T]), and with a
    chunk size only those of its own chunk. Position 37, chunk 16: keys 32..37."""
    key_pos = torch.arange(kv_len, device=positions.device)[None, None, None, :]
    query_pos = positions[:, None, :, None]
    mask = key_pos <= query_pos
    if chunk:
        mask &= key_pos >= query_pos - query_pos % chunk
    return mask


def tree_visible(
    key_positions: torch.Tensor,  # [B or 1, 1, 1, S]
    base: torch.Tensor,  # [B] the tree's first slot
    bits: torch.Tensor,  # [B, T] int64: bit j set -> the row sees slot base + j
    chunk: int = 0,  # Llama 4's chunked layers: only keys from the start of the root's chunk
) -> torch.Tensor:  # [B, 1, T, S] bool
    """A token tree's mask (speculative/tree.py): every key before the base, then the row's ancestors'
    slots. Base 40, bits 0b101: keys 0..39, 40 and 42; chunk 32: keys 32..39, 40 and 42. Under a chunk every
    row sees its root's chunk, which is its own while the row's position (base + depth) is in it; the rows
    past the chunk's end are never accepted (speculative/tree.truncate_at_chunk)."""
    past_base = key_positions - base[:, None, None, None]
    bit = (bits[:, None, :, None] >> past_base.clamp(0, TREE_SLOTS - 1)) & 1
    seen = (past_base < 0) | ((past_base < TREE_SLOTS) & (bit == 1))
    if chunk:
        seen &= past_base >= -torch.remainder(base, chunk)[:, None, None, None]
    return seen


def decode_attention_reference(
    q: torch.Tensor,  # [B, T, Hq, D]
    k_cache: torch.Tensor,  # [blocks, Hkv, BLOCK, D]
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [B, T] absolute positions of the queries
    tables: torch.Tensor,  # [B, blocks per sequence] int32 (kernels/paged_kv.py)
    kv_len: int,
    chunk: int = 0,  # attention chunk size (0: none)
    tree_base: torch.Tensor | None = None,  # [B] with tree_bits [B, T]: a token tree's mask (tree_visible)
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, T, Hq, D]
    """What the decode attention kernels compute (kernels/decode_attention.py on CUDA, kernels/cpu_ops.py
    on CPU): the queries over the gathered cache in fp32."""
    keys, values = gather_blocks(k_cache, tables, kv_len), gather_blocks(v_cache, tables, kv_len)
    if tree_base is not None and tree_bits is not None:
        key_positions = torch.arange(kv_len, device=q.device)[None, None, None]
        mask = tree_visible(key_positions, tree_base, tree_bits, chunk)
    else:
        mask = step_mask(positions, kv_len, chunk)
    return sdpa_attention(q.float(), keys.float(), values.float(), mask).to(q.dtype)
