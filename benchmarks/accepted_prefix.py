"""Microseconds per call of speculative/verify.accepted_prefix, eager and compiled alone, against the argmin
it replaced (418a6d0), at the chain's [1, 3] and [16, 8]: `python benchmarks/accepted_prefix.py`."""

from __future__ import annotations

import time

import torch

from redline.speculative.verify import accepted_prefix


def argmin_prefix(accepted: torch.Tensor) -> torch.Tensor:  # [B, K] bool -> [B]: 418a6d0's accepted_prefix
    ended = torch.cat((accepted, torch.zeros_like(accepted[:, :1])), dim=1)
    return ended.to(torch.uint8).argmin(dim=1)


def microseconds(fn, accepted: torch.Tensor, calls: int = 2000) -> float:
    """The fastest of 5 rounds of `calls` calls, per call."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn(accepted)
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return min(rounds)


def main() -> None:
    for rows, k in [(1, 3), (16, 8)]:
        accepted = torch.rand(rows, k) < 0.7
        for name, fn in [("argmin (418a6d0)", argmin_prefix), ("min over positions", accepted_prefix)]:
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True)
            compiled(accepted)
            eager_us, compiled_us = microseconds(fn, accepted), microseconds(compiled, accepted)
            print(f"[{rows}, {k}] {name:20s} eager {eager_us:6.1f} us  compiled {compiled_us:6.1f} us")


if __name__ == "__main__":
    main()
