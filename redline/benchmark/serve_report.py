"""The serving benchmark's numbers, named and printed as vLLM's `bench serve` does.

Over completed requests: TTFT (sent to first text), TPOT (time per output token after the first, per
request), ITL (every gap between text chunks, pooled over requests; with speculation a chunk may carry
several tokens) and E2E latency (sent to end of stream), each as mean, median and p99 in ms (p99 with
linear interpolation, numpy's default). Throughputs divide by the duration: first request sent to last
request finished. Input tokens are the server's prompt_tokens (its chat template included).
"""

from __future__ import annotations

import math
import statistics

from redline.benchmark.load import Run

TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def summarize(run: Run) -> dict:
    done = [r for r in run.results if r.ok]
    samples = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itls_s],
        "e2el": [r.done - r.sent for r in done],
    }
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    out = {
        "completed": len(done),
        "failed": len(run.results) - len(done),
        "errors": [r.error for r in run.results if not r.ok],
        "duration": run.duration_s,
        "max_concurrency": run.peak_concurrency,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / run.duration_s,
        "output_throughput": output_tokens / run.duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / run.duration_s,
    }
    for name, values in samples.items():
        ms = [1000 * v for v in values] or [math.nan]
        out |= {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
                f"p99_{name}_ms": percentile(ms, 99)}  # fmt: skip
    return out


def serve_table(result: dict) -> str:
    def row(label: str, value: float | int | str) -> str:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40}{text:>12}"

    lines = [
        " Serving Benchmark Result ".center(52, "="),
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
        row("Maximum request concurrency:", result["max_concurrency"]),
        row("Request rate (req/s):", result["settings"]["request_rate"]),
        row("Benchmark duration (s):", result["duration"]),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"]),
        row("Output token throughput (tok/s):", result["output_throughput"]),
        row("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for key, title in TITLES.items():
        lines.append(f" {title} ".center(52, "-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(row(f"{label} {key.upper()} (ms):", result[f"{stat}_{key}_ms"]))
    accept = result["acceptance_length"]
    lines.append("=" * 52)
    lines.append(row("Acceptance length (server, mean):", "-" if accept is None else accept))
    hits = result.get("prefix_cache_hit_rate")
    lines.append(row("Prefix cache hit rate (server):", "-" if hits is None else f"{hits:.1%}"))
    lines += [f"failed: {e}" for e in result["errors"][:3]]
    return "\n".join(lines)
