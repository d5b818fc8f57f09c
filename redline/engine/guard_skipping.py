"""Calling a compiled step without re-checking all of dynamo's guards once its shape has been seen.

Every call of a torch.compile'd function first evaluates its guards: for the decode step of an 8-layer
model about 2,400 checks on modules, parameters and cache tensors, ~0.8 ms per call on an AVX2 instance
of our CPU, about a tenth of a bf16 step there (BENCHMARKS.md "Compiled bf16 decode"). Nothing those
guards watch changes between steps: the runner's modules, parameters and state tensors are fixed once it
is built, and what does change, (rows, kv_len, sampling), picks the graph. So the first call with a key
runs with every guard (and compiles); later calls with that key run under
`set_stance(skip_guard_eval_unsafe=True)`, where dynamo checks only the guards that tell its compiled
graphs apart, which include those three arguments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class GuardSkippingStep:
    def __init__(self, compiled: Callable[[int, int, bool], torch.Tensor]):
        self.compiled = compiled
        self.seen: set[tuple[int, int, bool]] = set()

    def __call__(self, rows: int, kv_len: int, sampling: bool) -> torch.Tensor:
        key = (rows, kv_len, sampling)
        if key not in self.seen:
            out = self.compiled(*key)
            self.seen.add(key)
            return out
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self.compiled(*key)
