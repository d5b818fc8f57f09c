"""Dtype names as options spell them, and the dtype a device computes fast (the engine's default)."""

from __future__ import annotations

import torch

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}, fp8, auto")
    return DTYPES[name]


def dtype_name(value: str | torch.dtype | None) -> str | None:
    """torch.bfloat16 -> "bfloat16" (LLM(dtype=torch.bfloat16) works); a name (or None) passes through."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether `device` computes bf16 natively: CUDA with bf16, or a CPU with AVX-512 BF16 or AMX tiles, as
    torch's own CPU feature detection (what inductor asks) reports them. Elsewhere bf16 is emulated and
    slower than fp32."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def fast_dtype(device: str | torch.device = "cpu") -> str:
    """The default dtype: "bfloat16" where the device computes it natively, "float32" elsewhere."""
    return "bfloat16" if fast_bf16(device) else "float32"
