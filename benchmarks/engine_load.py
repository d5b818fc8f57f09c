"""The scheduler under load, in-process (no HTTP): held-out ShareGPT chats on SmolLM2-135M-Instruct with
its EAGLE-3 draft (K = 1, fp32, eager), C requests in flight (a new one joins as one finishes), and where
the time goes: prefill forwards (rows, tokens computed, tokens with padding) and decode steps.

    .venv/bin/python benchmarks/engine_load.py [--concurrency 64] [--requests 96] [--max-prefill-tokens 2048]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from redline import LLM, SamplingParams
from redline.benchmark.machine import describe
from redline.benchmark.prompts import sharegpt_requests
from redline.models.gguf import smollm2_gguf
from redline.runner.model_runner import ModelRunner
from redline.runner.plan import PrefillBatch


def timed(runner: ModelRunner, counts: dict) -> None:
    """Wraps the runner's prefill forward and decode step to add up their time and work (on CPU both run
    synchronously: the time is the work's)."""
    prefill_run, run_step = runner.prefill.run, runner.run_step

    def prefill(batch: PrefillBatch):
        start = time.perf_counter()
        out = prefill_run(batch)
        counts["prefill_batch_s"] += time.perf_counter() - start
        counts["prefill_batch_calls"] += 1
        lengths = [len(c.tokens) for c in batch.chunks]
        counts["prefill_rows"] += len(lengths)
        counts["prefill_tokens"] += sum(lengths)
        counts["prefill_padded"] += len(lengths) * runner.shapes.prefill_len(max(lengths))
        return out

    def step(*args):
        start = time.perf_counter()
        out = run_step(*args)
        counts["decode_s"] += time.perf_counter() - start
        counts["decode_calls"] += 1
        return out

    runner.prefill.run, runner.run_step = prefill, step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", type=Path, default=Path.home() / ".cache/redline/demo-v2/draft")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-prefill-tokens", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(smollm2_gguf(), dtype="float32", max_batch=256, max_seq_len=2048, compile=False, progress=False,
              draft=args.draft, num_draft_tokens=1, max_prefill_tokens=args.max_prefill_tokens,
              kv_cache_memory=2**30)  # fmt: skip
    counts: dict = collections.defaultdict(float)
    timed(llm.runner, counts)
    waiting = [
        llm.make_request(llm.tokenizer.encode_chat(list(r.prompt)), SamplingParams(max_tokens=r.max_tokens))
        for r in sharegpt_requests(llm.tokenizer, args.requests, 128, 2048, False)
    ]
    started, engine = [], llm.engine
    begin = time.perf_counter()
    while waiting or engine.has_work:
        while waiting and sum(not r.finished for r in started) < args.concurrency:
            started.append(waiting.pop(0))
            engine.add(started[-1])
        engine.step()
    seconds = time.perf_counter() - begin
    result = {
        "machine": describe(),
        "concurrency": args.concurrency,
        "requests": args.requests,
        "max_prefill_tokens": args.max_prefill_tokens,
        "seconds": seconds,
        "output_tokens_per_s": sum(len(r.output_ids) for r in started) / seconds,
        "preemptions": sum(r.preemptions for r in started),
        **counts,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
