"""SwiGLU on the fused gate/up GEMM output (the seed's FC13 + SwiGLU): [M, 2I] -> silu(gate) * up [M, I].

The gate half comes first, as in Llama 4's fused expert weights: row [g0 .. g(I-1), u0 .. u(I-1)].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op

from redline.kernels.launch import traceable


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [M, 2I] -> [M, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


@triton.jit
def _swiglu_kernel(in_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(in_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton_op("redline::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:  # contiguous [M, 2I] -> [M, I]
    m, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(m, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(block, triton.next_power_of_2(inter))
    traceable(_swiglu_kernel)[(m, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
