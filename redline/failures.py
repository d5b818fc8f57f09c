"""How the engine fails: one request alone, or the whole device.

An ordinary error (out of memory, a bad token) fails the requests it touched and the engine goes on.
An error that leaves the device unusable (on CUDA a sticky error: a device-side assert, an illegal
memory access, a launch failure) fails every request and the engine admits no more work.
"""

from __future__ import annotations

import torch

# Parts of the messages torch gives CUDA errors; a CUDA context that raised one of them is lost.
DEVICE_UNUSABLE_MARKERS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "CUBLAS_STATUS_EXECUTION_FAILED",
)


class RankLostError(RuntimeError):
    """A tensor-parallel worker process died: the group can run nothing more (runner/ranks.py)."""


def device_unusable(error: BaseException) -> bool:
    """True for errors after which the device cannot run anything more (or, with tensor parallelism,
    a rank is lost). Running out of memory is not one of them (torch.OutOfMemoryError, or a CUDA error
    saying "out of memory": freeing memory recovers)."""
    if isinstance(error, RankLostError | DeviceUnusableError):
        return True
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error):
        return False
    if isinstance(error, torch.AcceleratorError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in DEVICE_UNUSABLE_MARKERS)


def describe(stage: str, error: BaseException) -> str:
    """The message a failed request carries: "prefill failed: OutOfMemoryError: CUDA out of memory"."""
    return f"{stage} failed: {type(error).__name__}: {error}"


class DeviceUnusableError(RuntimeError):
    """The device failed earlier (the message says how); this engine accepts no more requests."""
