"""The float type training and feature extraction run in: bf16 where the hardware computes it natively
(CUDA GPUs with bf16, CPUs with AVX-512 BF16 or AMX), fp32 elsewhere, where bf16 is emulated and
slower than fp32."""

from __future__ import annotations

import contextlib

import torch

from redline.dtypes import fast_bf16


def compute_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    return torch.bfloat16 if fast_bf16(device) else torch.float32


def autocast(device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
    """bf16 autocast where bf16 is fast (weights stay fp32 for the optimizer), else nothing."""
    kind = torch.device(device).type
    return torch.autocast(kind, torch.bfloat16) if fast_bf16(device) else contextlib.nullcontext()
