"""Top-1 MoE for a few tokens (decode): each token through its one chosen expert, reading only that
expert's weights. Llama 4 layout: gate_up [E, H, 2I] (gate columns first), down [E, I, H]; the routing
weight scales the expert's input.

    act[n] = silu(x[n] w[n] @ gate_up[e[n]][:, :I]) * (x[n] w[n] @ gate_up[e[n]][:, I:])   [N, I]
    out[n] = act[n] @ down[e[n]]                                                           [N, H]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op

from redline.kernels.launch import traceable


def moe_top1_reference(
    x: torch.Tensor,  # [N, H]
    expert: torch.Tensor,  # [N] chosen expert
    weight: torch.Tensor,  # [N] routing weight
    gate_up: torch.Tensor,  # [E, H, 2I]
    down: torch.Tensor,  # [E, I, H]
) -> torch.Tensor:  # [N, H]
    scaled = (x.float() * weight.float()[:, None])[:, None, :]  # [N, 1, H]
    gate, up = torch.bmm(scaled, gate_up[expert].float()).chunk(2, dim=-1)
    return torch.bmm(F.silu(gate) * up, down[expert].float())[:, 0].to(x.dtype)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    e_ptr,
    w_ptr,
    gu_ptr,
    act_ptr,
    hidden: tl.constexpr,
    inter: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    n, block = tl.program_id(0), tl.program_id(1)
    e = tl.load(e_ptr + n)
    routing = tl.load(w_ptr + n).to(tl.float32)
    cols = block * BLOCK_J + tl.arange(0, BLOCK_J)
    col_ok = cols < inter
    gate = tl.zeros([BLOCK_J], tl.float32)
    up = tl.zeros([BLOCK_J], tl.float32)
    base = e * hidden * 2 * inter
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        xk = tl.load(x_ptr + n * hidden + k, mask=k_ok, other=0.0).to(tl.float32) * routing
        ok = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gu_ptr + base + k[:, None] * 2 * inter + cols[None, :], mask=ok, other=0.0)
        w_up = tl.load(gu_ptr + base + k[:, None] * 2 * inter + inter + cols[None, :], mask=ok, other=0.0)
        gate += tl.sum(xk[:, None] * w_gate.to(tl.float32), axis=0)
        up += tl.sum(xk[:, None] * w_up.to(tl.float32), axis=0)
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + n * inter + cols, act, mask=col_ok)


@triton.jit
def _down_kernel(
    act_ptr,
    e_ptr,
    down_ptr,
    out_ptr,
    hidden: tl.constexpr,
    inter: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    n, block = tl.program_id(0), tl.program_id(1)
    e = tl.load(e_ptr + n)
    cols = block * BLOCK_J + tl.arange(0, BLOCK_J)
    col_ok = cols < hidden
    out = tl.zeros([BLOCK_J], tl.float32)
    base = e * inter * hidden
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(act_ptr + n * inter + k, mask=k_ok, other=0.0)
        w = tl.load(
            down_ptr + base + k[:, None] * hidden + cols[None, :],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        out += tl.sum(a[:, None] * w.to(tl.float32), axis=0)
    tl.store(out_ptr + n * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton_op("redline::moe_top1", mutates_args=())
def moe_top1(
    x: torch.Tensor,
    expert: torch.Tensor,
    weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    block_k: int = 64,
    block_j: int = 64,
) -> torch.Tensor:  # same as moe_top1_reference; contiguous weights
    n, hidden = x.shape
    inter = down.shape[1]
    act = torch.empty(n, inter, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    traceable(_gate_up_kernel)[(n, triton.cdiv(inter, block_j))](
        x, expert, weight, gate_up, act, hidden, inter, BLOCK_K=block_k, BLOCK_J=block_j
    )
    traceable(_down_kernel)[(n, triton.cdiv(hidden, block_j))](
        act, expert, down, out, hidden, inter, BLOCK_K=block_k, BLOCK_J=block_j
    )
    return out
