"""The float type training and feature extraction run in: bf16 where the hardware computes it natively
(CUDA GPUs with bf16, CPUs with AVX-512 BF16 or AMX), fp32 elsewhere, where bf16 is emulated and
slower than fp32."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def compute_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    return torch.bfloat16 if fast_bf16(device) else torch.float32


def autocast(device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
    """bf16 autocast where bf16 is fast (weights stay fp32 for the optimizer), else nothing."""
    kind = torch.device(device).type
    return torch.autocast(kind, torch.bfloat16) if fast_bf16(device) else contextlib.nullcontext()
