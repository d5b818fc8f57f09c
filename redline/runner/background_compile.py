"""Serving at once while the compiled graphs build: an eager runner answers from the first request, a
compiled twin compiles in a background thread, and the engine switches to it between two steps.

Compiling every step and prefill shape takes about a minute for SmolLM2 on 2 cores (BENCHMARKS.md
"Hot path"); an eager step is several times slower than a compiled one but needs no start-up. The twin
is a second ModelRunner over the same model (the same weights, built with the compiled kernels) that
shares the eager runner's KV pool (ModelRunner's kv_of) and has its own block tables, decode state and
sampling tensors. Its warm-up writes only the scratch block of the shared pool: its slots are all free,
and the eager prompt run (which writes real blocks) is left out. Once it has compiled every shape, the
next execute() copies the eager runner's per-slot state into it (DeviceSlots.copy_from: tables, decode
state with the penalty counts [slots, V], sampling: about 1 MB at 4 slots of SmolLM2) and runs on it from
then on. Requests in flight continue where they were: their keys and values are already in the shared
pool.

If the compile fails, the error is logged and the eager runner keeps serving.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

import torch

from redline.runner.model_runner import ModelRunner
from redline.runner.plan import StepPlan, StepResult
from redline.runner.warm_up import warm_up

log = logging.getLogger("redline.compile")


class BackgroundCompile:
    """An executor (engine/core.py) that runs plans on `eager` until the twin `build_compiled()` returns
    is compiled, then on the twin."""

    recovers = True  # one process, as ModelRunner

    def __init__(self, eager: ModelRunner, build_compiled: Callable[[], ModelRunner], progress: bool = True):
        self.runner = eager  # the runner plans run on now
        self.progress = progress
        self.compile_s: float | None = None  # seconds the background compile took, once it has finished
        self.error: BaseException | None = None
        self._compiled: ModelRunner | None = None  # compiled, not yet switched to
        self._done, self._stop = threading.Event(), threading.Event()
        self._say("serving eagerly; compiling the decode step and prefill in the background")
        self._thread = threading.Thread(target=self._compile, args=(build_compiled,), name="redline-compile",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def compiled(self) -> bool:
        """Whether plans run on the compiled runner now."""
        return self.runner.compiled_step is not None

    def _say(self, message: str) -> None:
        if self.progress:
            print(f"[redline] {message}", file=sys.stderr, flush=True)

    def _compile(self, build_compiled: Callable[[], ModelRunner]) -> None:
        start = time.perf_counter()
        try:
            compiled = build_compiled()
            if not warm_up(compiled, progress=False, prompt=False, stop=self._stop):
                return  # closed
        except BaseException as error:  # the eager runner keeps serving
            self.error = error
            log.exception("background compile failed; the engine keeps running eagerly")
            self._say(f"background compile failed ({type(error).__name__}: {error}); running eagerly")
        else:
            self._compiled = compiled
            self.compile_s = time.perf_counter() - start
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the background compile has finished; True when it succeeded (the switch happens at
        the next execute()), False when it failed (`error` says why), was closed, or timed out."""
        return self._done.wait(timeout) and self.compile_s is not None

    def _switch(self) -> None:
        compiled, self._compiled = self._compiled, None
        assert compiled is not None
        self._thread.join()
        with torch.inference_mode():
            compiled.slots.copy_from(self.runner.slots)
        self.runner = compiled
        self._say(f"compiled in {self.compile_s:.0f} s: decoding on the compiled path from now on")

    def execute(self, plan: StepPlan) -> StepResult:
        if self._compiled is not None:
            self._switch()
        return self.runner.execute(plan)

    def log_probs(self, tokens: list[int]) -> torch.Tensor:  # [T - 1, V] fp32, on the CPU
        return self.runner.log_probs(tokens)

    def lost(self) -> str | None:
        return None

    def close(self) -> None:
        """Stops the compile at its next shape and waits for the shape in progress (up to about 20 s for
        SmolLM2): a process that exits with the thread inside torch's C++ code aborts ("terminate called
        without an active exception")."""
        self._stop.set()
        self._thread.join(timeout=1.0)
        if self._thread.is_alive():
            self._say("stopping the background compile: finishing the shape in progress")
            self._thread.join()
