"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from redline.layers.backends import TORCH, Backends, backend_name
from redline.layers.linear import Linear, fuse_weights, product, quantized_parts, tokens_per_sequence


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False, backends: Backends = TORCH):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias, backends.few_rows)
        self.up_proj = Linear(hidden, inter, bias, backends.few_rows)
        self.down_proj = Linear(inter, hidden, bias, backends.few_rows)
        # With a SwiGLU kernel or fused projections (and no biases) gate and up become views of one
        # [2 * inter, hidden] weight once loaded (fuse_gate_up), multiplied once ([M, 2I]), then
        # SwiGLU'd by the kernel or by torch ([M, 2I] -> [M, I])
        self.swiglu: Callable[[torch.Tensor], torch.Tensor] | None = None if bias else backends.swiglu
        self.fuse = backends.fused_projections and not bias
        self.packed = backends.packed_weights  # the fused weight packed (linear.fuse_weights)
        self.few_rows = backends.few_rows
        self.gate_up_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        flat = x.reshape(-1, x.shape[-1])
        gate_up = product(flat, self.gate_up_weight, self.few_rows, tokens_per_sequence(x))  # [M, 2 * inter]
        if self.swiglu is not None:
            return self.down_proj(self.swiglu(gate_up).view(*x.shape[:-1], -1))
        gate, up = gate_up.split(self.gate_proj.out_features, dim=-1)
        return self.down_proj((F.silu(gate) * up).view(*x.shape[:-1], -1))

    def fuse_gate_up(self) -> None:
        """After loading, for the SwiGLU kernel, fused projections or quantized weights
        (linear.quantized_parts): gate_proj and up_proj become views of one weight (no extra memory).
        Nothing to do without any, or when quantization replaced the linears by other modules."""
        parts = (self.gate_proj, self.up_proj)
        wanted = self.swiglu is not None or self.fuse or quantized_parts(parts)
        if not wanted or self.gate_up_weight is not None:
            return
        self.gate_up_weight = fuse_weights(parts, self.packed)
        if self.gate_up_weight is None:  # quantized after construction (tests do)
            self.swiglu, self.fuse = None, False

    def extra_repr(self) -> str:
        return "" if self.swiglu is None else f"gate_up + {backend_name(self.swiglu)}"
