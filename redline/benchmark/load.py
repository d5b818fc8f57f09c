"""Streaming clients against a running OpenAI-compatible server (redline's or any other).

`send` streams one greedy request (a chat to /v1/chat/completions, a text prompt to /v1/completions)
and records when each chunk with text arrived and the token counts of the final usage chunk (without
one, the number of text chunks). Any failure (an HTTP error status, an error event, a broken
connection, a stream without text) marks that request failed with its error; the run goes on.

`replay` sends requests as a Poisson process at `request_rate` per second (exponential gaps from a
seeded generator; inf: all at once), with at most `max_concurrency` in flight (None: no limit).

`run_load` is the fixed-length sweep of `redline bench --url --concurrency 1,2,4,8,16`: at each level C,
C x requests_per_client completions of held-out stdlib text (ignore_eos: max_tokens each), at most C
in flight. Per level: medians of time to first token, of each request's mean inter-token gap
(t_last - t_first) / (tokens - 1) and of its inverse (tokens/s per user); total tokens/s; errors.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from redline.benchmark.prompts import Request, stdlib_requests

TIMEOUT_S = 600.0


@dataclass
class Result:
    sent: float  # time.perf_counter() when the request was sent
    prompt_tokens: int
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    done: float = math.nan
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (t_last - t_first) / (tokens - 1)."""
        if self.output_tokens < 2:
            return None
        return (self.chunks[-1] - self.chunks[0]) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive text chunks (a chunk may carry several tokens)."""
        return [b - a for a, b in itertools.pairwise(self.chunks)]


@dataclass(frozen=True)
class Pace:
    request_rate: float = math.inf  # requests per second, Poisson arrivals; inf: all at once
    max_concurrency: int | None = None  # most requests in flight; None: no limit
    seed: int = 0  # of the arrival gaps


@dataclass
class Run:
    results: list[Result]
    duration_s: float  # first request sent to last request finished
    peak_concurrency: int  # most requests in flight at once


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def model_card(url: str, api_key: str | None) -> dict:
    """The first entry of GET /v1/models (its "id"; redline's also has "max_model_len")."""
    try:
        response = httpx.get(url + "/v1/models", headers=_headers(api_key), timeout=30)
        response.raise_for_status()
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot list the models of the server at {url}: {e}") from e
    return response.json()["data"][0]


async def _stream(http: httpx.AsyncClient, url: str, body: dict, chat: bool, result: Result) -> None:
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error'].get('message')}")
            if event.get("usage"):
                result.prompt_tokens = event["usage"]["prompt_tokens"]
                result.output_tokens = event["usage"]["completion_tokens"]
            choice = (event.get("choices") or [{}])[0]
            if choice.get("delta", {}).get("content") if chat else choice.get("text"):
                result.chunks.append(time.perf_counter())
    if not result.chunks:
        raise RuntimeError("the stream ended without text")
    result.output_tokens = result.output_tokens or len(result.chunks)


async def send(http: httpx.AsyncClient, url: str, model: str, request: Request) -> Result:
    chat = not isinstance(request.prompt, str)
    body = {"model": model, "max_tokens": request.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    body |= {"messages": list(request.prompt)} if chat else {"prompt": request.prompt}
    if request.ignore_eos:
        body["ignore_eos"] = True
    result = Result(time.perf_counter(), request.prompt_tokens)
    try:
        await _stream(http, url + ("/v1/chat/completions" if chat else "/v1/completions"), body, chat, result)
    except Exception as e:  # this request failed; the others go on
        result.error = f"{type(e).__name__}: {e}"
    result.done = time.perf_counter()
    return result


async def _replay(url: str, model: str, requests: list[Request], pace: Pace, api_key: str | None) -> Run:
    gaps = random.Random(pace.seed)
    limit = asyncio.Semaphore(pace.max_concurrency or len(requests))
    in_flight, peak = 0, 0

    async def one(http: httpx.AsyncClient, request: Request) -> Result:
        nonlocal in_flight, peak
        async with limit:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send(http, url, model, request)
            finally:
                in_flight -= 1

    connections = httpx.Limits(max_connections=(pace.max_concurrency or len(requests)) + 4)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, headers=_headers(api_key), limits=connections) as http:
        start, tasks = time.perf_counter(), []
        for i, request in enumerate(requests):
            if i and math.isfinite(pace.request_rate):
                await asyncio.sleep(gaps.expovariate(pace.request_rate))
            tasks.append(asyncio.create_task(one(http, request)))
        results = await asyncio.gather(*tasks)
        return Run(list(results), time.perf_counter() - start, peak)


def replay(url: str, model: str, requests: list[Request], pace: Pace, api_key: str | None = None) -> Run:
    if not requests:
        raise ValueError("no requests to send")
    if not pace.request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {pace.request_rate}")
    if pace.max_concurrency is not None and pace.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {pace.max_concurrency}")
    return asyncio.run(_replay(url, model, requests, pace, api_key))


def run_level(url: str, model: str, concurrency: int, requests_per_client: int, max_tokens: int,
              api_key: str | None) -> dict:  # fmt: skip
    requests = stdlib_requests(concurrency * requests_per_client, max_tokens)
    run = replay(url, model, requests, Pace(max_concurrency=concurrency), api_key)
    ok = [r for r in run.results if r.ok and r.output_tokens > 1]
    errors = [r.error or "fewer than 2 tokens" for r in run.results if not (r.ok and r.output_tokens > 1)]

    def median(values: list[float]) -> float:
        return statistics.median(values) if values else math.nan

    return {"concurrency": concurrency, "requests": len(ok), "errors": len(errors),
            "error_examples": errors[:3], "ttft_s_median": median([r.ttft_s for r in ok]),
            "itl_s_median": median([r.tpot_s for r in ok]),
            "tps_user_median": median([1 / r.tpot_s for r in ok if r.tpot_s]),  # type: ignore[operator]
            "tps_total": sum(r.output_tokens for r in ok) / run.duration_s,
            "wall_s": run.duration_s}  # fmt: skip


def run_load(
    url: str, levels: list[int], requests_per_client: int, max_tokens: int, api_key: str | None = None
) -> dict:
    url = url.rstrip("/")
    model = model_card(url, api_key)["id"]
    run_level(url, model, 1, 1, 8, api_key)  # warm-up
    results = [run_level(url, model, c, requests_per_client, max_tokens, api_key) for c in levels]
    return {"url": url, "model": model, "max_tokens": max_tokens, "levels": results}


def load_table(result: dict) -> str:
    head = f"{'clients':>8}{'requests':>10}{'errors':>8}{'TTFT ms':>10}{'ITL ms':>9}"
    lines = [head + f"{'tok/s/user':>12}{'tok/s total':>13}"]
    for r in result["levels"]:
        lines.append(
            f"{r['concurrency']:>8}{r['requests']:>10}{r['errors']:>8}{1e3 * r['ttft_s_median']:>10.1f}"
            f"{1e3 * r['itl_s_median']:>9.2f}{r['tps_user_median']:>12.1f}{r['tps_total']:>13.1f}"
        )
    return "\n".join(lines)
