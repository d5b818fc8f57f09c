"""Acceptance length of a draft on prompts cut from the held-out standard-library files, greedy.

    .venv/bin/python benchmarks/acceptance.py [--target DIR --draft DIR] [--k 3] [--seeds 1,7,11]

Defaults to the demo pair in the cache (`redline demo` trains it). Each seed draws a different set
of prompts (`--prompt-len` tokens each); every prompt is completed for `--max-tokens` tokens.
"""

from __future__ import annotations

import argparse
import statistics

from redline.demo import cache_root
from redline.train.draft import acceptance_length, held_out_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=cache_root() / "target")
    parser.add_argument("--draft", default=cache_root() / "draft")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seeds", default="1,7,11")
    args = parser.parse_args()
    results = []
    for seed in map(int, args.seeds.split(",")):
        prompts = held_out_prompts(args.target, args.prompts, args.prompt_len, seed=seed)
        results.append(acceptance_length(args.target, args.draft, prompts, args.max_tokens, args.k))
        print(f"seed {seed}: acceptance length {results[-1]:.2f} (K={args.k}, {args.prompts} prompts)")
    print(f"mean {statistics.mean(results):.2f}")


if __name__ == "__main__":
    main()
