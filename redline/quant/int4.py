"""int4 weight-only linears on CPU: 4-bit weights in groups along the input dimension, each group with a
scale and a zero (asymmetric, as llama.cpp's Q4_1 and torchao's int4 weight-only), multiplied by torch's
CPU int4 kernel (aten._weight_int4pack_mm_for_cpu, the one torchao's int4 CPU layout calls; its vector
code is bf16's: other dtypes take its scalar loop).

A group of `group` weights w gets scale = (max - min) / 15 and zero = min + 8 * scale, both rounded to the
model's dtype, and q = round((w - zero) / scale) + 8 in 0 .. 15; it reads back as (q - 8) * scale + zero
(the kernel's form). Example, group [-0.3, 0.0, 0.3, 0.6] in fp32: scale 0.06, zero 0.18, q [0, 5, 10,
15]; q 5 reads back (5 - 8) * 0.06 + 0.18 = 0.0. A weight is off by at most scale / 2, plus what rounding
scale and zero to bf16 moves the grid by (at most 2^-9 of 8 steps at either end).

Storage: 4 bits a weight plus a scale and a zero per group: 5 bits a weight in groups of 32 of bf16, a
third of bf16's bytes. With weights streamed from memory as in a decode step, the kernel takes about half
the bf16 kernel's time at one row and about the same at four (BENCHMARKS.md "Weight-only kernels on CPU").
"""

from __future__ import annotations

import torch
from torch import nn

from redline.kernels.quantized_layout import check_shape

INNER_K_TILES = 1  # the CPU kernel's packing parameter (the CUDA kernel's tiles do not apply)
OUT_MULTIPLE = 16  # the kernel's output features come in blocks of 16


def quantize_int4(
    w: torch.Tensor,  # [N, K]
    group: int,
    dtype: torch.dtype = torch.float32,  # scale and zero are stored in it
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [N, K] int32 (0 .. 15), scale, zero [N, K / group]
    n, k = w.shape
    groups = w.float().reshape(n, k // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-10).to(dtype).float()
    zero = (low + 8 * scale).to(dtype).float()
    q = ((groups - zero[..., None]) / scale[..., None]).round() + 8
    return q.clamp(0, 15).to(torch.int32).reshape(n, k), scale, zero


def dequantize_int4(
    q: torch.Tensor,  # [N, K] int32
    scale: torch.Tensor,  # [N, K / group]
    zero: torch.Tensor,  # [N, K / group]
    group: int,
) -> torch.Tensor:  # [N, K] fp32
    """(q - 8) * scale + zero per group: what the kernel multiplies by."""
    n, k = q.shape
    groups = (q.reshape(n, k // group, group).float() - 8) * scale[..., None] + zero[..., None]
    return groups.reshape(n, k)


@torch.library.custom_op("redline::int4_mm", mutates_args=())
def int4_mm(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # the kernel's layout of q [N, K]
    group: int,
    scales_and_zeros: torch.Tensor,  # [K / group, N, 2], x's dtype
) -> torch.Tensor:  # [M, N]
    """The kernel as one opaque op: inductor rewrites the aten op into its own int4 op, which failed on the
    prefill's dynamic row count ("group size must be a scalar", torch 2.13)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)


@int4_mm.register_fake
def _(x, packed, group, scales_and_zeros):
    return x.new_empty(x.shape[0], scales_and_zeros.shape[1])


class Int4Linear(nn.Module):
    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int,
                 bias: torch.Tensor | None) -> None:  # fmt: skip
        """packed: the kernel's layout of q [N, K]; scales_and_zeros [K / group, N, 2], the compute dtype."""
        super().__init__()
        self.in_features = scales_and_zeros.shape[0] * group
        self.out_features, self.group = scales_and_zeros.shape[1], group
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group: int, name: str = "a linear", dtype: torch.dtype | None = None
    ) -> Int4Linear:
        """The linear's weight quantized in groups of `group` along its input dimension, computing in
        `dtype` (None: the weight's)."""
        check_int4_shape(linear.in_features, linear.out_features, group, name)
        weight = linear.weight.detach()
        if weight.device.type != "cpu":
            raise ValueError(f"int4 weights run on CPU (the {weight.device.type} kernel is not wired in yet)")
        dtype = dtype or weight.dtype
        q, scale, zero = quantize_int4(weight, group, dtype)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype).clone()
        return cls._kernel_form(q, scale, zero, group, bias, dtype)

    @classmethod
    def from_codes(
        cls,
        q: torch.Tensor,  # [N, K] int32, 0 .. 15
        scale: torch.Tensor,  # [N, K / group]
        zero: torch.Tensor,  # [N, K / group]: the weight is q * scale + zero (the kernel's: zero + 8 scale)
        group: int,
        bias: torch.Tensor | None,  # [N], dtype
        dtype: torch.dtype,  # scales and zeros are rounded to it, and the product computes in it
    ) -> Int4Linear:
        """Codes read from a checkpoint (models/int_checkpoint.py), in the kernel's form."""
        return cls._kernel_form(q, scale, zero + 8 * scale, group, bias, dtype)

    @classmethod
    def _kernel_form(
        cls,
        q: torch.Tensor,  # [N, K] int32, 0 .. 15
        scale: torch.Tensor,  # [N, K / group]
        zero: torch.Tensor,  # [N, K / group]: the weight is (q - 8) * scale + zero
        group: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> Int4Linear:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        return cls(packed, scales_and_zeros, group, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype).contiguous()
        # eager: the aten op itself (int4_mm's Python dispatch cost 59 us a call at [960, 576], the kernel
        # 22); compiled: the opaque op, which inductor does not rewrite
        mm = int4_mm if torch.compiler.is_compiling() else torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(flat, self.packed, self.group, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


def check_int4_shape(in_features: int, out_features: int, group: int, name: str) -> None:
    """ValueError naming the layer when the kernel cannot take it: inputs in whole groups, outputs in
    blocks of OUT_MULTIPLE."""
    check_shape(in_features, out_features, group, name, OUT_MULTIPLE, "torch's int4")
