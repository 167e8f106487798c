"""The server's Prometheus metrics (``GET /metrics``), all named ``autodeploy_*``.

Each app has its own registry, so several servers (tests) in one process don't collide. Counters and
histograms are updated by the engine thread; the gauges read the scheduler when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds; CPU serving spans sub-millisecond decode steps to multi-second prefills under load
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.running = Gauge("autodeploy_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("autodeploy_requests_waiting", "Requests waiting to be admitted.", registry=r)
        self.pages_used = Gauge("autodeploy_kv_cache_pages_used", "KV-cache pages held by requests.", registry=r)
        self.pages_total = Gauge("autodeploy_kv_cache_pages_total", "KV-cache pages allocated.", registry=r)
        self.prompt_tokens = Counter("autodeploy_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("autodeploy_generation_tokens", "Tokens generated.", registry=r)
        self.prefix_hit_tokens = Gauge("autodeploy_prefix_cache_hit_tokens",
                                       "Prompt tokens served from the prefix cache since the start.", registry=r)
        self.finished = Counter("autodeploy_requests_finished", "Requests finished, by reason.", ["reason"],
                                registry=r)
        self.ttft = Histogram("autodeploy_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("autodeploy_inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def bind(self, loop) -> None:
        """Read the gauges from ``loop`` (an :class:`~autodeploy.serve.engine_loop.EngineLoop`) when scraped."""
        scheduler = loop.engine.scheduler
        self.running.set_function(lambda: loop.num_running)
        self.waiting.set_function(lambda: loop.num_waiting)
        self.pages_used.set_function(lambda: scheduler.num_pages_in_use)
        self.pages_total.set_function(lambda: scheduler.info.num_pages)
        self.prefix_hit_tokens.set_function(lambda: getattr(scheduler.pool, "hit_tokens", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
