"""Grouped-query attention over a paged KV cache (kernels/paged_kv.py), with Llama 4's per-layer
variations."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from redline.config import ModelConfig
from redline.kernels.attention_core import STEP_QUERIES, tree_visible
from redline.kernels.paged_kv import BLOCK, gather_blocks, kv_bucket
from redline.layers.backends import TORCH, Backends, backend_name
from redline.layers.linear import Linear, fuse_weights, product, quantized_parts
from redline.layers.norm import rms_normalize
from redline.layers.rotary import Rotary
from redline.quant.fp8 import FP8, FP8_MAX


@dataclass
class TreeMask:
    """Rows of a token tree (speculative/tree.py) in one forward: each row sits at its depth's position
    (rotary) but is stored at a cache slot of its own, and attends to the cache before `base` and to the
    slots of its ancestors. Row 2 of a tree rooted at base 40 with bits 0b101: keys 0..39, then slots 40
    (the root) and 42 (itself), not 41 (a sibling). A chunked layer (Llama 4) sees the cache from the start
    of the root's chunk only: chunk 32, keys 32..39, 40 and 42 (attention_core.tree_visible)."""

    slots: torch.Tensor  # [B, T] the cache position each row's key is written at
    base: torch.Tensor  # [B] the first slot the tree's rows may use; earlier positions are attended
    bits: torch.Tensor  # [B, T] int64: bit j set -> the row attends to slot base + j (j < 63)


