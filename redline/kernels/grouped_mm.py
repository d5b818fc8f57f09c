"""Grouped GEMM over contiguous row groups: rows offs[g-1]:offs[g] of x times w[g], one call for all groups.

    x [M, K] rows sorted by group, w [G, K, N], offs [G] int32 group ends (offs[G-1] == M) -> [M, N]
    e.g. offs = [2, 2, 5]: rows 0-1 times w[0], no rows for w[1], rows 2-4 times w[2]

Two implementations compute it, chosen by `native_grouped_mm` from the dtypes, widths and device, which
are fixed for a layer (and constants under torch.compile):
- torch._grouped_mm, for bf16 on CPU (ATen's loop of matrix products) and on CUDA compute capability
  9.x / 10.x (H100, H200, B200: a CUTLASS kernel, row- or column-major weights, no host sync, so CUDA
  graphs can capture it). Its fake (meta) implementation, which torch.compile traces, accepts only bf16
  (torch 2.13; fp32 runs eagerly on CPU but does not trace), and rows must be multiples of 16 bytes.
  Other GPUs get an ATen loop that copies offs to the host, so they take the custom op below.
- `grouped_mm_loop` (fp32, fp16, unaligned widths, other GPUs): a custom op; torch.compile sees one
  opaque op with a registered fake, so traced code has no data-dependent shapes. Its body
  (`loop_over_groups`) reads offs on the host and multiplies each non-empty group, or, while a CUDA
  graph is being captured (no host reads allowed), multiplies every group over all rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
CUTLASS_GROUPED_MM_MAJORS = (9, 10)  # CUDA compute capabilities of torch._grouped_mm's bf16 kernel


def native_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs, traces and needs no host sync for x [M, K] @ w [G, K, N]: bf16, K
    and N multiples of 16 bytes, on CPU or on a CUDA GPU with the CUTLASS kernel."""
    if not HAS_GROUPED_MM or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    aligned = 16 // x.element_size()
    if x.shape[-1] % aligned or w.shape[-1] % aligned:
        return False
    if x.device.type == "cuda":
        major = torch.cuda.get_device_properties(x.device).major  # a constant under torch.compile
        return torch.version.hip is None and major in CUTLASS_GROUPED_MM_MAJORS  # ROCm: ATen loops
    return x.device.type == "cpu"


# (group, rows [R, K], out [R, N]): writes the rows' product with the group's weight into out
GroupProduct = Callable[[int, torch.Tensor, torch.Tensor], None]


def masked_grouped_mm(
    x: torch.Tensor,  # [M, K] rows sorted by group
    offs: torch.Tensor,  # [G] int32 group ends
    out_features: int,
    product: GroupProduct,
) -> torch.Tensor:  # [M, N]
    """The grouped GEMM without reading offs on the host: every group's product over all rows, kept on
    the group's own rows (G times the work; for the few rows of a captured decode step)."""
    rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
    row_group = torch.searchsorted(offs, rows, right=True)  # offs [2, 2, 5] -> rows 0-4 in [0, 0, 2, 2, 2]
    out, group_out = x.new_zeros(x.shape[0], out_features), x.new_empty(x.shape[0], out_features)
    for group in range(offs.shape[0]):
        product(group, x, group_out)
        out = torch.where(row_group[:, None] == group, group_out, out)
    return out


def loop_over_groups(
    x: torch.Tensor,  # [M, K] rows sorted by group
    offs: torch.Tensor,  # [G] int32 group ends, offs[G-1] == M
    out_features: int,
    product: GroupProduct,
) -> torch.Tensor:  # [M, N]
    """`product` once per non-empty group (offs read on the host), or `masked_grouped_mm` while a CUDA
    graph is being captured."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return masked_grouped_mm(x, offs, out_features, product)
    out = x.new_empty(x.shape[0], out_features)
    start = 0
    for group, end in enumerate(offs.tolist()):
        if end > start:
            product(group, x[start:end], out[start:end])
        start = end
    return out


@torch.library.custom_op("redline::grouped_mm_loop", mutates_args=())
def grouped_mm_loop(
    x: torch.Tensor,  # [M, K] rows sorted by group
    w: torch.Tensor,  # [G, K, N]
    offs: torch.Tensor,  # [G] int32 group ends
) -> torch.Tensor:  # [M, N]
    """The grouped GEMM where torch._grouped_mm does not serve (see the module docstring)."""
    return loop_over_groups(x, offs, w.shape[-1], lambda group, rows, out: torch.mm(rows, w[group], out=out))


@grouped_mm_loop.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


def grouped_mm(
    x: torch.Tensor,  # [M, K] rows sorted by group
    w: torch.Tensor,  # [G, K, N]
    offs: torch.Tensor,  # [G] int32 group ends, offs[G-1] == M
) -> torch.Tensor:  # [M, N]
    """Rows offs[g-1]:offs[g] of x times w[g] for every group g, by the implementation that serves x and w."""
    if native_grouped_mm(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    return grouped_mm_loop(x, w, offs)
