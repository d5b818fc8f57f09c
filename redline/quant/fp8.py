"""FP8 (e4m3fn) weights with per-output-channel scales and dynamic per-token activation scales.

Weights: w ~= q * scale, q = round(w / scale) in e4m3fn (|q| <= 448), scale = absmax over the input
dimension / 448, one per output channel. Activations (the _scaled_mm path): the same per token, at
run time. lm_head, embeddings, norms and the MoE router stay in high precision.

Two kernels compute the same function, picked at construction (`scaled_mm`):
- torch._scaled_mm: FP8 x FP8 with fp32 accumulation (Hopper / Ada GPUs; also runs on CPU in torch
  2.13, but as a slow reference: 11.4 ms vs 0.17 ms for the bf16 GEMM at [1, 512] x [512, 1408]);
- dequantize: the FP8 weight cast to the activation dtype, its scale applied to the output
  (x @ (q * s)^T = (x @ q^T) * s^T per output channel); activations stay unquantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12  # an all-zero row gets scale MIN_SCALE, not 0 (no 0/0)


def quantize(w: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values and fp32 scales over `dim` (kept, size 1): w [N, K], dim -1 -> q [N, K], scale [N, 1]."""
    scale = (w.float().abs().amax(dim=dim, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def scaled_mm_available(device: torch.device) -> bool:
    """_scaled_mm where it is fast: CUDA devices with FP8 tensor cores (compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        per_tensor: bool = False,
        scaled_mm: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features, self.scaled_mm = in_features, out_features, scaled_mm
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        scale_shape = (1,) if per_tensor else (out_features, 1)
        self.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scaled_mm: bool = False) -> Fp8Linear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, scaled_mm=scaled_mm)
        q, scale = quantize(linear.weight.detach())
        layer.weight.data, layer.weight_scale.data = q, scale
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features)
        y = self._scaled_mm(flat) if self.scaled_mm else self._dequantized(flat)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _dequantized(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        y = F.linear(x, self.weight.to(x.dtype))
        return (y.float() * self.weight_scale.reshape(1, -1)).to(x.dtype)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        xq, x_scale = quantize(x)  # per token
        w_scale = self.weight_scale.reshape(1, -1).expand(1, self.out_features).float()
        return torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)


class Fp8Experts(nn.Module):
    """Llama 4 experts in FP8 with per-output-channel scales, laid out as the published FP8 Llama 4
    checkpoints hold them: gate_up_proj [E, H, 2I] with gate_up_proj_scale [E, 1, 2I], down_proj
    [E, I, H] with down_proj_scale [E, H, 1]. Only the selected experts' weights are read and cast."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        p = lambda *shape, dtype=FP8: nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        self.gate_up_proj = p(num_experts, hidden, 2 * inter)
        self.gate_up_proj_scale = p(num_experts, 1, 2 * inter, dtype=torch.float32)
        self.down_proj = p(num_experts, inter, hidden)
        self.down_proj_scale = p(num_experts, hidden, 1, dtype=torch.float32)

    @classmethod
    def from_experts(cls, experts: nn.Module) -> Fp8Experts:
        e, h, two_i = experts.gate_up_proj.shape
        layer = cls(e, h, two_i // 2)
        layer.gate_up_proj.data, layer.gate_up_proj_scale.data = quantize(
            experts.gate_up_proj.detach(), dim=1
        )
        down, down_scale = quantize(experts.down_proj.detach(), dim=1)  # scale [E, 1, H]
        layer.down_proj.data, layer.down_proj_scale.data = down, down_scale.transpose(1, 2).contiguous()
        return layer

    def _weights(self, expert: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = dequantize(self.gate_up_proj[expert], self.gate_up_proj_scale[expert], dtype)
        down = dequantize(self.down_proj[expert], self.down_proj_scale[expert].transpose(-1, -2), dtype)
        return gate_up, down

    def forward_selected(
        self, x: torch.Tensor, expert: torch.Tensor
    ) -> torch.Tensor:  # [N, H], [N] -> [N, H]
        gate_up_w, down_w = self._weights(expert, x.dtype)
        gate, up = torch.bmm(x[:, None, :], gate_up_w).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, down_w)[:, 0]

    def forward_all(self, x: torch.Tensor) -> torch.Tensor:  # [E, N, H] -> [E, N, H]
        gate_up_w, down_w = self._weights(slice(None), x.dtype)
        gate, up = torch.bmm(x, gate_up_w).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, down_w)
