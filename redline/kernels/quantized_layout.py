"""Weights quantized in groups along the input dimension, in the block layout of redline's CPU kernels
(csrc/quantized_rows_bf16.cpp for int4, csrc/int8_rows_vnni.cpp for int8 on AVX-512 BF16; both widths in
csrc_avx2/quantized_rows_avx2.cpp on AVX2): codes q (0 .. 15 or 0 .. 255)
with an fp16 scale s and zero z per group of G weights of one row, w = q * s + z, the shape of llama.cpp's
Q4_1 / Q8_0 (GGUF loads into it exactly: a Q8_0 code c is q = c + 128 with z = -128 s).

    int4 (uint8 tensor): [N / 32, K / G, 16 G + 128]     int8 (int8 tensor): [N / 32, K / G, 32 G + 128]

Blocks of 32 rows, as the bf16 packed layout (packed_layout.py); each group of a block holds its
codes, pair of k by pair, then the 32 rows' scales (fp16) and their zeros (fp16). A pair p of int4 is 32
bytes: byte l holds q[l // 2, 2p + l % 2] in its low nibble and q[16 + l // 2, 2p + l % 2] in its high one;
a pair of int8 is 64 bytes, rows 0-15 then rows 16-31, byte l of each half q[l // 2, 2p + l % 2], as an
unsigned byte (the tensor's dtype, int8, only says the width). Example, int4, G = 32, the block's group 1
starts at byte 640 (16 * 32 + 128), and its byte 640 + 3 * 32 + 5 holds q[2, 32 + 7] and q[18, 32 + 7].

Rounding on load, both widths: asymmetric, s = (max - min) / (2^bits - 1) and z = min per group (rounded
to fp16), q = round((w - z) / s), as Q4_1. A weight reads back within s / 2 (plus fp16's rounding of s and
z). So int8 in groups of 32 keeps a Q4_1 file's weights (SmolLM2's only release) up to fp16's rounding of s:
a block whose codes span 0 .. 15 gets s = d / 17 and q = 17 times its code.
"""

from __future__ import annotations

import torch

from redline.engine_config import INT4_GROUP_SIZES

BLOCK_ROWS = 32  # kernels/csrc/kernels.h PACK_ROWS
SCALE_BYTES = 4 * BLOCK_ROWS  # a group's 32 fp16 scales and 32 fp16 zeros


# No table of dtypes: a compiled layer region (invoke_subgraph) cannot guard on a global dict's entry, and a
# lookup of one failed its compile ("failed to resolve source ... BITS_OF[torch.uint8]").
def is_quantized(weight: torch.Tensor) -> bool:
    return weight.dim() == 3 and weight.dtype in (torch.uint8, torch.int8)


def bits_of(weight: torch.Tensor) -> int:  # uint8: int4 codes; int8: int8 codes
    return 4 if weight.dtype == torch.uint8 else 8


def group_of(weight: torch.Tensor) -> int:
    return (weight.shape[2] - SCALE_BYTES) // (BLOCK_ROWS * bits_of(weight) // 8)


def shape_of(weight: torch.Tensor) -> tuple[int, int]:  # (N, K) of the weight it holds
    return weight.shape[0] * BLOCK_ROWS, weight.shape[1] * group_of(weight)


