"""int4 / int8 weight-only linears on CUDA: the weight rounded as on CPU (kernels/quantized_layout.rounded:
asymmetric, groups of 32 / 64 / 128 with fp16 scales and zeros), held in the GPU kernel's layout
(kernels/weight_only_mm.py: int4 codes 8 to an int32 word along K, int8 codes as uint8). The GPU kernel
multiplies x as it is; the CPU's int8 kernel carries x in int16 (csrc/int8_rows_vnni.cpp).
A decode or verify step's rows (up to KERNEL_ROWS) take the Triton kernel, which reads each weight once
per 64 rows; a prompt's rows multiply the dequantized weight (a GEMM's worth of compute, where reading it
is not the cost), and so does an fp32 model (the kernel's tl.dot would round to tf32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redline.kernels.quantized_layout import rounded
from redline.quant.int_packing import pack_int32

# rows up to which the kernel runs (in tiles of up to 64 rows, each reading the weight): every decode and
# verify step of max-throughput's 256 slots; longer prompts multiply the dequantized weight
KERNEL_ROWS = 256


class GpuWeightOnlyLinear(nn.Module):
    def __init__(
        self,
        codes: torch.Tensor,  # int4 [N, K / 8] int32 or int8 [N, K] uint8
        scales: torch.Tensor,  # [N, K / G] fp16
        zeros: torch.Tensor,  # [N, K / G] fp16
        bias: torch.Tensor | None,  # [N], the model's dtype
    ) -> None:
        super().__init__()
        per_code = 8 if codes.dtype == torch.int32 else 1  # int4: 8 codes a word
        self.out_features, self.in_features = scales.shape[0], codes.shape[1] * per_code
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group: int, dtype: torch.dtype) -> GpuWeightOnlyLinear:
        q, scale, zero = rounded(linear.weight.detach(), bits, group)
        codes = pack_int32(q, 4) if bits == 4 else q.to(torch.uint8)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(codes, scale.half(), zero.half(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        # Triton, imported where it runs (the core imports without it)
        from redline.kernels.weight_only_mm import dequantize_codes, weight_only_mm

        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= KERNEL_ROWS and x.dtype != torch.float32:  # fp32: an exact product, not tf32
            y = weight_only_mm(flat.contiguous(), self.codes, self.scales, self.zeros)
        else:
            y = F.linear(flat, dequantize_codes(self.codes, self.scales, self.zeros).to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bits = 4 if self.codes.dtype == torch.int32 else 8
        group = self.in_features // self.scales.shape[1]
        return f"in_features={self.in_features}, out_features={self.out_features}, int{bits}, group={group}"
