"""Choosing kernels once, when the runner is built: never a device check inside the step."""

from __future__ import annotations

import functools

import torch
from torch import nn

from redline.kernels import HAS_TRITON
from redline.layers.attention import Attention


def triton_by_default(device: torch.device) -> bool:
    return HAS_TRITON and device.type == "cuda"


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper (compute capability 9.0) and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def select_kernels(model: nn.Module, triton: bool, pdl: bool = False) -> None:
    """Cached attention through the Triton split-KV kernel (triton=True, launched with programmatic
    dependent launch when pdl) or SDPA over the cache slice."""
    kernel = None
    if triton:
        from redline.kernels.decode_attention import decode_attention

        kernel = functools.partial(decode_attention, pdl=pdl)
    for module in model.modules():
        if isinstance(module, Attention):
            module.split_kv = kernel
