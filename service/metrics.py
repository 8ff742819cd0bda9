"""Prometheus metrics of the engine, under vLLM's names.

Dashboards, alerts and the Kubernetes Gateway API Inference Extension read
vLLM's metric names, so the engine's are the same (`vllm:` prefix, a
`model_name` label). Gauges and counters come from the `EngineStats`
snapshot the loop thread publishes each turn, read at scrape time (this
module never touches scheduler state). Per-request histograms are observed
by a finish listener on the loop thread, once per request as it ends.

Counting: the request histograms (latencies, prompt and generation tokens)
count requests; `vllm:request_success_total{finished_reason}` counts
samples (a request with n = 4 adds 4), as vLLM counts the child requests
it fans n out to.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from esurge.engine.request_output import RequestOutput
from esurge.engine.stats import EngineStats

if TYPE_CHECKING:
    from esurge.engine.api import eSurge

__all__ = ["TOKEN_BUCKETS", "EngineMetrics"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)


class _SnapshotCollector(Collector):
    """Gauges and counters of the engine's latest published stats."""

    def __init__(self, engine: eSurge, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats: EngineStats = self._engine.stats
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.",
                          stats.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                          stats.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache pages in use (0-1).",
                          stats.kv_cache_usage)
        counters = (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            ("vllm:num_preemptions", "Requests preempted (their KV recomputed later).",
             stats.num_preemptions),
            ("vllm:prompt_tokens", "Prompt tokens of accepted requests.",
             stats.num_prompt_tokens),
            ("vllm:generation_tokens", "Tokens generated and delivered.",
             stats.num_generation_tokens),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed for verification.",
             stats.spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
             stats.spec.num_accepted_tokens),
        )
        for name, doc, value in counters:
            yield self._counter(name, doc, value)


class EngineMetrics:
    """The engine's metrics in `registry`, fed by the engine loop."""

    def __init__(self, engine: eSurge, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        registry.register(_SnapshotCollector(engine, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=tuple(buckets),
                             registry=registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Arrival to first generated token.", _LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive generated tokens.", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Arrival to the end of the request.", _REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens",
                                       "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_tokens = histogram("vllm:request_generation_tokens",
                                           "Generated tokens per request (all samples).",
                                           TOKEN_BUCKETS)
        self.success = Counter("vllm:request_success", "Samples that ended, by reason.",
                               ["model_name", "finished_reason"], registry=registry)
        engine.loop.add_finish_listener(self.observe)

    def observe(self, output: RequestOutput, aborted: bool) -> None:
        """Account for one ended request (loop thread)."""
        for sample in output.outputs:
            reason = sample.finish_reason or "abort"
            self.success.labels(self.model_name, reason).inc()
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(sum(len(s.token_ids) for s in output.outputs))
        metrics = output.metrics
        if metrics is None:
            return
        if metrics.first_scheduled_time is not None:
            self.queue.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))
        ttft = metrics.time_to_first_token
        if ttft is not None:
            self.ttft.observe(ttft)
        times = metrics.token_times
        for before, after in itertools.pairwise(times):
            self.itl.observe(after - before)
        end = metrics.finished_time or (time.monotonic() if aborted else metrics.last_token_time)
        if end is not None:
            self.e2e.observe(max(0.0, end - metrics.arrival_time))
