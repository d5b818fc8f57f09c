"""Fake CUDA on a CPU-only torch: the pieces tests/test_fake_cuda.py needs to run the engine's CUDA path.

FakeTensorMode makes tensors on device "cuda" that have shapes, dtypes and devices but no memory: every
op only computes metadata. It raises FakeTensorDeviceMismatchError where CPU and CUDA tensors meet,
and DataDependentOutputException / DynamicOutputShapeException at a host sync (`.item()`, `.tolist()`,
`int(t)`, `nonzero`). Three gaps of a CPU-only build are filled here:

- Python indexing (`t[:, 1:]`, `t[rows] = x`) enters a CUDA device guard, and a CPU-only build has
  none (FakeTensorMode installs one only on CUDA builds without a device): `register_cuda_device_guard`
  compiles a two-line library that registers c10's FakeGuardImpl for CUDA (g++ and torch's headers,
  about a second) and loads it into the process;
- Triton kernels launch as torch's higher-order op only when they are JITFunctions, not the
  interpreter's InterpretedFunction, so the process must run with TRITON_INTERPRET=0; a stand-in
  driver (`use_h200_target`) then reports an H200's target (cuda, sm_90, 32-thread warps), so torch
  can analyse the kernels (which arguments they write) and Triton can compile them to cubin with
  its bundled ptxas, with no GPU;
- the engine asks the device for its compute capability (PDL needs Hopper; torch._grouped_mm's
  CUTLASS kernel needs 9.x / 10.x; FP8 GEMMs need 8.9+): `use_h200_target` also answers those
  queries as an H200 does (9.0);
- `.to("cuda")` without an index asks the CUDA runtime for the current device: use cuda:0.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CUDA = torch.device("cuda", 0)
H200_SHARED_MEMORY = 232_448  # bytes of shared memory one block may use on sm_90 (227 KB)

_GUARD_SOURCE = """#include <c10/core/impl/FakeGuardImpl.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
"""


def register_cuda_device_guard() -> None:
    """Registers a CUDA device guard in a CPU-only torch (a no-op on CUDA builds)."""
    if torch.backends.cuda.is_built():
        return
    root = Path(torch.__file__).parent
    out = Path(tempfile.mkdtemp(prefix="redline-fake-cuda-"))
    (out / "guard.cpp").write_text(_GUARD_SOURCE)
    lib = out / "libfakecudaguard.so"
    subprocess.run(
        ["g++", "-shared", "-fPIC", "-std=c++17", "-I", str(root / "include"), str(out / "guard.cpp"),
         "-L", str(root / "lib"), "-lc10", "-o", str(lib)],
        check=True,
    )  # fmt: skip
    ctypes.CDLL(str(lib))  # its static registrar runs on load; libc10 is already in the process


class _H200Driver:
    """The part of a Triton driver that compiling (not launching) asks for."""

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


class DeviceProperties(NamedTuple):  # the fields of torch.cuda.get_device_properties the engine reads
    name: str
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int


H200_PROPERTIES = DeviceProperties("NVIDIA H200", 9, 0, 132, 150_110_011_392)  # a tuple dynamo can trace


def use_h200_target() -> None:
    """Without a GPU, Triton compiles for an H200 and torch.cuda answers capability queries as one."""
    import triton

    if not torch.cuda.is_available():
        triton.runtime.driver.set_active(_H200Driver())
        torch.cuda.get_device_properties = lambda device=None: H200_PROPERTIES
        torch.cuda.get_device_capability = lambda device=None: (H200_PROPERTIES.major, H200_PROPERTIES.minor)


class OpLog(TorchDispatchMode):
    """Counts the ops dispatched under it (a triton_op counts once, as itself) and records those whose
    outputs include a tensor off the CUDA device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.off_device: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.name()] += 1
        if any(isinstance(t, torch.Tensor) and t.device.type != "cuda" for t in tree_leaves(out)):
            self.off_device.append(func.name())
        return out


@contextmanager
def recorded_launches() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Every Triton launch made through wrap_triton inside the block, as (kernel, args, kwargs)."""
    from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper

    launches: list[tuple[Any, tuple, dict]] = []
    original = TraceableTritonKernelWrapper.__call__

    def record(self, *args, **kwargs):
        launches.append((self.kernel, args, kwargs))
        return original(self, *args, **kwargs)

    TraceableTritonKernelWrapper.__call__ = record
    try:
        yield launches
    finally:
        TraceableTritonKernelWrapper.__call__ = original


def compile_for_h200(kernel: Any, args: tuple, kwargs: dict) -> Any:
    """Compiles one recorded launch for sm_90 as Triton's JIT would at that launch (same constants,
    options and argument specialization), without launching it. Returns the CompiledKernel."""

    def real(a: Any) -> Any:  # fake tensors become small CPU tensors of their dtype (16-byte aligned)
        return torch.empty(16, dtype=a.dtype) if isinstance(a, torch.Tensor) else a

    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return kernel.warmup(*map(real, args), grid=(1,), **{k: real(v) for k, v in kwargs.items()})


def resource_usage(compiled: Any) -> str:
    """ptxas's registers / stack / shared memory per thread for a compiled kernel (cuobjdump)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True)
    return " ".join(line.strip() for line in out.stdout.splitlines() if "REG:" in line)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("0", "", "false", "False")