@dataclass
class AttentionBatch:
    """Per-forward metadata shared by every layer.

    The KV cache is indexed by absolute position through block tables: row b keeps the key of position
    p in block tables[b, p // BLOCK] at row p % BLOCK. A forward writes its T new keys at `positions`
    and attends over positions 0 .. kv_len - 1, masked by position, so entries left over from rejected
    tokens or earlier requests are never seen.
    """

    positions: torch.Tensor  # [B, T] where each new token's key goes (a tree's rows: their slots, not their
    # rotary positions, which cos and sin hold)
    tables: torch.Tensor | None  # [B, blocks per sequence] int32; None without a cache
    kv_len: int  # keys attended: cache positions [0, kv_len)
    full_mask: torch.Tensor  # [B, 1, T, kv_len] bool, causal (a tree's: tree_visible)
    chunked_mask: torch.Tensor | None  # [B, 1, T, kv_len] bool, causal and same chunk (a tree's: its root's)
    cos: torch.Tensor  # [B, T, 1, head_dim // 2]
    sin: torch.Tensor
    temperature: torch.Tensor | None  # [B, T, 1, 1] Llama 4 NoPE query scale
    # where the T new keys go, the same in every layer: (block, row in block), each [B, T] int64
    write_at: tuple[torch.Tensor, torch.Tensor] | None
    # eager CPU with several rows: (kv bucket, row indices) groups for Attention._attend_by_length
    key_groups: tuple[tuple[int, torch.Tensor], ...] | None
    # a token tree's (TreeMask) base [B] and ancestor bits [B, T]: full_mask is theirs, and the cached
    # attention kernels take them (positions then hold the rows' slots)
    tree_base: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None

    @property
    def tree(self) -> bool:
        return self.tree_base is not None

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        rotary: Rotary,
        positions: torch.Tensor,
        key_positions: torch.Tensor,  # [B or 1, kv_len]
        tables: torch.Tensor | None,  # [B, blocks per sequence] int32
        tree: TreeMask | None = None,
    ) -> AttentionBatch:
        q = positions[:, None, :, None]  # [B, 1, T, 1]
        k = key_positions[:, None, None, :]  # [B|1, 1, 1, S]
        full, slots, chunked, chunk = k <= q, positions, None, config.attention_chunk_size
        if tree is not None:
            full, slots = tree_visible(k, tree.base, tree.bits), tree.slots
            if chunk is not None:  # from its root's chunk's start
                chunked = tree_visible(k, tree.base, tree.bits, chunk)
        elif chunk is not None:
            # chunk 8192: a query at 8195 sees keys 8192..8195 only (its chunk starts at 8195 - 8195 % 8192).
            # Written without k // c: inductor (torch 2.13, CPU) miscompiles that floor division.
            chunked = full & (k >= q - torch.remainder(q, chunk))
        temperature = None
        if config.attn_temperature_tuning and not all(config.rope_layers):
            steps = torch.floor((positions.float() + 1.0) / config.floor_scale)
            temperature = (1.0 + config.attn_scale * torch.log1p(steps))[:, :, None, None]
        cos, sin = rotary.cos_sin(positions)
        kv_len, write_at, key_groups = key_positions.shape[-1], None, None
        if tables is not None:
            write_at = (tables.gather(1, slots // BLOCK).long(), slots % BLOCK)
            if (
                positions.device.type == "cpu"
                and positions.shape[0] > 1
                and not torch.compiler.is_dynamo_compiling()
            ):
                key_groups = _key_groups(slots, kv_len)
        base, bits = (None, None) if tree is None else (tree.base, tree.bits)
        rest = (cos, sin, temperature, write_at, key_groups, base, bits)
        return cls(slots, tables, kv_len, full, chunked, *rest)

    def leaves(self) -> tuple:
        """The fields in order as one tuple, write_at unpacked: in a compiled graph only tensors, ints and
        Nones (key_groups is eager's), what a nested compile region takes without dynamo flattening it again
        for every layer (models/llama.run_layer)."""
        block, row = self.write_at if self.write_at is not None else (None, None)
        head = (self.positions, self.tables, self.kv_len, self.full_mask, self.chunked_mask, self.cos)
        return (
            *head,
            self.sin,
            self.temperature,
            block,
            row,
            self.key_groups,
            self.tree_base,
            self.tree_bits,
        )

    @classmethod
    def from_leaves(cls, leaves: tuple) -> AttentionBatch:
        """The inverse of leaves()."""
        assert len(leaves) == _LEAVES, "leaves(): one entry per field, two for write_at"
        *head, block, row, key_groups, base, bits = leaves
        return cls(*head, None if block is None else (block, row), key_groups, base, bits)


_LEAVES = len(fields(AttentionBatch)) + 1


def _key_groups(positions: torch.Tensor, kv_len: int) -> tuple[tuple[int, torch.Tensor], ...]:
    """Rows grouped by the kv bucket of the keys they need (host values: the eager CPU path only). Rows
    needing 70, 300 and 90 keys -> ((128, [0, 2]), (512, [1]))."""
    groups: dict[int, list[int]] = {}
    for row, last in enumerate(positions.amax(dim=1).tolist()):
        groups.setdefault(kv_bucket(last + 1, kv_len), []).append(row)
    return tuple((length, torch.tensor(rows, device=positions.device)) for length, rows in groups.items())


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: Rotary,
        in_features: int | None = None,
        backends: Backends = TORCH,
    ):
        super().__init__()
        h, hd = in_features or config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        linear = lambda n_in, n_out: Linear(n_in, n_out, config.attention_bias, backends.few_rows)
        self.q_proj = linear(h, config.num_heads * hd)
        self.k_proj = linear(h, config.num_kv_heads * hd)
        self.v_proj = linear(h, config.num_kv_heads * hd)
        self.o_proj = linear(config.num_heads * hd, config.hidden_size)
        self.rotary = rotary
        self.use_rope = config.is_rope_layer(layer)
        self.chunked = config.is_chunked_layer(layer)
        self.qk_norm_eps = config.rms_norm_eps if (config.use_qk_norm and self.use_rope) else None
        self.temperature_tuning = config.attn_temperature_tuning and not self.use_rope
        self.chunk = config.attention_chunk_size if self.chunked else 0  # for the cached kernels
        # Cached attention kernels that read the cache themselves (None: the core over the gathered cache):
        # split-KV for a decode step's few queries, flash-attention forward for prompts. Which one is a
        # Python branch on the static query count (see forward).
        self.step_kernel = backends.decode_attention
        self.tree_rows = backends.tree_rows  # a tree of more rows takes the prefill kernel, or the core
        self.prefill_kernel = backends.prefill_attention
        self.core = backends.attention_core  # over gathered keys and values
        self.few_rows, self.fuse = backends.few_rows, backends.fused_projections and not config.attention_bias
        self.packed = backends.packed_weights  # the fused weight packed (linear.fuse_weights)
        self.qkv_weight: torch.Tensor | None = None  # [q + 2 kv features, in]: see fuse_qkv

    def fuse_qkv(self) -> None:
        """After loading, with fused projections or quantized weights (linear.quantized_parts): q_proj,
        k_proj and v_proj become views of one weight, multiplied once per step (linear.fuse_weights). Not
        when quantization replaced the linears by other modules."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        if (self.fuse or quantized_parts(parts)) and self.qkv_weight is None:
            self.qkv_weight = fuse_weights(parts, self.packed)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        batch: AttentionBatch,
        cache: tuple[torch.Tensor, torch.Tensor] | None,  # k, v: [blocks, kv_heads, BLOCK, head_dim]
    ) -> torch.Tensor:
        q, k, v = self.project(x, batch)
        mask = batch.chunked_mask if self.chunked else batch.full_mask
        if cache is None:  # no cache: the T tokens attend to each other
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
        else:
            self._write(cache, k, v, batch)
            # A decode step has K + 1 <= STEP_QUERIES queries, a static int; a compiled prefill's length
            # is a dynamic dimension >= 16, which this comparison only guards (> 9), never splits.
            kernel = self.step_kernel if x.shape[1] <= STEP_QUERIES else self.prefill_kernel
            assert batch.tables is not None
            if batch.tree:  # a token tree under its mask: the decode kernel for a step's few rows, else the
                # prompt kernel (CUDA; None on CPU: the core over the gathered cache)
                kernel = self.step_kernel if x.shape[1] <= self.tree_rows else self.prefill_kernel
                if kernel is not None:
                    out = kernel(q, *cache, batch.positions, batch.tables, batch.kv_len, self.chunk,
                                 batch.tree_base, batch.tree_bits)  # fmt: skip
                    return self.o_proj(out.reshape(*x.shape[:2], -1))
            # (eager CPU rows grouped by kv bucket keep the grouping where the CPU kernels would gather the
            # whole cache instead: an FP8 cache)
            elif kernel is not None and (batch.key_groups is None or cache[0].dtype == q.dtype):
                out = kernel(q, *cache, batch.positions, batch.tables, batch.kv_len, self.chunk)
                return self.o_proj(out.reshape(*x.shape[:2], -1))
            if batch.key_groups is not None:
                return self._attend_by_length(q, cache, batch, mask)
            keys, values = (gather_blocks(c, batch.tables, batch.kv_len).to(k.dtype) for c in cache)
        return self.attend(q, keys, values, mask)

    def write_keys(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        batch: AttentionBatch,
        cache: tuple[torch.Tensor, torch.Tensor],  # k, v: [blocks, kv_heads, BLOCK, head_dim]
    ) -> None:
        """Only what `forward` stores: the rows' keys and values at their positions, nothing attended (and
        no queries multiplied)."""
        k, v = self.project_kv(x, batch)
        self._write(cache, k, v, batch)

    def _attend_by_length(
        self,
        q: torch.Tensor,  # [B, T, heads, head_dim]
        cache: tuple[torch.Tensor, torch.Tensor],  # k, v: [blocks, kv_heads, BLOCK, head_dim]
        batch: AttentionBatch,
        mask: torch.Tensor,  # [B, 1, T, kv_len] bool
    ) -> torch.Tensor:  # [B, T, hidden]
        """Eager attention over gathered keys, the rows grouped by the keys they need (batch.key_groups):
        each group gathers its rows' positions up to the kv bucket of its longest, not every row up to
        kv_len. The gather copies: a step of 64 rows where one request sits at 2,000 tokens and the rest
        near 200 copies 2 buckets' worth (256 for 63 rows, 2,048 for one), not 64 x 2,048 positions."""
        assert batch.key_groups is not None and batch.tables is not None
        out = q.new_empty(q.shape)
        for length, index in batch.key_groups:
            keys, values = (gather_blocks(c, batch.tables[index], length).to(q.dtype) for c in cache)
            out[index] = self.core(q[index], keys, values, mask[index, :, :, :length])
        b, t = q.shape[:2]
        return self.o_proj(out.reshape(b, t, -1))

    def extra_repr(self) -> str:
        kernels = (self.step_kernel, self.prefill_kernel, self.core)
        return "decode={}, prefill={}, core={}".format(*map(backend_name, kernels))

    def project(
        self, x: torch.Tensor, batch: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, heads, head_dim] and k, v [B, T, kv_heads, head_dim], positions encoded."""
        b, t, _ = x.shape
        if self.qkv_weight is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            qkv = product(x.reshape(b * t, -1), self.qkv_weight, self.few_rows, t)  # [B * T, q + 2 kv]
            q, k, v = qkv.split([p.out_features for p in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        if self.use_rope:
            q = self.rotary.apply(q, batch.cos, batch.sin)
        if self.qk_norm_eps is not None:
            q = rms_normalize(q, self.qk_norm_eps)
        if self.temperature_tuning:
            q = (q * batch.temperature).to(q.dtype)
        return q, *self._keys_values(k, v, batch, b, t)

    def project_kv(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        batch: AttentionBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, T, kv_heads, head_dim] as `project` gives them, without multiplying the queries: the
        fused weight's rows past q_proj's (k_proj's then v_proj's). Its first dimension counts rows, or
        blocks of 32 rows when packed: q's share of it is q_out / (q_out + 2 kv_out), e.g. 576 / 960 of 960
        rows or of 30 blocks."""
        b, t, _ = x.shape
        if self.qkv_weight is None:
            return self._keys_values(self.k_proj(x), self.v_proj(x), batch, b, t)
        q_out, kv_out = self.q_proj.out_features, self.k_proj.out_features + self.v_proj.out_features
        kv_weight = self.qkv_weight[self.qkv_weight.shape[0] * q_out // (q_out + kv_out) :]
        kv = product(x.reshape(b * t, -1), kv_weight, self.few_rows, t)  # [B * T, 2 kv]
        k, v = kv.split([self.k_proj.out_features, self.v_proj.out_features], dim=-1)
        return self._keys_values(k, v, batch, b, t)

    def _keys_values(
        self,
        k: torch.Tensor,  # [B * T or B, T, kv_heads * head_dim]
        v: torch.Tensor,  # [B * T or B, T, kv_heads * head_dim]
        batch: AttentionBatch,
        b: int,
        t: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T, kv_heads, head_dim] each, k's positions encoded
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            k = self.rotary.apply(k, batch.cos, batch.sin)
        if self.qk_norm_eps is not None:
            k = rms_normalize(k, self.qk_norm_eps)
        return k, v

    def attend(
        self,
        q: torch.Tensor,  # [B, T, heads, head_dim]
        keys: torch.Tensor,  # [B, kv_heads, S, head_dim]
        values: torch.Tensor,  # [B, kv_heads, S, head_dim]
        mask: torch.Tensor,  # [B or 1, 1, T, S] bool, True = attend
    ) -> torch.Tensor:  # [B, T, hidden]
        b, t = q.shape[:2]
        return self.o_proj(self.core(q, keys, values, mask).reshape(b, t, -1))

    @staticmethod
    def _write(
        cache: tuple[torch.Tensor, torch.Tensor],
        k: torch.Tensor,  # [B, T, kv_heads, head_dim]
        v: torch.Tensor,
        batch: AttentionBatch,
    ) -> None:
        """Stores the new keys and values of each row at their absolute positions, through its block table.

        One index_put_ on the cache tensor itself, not on a view of it: a compiled step writes the draft's
        cache three times, and through views the compiler copied the whole cache in and out every step.
        Indices broadcast to [B, T, kv_heads]: tables [[4, 9]], positions [[15, 16]], BLOCK 16, 3 heads ->
        entries [4, h, 15] and [9, h, 0] for h = 0, 1, 2 take k[0, 0, h] and k[0, 1, h]."""
        assert batch.write_at is not None
        blocks, rows = batch.write_at  # [B, T] each
        heads = torch.arange(k.shape[2], device=k.device)
        index = (blocks[:, :, None], heads, rows[:, :, None])
        for store, new in zip(cache, (k, v), strict=True):
            if store.dtype == FP8:  # FP8 cache (scale 1): saturate, e4m3 has no infinity
                new = new.clamp(-FP8_MAX, FP8_MAX)
            store.index_put_(index, new.to(store.dtype))
