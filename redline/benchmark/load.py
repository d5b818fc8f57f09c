"""`redline bench --url URL --concurrency 1,2,4,8,16`: concurrent streaming clients against a running
OpenAI-compatible server (redline's or any other).

At each concurrency C, C clients each send `requests_per_client` streaming completions one after
another (greedy, fixed length via ignore_eos, prompts cut from the held-out files' text). Per request:
time to first token, inter-token latency (t_last - t_first) / (tokens - 1), tokens/s per user
(its inverse); per level: medians of those, total tokens/s (all tokens / wall time) and errors.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx

from redline.train import data


@dataclass
class Sample:
    ttft_s: float
    itl_s: float
    tokens: int


def load_prompts(count: int, chars: int = 400) -> list[str]:
    texts = data.split_stdlib()[1]
    return [texts[i % len(texts)][(i // len(texts)) * chars :][:chars] for i in range(count)]


async def _one(http: httpx.AsyncClient, url: str, body: dict) -> Sample:
    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                times.append(time.perf_counter())
    if not times or tokens < 2:
        raise RuntimeError("stream ended without tokens")
    return Sample(times[0] - start, (times[-1] - times[0]) / (tokens - 1), tokens)


async def run_level(
    url: str, model: str, concurrency: int, requests_per_client: int, max_tokens: int, api_key: str | None
) -> dict:
    prompts = load_prompts(concurrency * requests_per_client)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    samples: list[Sample] = []
    errors: list[str] = []

    async def client(index: int, http: httpx.AsyncClient) -> None:
        for r in range(requests_per_client):
            prompt = prompts[index * requests_per_client + r]
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            }
            body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
            try:
                samples.append(await _one(http, url, body))
            except Exception as e:  # counted, reported, and the run goes on
                errors.append(str(e))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
        wall = time.perf_counter() - start
    ok = samples or [Sample(float("nan"), float("nan"), 0)]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(errors),
        "error_examples": errors[:3],
        "ttft_s_median": statistics.median(s.ttft_s for s in ok),
        "itl_s_median": statistics.median(s.itl_s for s in ok),
        "tps_user_median": statistics.median(1 / s.itl_s for s in ok) if samples else float("nan"),
        "tps_total": sum(s.tokens for s in samples) / wall,
        "wall_s": wall,
    }


def served_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def run_load(
    url: str, levels: list[int], requests_per_client: int, max_tokens: int, api_key: str | None = None
) -> dict:
    url = url.rstrip("/")
    model = served_model(url, api_key)
    asyncio.run(run_level(url, model, 1, 1, 8, api_key))  # warm-up
    results = [
        asyncio.run(run_level(url, model, c, requests_per_client, max_tokens, api_key)) for c in levels
    ]
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
