"""Integer codes packed into int32 words, as weight-only checkpoints store them (quant/int_scheme.py).

Every layout here puts 32 / bits codes in a word, code j of a word in bits [bits * j, bits * (j + 1)):
compressed-tensors packs along a row (`weight_packed` [N, K * bits / 32]), GPTQ along a column
(`qweight` [K * bits / 32, N]: unpack its transpose). AWQ packs 8 codes a word along a row too, but in the
order of its GEMM kernel: word bits 4 j hold column AWQ_ORDER[j] of the eight. Example, the AWQ word
0x76543210 holds code j in bits 4 j ([0, 1, ..., 7]), so its eight columns are [0, 4, 1, 5, 2, 6, 3, 7]:
column 1 is code 4, from bits 16-19.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of the eight whose code word bits 4 j hold


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:  # [rows, cols] 0 .. 2^bits - 1 -> [rows, w]
    """Codes along each row into int32 words (cols a multiple of 32 / bits)."""
    per = 32 // bits
    rows, cols = codes.shape
    lanes = codes.to(torch.int32).reshape(rows, cols // per, per)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    words = torch.zeros(rows, cols // per, dtype=torch.int32, device=codes.device)
    for j in range(per):  # int32 wraps: code 15 << 28 sets the sign bit, as the word's top nibble
        words |= lanes[..., j] << shifts[j]
    return words


def unpack_int32(words: torch.Tensor, bits: int) -> torch.Tensor:  # [rows, w] -> [rows, w * 32 / bits]
    """pack_int32's inverse: codes 0 .. 2^bits - 1 as int32."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=words.device) * bits
    codes = (words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # >> sign-extends: masked
    return codes.reshape(words.shape[0], -1)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:  # [rows, N / 8] -> [rows, N] 0 .. 15
    """AWQ's 4-bit words into codes in column order."""
    codes = unpack_int32(words, 4).reshape(words.shape[0], -1, 8)  # [rows, words, code j of the word]
    ordered = torch.empty_like(codes)
    ordered[..., list(AWQ_ORDER)] = codes  # code j is column AWQ_ORDER[j]
    return ordered.reshape(words.shape[0], -1)


def rounded_codes(
    w: torch.Tensor,  # [N, K]
    bits: int,
    group: int | None,  # weights a scale covers along K; None: the whole row
    scale_dtype: torch.dtype,  # the scale is stored in it (the model's), and q rounded by the stored scale
    symmetric: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [N, K], zero point [N, G] int32, scale [N, G]
    """compressed-tensors' min-max rounding (its formula, computed in fp32 where it computes in the
    weight's dtype) to signed codes q (-2^(bits-1) .. 2^(bits-1) - 1), w = (q - zero
    point) * scale. Symmetric: scale = max |w| / (2^bits - 1) * 2, zero point 0. Asymmetric: the range
    [min(w, 0), max(w, 0)] in 2^bits - 1 steps, zero point round(-2^(bits-1) - min / scale). Example, int4,
    group [0.3, -0.75, 0.1]: symmetric scale 0.1, q [3, -8, 1] (-7.5 rounds to -8); asymmetric scale
    0.07, zero point round(-8 + 10.71) = 3, q [7, -8, 4] (round(0.3 / 0.07) + 3 = 7)."""
    n, k = w.shape
    size = k if group is None else group
    groups = w.float().reshape(n, k // size, size)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    least, most = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    if symmetric:
        scale = (torch.maximum(-least, most) / ((high - low) / 2)).to(scale_dtype)
    else:
        scale = ((most - least) / (high - low)).to(scale_dtype)
    steps = scale.float().clamp(min=torch.finfo(torch.float32).tiny)  # the stored scale
    zero = torch.zeros_like(steps) if symmetric else (low - least / steps).round().clamp(low, high)
    q = ((groups / steps[..., None]).round() + zero[..., None]).clamp(low, high)
    return q.to(torch.int32).reshape(n, k), zero.to(torch.int32), scale
