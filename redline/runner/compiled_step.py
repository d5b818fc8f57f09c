"""The decode step through torch.compile(fullgraph=True), one graph per (rows, sampling).

The step's shapes depend on three things the host picks: rows (the batch bucket), kv_len (the kv
bucket) and whether any row samples. kv_len enters the graph as a dynamic dimension (the length of
a view of `kv_index`), so the graphs are one per (rows, sampling): 16 slots make 5 x 2 = 10 graphs
whatever the context length, where a static kv_len made 5 x 8 x 2 = 80 at 4,096 tokens, past dynamo's
recompile limit. The dimension is marked unbacked: the compiler may not specialize on its value, so
nothing can split the range (a backed dynamic size let inductor's CPU code generation guard its
reductions at 4,096 elements, which doubled the graphs, and the start-up compile, of every context
past 4,096 tokens: BENCHMARKS.md "Start-up compile"). Every key is known up front
(Shapes.step_keys); start-up runs each (rows, sampling) once (runner/warm_up.py), and after `freeze()` a
call that would compile raises. Inside each graph the decoder layers are
nested compile regions (models/llama.run_layer): one layer of each kind is traced and compiled, and
every layer calls it.

Guard evaluation: every call of a compiled function first evaluates its guards, for an 8-layer model
about 2,400 checks on modules, parameters and cache tensors, ~0.8 ms per call on an AVX2 instance of
our CPU, about a tenth of a bf16 step there (BENCHMARKS.md "Compiled bf16 decode"). Nothing those
guards watch changes between steps: the runner's modules, parameters and state tensors are fixed
once it is built, and kv_len is unbacked: no guard reads it. So the first call of a (rows,
sampling) pair runs with every guard (and compiles if no graph fits); later calls, at any kv_len,
run under `set_stance(skip_guard_eval_unsafe=True)`, where dynamo checks only the guards that tell
its compiled graphs apart, which include rows and sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from redline.runner.compiling import own_copy, room_for

Step = Callable[[int, int, bool], torch.Tensor]


def _through_kv_index(step: Step) -> Callable[[int, torch.Tensor, bool], torch.Tensor]:
    def run(rows: int, kv_index: torch.Tensor, any_sampling: bool) -> torch.Tensor:
        return step(rows, kv_index.shape[0], any_sampling)

    return run


class CompiledStep:
    def __init__(self, step: Step, cache_len: int, device: torch.device, graphs: int):
        """graphs: the (rows, sampling) pairs the step will run at."""
        self.step, self.graphs = step, graphs
        self.kv_index = torch.arange(cache_len + 1, device=device)  # its views carry kv_len into the graph
        # size_asserts off: the wrapper checked every input's and layer call's strides in Python, ~800
        # checks a step for 30 layers; the inputs are the runner's own fixed tensors (as for the guards)
        options = {"size_asserts": False}
        run = own_copy(_through_kv_index(step))
        self.compiled = torch.compile(run, fullgraph=True, dynamic=False, options=options)
        self.seen: set[tuple[int, bool]] = set()  # (rows, sampling) pairs run with every guard
        self.frozen = False

    def freeze(self) -> None:
        """From now on a call that would compile raises instead (every key was compiled at warm-up)."""
        self.frozen = True

    def __call__(self, rows: int, kv_len: int, any_sampling: bool) -> torch.Tensor:
        kv_index = self.kv_index[:kv_len]
        torch._dynamo.decorators.mark_unbacked(kv_index, 0)  # one graph for every kv_len
        key = (rows, any_sampling)
        if key not in self.seen:
            if self.frozen:
                raise RuntimeError(f"decode step shape {key} (rows, sampling) was not compiled at warm-up")
            with room_for(self.graphs):
                out = self.compiled(rows, kv_index, any_sampling)
            self.seen.add(key)
            return out
        stance = "fail_on_recompile" if self.frozen else "default"
        with torch.compiler.set_stance(stance, skip_guard_eval_unsafe=True):
            return self.compiled(rows, kv_index, any_sampling)
