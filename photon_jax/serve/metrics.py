"""`photon-serve`'s Prometheus metrics, in a registry per app (several servers in one
process do not collide).

Owns: the request counters and latency histograms the routes update, the token counts and
time-to-first-token / per-token histograms filled from each finished handle's metrics, and
the engine gauges (queue depth, running rows, KV pages, prefix cache) read at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _EngineCollector:
    """Engine gauges read at scrape time (queue depth, running rows, KV pages, prefix-cache
    counters), so they are never stale and cost nothing between scrapes."""

    def __init__(self, server):
        self.server = server   # serve.Server: its model (None while loading), in_flight

    def collect(self):
        md = self.server.md
        if md is None:
            return
        eng = md.engine
        sched = eng.sched
        yield GaugeMetricFamily("photon_requests_in_flight", "HTTP requests submitted and "
                                "not finished", value=self.server.in_flight)
        yield GaugeMetricFamily("photon_queue_depth", "Requests waiting for a row",
                                value=len(sched.waiting) + eng._inbox.qsize())
        yield GaugeMetricFamily("photon_running_rows", "Rows decoding now",
                                value=len(sched.running))
        yield GaugeMetricFamily("photon_max_batch_size", "Rows the engine decodes together",
                                value=eng.max_batch_size)
        a = sched.alloc
        yield GaugeMetricFamily("photon_kv_pages_in_use", "KV pool pages in use (sequences "
                                "and the prefix cache)", value=a.usable - a.n_free)
        yield GaugeMetricFamily("photon_kv_pages", "KV pool pages (usable)", value=a.usable)
        c = sched.cache
        yield GaugeMetricFamily("photon_prefix_cache_entries", "Cached image prefixes",
                                value=len(c.entries))
        for name, v in (("hits", c.hits), ("misses", c.misses), ("evictions", c.evictions)):
            yield CounterMetricFamily(f"photon_prefix_cache_{name}",
                                      f"Image-prefix cache {name}", value=v)
        yield CounterMetricFamily("photon_engine_tokens", "Tokens committed by the engine",
                                  value=eng.counters.get("tokens", 0))


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (several apps in one
    process do not collide)."""

    def __init__(self, server):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("photon_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("photon_prompt_tokens", "Prompt tokens (image prefix "
                                     "included) of finished requests", registry=r)
        self.output_tokens = Counter("photon_output_tokens", "Generated tokens of finished "
                                     "requests", registry=r)
        self.ttft = Histogram("photon_time_to_first_token_seconds", "Submit to first token",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60),
                              registry=r)
        self.tpot = Histogram("photon_time_per_output_token_seconds", "Decode time per token "
                              "after the first", buckets=(.001, .0025, .005, .01, .02, .04,
                                                          .08, .16, .32, 1),
                              registry=r)
        self.latency = Histogram("photon_request_duration_seconds", "Request time, end to end",
                                 ["route"], registry=r,
                                 buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        r.register(_EngineCollector(server))

    def finished(self, handle) -> None:
        """Token counts and latencies of a finished request."""
        try:
            m = handle.metrics()
        except RuntimeError:
            return
        self.prompt_tokens.inc(m["input_tokens"] or 0)
        self.output_tokens.inc(m["output_tokens"] or 0)
        if m["time_to_first_token_s"] is not None:
            self.ttft.observe(m["time_to_first_token_s"])
        if m["decode_tokens_per_s"]:
            self.tpot.observe(1.0 / m["decode_tokens_per_s"])
