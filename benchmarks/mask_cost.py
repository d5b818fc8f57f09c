"""What the argmax path's token masks and bias rows cost a step that has none (issue 28): the target's
argmax over SmolLM2's 49,152 logits, compiled, with and without speculative/emit.py's argmax_shaping (the
rows' bitmasks all-allowed, the bias rows zero), at batch 1 and 8, one row per slot (plain decoding) and
four (EAGLE-3 K = 3). The rest of a step is the same either way; compare the added time with a step's
(benchmarks/hot_path.py: 9-11 ms at batch 1 and 8 on 2 cores).

    .venv/bin/python benchmarks/mask_cost.py [--vocab 49152] [--calls 200] [--rounds 5]

Another revision's redline: PYTHONPATH=<its worktree> (the script is run from this tree).
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

from redline.benchmark.machine import describe
from redline.sampling import SamplingTensors
from redline.speculative.emit import argmax_shaping


def best_ms(fn, logits: torch.Tensor, calls: int, rounds: int) -> float:
    for _ in range(20):
        fn(logits)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(logits)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(describe())
    print("| batch | rows per slot | argmax ms | masked + biased argmax ms | added ms |")
    print("|---:|---:|---:|---:|---:|")
    for batch, rows in ((1, 1), (8, 1), (1, 4), (8, 4)):
        sampling = SamplingTensors.zeros(batch, torch.device("cpu"), rows, args.vocab)
        logits = torch.randn(batch, rows, args.vocab)
        old = len(inspect.signature(argmax_shaping).parameters) > 1  # before 026551f it took rows
        shape = argmax_shaping(sampling, rows) if old else argmax_shaping(sampling)
        plain = best_ms(torch.compile(lambda x: x.argmax(-1)), logits, args.calls, args.rounds)
        shaped = best_ms(
            torch.compile(lambda x, s=shape: s(x, 0).argmax(-1)), logits, args.calls, args.rounds
        )
        print(f"| {batch} | {rows} | {plain:.3f} | {shaped:.3f} | {shaped - plain:.3f} |")


if __name__ == "__main__":
    main()
