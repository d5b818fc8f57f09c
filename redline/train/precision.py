"""The float type training and feature extraction run in: bf16 where the hardware computes it natively
(CUDA GPUs with bf16, CPUs with AVX-512 BF16 or AMX), fp32 elsewhere, where bf16 is emulated and
slower than fp32."""

from __future__ import annotations

import contextlib

import torch


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """CUDA with bf16, or a CPU with AVX-512 BF16 or AMX tiles, as torch's own CPU feature detection
    (what inductor asks) reports them."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def compute_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    return torch.bfloat16 if fast_bf16(device) else torch.float32


def autocast(device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
    """bf16 autocast where bf16 is fast (weights stay fp32 for the optimizer), else nothing."""
    kind = torch.device(device).type
    return torch.autocast(kind, torch.bfloat16) if fast_bf16(device) else contextlib.nullcontext()
