"""Rotary position embeddings with `llama3` frequency scaling.

Llama 3 rotates halves: the pair for frequency i is (x[i], x[i + d/2]).
Llama 4 rotates adjacent pairs: the pair for frequency i is (x[2i], x[2i + 1]).
"""

import math

import torch
from torch import nn

from redline.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] fp32
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.scaling == "default":
        return inv_freq.float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    if rope.high_freq_factor != rope.low_freq_factor:
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        scaled = torch.where(medium, smoothed, scaled)
    return scaled.float()


class Rotary(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, interleaved: bool):
        super().__init__()
        self.rope, self.head_dim, self.interleaved = rope, head_dim, interleaved
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)

    def materialize(self, device: torch.device) -> None:
        """Recomputes the frequencies on `device` (after building the model on the meta device)."""
        self.inv_freq = inverse_frequencies(self.rope, self.head_dim).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, 1, head_dim // 2] in fp32 (broadcast over heads)."""
        angles = positions.float()[..., None] * self.inv_freq
        return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, head_dim] -> rotated x, computed in fp32, returned in x's dtype."""
        xf = x.float()
        if self.interleaved:
            # [a0, b0, a1, b1, ...] -> pairs (a_i, b_i)
            a, b = xf.unflatten(-1, (-1, 2)).unbind(-1)
            out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            # [a0, a1, ..., b0, b1, ...] -> pairs (a_i, b_i)
            a, b = xf.chunk(2, dim=-1)
            out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return out.type_as(x)
