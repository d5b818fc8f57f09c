"""Serving at once while the compiled graphs build: an eager runner answers from the first request, a
compiled twin compiles in a background thread, and the engine switches to it between two steps.

Compiling every step and prefill shape takes about a minute for SmolLM2 on 2 cores (BENCHMARKS.md
"Hot path"); an eager step is several times slower than a compiled one but needs no start-up. The twin
is a second ModelRunner over the same model (the same weights, built with the compiled kernels) that
shares the eager runner's KV pool (ModelRunner's kv_of) and has its own block tables, decode state and
sampling tensors. The background thread compiles in two phases:

1. the decode step, every (rows, sampling, k) graph it builds (ModelRunner.built_step_keys). Each warm-up
   step runs the twin's own slots, all free then (they compute in the scratch block), so the twin must not
   serve yet. Once they are compiled, the
   next execute() copies the eager runner's per-slot state into the twin (DeviceSlots.copy_from: tables,
   decode state with the penalty counts [slots, V], sampling: about 1 MB at 4 slots of SmolLM2) and runs
   on it from then on. Requests in flight continue where they were: their keys and values are already in
   the shared pool.
2. the prefill graphs, each shape at a pause in serving (PAUSE_S below): their warm-up forwards write only
   the scratch block, and until they are compiled the twin's prefills run the same forward eagerly
   (CompiledPrefill.deferred).

Decode is what a stream waits on token after token, so it comes first: a warm start reaches compiled
decode seconds earlier than when the switch waited for the prefill too (BENCHMARKS.md "Start-up in
seconds").
If the compile fails, the error is logged and the runner serving keeps serving (the prefill eagerly).
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

# Both threads run Python, one at a time (the GIL), and the serving one hands the GIL over and waits to get
# it back around its calls into C++: beside a prefill compile, compiled steps ran tens of times slower
# (BENCHMARKS.md "Start-up in seconds"). So once the step serves compiled, each prefill shape waits for a
# pause of PAUSE_S seconds between plans (until then the prefill runs eagerly), or under steady load
# compiles after PATIENCE_S of waiting, so that prompts do not run eagerly for good.
PAUSE_S = 0.25
PATIENCE_S = 60.0


class BackgroundCompile:
    """An executor (engine/core.py) that runs plans on `eager` until the twin `build_compiled()` returns
    is compiled, then on the twin."""

    recovers = True  # one process, as ModelRunner

    def __init__(self, eager: ModelRunner, build_compiled: Callable[[], ModelRunner], progress: bool = True):
        self.runner = eager  # the runner plans run on now
        self.progress = progress
        self.compile_s: float | None = None  # seconds until the compiled decode step was ready
        self.error: BaseException | None = None
        self._compiled: ModelRunner | None = None  # its step compiled, not yet switched to
        self._finished = False  # every graph compiled
        self._done, self._stop = threading.Event(), threading.Event()
        self.step_ready = threading.Event()  # set once the decode step is compiled (the switch is due)
        self._busy, self._last_plan = False, time.perf_counter()  # a plan running; when the last one ended
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
            prefill = compiled.compiled_prefill
            if prefill is not None:
                prefill.deferred = True  # eager prefills once the twin serves, until phase 2 is done
            go_on = lambda: not self._stop.is_set()
            if not warm_up(compiled, progress=False, prompt=False, go_on=go_on, prefill=False):
                return  # closed
            self.compile_s = time.perf_counter() - start
            self._compiled = compiled  # phase 1 done: the next execute() switches
            self.step_ready.set()
            if not warm_up(compiled, progress=False, prompt=False, go_on=self._pause, steps=False):
                return
            if prefill is not None:
                prefill.deferred = False
                self._say(f"prefill compiled too ({time.perf_counter() - start:.0f} s)")
            self._finished = True
        except BaseException as error:  # the runner serving keeps serving
            self.error = error
            log.exception("background compile failed; the engine keeps running")
            path = "the prefill eagerly" if self.compile_s is not None else "eagerly"
            self._say(f"background compile failed ({type(error).__name__}: {error}); running {path}")
        finally:
            self._done.set()

    def _pause(self) -> bool:
        """Waits for a pause in serving (no plan for PAUSE_S), at most PATIENCE_S; False once closed."""
        waited = time.perf_counter()
        while self._busy or time.perf_counter() - self._last_plan < PAUSE_S:
            if time.perf_counter() - waited > PATIENCE_S:
                break
            if self._stop.wait(PAUSE_S / 4):
                return False
        return not self._stop.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the background compile has finished; True when it compiled every graph (the switch
        happens at the next execute() if it has not yet), False when it failed (`error` says why), was
        closed, or timed out."""
        return self._done.wait(timeout) and self._finished

    def _switch(self) -> None:
        compiled, self._compiled = self._compiled, None
        assert compiled is not None
        with torch.inference_mode():
            self.runner.write_deferred_keys()  # the twin's ring starts empty
            compiled.slots.copy_from(self.runner.slots)
        self.runner = compiled
        self._say(f"compiled in {self.compile_s:.0f} s: decoding on the compiled path from now on")

    def execute(self, plan: StepPlan) -> StepResult:
        if self._compiled is not None:
            self._switch()
        self._busy = True
        try:
            return self.runner.execute(plan)
        finally:
            self._last_plan = time.perf_counter()  # before _busy: the compile thread reads _busy first
            self._busy = False

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
