"""Prometheus metrics of the HTTP front end, in the `reprise_` family.

Two sources: what the HTTP layer measures itself (requests by finish reason,
token counters, latency histograms, seen from the HTTP side), and what the
daemon's stats reply says at scrape time (queue gauges, KV blocks, prefix-cache
lookups), read through the same ZeroMQ client as every request by a custom
collector, so a scrape shows the daemon's state at that moment. The names are
listed in the README.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("reprise.http")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)  # fmt: skip


class DaemonCollector(Collector):
    """Gauges and counters read from the daemon's stats reply on each scrape."""

    def __init__(self, read_stats: Callable[[], dict[str, Any]]) -> None:
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.read_stats()
        except Exception as e:  # a scrape while the daemon loads or stops: HTTP metrics only
            log.debug("metrics: no stats from the daemon: %s", e)
            return
        running = GaugeMetricFamily("reprise_num_requests_running",
                                    "Requests in the engine's running batch")  # fmt: skip
        running.add_metric([], stats.get("num_running", 0))
        yield running
        waiting = GaugeMetricFamily("reprise_num_requests_waiting",
                                    "Requests queued for admission (or being tokenized)")  # fmt: skip
        num_waiting = stats.get("num_requests", 0) - stats.get("num_running", 0)
        waiting.add_metric([], max(num_waiting, 0))
        yield waiting
        used = GaugeMetricFamily("reprise_kv_blocks_used", "KV blocks held by requests",
                                 labels=["tier"])  # fmt: skip
        used.add_metric(["device"], stats.get("used_blocks", 0))
        used.add_metric(["host"], stats.get("host_cached_blocks", 0))
        used.add_metric(["disk"], stats.get("disk_blocks", 0))
        yield used
        total = GaugeMetricFamily("reprise_kv_blocks", "KV blocks in the pool", labels=["tier"])
        total.add_metric(["device"], stats.get("max_blocks", 0))
        total.add_metric(["host"], stats.get("host_max_blocks", 0))
        yield total
        block = stats.get("tokens_per_block", 0)
        reused, missed = stats.get("reused_blocks", 0), stats.get("missed_blocks", 0)
        host_hits, disk_hits = stats.get("host_hits", 0), stats.get("disk_hits", 0)
        queries = CounterMetricFamily("reprise_prefix_cache_queries_tokens",
                                      "Prompt tokens looked up in the prefix cache (full blocks)")  # fmt: skip
        queries.add_metric([], (reused + missed) * block)
        yield queries
        hits = CounterMetricFamily("reprise_prefix_cache_hits_tokens",
                                   "Prompt tokens served from the prefix cache, by tier",
                                   labels=["tier"])  # fmt: skip
        hits.add_metric(["device"], (reused - host_hits - disk_hits) * block)
        hits.add_metric(["host"], host_hits * block)
        hits.add_metric(["disk"], disk_hits * block)
        yield hits
        for name, help_text, key in _STAT_COUNTERS:
            counter = CounterMetricFamily(name, help_text)
            counter.add_metric([], stats.get(key, 0))
            yield counter


# counters read from one stats key each: (metric name, help, stats key)
_STAT_COUNTERS = [
    ("reprise_prefill_tokens_computed", "Prompt tokens the engine computed",
     "prefill_tokens_computed"),
    ("reprise_exact_repeats", "Requests whose first token came from a stored logits row, "
     "with no forward step", "exact_repeats"),
    ("reprise_spec_decode_num_draft_tokens", "Draft tokens decode steps checked "
     "(prompt lookup, a grammar's forced tokens)", "spec_draft_tokens"),
    ("reprise_spec_decode_num_accepted_tokens", "Draft tokens equal to the token sampled "
     "in their place, so kept", "spec_accepted_tokens"),
    ("reprise_preemptions", "Requests preempted", "preemptions"),
    ("reprise_disk_tier_corrupt_files", "Damaged, truncated or foreign disk-tier block files "
     "found and removed (never served)", "disk_corrupt_removed"),
]  # fmt: skip


class Metrics:
    """The HTTP layer's registry: its own measurements plus the daemon's collector."""

    def __init__(self, read_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("reprise_requests", "Finished requests (each choice counts), "
                                "by finish reason", ["finish_reason"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("reprise_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)  # fmt: skip
        self.generation_tokens = Counter("reprise_generation_tokens", "Generated tokens",
                                         registry=r)  # fmt: skip
        self.ttft = Histogram("reprise_time_to_first_token_seconds", "Time from the HTTP "
                              "request to its first token", buckets=_LATENCY_BUCKETS,
                              registry=r)  # fmt: skip
        self.itl = Histogram("reprise_inter_token_latency_seconds", "Time between two tokens "
                             "of a streamed choice", buckets=_ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("reprise_e2e_request_latency_seconds", "Time from the HTTP "
                             "request to its last token", buckets=_LATENCY_BUCKETS,
                             registry=r)  # fmt: skip
        self.queue = Histogram("reprise_request_queue_seconds", "Time from the daemon's "
                               "receipt of a request to the start of the engine step that gave "
                               "its first token", buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.errors = Counter("reprise_http_errors", "Error replies, by HTTP status",
                              ["status"], registry=r)  # fmt: skip
        r.register(DaemonCollector(read_stats))
