"""Residual add + RMSNorm in one pass, optionally emitting FP8 with a per-token scale.

residual' = x + residual
out       = residual' / rms(residual') * weight          (fp32 math, stored in x's dtype)
fp8 mode:   q = out / s in e4m3, s = amax(|out|) / 448  (one scale per row)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from redline.kernels.launch import traceable


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # x, residual [M, N]; weight [N] -> (out, residual') [M, N]
    total = x.float() if residual is None else x.float() + residual.float()
    out = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), total.to(x.dtype)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    q_ptr,
    scale_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offsets = row * n_cols + cols
    total = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        total += tl.load(res_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(res_out_ptr + offsets, total.to(res_out_ptr.dtype.element_ty), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(total * total, axis=0) / n_cols + eps)
    out = total * inv_rms * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    if QUANTIZE:
        rounded = out.to(out_ptr.dtype.element_ty).to(tl.float32)  # quantize what the reference sees
        scale = tl.maximum(tl.max(tl.abs(rounded), axis=0) / 448.0, 1e-12)
        tl.store(scale_ptr + row, scale)
        q = tl.clamp(rounded / scale, -448.0, 448.0)
        tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quantize: bool = False
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(out, residual', (q, scale [M, 1]) or None) for contiguous x, residual [M, N]."""
    out, total, q, scale = add_rms_norm_op(x, residual, weight, eps, quantize)
    return out, total, (q, scale) if quantize else None


@triton_op("redline::add_rms_norm", mutates_args=())
def add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, residual', q, scale); without quantize, q and scale are empty (an op's outputs are distinct
    tensors, so they cannot stand in as aliases of out)."""
    m, n = x.shape
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    q = torch.empty(m if quantize else 0, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m if quantize else 0, 1, dtype=torch.float32, device=x.device)
    traceable(_add_rms_norm_kernel)[(m,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out,
        q,
        scale,
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        QUANTIZE=quantize,
        BLOCK=triton.next_power_of_2(n),
    )
    return out, res_out, q, scale


def fused_add_norm(
    attended: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # [..., H] each -> (normed, residual + attended)
    """The decoder's post-attention boundary, residual add + RMSNorm, as one kernel over the flat rows."""
    shape = attended.shape
    out, total, _ = add_rms_norm(
        attended.reshape(-1, shape[-1]).contiguous(),
        residual.reshape(-1, shape[-1]).contiguous(),
        weight,
        eps,
    )
    return out.view(shape), total.view(shape)
