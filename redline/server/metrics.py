"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from redline.engine.blocks import PrefixStats
from redline.engine.request import Completion

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_BUCKETS = (5, 10, 25, 50, 100, 200, 400, 800, 1600)
ACCEPTANCE_BUCKETS = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 9)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        at = {"namespace": "redline", "registry": r}  # every name starts with redline_
        histogram = lambda name, doc, buckets: Histogram(name, doc, buckets=buckets, **at)
        counter = lambda name, doc, *labels: Counter(name, doc, labels, **at)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Mean gap between tokens", LATENCY_BUCKETS)
        self.tps = histogram("tokens_per_second_per_user", "Decode tokens/s of a request", RATE_BUCKETS)
        self.acceptance = histogram("acceptance_length", "Tokens per step", ACCEPTANCE_BUCKETS)
        self.queue_depth = Gauge("queue_depth", "Requests waiting for a slot", **at)
        self.slots_in_use = Gauge("slots_in_use", "Slots holding a request", **at)
        self.requests = counter("requests", "Finished requests by outcome", "outcome")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generated_tokens = counter("generated_tokens", "Tokens generated")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prefix_evictions = counter("prefix_cache_evictions", "Cached KV blocks evicted for room")
        self.http = counter("http_requests", "HTTP answers by endpoint (a route, or other) and status",
                            "endpoint", "status")  # fmt: skip
        self.rejections = counter(
            "rejections",
            "Requests refused, by reason (queue_full, too_long, "
            "bad_field, bad_json, not_json, host, origin, read_timeout, ...)",
            "reason",
        )
        self._prefix_seen = PrefixStats()

    def count_prefix_cache(self, stats: PrefixStats) -> None:
        """Brings the prefix-cache counters up to the pool's running totals."""
        seen = self._prefix_seen
        self.prefix_queries.inc(stats.queries - seen.queries)
        self.prefix_hits.inc(stats.hits - seen.hits)
        self.prefix_evictions.inc(stats.evictions - seen.evictions)
        self._prefix_seen = dataclasses.replace(stats)

    def observe(self, c: Completion) -> None:
        self.requests.labels(c.finish_reason).inc()
        self.prompt_tokens.inc(c.prompt_tokens)
        self.generated_tokens.inc(c.completion_tokens)
        if c.completion_tokens:
            self.ttft.observe(c.ttft_s)
        if c.completion_tokens > 1:
            self.itl.observe((c.latency_s - c.ttft_s) / (c.completion_tokens - 1))
            self.tps.observe(c.tokens_per_s)
        if c.acceptance_length is not None:
            self.acceptance.observe(c.acceptance_length)
