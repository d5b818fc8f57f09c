"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
