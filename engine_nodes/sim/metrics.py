"""vLLM's Prometheus metrics, by the names, types, labels and buckets vLLM exports.

Every series carries ``model_name`` (the served model name) and ``engine="0"``, as
vLLM V1 does. Counters are exposed with ``_total`` (and ``_created``) by
prometheus_client, exactly like vLLM's own exporter. Gauges are set once per engine
step, so a 50 ms scraper sees the same jitter it would see on a real replica.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine_nodes.domain.engine import FinishedRequest

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """Return vLLM's 1, 2, 5, 10, 20, 50, ... buckets up to ``max_value``."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


class EngineMetrics:
    """The replica's collectors, in a registry of their own (one per server)."""

    def __init__(
        self,
        *,
        model_name: str,
        max_model_len: int,
        block_size: int,
        num_gpu_blocks: int,
        enable_prefix_caching: bool,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = {"model_name": model_name, "engine": "0"}
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(**values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(**values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets).labels(
                **values
            )

        self.num_requests_running = gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self._success_labels = values
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            token_buckets,
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_BUCKETS,
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LATENCY_BUCKETS,
        )
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "engine",
                "model_name",
            ],
            registry=reg,
        )
        cache_info.labels(
            block_size=str(block_size),
            cache_dtype="auto",
            enable_prefix_caching=str(enable_prefix_caching),
            num_gpu_blocks=str(num_gpu_blocks),
            engine="0",
            model_name=model_name,
        ).set(1)
        # Counted so far, to turn the engine's cumulative counters into increments.
        self._seen = {
            "queries": 0,
            "hits": 0,
            "prompt": 0,
            "generation": 0,
            "preempt": 0,
        }

    def record_step(
        self,
        *,
        num_running: int,
        num_waiting: int,
        kv_cache_usage_perc: float,
        iteration_tokens: int,
        prefix_cache_queries: int,
        prefix_cache_hits: int,
        prompt_tokens_computed: int,
        generation_tokens: int,
        num_preemptions: int,
    ) -> None:
        """Set the gauges and advance the counters from the engine's cumulative state."""
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.kv_cache_usage_perc.set(kv_cache_usage_perc)
        if iteration_tokens:
            self.iteration_tokens.observe(iteration_tokens)
        seen = self._seen
        for key, total, collector in (
            ("queries", prefix_cache_queries, self.prefix_cache_queries),
            ("hits", prefix_cache_hits, self.prefix_cache_hits),
            ("prompt", prompt_tokens_computed, self.prompt_tokens),
            ("generation", generation_tokens, self.generation_tokens),
            ("preempt", num_preemptions, self.num_preemptions),
        ):
            delta = total - seen[key]
            if delta > 0:
                collector.inc(delta)
                seen[key] = total

    def record_finished(
        self, done: FinishedRequest, *, arrived_at: float, max_tokens: int
    ) -> None:
        """Observe one finished request's histograms (times from frontend arrival)."""
        self._request_success.labels(
            finished_reason=done.finish_reason, **self._success_labels
        ).inc()
        self.request_prompt_tokens.observe(done.prompt_tokens)
        self.request_generation_tokens.observe(done.output_tokens)
        self.request_params_max_tokens.observe(max_tokens)
        self.e2e_request_latency.observe(max(0.0, done.finished_at - arrived_at))
        if done.scheduled_at is not None:
            self.request_queue_time.observe(
                max(0.0, done.scheduled_at - done.arrived_at)
            )
            self.request_inference_time.observe(
                max(0.0, done.finished_at - done.scheduled_at)
            )
            if done.first_token_at is not None:
                self.request_prefill_time.observe(
                    max(0.0, done.first_token_at - done.scheduled_at)
                )
        if done.first_token_at is not None:
            self.request_decode_time.observe(
                max(0.0, done.finished_at - done.first_token_at)
            )
            if done.output_tokens > 1:
                self.request_time_per_output_token.observe(
                    (done.finished_at - done.first_token_at) / (done.output_tokens - 1)
                )

    def render(self) -> bytes:
        """Return the exposition text for ``GET /metrics``."""
        return generate_latest(self.registry)
