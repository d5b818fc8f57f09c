"""Llama 4 experts in FP8 (e4m3fn) with per-output-channel scales (quant/fp8.py has the scheme).

Prefill (`forward_grouped`) casts one expert's matrix at a time, only for experts that received tokens,
inside the custom op `fp8_grouped_mm` (one opaque op to torch.compile); decode (`forward_selected`)
dequantizes the few selected experts. Not torch._scaled_grouped_mm: it needs each expert's weight
column-major, a second copy of every expert beside the checkpoint's row-major layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redline.kernels.grouped_mm import loop_over_groups
from redline.quant.fp8 import FP8, dequantize, quantize_weight


@torch.library.custom_op("redline::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(
    x: torch.Tensor,  # [M, K] rows sorted by expert
    q: torch.Tensor,  # [E, K, N] e4m3fn
    scale: torch.Tensor,  # [E, 1, N] fp32, per output channel
    offs: torch.Tensor,  # [E] int32 group ends, offs[E-1] == M
) -> torch.Tensor:  # [M, N]
    """Rows offs[e-1]:offs[e] times expert e's FP8 weight, for each expert with rows (kernels/grouped_mm.py,
    `loop_over_groups`): the weight cast to x's dtype (exact: e4m3 values are bf16 values), its scale
    applied to the product's columns, x @ (q * s) = (x @ q) * s. One cast [K, N] weight at a time."""

    def product(e: int, rows: torch.Tensor, out: torch.Tensor) -> None:  # [R, K] -> out [R, N]
        torch.mm(rows, q[e].to(x.dtype), out=out)
        out.mul_(scale[e])  # in fp32, rounded once to out's dtype

    return loop_over_groups(x, offs, q.shape[-1], product)


@fp8_grouped_mm.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[-1])


class Fp8Experts(nn.Module):
    """Llama 4 experts in FP8 with per-output-channel scales, laid out as the published FP8 Llama 4
    checkpoints hold them: gate_up_proj [E, H, 2I] with gate_up_proj_scale [E, 1, 2I], down_proj
    [E, I, H] with down_proj_scale [E, H, 1]. Only the experts that run are read and cast."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        p = lambda *shape, dtype=FP8: nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        self.gate_up_proj = p(num_experts, hidden, 2 * inter)
        self.gate_up_proj_scale = p(num_experts, 1, 2 * inter, dtype=torch.float32)
        self.down_proj = p(num_experts, inter, hidden)
        self.down_proj_scale = p(num_experts, hidden, 1, dtype=torch.float32)

    @classmethod
    def from_experts(cls, experts: nn.Module) -> Fp8Experts:
        """High-precision experts quantized per expert and output channel."""
        e, h, two_i = experts.gate_up_proj.shape
        with torch.device("meta"):
            layer = cls(e, h, two_i // 2)
        for name, kind in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
            weight, scale = quantize_weight(getattr(experts, name).detach(), kind)
            setattr(layer, name, nn.Parameter(weight, requires_grad=False))
            setattr(layer, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
        return layer

    def forward_selected(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each row through its own expert: x [N, H], expert [N] -> [N, H]"""
        gate_up_w = dequantize(self.gate_up_proj[expert], self.gate_up_proj_scale[expert], x.dtype)
        down_w = dequantize(self.down_proj[expert], self.down_proj_scale[expert].transpose(-1, -2), x.dtype)
        gate, up = torch.bmm(x[:, None, :], gate_up_w).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, down_w)[:, 0]

    def forward_grouped(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert, each group through its expert: x [M, H] sorted by expert, offs [E]
        int32 group ends (offs[E-1] == M) -> [M, H]"""
        gate, up = fp8_grouped_mm(x, self.gate_up_proj, self.gate_up_proj_scale, offs).chunk(2, dim=-1)
        down_scale = self.down_proj_scale.transpose(1, 2)  # [E, 1, H]
        return fp8_grouped_mm(F.silu(gate) * up, self.down_proj, down_scale, offs)
