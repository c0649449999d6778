"""Prometheus metrics of one app, in its own CollectorRegistry (never the global one, so
several apps in one process keep separate counts).

Two sources:
- the requests, counted by the server as they end: requests by adapter and finish reason,
  prompt and generated tokens, time to first token, time between tokens, end-to-end time;
- the engine's state, read on the engine thread at each scrape (`refresh`): running and
  waiting requests, pool pages by use, adapters on the GPU and in the host tier, adapter
  loads and evictions, host-tier hits and misses, preemptions, and every adapter's residency
  (`slora_adapter_residency{adapter}`: 2 on the GPU, 1 in the host tier, 0 on disk only), the
  gauge a router reads to send a request where its adapter already is.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)

# engine stats key -> (metric name, help); counters get "_total" appended by the exposition
ENGINE_COUNTERS = {
    "adapter_loads": ("slora_adapter_loads", "adapter copies into the pool"),
    "adapter_evictions": ("slora_adapter_evictions", "adapters evicted from the pool"),
    "host_evictions": ("slora_host_tier_evictions", "adapters dropped from the host tier"),
    "preemptions": ("slora_preemptions", "requests preempted (pages freed, recomputed later)"),
    "prefix_query_tokens": ("slora_prefix_cache_queries", "prompt tokens looked up in the "
                            "prefix cache at admission"),
    "prefix_hit_tokens": ("slora_prefix_cache_hits", "prompt tokens found in the prefix cache "
                          "(not computed)"),
}


def engine_snapshot(engine) -> dict:
    """What a scrape reports of an Engine; runs on the engine thread (AsyncEngine.call)."""
    adapters = engine.adapters
    residency = {name: 2 if info.resident else 1 if adapters.on_host(name) else 0
                 for name, info in adapters.adapters.items()}
    return {"stats": engine.stats(), "residency": residency,
            "on_host": sum(1 for name in adapters.adapters if adapters.on_host(name))}


class _EngineCollector:
    """Yields the engine's state as of the last `refresh`."""

    def __init__(self) -> None:
        self.snapshot: dict | None = None

    def describe(self):
        return []

    def collect(self):
        if self.snapshot is None:
            return
        s, residency = self.snapshot["stats"], self.snapshot["residency"]
        yield GaugeMetricFamily("slora_num_requests_running", "requests in the running batch",
                                value=s["num_running"])
        yield GaugeMetricFamily("slora_num_requests_waiting", "requests queued in the engine",
                                value=s["num_waiting"])
        pages = GaugeMetricFamily("slora_pool_pages", "pool pages by use", labels=["use"])
        for use in ("free", "kv", "adapter", "cached", "total"):
            pages.add_metric([use], s[f"pages_{use}"])
        yield pages
        yield GaugeMetricFamily("slora_adapters_registered", "adapters registered",
                                value=len(residency))
        yield GaugeMetricFamily("slora_adapters_gpu", "adapters resident in the GPU pool",
                                value=s["adapters_resident"])
        yield GaugeMetricFamily("slora_adapters_host", "adapters cached in the host tier",
                                value=self.snapshot["on_host"])
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=s[key])
        yield GaugeMetricFamily("slora_prefix_cache_hit_rate", "prefix cache hits over queries, "
                                "in tokens, since start", value=s["prefix_hit_rate"])
        yield GaugeMetricFamily("slora_prefix_cache_pages", "pages in the prefix cache, held by "
                                "requests or not", value=s["prefix_cached_pages"])
        # a pool load finds its adapter in the host tier (a hit) or reads its files (a miss,
        # which then enters the host tier: host_loads)
        yield CounterMetricFamily("slora_host_tier_misses", "pool loads that read the adapter "
                                  "from disk", value=s["host_loads"])
        yield CounterMetricFamily("slora_host_tier_hits", "pool loads served from the host tier",
                                  value=max(0, s["adapter_loads"] - s["host_loads"]))
        res = GaugeMetricFamily("slora_adapter_residency", "per adapter: 2 in the GPU pool, "
                                "1 in the host tier, 0 on disk only", labels=["adapter"])
        for name, level in sorted(residency.items()):
            res.add_metric([name], level)
        yield res


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("slora_requests", "engine requests ended, by adapter and finish "
                                "reason", ["adapter", "finish_reason"], registry=r)
        self.rejected = Counter("slora_http_errors", "error answers, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("slora_prompt_tokens", "prompt tokens of ended requests",
                                     registry=r)
        self.generation_tokens = Counter("slora_generation_tokens", "tokens generated",
                                         registry=r)
        self.ttft = Histogram("slora_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("slora_inter_token_latency_seconds", "time between tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("slora_e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def render(self, snapshot: dict) -> bytes:
        """The exposition text, with the engine's state `snapshot` (engine_snapshot)."""
        self._engine.snapshot = snapshot
        return generate_latest(self.registry)
