"""int4 / int8 weight-only products on the GPU: x [M, K] times a weight held as codes with a scale and a zero
per group of G inputs and row, w = q * scale + zero (the CPU layout's rule, kernels/quantized_layout.py),
for the few rows of a decode or verify step. Decode reads every weight once, so the product is as fast
as its bytes: int4 reads 4 bits a weight plus 4 bytes a group, against bf16's 16 bits.

    int4: codes [N, K / 8] int32, code j of word w in bits 4 j .. 4 j + 3 (0 .. 15: k = 8 w + j)
    int8: codes [N, K] uint8 (0 .. 255)
    scales, zeros: [N, K / G] in fp16

Example, int4, K = 16, G = 8: row n's word 1 holds k = 8 .. 15; its k = 10 is bits 8 .. 11, scaled by
scales[n, 1]. The int4 words are compressed-tensors' (and quant/int_packing.pack_int32's) packing.

The kernel: a program per block of BLOCK_N rows and BLOCK_M (16 to 64) input rows, walking K a group at a
time: it loads the group's codes (each int4 word once, split into its 8 nibbles), dequantizes them in fp32
with the group's scale and zero, and multiplies x's tile by them with tl.dot into an fp32 accumulator.
Rows past M are masked. weight_only_mm_reference computes the same in torch (fp32 accumulation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from redline.kernels.launch import is_interpreted, traceable

MAX_BLOCK_M = 64  # input rows a program multiplies at once: tl.dot's 16 up to a verify step's 64


def dequantize_codes(
    codes: torch.Tensor,  # int4 [N, K / 8] int32 or int8 [N, K] uint8
    scales: torch.Tensor,  # [N, K / G]
    zeros: torch.Tensor,  # [N, K / G]
) -> torch.Tensor:  # [N, K] fp32
    if codes.dtype == torch.int32:  # int4: 8 codes a word, k = 8 w + j in bits 4 j
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
        q = ((codes[..., None] >> shifts) & 15).reshape(codes.shape[0], -1)
    else:
        q = codes
    n, k = q.shape
    groups = q.reshape(n, scales.shape[1], -1).float() * scales.float()[..., None] + zeros.float()[..., None]
    return groups.reshape(n, k)


def weight_only_mm_reference(
    x: torch.Tensor,  # [M, K]
    codes: torch.Tensor,  # int4 [N, K / 8] int32 or int8 [N, K] uint8
    scales: torch.Tensor,  # [N, K / G]
    zeros: torch.Tensor,  # [N, K / G]
    rounded: bool = True,
) -> torch.Tensor:  # [M, N], x's dtype
    """The dequantized weight, rounded to x's dtype as the kernel feeds it to tl.dot on a GPU (rounded;
    under the interpreter it stays fp32), multiplied in fp32."""
    weight = dequantize_codes(codes, scales, zeros)
    weight = weight.to(x.dtype).float() if rounded else weight
    return (x.float() @ weight.t()).to(x.dtype)


@triton.jit
def _weight_only_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, out_ptr, m, n,
    k: tl.constexpr,  # the loop's bound: constant per weight (the interpreter cannot loop to a runtime int)
    INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, GROUP)
    groups = k // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, GROUP):
        g = k0 // GROUP
        x = tl.load(x_ptr + rows_m[:, None] * k + (k0 + ks)[None, :], mask=rows_m[:, None] < m, other=0.0)
        if INT4:  # the group's GROUP / 8 words a row, each read once and split into its 8 nibbles
            at = rows_n[:, None] * (k // 8) + k0 // 8 + tl.arange(0, GROUP // 8)[None, :]
            words = tl.load(codes_ptr + at, mask=rows_n[:, None] < n, other=0)
            nibbles = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 15  # k = 8 w + j
            q = tl.reshape(nibbles, (BLOCK_N, GROUP))
        else:
            at = rows_n[:, None] * k + (k0 + ks)[None, :]
            q = tl.load(codes_ptr + at, mask=rows_n[:, None] < n, other=0)
        scale = tl.load(scales_ptr + rows_n * groups + g, mask=rows_n < n, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + rows_n * groups + g, mask=rows_n < n, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * scale[:, None] + zero[:, None]  # [BLOCK_N, GROUP]
        if FP32_DOT:  # the interpreter rounds to bf16 and multiplies bf16 wrongly (kernels/launch.py): fp32
            acc += tl.dot(x.to(tl.float32), tl.trans(w))
        else:  # tl.dot takes both in x's dtype
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    mask = (rows_m[:, None] < m) & (rows_n[None, :] < n)
    tl.store(out_ptr + rows_m[:, None] * n + rows_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_n_for(n: int, programs: int = 132) -> int:
    """Rows of the weight a program takes: 64, or fewer where 64 would leave most of an H100 / H200's 132
    SMs idle (the 8B's k / v products: 1,024 rows, 16 programs of 64, 64 of 16)."""
    return next((b for b in (64, 32) if triton.cdiv(n, b) >= programs // 2), 16)


@triton_op("redline::weight_only_mm", mutates_args=())
def weight_only_mm(
    x: torch.Tensor,  # contiguous [M, K], bf16 or fp16
    codes: torch.Tensor,  # int4 [N, K / 8] int32 or int8 [N, K] uint8
    scales: torch.Tensor,  # [N, K / G] fp16
    zeros: torch.Tensor,  # [N, K / G] fp16
    block_n: int = 0,  # 0: block_n_for(N)
) -> torch.Tensor:  # [M, N], x's dtype
    m, k = x.shape
    n, groups = scales.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
    block_n = block_n or block_n_for(n)
    kernel = traceable(_weight_only_kernel)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    kernel[grid](x, codes, scales, zeros, out, m, n, k=k, INT4=codes.dtype == torch.int32, GROUP=k // groups,
                 BLOCK_M=block_m, BLOCK_N=block_n, FP32_DOT=is_interpreted(_weight_only_kernel))  # fmt: skip
    return out
