"""CPU tensors on 2 MiB pages: the weights and the KV cache a decode step streams.

A CPU decode step reads every weight once, front to back: 269 MB through 4 KiB pages is 66,000 TLB misses
a step, and under a virtual machine's nested paging each is a two-level page walk. On a 2-core AMD EPYC VM
(BENCHMARKS.md "Weights and KV cache on huge pages") one core's read went from 20 to 30 GB/s on 2 MiB
pages, SmolLM2's products from 26 to 28 GB/s at one row and 18 to 21 GB/s at four, and the compiled decode
step got 4-7% faster. Linux gives anonymous memory transparent huge pages where advised
(transparent_hugepage "madvise", the common default) or always ("always"); with "never", or on other
systems, everything stays on torch's allocations.

`REDLINE_HUGE_PAGES=0` keeps torch's allocations (to measure against). Where memory is too fragmented
for huge pages, the kernel falls back to ordinary pages by itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

HUGE_PAGE = 2 << 20
ALIGN = 64  # each moved storage starts on a cache line, so every dtype's elements stay aligned
TRIM_BYTES = 32 << 20  # the heap is trimmed after each this many bytes moved
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    """Linux with transparent huge pages for advised memory: "madvise" or "always", not "never"."""
    return hasattr(mmap, "MADV_HUGEPAGE") and THP.is_file() and "[never]" not in THP.read_text()


def enabled() -> bool:
    """Whether CPU weights and caches go on huge pages: where thp_available(), unless REDLINE_HUGE_PAGES=0
    (elsewhere moving them would only copy them)."""
    return os.environ.get("REDLINE_HUGE_PAGES", "1") != "0" and thp_available()


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with nbytes of zeros from a 2 MiB boundary, its huge pages advised (to the
    2 MiB past the end, so that the last partial one is a huge page too), and that boundary's offset.
    Nothing is committed until written."""
    whole = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, whole + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # private: shared has no huge pages
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    start = -address % HUGE_PAGE  # mmap returns 4 KiB-aligned memory: skip to the 2 MiB boundary
    with contextlib.suppress(OSError):  # huge pages off in this kernel: ordinary pages
        mapping.madvise(mmap.MADV_HUGEPAGE, start, whole)
    return mapping, start


def huge_page_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device), on huge pages for a CPU where enabled(). Like
    torch.zeros it writes every page now: a cache whose pages were first touched while serving would fault
    (and compact memory) in the middle of decode steps, and run out of memory there rather than at
    start-up."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or not enabled() or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping, start = _mapping(nbytes)
    storage = torch.frombuffer(mapping, dtype=torch.uint8, offset=start, count=nbytes).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape).zero_()  # a tensor of its own, not a view


def _tensors(modules: list[nn.Module]) -> Iterator[torch.Tensor]:
    """Every parameter, buffer and tensor attribute of the modules (e.g. the fused qkv weight), in module
    order: the order a decode step reads them."""
    for module in modules:
        for m in module.modules():
            yield from (t for t in m._parameters.values() if t is not None)
            yield from (t for t in m._buffers.values() if t is not None)
            yield from (t for t in vars(m).values() if isinstance(t, torch.Tensor))


def move_to_huge_pages(*modules: nn.Module | None) -> int:
    """Moves the CPU tensors of the modules into one huge-page mapping, in the order a step reads them, and
    returns its size (0 where not enabled()). Every tensor keeps its identity, values, shape, strides and
    sharing: the tensors of one storage (e.g. q_proj.weight, k_proj.weight and v_proj.weight, views of the
    fused qkv weight; a tied lm_head and embedding) move together to one new storage and still share it,
    at the same offsets. Each storage stays a storage of its own (in the one mapping): compiled regions
    take weights that do not alias one another. A tensor the walk does not reach (say, a view kept in a
    list) keeps its old storage alive, so that the process holds those bytes twice: a warning says so."""
    if not enabled():
        return 0
    groups: dict[int, list[torch.Tensor]] = {}  # storage address -> its tensors, first seen first
    for t in _tensors([m for m in modules if m is not None]):
        if t.device.type == "cpu" and t.untyped_storage().nbytes() > 0:
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    sizes = [max(t.untyped_storage().nbytes() for t in tensors) for tensors in groups.values()]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // ALIGN) * ALIGN)
    mapping, base = _mapping(starts[-1])
    left_behind = []  # (the old storage, its bytes)
    freed = 0  # bytes moved since the heap was last trimmed
    with torch.no_grad():
        for start, size, tensors in zip(starts[:-1], sizes, groups.values(), strict=True):
            old = max((t.untyped_storage() for t in tensors), key=lambda s: s.nbytes())
            left_behind.append((StorageWeakRef(old), old.nbytes()))
            new = torch.frombuffer(mapping, dtype=torch.uint8, offset=base + start, count=size)
            new.copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for t in {id(t): t for t in tensors}.values():  # each tensor object once
                t.set_(new.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            del old
            freed += size
            if freed > TRIM_BYTES:  # the old copies leave as the new fill: the peak stays near one model
                trim_heap()
                freed = 0
    held = sum(nbytes for ref, nbytes in left_behind if not ref.expired())
    if held:
        message = f"{held:,} bytes of weights moved to huge pages stay held by tensors outside the model"
        warnings.warn(message, stacklevel=2)
    trim_heap()
    return starts[-1]


def trim_heap() -> None:
    """Gives the heap's free memory back to the system (glibc's malloc_trim; elsewhere nothing). Weights
    freed after loading (high-precision copies quantized away, storages moved to huge pages) otherwise stay
    in the process: glibc raises its mmap threshold as large blocks are freed, so that later ones come from
    the heap, which free() does not shrink. SmolLM2's bf16 load held 619 MB of a 257 MB model without it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
