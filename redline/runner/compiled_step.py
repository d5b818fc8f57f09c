"""The decode step through torch.compile(fullgraph=True), one graph per (rows, sampling, k).

The step's shapes depend on four things the host picks: rows (the batch bucket), kv_len (the kv
bucket), whether any row samples, and k, the drafts it verifies (K, or 0 where the engine adapts the
draft length: engine/draft_length.py). kv_len enters the graph as a dynamic dimension (the length of
a view of `kv_index`), so the graphs are one per (rows, sampling, k): 16 slots make 5 x 2 = 10 graphs per k
whatever the context length, where a static kv_len made 5 x 8 x 2 = 80 at 4,096 tokens, past dynamo's
recompile limit. The dimension is marked unbacked: the compiler may not specialize on its value, so
nothing can split the range (a backed dynamic size let inductor's CPU code generation guard its
reductions at 4,096 elements, which doubled the graphs, and the start-up compile, of every context
past 4,096 tokens: BENCHMARKS.md "Start-up compile"). Every key is known up front
(ModelRunner.built_step_keys); start-up runs each (rows, sampling, k) once (runner/warm_up.py), and after
`freeze()` a call that would compile raises. Inside each graph the decoder layers are nested compile
regions (models/llama.run_layer): one layer of each kind is traced and compiled, and every layer calls it.

Guard evaluation: every call of a function torch.compile wraps first looks up its graph by evaluating
guards, for an 8-layer model about 2,400 checks on modules, parameters and cache tensors, and even under
`skip_guard_eval_unsafe` (only the guards that tell graphs apart) the lookup cost ~0.6 ms of a 10 ms
SmolLM2 step (torch.profiler's "TorchDynamo Cache Lookup", BENCHMARKS.md "The compiled step without
dynamo's lookup"). Nothing those guards watch changes between steps: the runner's modules, parameters
and state tensors are fixed once it is built (the rule: never rebind a tensor a compiled step reads,
copy into it, as DeviceSlots.copy_from does), kv_len is unbacked (no guard reads it), and the graph is
picked by (rows, sampling, k) here. So the first call of a (rows, sampling, k) key (at warm-up) compiles it
as usual, with every guard, and later calls run the bytecode dynamo made for it (its cache entry's code:
the same function that calls the compiled graph) directly, with no lookup. (torch's aot_compile does
this too, but compiles anew each time: it missed inductor's warm cache, 166 s against 24 s for a test's
warm-up.) Where the entry cannot be told apart, calls go through dynamo under
`set_stance(skip_guard_eval_unsafe=True)`.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from redline.runner.compiling import STANCE, own_copy, remember_isa_probes, room_for

Step = Callable[[int, int, bool, int], torch.Tensor]
Run = Callable[[int, torch.Tensor, bool, int], torch.Tensor]


def _through_kv_index(step: Step) -> Run:
    def run(rows: int, kv_index: torch.Tensor, any_sampling: bool, k: int) -> torch.Tensor:
        return step(rows, kv_index.shape[0], any_sampling, k)

    return run


class CompiledStep:
    def __init__(self, step: Step, cache_len: int, device: torch.device, graphs: int):
        """graphs: the (rows, sampling, k) keys the step will run at."""
        self.step, self.graphs = step, graphs
        remember_isa_probes()
        self.kv_index = torch.arange(cache_len + 1, device=device)  # its views carry kv_len into the graph
        # size_asserts off: the wrapper checked every input's and layer call's strides in Python, ~800
        # checks a step for 30 layers; the inputs are the runner's own fixed tensors (as for the guards)
        self.run = own_copy(_through_kv_index(step))
        self.compiled = torch.compile(
            self.run, fullgraph=True, dynamic=False, options={"size_asserts": False}
        )
        self.direct: dict[tuple[int, bool, int], Run] = {}
        self.seen: set[tuple[int, bool, int]] = set()  # keys run with every guard
        self.frozen = False

    def freeze(self) -> None:
        """From now on a call that would compile raises instead (every key was compiled at warm-up)."""
        self.frozen = True

    def _entries(self) -> list[types.CodeType]:
        """The bytecode dynamo made for each graph of `run` so far."""
        return [
            entry.code for entry in torch._dynamo.eval_frame._debug_get_cache_entry_list(self.run.__code__)
        ]

    def __call__(self, rows: int, kv_len: int, any_sampling: bool, k: int) -> torch.Tensor:
        kv_index = self.kv_index[:kv_len]
        key = (rows, any_sampling, k)
        direct = self.direct.get(key)
        if direct is not None:
            return direct(rows, kv_index, any_sampling, k)
        torch._dynamo.decorators.mark_unbacked(kv_index, 0)  # one graph for every kv_len
        if key not in self.seen:
            if self.frozen:
                raise RuntimeError(f"decode step shape {key} (rows, sampling, k) was not compiled at warm-up")
            before = self._entries()
            with room_for(self.graphs):
                out = self.compiled(rows, kv_index, any_sampling, k)
            self.seen.add(key)
            new = [code for code in self._entries() if all(code is not old for old in before)]
            if len(new) == 1:  # this key's graph: its bytecode, in run's globals (the compiled graph's home)
                run = self.run
                self.direct[key] = types.FunctionType(
                    new[0], run.__globals__, run.__name__, None, run.__closure__
                )
            return out
        stance = "fail_on_recompile" if self.frozen else "default"
        with STANCE, torch.compiler.set_stance(stance, skip_guard_eval_unsafe=True):
            return self.compiled(rows, kv_index, any_sampling, k)
