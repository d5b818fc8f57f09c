"""Adaptive draft length against plain decoding when the draft is never accepted: tokens/s of SmolLM2-135M
bf16 compiled on CPU at batch 1 and 16, plain vs EAGLE-3 K = 3 with adaptive draft length vs K = 3 on
every step (BENCHMARKS.md "Adaptive draft length"; issue 27's target: adaptive >= 0.97x plain).

    .venv/bin/python benchmarks/adaptive_k.py [--draft DIR] [--tokens 128] [--rounds 4] [--batches 1,16]
        [--tree TOPK,NODES]

With --tree the two drafting engines draft trees (topk TOPK, NODES rows, 3 levels) rather than the chain,
and the results go to adaptive_k_tree.json.

The draft is a random EAGLE-3 head (draft vocabulary 8,192), accepted next to never, unless --draft names
one (the demo's, say: then the rows show what adaptation costs or gains with a draft that is accepted).
The three engines are built once, with 16 slots and a 512-token context, and measured in turns within each
round, in reverse order every other round (the VM's bandwidth drifts by tens of percent within minutes:
only ratios inside one round compare, and the reversal offsets a steady drift over pairs of rounds).
A round at batch B generates `tokens` tokens (greedy, ignore_eos) for each of B held-out ShareGPT prompts
at once. Two rates: end to end, B x tokens over the wall time, prefill included (a draft's engine also
prefills the draft over every prompt token), and decoding, the median request's (tokens - 1) / (time
from its first token to its last). Per engine the median over rounds, and the median of the per-round
ratios to plain.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from redline import LLM, SamplingParams
from redline.benchmark.machine import describe
from redline.benchmark.prompts import engine_prompts
from redline.models.gguf import smollm2_dir
from redline.train.random_init import write_random_draft

MAIN = Path(__file__).resolve().parents[1]
SLOTS, CONTEXT, PROMPT_MAX = 16, 512, 320


def prompts_of(llm: LLM, count: int) -> list[list[int]]:
    """The first held-out ShareGPT first turns that leave room for the output (at most PROMPT_MAX tokens)."""
    pool = engine_prompts(llm.tokenizer, "sharegpt", 64)
    fitting = [p for p in pool if len(p) <= PROMPT_MAX]
    if len(fitting) < count:
        raise SystemExit(f"only {len(fitting)} of 64 held-out prompts have at most {PROMPT_MAX} tokens")
    return fitting[:count]


def tokens_per_s(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, float, float | None]:
    """(end-to-end tokens/s of the batch, the median request's decode tokens/s, the share of the steps that
    drafted)."""
    start = time.perf_counter()
    out = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    rate = len(prompts) * tokens / (time.perf_counter() - start)
    steps = sum(c.decode_steps for c in out)
    drafting = sum(c.draft_steps for c in out) / steps if steps and llm.num_draft_tokens else None
    return rate, median(c.tokens_per_s for c in out), drafting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, help="an EAGLE-3 draft (default: a random one, never accepted)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--tree", help="TOPK,NODES: the drafting engines draft trees")
    parser.add_argument("--json", type=Path, help="default: benchmarks/results/adaptive_k(_tree).json")
    args = parser.parse_args()
    results_file = args.json or MAIN / f"benchmarks/results/adaptive_k{'_tree' if args.tree else ''}.json"
    drafting, name = {}, "K=3"
    if args.tree:
        topk, nodes = (int(x) for x in args.tree.split(","))
        drafting, name = (
            dict(speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes),
            f"tree {topk}x{nodes}",
        )
    target = smollm2_dir(torch.bfloat16)
    machine = describe()
    print(json.dumps(machine), flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        draft = args.draft or write_random_draft(target, Path(tmp) / "draft", draft_vocab=8192)
        common = dict(
            dtype="bfloat16", compile=True, max_batch=SLOTS, max_seq_len=CONTEXT, prefix_caching=False
        )
        engines = {
            "plain": LLM(target, **common),
            f"{name} adaptive": LLM(target, draft=draft, num_draft_tokens=3, **drafting, **common),
            f"{name} every step": LLM(
                target, draft=draft, num_draft_tokens=3, adaptive_draft_length=False, **drafting, **common
            ),
        }
        prompts = prompts_of(engines["plain"], max(batches))
        results: dict[str, dict[str, list]] = {}
        for batch in batches:
            rows = {name: {"tps": [], "decode_tps": [], "drafting": []} for name in engines}
            for round_index in range(args.rounds):
                order = list(engines.items())[:: -1 if round_index % 2 else 1]  # ABBA: drift cancels
                for name, llm in order:
                    rate, decode, drafting = tokens_per_s(llm, prompts[:batch], args.tokens)
                    for key, value in (("tps", rate), ("decode_tps", decode), ("drafting", drafting)):
                        rows[name][key].append(value)
                    print(f"batch {batch} {name}: {rate:.1f} tok/s, decode {decode:.1f} per user, drafting "
                          f"steps {drafting}", flush=True)  # fmt: skip
            results[str(batch)] = rows
    print("| batch | engine | tok/s | x plain | decode tok/s per user | x plain | steps that drafted |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for batch, rows in results.items():
        for name, row in rows.items():
            ratio = lambda row, key, plain=rows["plain"]: median(map(float.__truediv__, row[key], plain[key]))
            share = [d for d in row["drafting"] if d is not None]
            shown = f"{median(share):.0%}" if share else "-"
            tps, decode = (f"{median(row[key]):.1f} | {ratio(row, key):.3f}" for key in ("tps", "decode_tps"))
            print(f"| {batch} | {name} | {tps} | {decode} | {shown} |")
    record = {"machine": machine, "tokens": args.tokens, "rounds": args.rounds,
              "draft": str(args.draft or "random"), "tree": args.tree, "date": time.strftime("%Y-%m-%d"),
              "results": results}  # fmt: skip
    results_file.parent.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {results_file}")


if __name__ == "__main__":
    main()
