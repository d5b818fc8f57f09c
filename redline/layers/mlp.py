"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from redline.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        # kernels.select may fuse: gate and up weights become views of one [2 * inter, hidden] tensor,
        # multiplied once, then SwiGLU'd by a kernel ([M, 2 * inter] -> [M, inter])
        self.gate_up_weight: torch.Tensor | None = None
        self.swiglu: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        if self.swiglu is not None:  # set only once gate_up_weight exists
            gate_up = F.linear(x.reshape(-1, x.shape[-1]), self.gate_up_weight)  # [M, 2 * inter]
            return self.down_proj(self.swiglu(gate_up).view(*x.shape[:-1], -1))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse_gate_up(self) -> bool:
        """Makes gate_proj and up_proj views of one weight (no extra memory); False where that cannot be
        done (biases, FP8 weights)."""
        gate, up = self.gate_proj, self.up_proj
        if not (type(gate) is Linear and type(up) is Linear) or gate.bias is not None:
            return False
        if self.gate_up_weight is None:
            fused = torch.cat((gate.weight.detach(), up.weight.detach()))
            gate.weight = nn.Parameter(fused[: gate.out_features], requires_grad=False)
            up.weight = nn.Parameter(fused[gate.out_features :], requires_grad=False)
            self.gate_up_weight = fused
        return True
