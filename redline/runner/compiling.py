"""What every compiled stage of a runner shares: a function of its own for dynamo, room for the graphs it is
known to need, and inductor's start-up probe of the CPU remembered across processes.

Dynamo keeps its graphs, and counts recompilations against `recompile_limit`, per code object. Two
runners compiling the same function would share that count (a test process builds dozens), so each stage
compiles its own copy of its function's code: one runner's graphs never count against another's. The
stage knows how many graphs it needs (one per (rows, sampling, k) key, or per prefill shape), so it raises
the limit to that while compiling, and freezes once every shape is compiled (runner/warm_up.py).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def own_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn with a fresh copy of its code object (same globals, closure and defaults)."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def room_for(graphs: int) -> contextlib.AbstractContextManager:
    """While compiling: up to `graphs` graphs of this stage's function (and no process-wide cap: every
    runner bounds its own shapes)."""
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=max(graphs, 8), accumulated_recompile_limit=2**31 - 1)


# dynamo's stance (torch.compiler.set_stance) is one setting for the whole process: a compiled step on the
# serving thread and a prefill compiling on another (runner/background_compile.py) must not interleave
# setting and restoring it, or one runs under the other's stance
STANCE = threading.Lock()
_probes_remembered = False


def remember_isa_probes() -> None:
    """Inductor's CPU code generation first checks, once per process, that a library built with each
    vector ISA's flags loads: six fresh Python processes that dlopen it (BENCHMARKS.md "Start-up in
    seconds"). A library that loaded once is remembered by a marker beside it, naming the torch build it
    loaded against and the library's size and time, and later processes skip its probe; a rebuilt
    library, or another torch, is probed again. A torch without this probe (`VecISA._probe_load`) is left
    as it is."""
    global _probes_remembered
    from torch._inductor import cpu_vec_isa

    probe = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if probe is None or _probes_remembered:
        return

    def stamp(library: Path) -> str:  # raises OSError when the library is not there
        built, torch_build = library.stat(), f"{Path(torch.__file__).parent} {torch.version.git_version}"
        return f"{torch_build} {built.st_size} {built.st_mtime_ns}"

    def remembered(isa: cpu_vec_isa.VecISA, output_path: str) -> bool:
        library = Path(output_path)
        marker = library.with_name(library.name + ".loads")
        with contextlib.suppress(OSError):
            if marker.read_text() == stamp(library):
                return True
        loads = probe(isa, output_path)
        if loads:
            with contextlib.suppress(OSError):
                marker.write_text(stamp(library))
        return loads

    cpu_vec_isa.VecISA._probe_load = remembered
    _probes_remembered = True
