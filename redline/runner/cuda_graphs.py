"""CUDA graphs of the decode step, one per (batch bucket, kv bucket, sampling, k) key.

The step reads and writes only persistent tensors (weights, KV caches, decode state, sampling
parameters) and draws its random numbers from a hash, so a captured graph replays it exactly. The
keys are known up front (ModelRunner.built_step_keys) and captured at start-up (runner/warm_up.py);
after `freeze()` a key without a graph raises instead of capturing while requests are in flight.
The warm-up runs before a capture advance the decode state; it is saved and restored around them
(KV entries they write lie at positions the real step rewrites before reading).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from redline.speculative.step import DecodeState

Key = tuple[int, int, bool, int]


class GraphedStep:
    def __init__(
        self, step: Callable[[int, int, bool, int], torch.Tensor], state: DecodeState, warmup: int = 2
    ):
        self.step, self.state, self.warmup = step, state, warmup
        self.graphs: dict[Key, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.frozen = False

    def freeze(self) -> None:
        self.frozen = True

    def __call__(self, rows: int, kv_len: int, any_sampling: bool, k: int) -> torch.Tensor:
        key = (rows, kv_len, any_sampling, k)
        if key not in self.graphs:
            if self.frozen:
                raise RuntimeError(
                    f"decode step {key} (rows, kv_len, sampling, k) was not captured at warm-up"
                )
            self.graphs[key] = self._capture(key)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, key: Key) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        saved = self._snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.step(*key)
        torch.cuda.current_stream().wait_stream(side)
        self._restore(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.step(*key)  # recorded, not run
        return graph, out

    def _snapshot(self) -> dict[str, torch.Tensor]:
        s = self.state
        tensors = {"pending": s.pending, "pos": s.pos, "active": s.active, "counts": s.counts}
        if s.draft_probs is not None:
            tensors["draft_probs"] = s.draft_probs
        if s.history is not None:
            tensors["history"] = s.history
        if s.parents is not None:
            tensors["parents"] = s.parents
        return {name: t.clone() for name, t in tensors.items()}

    def _restore(self, saved: dict[str, torch.Tensor]) -> None:
        for name, t in saved.items():
            getattr(self.state, name).copy_(t)
