"""`redline bench --url URL --dataset sharegpt`: replays held-out ShareGPT conversations against a
running OpenAI-compatible server, as vLLM's `bench serve` does with the same file.

Each request is a streamed, greedy chat with the conversation's real first user turn and, as max_tokens,
the length of its real first answer (capped at max_output_tokens). Token counts come from the served
model's tokenizer on this side (`--tokenizer DIR`): max_tokens must be known before the request is sent,
and OpenAI-compatible servers have no tokenize endpoint. One request is sent first as a warm-up (not
counted; the run stops if it fails). The server's acceptance length and prefix-cache hit rate are read
from its Prometheus /metrics before and after the run (redline's `redline_acceptance_length` histogram:
the mean over the run's requests; `redline_prefix_cache_hits_total` / `_queries_total`: prompt tokens
found in the cache over those looked up); None for a server without them.
"""

from __future__ import annotations

import math
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from redline.benchmark.load import Pace, model_card, replay
from redline.benchmark.prompts import sharegpt_requests
from redline.benchmark.serve_report import summarize
from redline.tokenizer import Tokenizer

ACCEPTANCE = "redline_acceptance_length"
PREFIX_HITS, PREFIX_QUERIES = "redline_prefix_cache_hits_total", "redline_prefix_cache_queries_total"


@dataclass(frozen=True)
class ServeSettings:
    tokenizer: Path  # a directory with the served model's tokenizer.json (+ chat template)
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    max_output_tokens: int = 256
    ignore_eos: bool = False
    seed: int = 0


class ServerDidNotStart(RuntimeError):
    """`redline serve` exited, or did not answer /health in time, while starting."""


def wait_until_healthy(url: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    """Polls url/health every 0.5 s until it answers 200 (a server compiles before it listens);
    ServerDidNotStart if `process` exits first or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerDidNotStart(f"redline serve exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerDidNotStart(f"redline serve did not answer /health in {timeout_s:.0f} s")


def scrape_metrics(url: str) -> dict[str, float]:
    """Samples of GET /metrics ("name{labels}" -> value); empty when the server has no such page."""
    try:
        response = httpx.get(url + "/metrics", timeout=30).raise_for_status()
    except httpx.HTTPError:  # unreachable, or no such page
        return {}
    samples = {}
    for line in response.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            samples[name] = float(value)
    return samples


def growth_ratio(before: dict[str, float], after: dict[str, float], part: str, whole: str) -> float | None:
    """How much sample `part` grew between the two scrapes over how much `whole` did; None if `whole` did
    not grow (or the server has no such samples)."""
    grown = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in (part, whole)}
    return grown[part] / grown[whole] if grown[whole] > 0 else None


def run_serve_bench(url: str, s: ServeSettings, api_key: str | None = None) -> dict:
    if s.num_prompts < 1 or s.max_output_tokens < 1:
        raise ValueError("--num-prompts and --max-output-tokens must be at least 1")
    url = url.rstrip("/")
    card = model_card(url, api_key)
    tokenizer = Tokenizer.from_dir(s.tokenizer)
    requests = sharegpt_requests(tokenizer, s.num_prompts, s.max_output_tokens, card.get("max_model_len"),
                                 s.ignore_eos)  # fmt: skip
    pace = Pace(s.request_rate, s.max_concurrency, s.seed)
    warm_up = replay(url, card["id"], requests[:1], Pace(), api_key).results[0]
    if not warm_up.ok:
        raise ConnectionError(f"the warm-up request to {url} failed: {warm_up.error}")
    before = scrape_metrics(url)
    run = replay(url, card["id"], requests, pace, api_key)
    after = scrape_metrics(url)
    return {
        "url": url,
        "model": card["id"],
        "dataset": "sharegpt",
        "settings": {**asdict(s), "tokenizer": str(s.tokenizer)},
        **summarize(run),
        "acceptance_length": growth_ratio(before, after, f"{ACCEPTANCE}_sum", f"{ACCEPTANCE}_count"),
        "prefix_cache_hit_rate": growth_ratio(before, after, PREFIX_HITS, PREFIX_QUERIES),
    }
