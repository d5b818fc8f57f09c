"""Choosing kernels once, when the runner is built: never a device check inside the step."""

from __future__ import annotations

import torch
from torch import nn

from redline.kernels import HAS_TRITON
from redline.layers.attention import Attention


def triton_by_default(device: torch.device) -> bool:
    return HAS_TRITON and device.type == "cuda"


def select_kernels(model: nn.Module, triton: bool) -> None:
    """Cached attention through the Triton split-KV kernel (triton=True) or SDPA over the cache slice."""
    kernel = None
    if triton:
        from redline.kernels.decode_attention import decode_attention

        kernel = decode_attention
    for module in model.modules():
        if isinstance(module, Attention):
            module.split_kv = kernel