def to_blocks(
    q: torch.Tensor,  # [N, K] integer codes: 0 .. 15 (bits 4) or 0 .. 255 (bits 8)
    scale: torch.Tensor,  # [N, K / G]
    zero: torch.Tensor,  # [N, K / G]
    bits: int,
) -> torch.Tensor:  # the layout of the module's doc
    n, k = q.shape
    groups = scale.shape[1]
    g = k // groups
    # [block, half, row in half, group, pair, k in pair] -> [block, group, pair, half, row in half, k in pair]
    codes = q.reshape(n // BLOCK_ROWS, 2, BLOCK_ROWS // 2, groups, g // 2, 2)
    codes = codes.permute(0, 3, 4, 1, 2, 5).to(torch.uint8)
    if bits == 4:  # [block, group, pair, row in half, k in pair]: low nibble half 0, high nibble half 1
        codes = codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)
    codes = codes.reshape(n // BLOCK_ROWS, groups, -1)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [blocks, groups, 64] bytes of fp16
        rows = t.to(torch.float16).reshape(n // BLOCK_ROWS, BLOCK_ROWS, groups).transpose(1, 2).contiguous()
        return rows.view(torch.uint8)

    blocks = torch.cat([codes, per_block(scale), per_block(zero)], dim=2).contiguous()
    return blocks if bits == 4 else blocks.view(torch.int8)


def from_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] int32, scale, zero [N, K / G] fp32): to_blocks's inverse."""
    (n, k), g, bits = shape_of(weight), group_of(weight), bits_of(weight)
    blocks, groups = weight.shape[:2]
    raw = weight.view(torch.uint8)
    codes, scales = raw[..., :-SCALE_BYTES], raw[..., -SCALE_BYTES:]
    if bits == 4:  # [block, group, pair, row in half, k in pair] x (low, high)
        codes = codes.reshape(blocks, groups, g // 2, BLOCK_ROWS // 2, 2)
        codes = torch.stack([codes & 15, codes >> 4], dim=3).to(torch.int32)
    else:  # [block, group, pair, half, row in half, k in pair]
        codes = codes.reshape(blocks, groups, g // 2, 2, BLOCK_ROWS // 2, 2).to(torch.int32)
    q = codes.permute(0, 3, 4, 1, 2, 5).reshape(n, k)  # [block, half, row in half, group, pair, k in pair]

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [blocks, groups, 64] bytes -> [N, groups] fp32
        return t.contiguous().view(torch.float16).float().transpose(1, 2).reshape(n, groups)

    return q, per_row(scales[..., : SCALE_BYTES // 2]), per_row(scales[..., SCALE_BYTES // 2 :])


def dequantize(weight: torch.Tensor) -> torch.Tensor:  # quantized -> [N, K] fp32
    """q * scale + zero per group: the weight the kernel multiplies by."""
    q, scale, zero = from_blocks(weight)
    n, k = q.shape
    groups = q.reshape(n, scale.shape[1], -1).float() * scale[..., None] + zero[..., None]
    return groups.reshape(n, k)


def rows_of(
    weight: torch.Tensor,  # quantized [V, K]
    ids: torch.Tensor,  # [...]
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # [..., K] in dtype
    """The weight's rows `ids` read back: an embedding table tied to a quantized head. Only
    each row's own bytes are read. Example, int8, G = 32: id 37 is block 1, half 0 (rows 32-47), row 5 of
    it, so in each group its codes are bytes p * 64 + 10 and p * 64 + 11 of pair p (k = 2p and 2p + 1), and
    its scale and zero bytes 1024 + 2 * 5 and 1024 + 64 + 2 * 5 (after the group's 16 pairs of codes)."""
    g, bits = group_of(weight), bits_of(weight)
    flat = ids.reshape(-1)
    block, half, row = flat // BLOCK_ROWS, flat % BLOCK_ROWS // 16, flat % 16
    raw = weight.view(torch.uint8)
    groups, codes = raw.shape[1], g // 2 * 8 * bits  # a group's bytes of codes: 8 * bits a pair
    pairs = torch.arange(g // 2)[:, None] * (8 * bits) + torch.arange(2)  # [G / 2, 2]: k = 2p, 2p + 1
    start = row * 2 + (half * 32 if bits == 8 else 0)  # [T]: where the row's pair starts within a pair
    at = (start[:, None, None] + pairs).reshape(-1, 1, g)  # [T, 1, G]
    in_block = (block[:, None, None], torch.arange(groups)[None, :, None])
    byte = raw[(*in_block, at)]  # [T, groups, G]
    if bits == 4:  # the low nibble is half 0's row, the high one half 1's
        byte = torch.where(half[:, None, None] == 1, byte >> 4, byte & 15)
    q = byte.to(torch.int32)
    fp16 = codes + 2 * (flat % BLOCK_ROWS)[:, None, None] + torch.arange(2)  # [T, 1, 2]: a scale's 2 bytes
    scale, zero = (raw[(*in_block, fp16 + at)].view(torch.float16).float() for at in (0, 2 * BLOCK_ROWS))
    rows = q.float() * scale + zero  # [T, groups, G] * [T, groups, 1]
    return rows.to(dtype).reshape(*ids.shape, groups * g)


QUANTIZE_ROWS = 2048  # rows a quantize() pass takes (whole blocks): a head's temporaries a slice at a time
assert QUANTIZE_ROWS % BLOCK_ROWS == 0


def quantize(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:  # [N, K] -> the layout
    """The module doc's rounding of w in groups of `group` along k, QUANTIZE_ROWS rows at a time into the
    result (a 128k-row head needs no fp32 copy of itself: SmolLM2's tied table quantized with 25 MB of
    temporaries, not 95)."""
    if w.shape[0] > QUANTIZE_ROWS:
        blocks = [quantize(w[:QUANTIZE_ROWS], bits, group)]  # the first slice's, to shape the whole
        whole = blocks[0].new_empty((w.shape[0] // BLOCK_ROWS, *blocks[0].shape[1:]))
        for start in range(0, w.shape[0], QUANTIZE_ROWS):
            part = blocks.pop() if blocks else quantize(w[start : start + QUANTIZE_ROWS], bits, group)
            whole[start // BLOCK_ROWS :][: part.shape[0]] = part
        return whole
    return to_blocks(*rounded(w, bits, group), bits)


def rounded(
    w: torch.Tensor,  # [N, K]
    bits: int,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [N, K] int32, scale, zero [N, K / group] fp32
    """The module doc's rounding (scale and zero exact in fp16), on w's device."""
    n, k = w.shape
    levels = (1 << bits) - 1
    groups = w.float().reshape(n, k // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / levels).to(torch.float16).float()
    zero = low.to(torch.float16).float()
    q = ((groups - zero[..., None]) / scale[..., None].clamp(min=2**-24)).round().clamp(0, levels)
    return q.reshape(n, k).to(torch.int32), scale, zero


def check_shape(
    in_features: int,
    out_features: int,
    group: int,
    name: str,
    rows: int = BLOCK_ROWS,
    kind: str = "quantized",
) -> None:
    """ValueError naming the layer when a layout cannot take it: inputs in whole groups, outputs in blocks
    of `rows` (this layout's BLOCK_ROWS; quant/int4.py's 16)."""
    if in_features % group:
        fits = [g for g in INT4_GROUP_SIZES if in_features % g == 0] or "none"
        raise ValueError(f"quantization_group_size {group} does not divide {name}'s {in_features} inputs "
                         f"(a tensor-parallel rank's share if sharded); sizes that do: {fits}")  # fmt: skip
    if out_features % rows:
        raise ValueError(f"{name} has {out_features} outputs; {kind} weights take multiples of {rows}")
