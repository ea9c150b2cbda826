"""SGLang's Prometheus metrics for a simulated replica run with ``--sim-engine sglang``.

Public surface: ``SGLangMetrics``, ``TTFT_BUCKETS``, ``ITL_BUCKETS``,
``E2E_BUCKETS``, ``SCHEDULER_LABELS``, ``TOKENIZER_LABELS``.

Names, types, label names and default buckets are those of SGLang's
``python/sglang/srt/metrics/collector.py``: the scheduler's gauges
(``SchedulerMetricsCollector``, labelled ``model_name``, ``engine_type``
("unified": no prefill/decode disaggregation), ``tp_rank`` and ``pp_rank``, as
``scheduler_metrics_mixin.init_metrics`` builds them) and the tokenizer's counters
and histograms (``TokenizerMetricsCollector``, labelled ``model_name``). Only the
families the simulator has figures for are exported; speculative decoding, PD
disaggregation, grammar, LoRA and routing-key families are not (see
``engine_nodes/tests/data/sglang-reference/README.md``).

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

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine_nodes.domain.engine import Engine, FinishedRequest

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
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank")
TOKENIZER_LABELS = ("model_name",)
# gen_throughput is measured over at least this long (SGLang: its decode log
# interval, 40 steps).
_THROUGHPUT_WINDOW_S = 0.5


class SGLangMetrics:
    """One replica's SGLang collectors, in a registry of their own.

    The same recording surface as ``metrics.EngineMetrics`` (``record_engine``,
    ``record_finished``, ``record_admission_rejection``, ``render`` and the
    ``time_to_first_token`` / ``inter_token_latency`` histograms the replica
    observes), so the replica drives either.
    """

    def __init__(self, *, model_name: str, max_total_num_tokens: int) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        sched = {
            "model_name": model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
        }
        tok = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, SCHEDULER_LABELS, registry=reg).labels(**sched)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, TOKENIZER_LABELS, registry=reg).labels(**tok)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                name, doc, TOKENIZER_LABELS, registry=reg, buckets=buckets
            ).labels(**tok)

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
        self.cached_tokens = counter(
            "sglang:cached_tokens_total", "Number of cached prompt tokens."
        )
        self.num_requests = counter(
            "sglang:num_requests_total", "Number of requests processed."
        )
        self.num_aborted_requests = counter(
            "sglang:num_aborted_requests_total", "Number of requests aborted."
        )
        self.time_to_first_token = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
        )
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

    def record_finished(
        self,
        done: FinishedRequest,
        *,
        arrived_at: float,
        max_tokens: int,
        delivered_at: float | None = None,
    ) -> None:
        """Count a finished request as SGLang's tokenizer does (an abort only in
        ``num_aborted_requests_total``); ``max_tokens`` is not exported."""
        if done.finish_reason == "abort":
            self.num_aborted_requests.inc()
            return
        self.prompt_tokens.inc(done.prompt_tokens)
        self.cached_tokens.inc(done.cached_tokens)
        self.generation_tokens.inc(done.output_tokens)
        self.num_requests.inc()
        ended_at = max(done.finished_at, delivered_at or done.finished_at)
        self.e2e_request_latency.observe(max(0.0, ended_at - arrived_at))

    def render(self) -> bytes:
        """Return the exposition text for ``GET /metrics``."""
        return generate_latest(self.registry)
