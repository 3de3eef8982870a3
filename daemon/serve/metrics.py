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
from collections.abc import Callable, Iterator, Sequence
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

    def __init__(
        self, read_stats: Callable[[], dict[str, Any]], vllm: VllmNames | None = None
    ) -> None:
        self.read_stats = read_stats
        self.vllm = vllm  # the copies under vLLM's names, made from the same stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.read_stats()
        except Exception as e:  # a scrape while the daemon loads or stops: HTTP metrics only
            log.debug("metrics: no stats from the daemon: %s", e)
            return
        families = list(self._families(stats))
        yield from families
        if self.vllm is not None:
            yield from self.vllm.renamed(families)

    def _families(self, stats: dict[str, Any]) -> Iterator[Metric]:
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
    ("reprise_async_steps", "Decode steps launched before the tokens of the step before "
     "them were read back (--async-scheduling)", "async_steps"),
    ("reprise_disk_tier_corrupt_files", "Damaged, truncated or foreign disk-tier block files "
     "found and removed (never served)", "disk_corrupt_removed"),
]  # fmt: skip


# Our metrics under vLLM's names (its V1 engine's), for the dashboards and alerts written
# for vLLM: reprise name -> vLLM name (the sample suffixes _total, _bucket, _sum, _count
# follow), each sample labelled model_name as vLLM's are.
VLLM_NAMES = {
    "reprise_num_requests_running": "vllm:num_requests_running",
    "reprise_num_requests_waiting": "vllm:num_requests_waiting",
    "reprise_prompt_tokens": "vllm:prompt_tokens",
    "reprise_generation_tokens": "vllm:generation_tokens",
    "reprise_requests": "vllm:request_success",
    "reprise_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "reprise_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "reprise_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "reprise_request_queue_seconds": "vllm:request_queue_time_seconds",
    "reprise_preemptions": "vllm:num_preemptions",
    "reprise_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "reprise_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "reprise_prefix_cache_queries_tokens": "vllm:prefix_cache_queries",
}
_VLLM_LABELS = {"finish_reason": "finished_reason"}  # vLLM's label names where they differ


class VllmNames:
    """Metrics again under vLLM's names (VLLM_NAMES), with model_name: the daemon's
    families of a scrape and the HTTP layer's own (`http`); and what vLLM computes from
    them: vllm:prefix_cache_hits (every tier's hits: what the cache served) and
    vllm:kv_cache_usage_perc (the device blocks in use, 0 to 1)."""

    def __init__(self, http: Sequence[Collector], model_name: str) -> None:
        self.http = http
        self.model_name = model_name

    def renamed(self, daemon: list[Metric]) -> Iterator[Metric]:
        used = total = 0.0
        hits: Metric | None = None
        for metric in [*daemon, *(m for source in self.http for m in source.collect())]:
            if metric.name == "reprise_kv_blocks_used":
                used = _device(metric)
            elif metric.name == "reprise_kv_blocks":
                total = _device(metric)
            elif metric.name == "reprise_prefix_cache_hits_tokens":
                hits = metric
            if (name := VLLM_NAMES.get(metric.name)) is not None:
                yield self._renamed(metric, name)
        if hits is not None:
            merged = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in "
                                         "tokens (every tier)", labels=["model_name"])  # fmt: skip
            value = sum(s.value for s in hits.samples if s.name.endswith("_total"))
            merged.add_metric([self.model_name], value)
            yield merged
        if total:
            usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)",
                                      labels=["model_name"])  # fmt: skip
            usage.add_metric([self.model_name], used / total)
            yield usage

    def _renamed(self, metric: Metric, name: str) -> Metric:
        out = Metric(name, metric.documentation, metric.type)
        for sample in metric.samples:
            if sample.name.endswith("_created"):
                continue
            labels = {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
            out.add_sample(name + sample.name[len(metric.name) :],
                           {**labels, "model_name": self.model_name}, sample.value)  # fmt: skip
        return out


def _device(metric: Metric) -> float:
    return sum(s.value for s in metric.samples if s.labels.get("tier") == "device")


class Metrics:
    """The HTTP layer's registry: its own measurements plus the daemon's collector, each
    also under vLLM's names (VllmNames)."""

    def __init__(
        self, read_stats: Callable[[], dict[str, Any]], model_name: str = "default"
    ) -> None:
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
        own = [self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
               self.e2e, self.queue]  # fmt: skip
        r.register(DaemonCollector(read_stats, VllmNames(own, model_name)))
