"""What every compiled stage of a runner shares: a function of its own for dynamo, and room for the graphs
it is known to need.

Dynamo keeps its graphs, and counts recompilations against `recompile_limit`, per code object. Two
runners compiling the same function would share that count (a test process builds dozens), so each stage
compiles its own copy of its function's code: one runner's graphs never count against another's. The
stage knows how many graphs it needs (one per (rows, sampling) pair, or per prefill shape), so it raises
the limit to that while compiling, and freezes once every shape is compiled (runner/warm_up.py).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any


def own_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn with a fresh copy of its code object (same globals, closure and defaults)."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def room_for(graphs: int) -> contextlib.AbstractContextManager:
    """While compiling: up to `graphs` graphs of this stage's function (and no process-wide cap: every
    runner bounds its own shapes)."""
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=max(graphs, 8), accumulated_recompile_limit=2**31 - 1)
