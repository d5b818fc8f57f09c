"""FP8 (e4m3fn) weights with per-output-channel or per-tensor scales.

Weights: w ~= q * scale, q = round(w / scale) in e4m3fn (|q| <= 448), scale = absmax / 448 over the
input dimension (per output channel: what `redline quantize --scheme fp8` writes) or over the whole
tensor (the per-tensor "-FP8" releases). Activations (the _scaled_mm path): quantized per token at run
time, or with the checkpoint's calibrated per-tensor `input_scale` (static): x ~= clamp(x / s, +-448) in
e4m3 * s, as compressed-tensors and vLLM compute it.

Two kernels, picked at construction (`scaled_mm`):
- torch._scaled_mm: FP8 x FP8 with fp32 accumulation (Hopper / Ada GPUs; on CPU only a slow reference);
- dequantize: the FP8 weight cast to the activation dtype, its scale applied to the output
  (x @ (q * s)^T = (x @ q^T) * s^T per output channel); activations stay unquantized, so a static
  `input_scale` is not used there.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12  # an all-zero row gets scale MIN_SCALE, not 0 (no 0/0)
# How a weight's scales lie: "linear" [N, K] -> [N, 1]; "gate_up" (experts, x @ W) [E, H, 2I] -> [E, 1, 2I];
# "down" [E, I, H] -> [E, H, 1] (Fp8Experts keeps the down scales as a column per expert)
Kind = Literal["linear", "gate_up", "down"]


def quantize(w: torch.Tensor, dim: int | None = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values and fp32 scales over `dim` (kept, size 1): w [N, K], dim -1 -> q [N, K], scale [N, 1];
    dim None -> one scale for the tensor, shape [1]."""
    w = w.float()
    magnitude = w.abs()
    absmax = magnitude.amax().reshape(1) if dim is None else magnitude.amax(dim=dim, keepdim=True)
    del magnitude
    scale = (absmax / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(w: torch.Tensor, kind: Kind) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values and scales of one weight, per output channel: a linear's as `quantize`; experts'
    w [E, K, N] (x @ W) -> q [E, K, N] and a scale per expert and output column, computed one expert at a
    time so the fp32 temporaries stay the size of one expert."""
    if kind == "linear":
        return quantize(w)
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    scale = torch.empty(w.shape[0], 1, w.shape[2], dtype=torch.float32, device=w.device)  # [E, 1, N]
    for e in range(w.shape[0]):
        q[e], scale[e] = quantize(w[e], dim=0)
    return q, scale if kind == "gate_up" else scale.transpose(1, 2).contiguous()


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
        static_input: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features, self.scaled_mm = in_features, out_features, scaled_mm
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        scale_shape = (1,) if per_tensor else (out_features, 1)
        self.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # the checkpoint's calibrated activation scale; None: per-token scales at run time
        self.input_scale = nn.Parameter(torch.ones(1), requires_grad=False) if static_input else None
        # both scales single values: _scaled_mm's tensor-wise form; else its row-wise form
        self.tensorwise = per_tensor and static_input

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
        if self.input_scale is None:
            xq, x_scale = quantize(x)  # per token: [M, K], [M, 1]
        else:
            x_scale = self.input_scale.float()  # [1]
            xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        w_scale = self.weight_scale.float()  # [N, 1] or [1]
        if not self.tensorwise:  # row-wise scales must be [M, 1] and [1, N], contiguous
            x_scale = x_scale.expand(x.shape[0], 1).contiguous()
            w_scale = w_scale.reshape(1, -1).expand(1, self.out_features).contiguous()
        return torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)
