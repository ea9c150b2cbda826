"""SGLang's Prometheus metrics for a simulated replica run with ``--sim-engine sglang``.

Public surface: ``SGLangMetrics``, ``TTFT_BUCKETS``, ``ITL_BUCKETS``,
``E2E_BUCKETS``, ``SCHEDULER_LABELS``, ``TOKENIZER_LABELS``.

Names, types, label names and default buckets are those real SGLang 0.5.23
exports (``python/sglang/srt/observability/metrics_collector.py``; the reference
``simengine/tests/data/sglang-reference/`` is a capture of it): the
scheduler's gauges (labelled ``model_name``, ``engine_type`` ("unified": no
prefill/decode disaggregation), ``tp_rank``, ``pp_rank`` and ``moe_ep_rank``) and
the tokenizer's counters and histograms (``model_name`` and ``engine_type``; the
per-request counters, TTFT and end-to-end latency also ``is_streaming``,
``cached_tokens_total`` ``cache_source="device"``). SGLang serves them through
prometheus_client's multiprocess collector, so there are no ``_created`` series
and a labelled family shows up only once a series of it has been touched (no
``num_aborted_requests_total`` before an abort): ``render`` does the same. Only
the families the simulator has figures for are exported (22 of real SGLang's 83);
``simengine/tests/test_sim_sglang.py`` lists the others and why.

As in SGLang the tokenizer side counts a request once it finishes:
``sglang:prompt_tokens_total`` (its whole prompt), ``sglang:cached_tokens_total``
(its prefix hit), ``sglang:generation_tokens_total`` and
``sglang:num_requests_total``; an aborted one counts in
``sglang:num_aborted_requests_total`` only. The scheduler's gauges are set after
every engine step (SGLang sets them at its prefill and decode log intervals):
``num_used_tokens`` and ``token_usage`` are SGLang's ``max_total - available -
evictable`` (cached idle tokens count as free), ``cache_hit_rate`` the hit share of
the prompts admitted since the last step that admitted any (SGLang's last prefill
batch), ``gen_throughput`` tokens per second over the last half second or more.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from simengine.domain.engine import Engine, FinishedRequest

__all__ = [
    "E2E_BUCKETS",
    "ITL_BUCKETS",
    "SCHEDULER_LABELS",
    "TOKENIZER_LABELS",
    "TTFT_BUCKETS",
    "SGLangMetrics",
]

# TokenizerMetricsCollector's default buckets.
TTFT_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
    10.0,
    20.0,
    40.0,
    60.0,
    80.0,
    100.0,
    200.0,
    400.0,
)
E2E_BUCKETS = (*TTFT_BUCKETS, 600.0, 1200.0, 1800.0, 2400.0)
ITL_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1.000,
    2.000,
    4.000,
    6.000,
    8.000,
)
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
TOKENIZER_LABELS = ("model_name", "engine_type")
_PER_REQUEST_LABELS = (*TOKENIZER_LABELS, "is_streaming")
# gen_throughput is measured over at least this long (SGLang: its decode log
# interval, 40 steps).
_THROUGHPUT_WINDOW_S = 0.5


class SGLangMetrics:
    """One replica's SGLang collectors, in a registry of their own.

    The same recording surface as ``metrics.EngineMetrics`` (``record_engine``,
    ``record_finished``, ``record_admission_rejection``, ``observe_first_token``,
    ``observe_inter_token``, ``render``), so the replica drives either.
    """

    def __init__(self, *, model_name: str, max_total_num_tokens: int) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        sched = {
            "model_name": model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        self._tok = {"model_name": model_name, "engine_type": "unified"}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, SCHEDULER_LABELS, registry=reg).labels(**sched)

        # The tokenizer's families stay labelled (their series made on first use).
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _PER_REQUEST_LABELS, registry=reg)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...]
        ) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets)

        self.num_running_reqs = gauge(
            "sglang:num_running_reqs", "The number of running requests."
        )
        self.num_used_tokens = gauge(
            "sglang:num_used_tokens", "The number of used tokens."
        )
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.gen_throughput = gauge(
            "sglang:gen_throughput", "The generation throughput (token/s)."
        )
        self.num_queue_reqs = gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue."
        )
        self.cache_hit_rate = gauge(
            "sglang:cache_hit_rate", "The prefix cache hit rate."
        )
        self.max_total_num_tokens = gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
        )
        self.max_total_num_tokens.set(max_total_num_tokens)
        self.prompt_tokens = counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed."
        )
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed."
        )
        self.cached_tokens = Counter(
            "sglang:cached_tokens_total",
            "Number of cached prompt tokens.",
            (*TOKENIZER_LABELS, "cache_source"),
            registry=reg,
        )
        self.num_requests = counter(
            "sglang:num_requests_total", "Number of requests processed."
        )
        self.num_aborted_requests = Counter(
            "sglang:num_aborted_requests_total",
            "Number of requests aborted.",
            TOKENIZER_LABELS,
            registry=reg,
        )
        self.time_to_first_token = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
            _PER_REQUEST_LABELS,
        )
        self.inter_token_latency = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
            TOKENIZER_LABELS,
        )
        self.e2e_request_latency = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
            _PER_REQUEST_LABELS,
        )
        self._view = CollectorRegistry(auto_describe=False)
        self._view.register(_AsMultiprocess(reg))
        self._seen_queries = 0
        self._seen_hits = 0
        self._throughput_at: float | None = None
        self._throughput_tokens = 0

    def record_engine(self, engine: Engine, now: float) -> None:
        """Set the scheduler's gauges from the engine's state at ``now``
        (monotonic seconds)."""
        self.num_running_reqs.set(engine.num_running)
        self.num_queue_reqs.set(engine.num_waiting)
        self.num_used_tokens.set(engine.num_used_tokens)
        self.token_usage.set(engine.kv_cache_usage_perc)
        queries = engine.prefix_cache_queries - self._seen_queries
        if queries > 0:
            hits = engine.prefix_cache_hits - self._seen_hits
            self.cache_hit_rate.set(hits / queries)
            self._seen_queries = engine.prefix_cache_queries
            self._seen_hits = engine.prefix_cache_hits
        if self._throughput_at is None:
            self._throughput_at = now
            self._throughput_tokens = engine.generation_tokens
        elif now - self._throughput_at >= _THROUGHPUT_WINDOW_S:
            made = engine.generation_tokens - self._throughput_tokens
            self.gen_throughput.set(made / (now - self._throughput_at))
            self._throughput_at = now
            self._throughput_tokens = engine.generation_tokens

    def record_admission_rejection(self, reason: str) -> None:
        """SGLang has no admission-rejection family; nothing is counted."""

    def _request_labels(self, *, streaming: bool) -> dict[str, str]:
        return {**self._tok, "is_streaming": "true" if streaming else "false"}

    def observe_first_token(self, seconds: float, *, streaming: bool) -> None:
        """Observe one request's time to first token."""
        self.time_to_first_token.labels(
            **self._request_labels(streaming=streaming)
        ).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        """Observe the gap between two of a request's tokens."""
        self.inter_token_latency.labels(**self._tok).observe(seconds)

    def record_finished(
        self,
        done: FinishedRequest,
        *,
        arrived_at: float,
        max_tokens: int,
        delivered_at: float | None = None,
        streaming: bool = False,
    ) -> None:
        """Count a finished request as SGLang's tokenizer does (an abort only in
        ``num_aborted_requests_total``), under ``is_streaming``; ``max_tokens`` is
        not exported."""
        if done.finish_reason == "abort":
            self.num_aborted_requests.labels(**self._tok).inc()
            return
        labels = self._request_labels(streaming=streaming)
        self.prompt_tokens.labels(**labels).inc(done.prompt_tokens)
        self.cached_tokens.labels(**self._tok, cache_source="device").inc(
            done.cached_tokens
        )
        self.generation_tokens.labels(**labels).inc(done.output_tokens)
        self.num_requests.labels(**labels).inc()
        ended_at = max(done.finished_at, delivered_at or done.finished_at)
        self.e2e_request_latency.labels(**labels).observe(
            max(0.0, ended_at - arrived_at)
        )

    def render(self) -> bytes:
        """Return the exposition text for ``GET /metrics``, as SGLang's
        multiprocess collector writes it: no ``_created`` series, no family
        without a series."""
        return generate_latest(self._view)


class _AsMultiprocess(Collector):
    """A view of a registry without ``_created`` samples or empty families."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            samples = [s for s in family.samples if not s.name.endswith("_created")]
            if not samples:
                continue
            family.samples = samples
            yield family
