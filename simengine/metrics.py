"""vLLM's Prometheus metrics, by the names, types, labels and buckets vLLM exports.

Every series carries ``model_name`` (the served model name) and ``engine="0"``, as
vLLM V1 does. Counters are exposed with ``_total`` (and ``_created``) by
prometheus_client, exactly like vLLM's own exporter. Gauges are set once per engine
step, so a 50 ms scraper sees the same jitter it would see on a real replica.

The families, their labels and buckets are those of vLLM 0.32 and are checked
against a capture of real vLLM (``simengine/tests/test_sim_conformance.py``).
Labelled families are created with every label value up front, as vLLM does, so a
scraper sees the same series before and after the first request. Families for
what is not simulated (KV transfer between instances, multimodal inputs, and the
tool-call parser's invocations, which a replica started with ``--tool-call-parser``
exports as vLLM does) stay at zero.

The CPU offload tier (``--kv-offloading-size``, vLLM's native offloading
connector) feeds what vLLM 0.32 feeds from its connector's ``PrefixCacheStats``:
``vllm:external_prefix_cache_queries`` (per first admission, the request's tokens
past its GPU hit), ``vllm:external_prefix_cache_hits`` (the tokens loaded from the
host tier), ``vllm:prompt_tokens_cached_by_source{source="host"}`` (the same hits;
``source="device"`` takes ``vllm:prefix_cache_hits``, so the sources sum to the two
hit counters, counted at admission) and, once each prefill completes,
``vllm:prompt_tokens_by_source{source="external_kv_transfer"}`` (the host part of
``vllm:prompt_tokens_cached``). vLLM's connector-only ``vllm:kv_offload_*``
families are not simulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from simengine.domain.engine import FinishedRequest

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
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
# vllm:cache_config_info's labels (vLLM's CacheConfig, one label per field) with the
# values of a plain config; the ones the simulator knows are filled in per replica.
CACHE_CONFIG_DEFAULTS = {
    "_block_size_resolved": "True",
    "cache_dtype": "auto",
    "cache_hit_alignment_tokens": "None",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "gpu_memory_utilization": "0.92",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_cache_memory_bytes": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "float32",
    "num_cpu_blocks": "None",
    "num_gpu_blocks_override": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
    "user_specified_block_size": "True",
}


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


_GaugeOrCounter = TypeVar("_GaugeOrCounter", Gauge, Counter)


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
        kv_offloading_size: float | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
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

        def by_label(
            kind: type[_GaugeOrCounter],
            name: str,
            doc: str,
            label: str,
            label_values: tuple[str, ...],
        ) -> dict[str, _GaugeOrCounter]:
            family = kind(name, doc, [*labels, label], registry=reg)
            return {v: family.labels(**values, **{label: v}) for v in label_values}

        self.num_requests_running = gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.num_requests_waiting_by_reason = by_label(
            Gauge,
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            "reason",
            WAITING_REASONS,
        )
        sleep_state = by_label(
            Gauge,
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 "
            "means engine is awake.",
            "sleep_state",
            SLEEP_STATES,
        )
        sleep_state["awake"].set(1)
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
        # Fed by the CPU offload tier; nothing comes from another instance's KV.
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache "
            "sharing, in terms of number of queried tokens.",
        )
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache "
            "sharing, in terms of number of cached tokens.",
        )
        counter("vllm:mm_cache_queries", "Multi-modal cache queries.")
        counter("vllm:mm_cache_hits", "Multi-modal cache hits.")
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.prompt_tokens_by_source = by_label(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            PROMPT_SOURCES,
        )
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
        )
        self.prompt_tokens_cached_by_source = by_label(
            Counter,
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            "source",
            CACHE_HIT_SOURCES,
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = by_label(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            FINISHED_REASONS,
        )
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=reg,
        )
        self.admission_rejections = {
            reason: rejections.labels(model_name=model_name, reason=reason)
            for reason in ADMISSION_REASONS
        }
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
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            PARAMS_N_BUCKETS,
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
        self.request_num_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            PREEMPTIONS_BUCKETS,
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached "
            "tokens).",
            token_buckets,
        )
        # vLLM's num_gpu_blocks counts its null block, as EngineConfig's does.
        kv_tokens = num_gpu_blocks * block_size
        cache_config = {
            **CACHE_CONFIG_DEFAULTS,
            "block_size": str(block_size),
            "effective_attention_block_size": str(block_size),
            "enable_prefix_caching": str(enable_prefix_caching),
            "engine": "0",
            "kv_offloading_size": str(kv_offloading_size),
            "kv_cache_max_concurrency": str(kv_tokens / max_model_len),
            "kv_cache_size_tokens": str(kv_tokens),
            "num_gpu_blocks": str(num_gpu_blocks),
        }
        if tool_call_parser:
            # vLLM 0.32's parser metrics (vllm/parser/metrics.py): no engine label,
            # every series created up front.
            invocations = Counter(
                "vllm:tool_call_parser_invocations",
                "Total number of ToolParser invocations. Non-streaming increments "
                "once per choice; streaming increments once per delta.",
                ["model_name", "mode", "outcome", "request_type"],
                registry=reg,
            )
            for mode in ("streaming", "non_streaming"):
                for outcome in ("tool_call", "no_tool_call"):
                    for request_type in ("chat_completions", "responses", "other"):
                        invocations.labels(
                            model_name=model_name,
                            mode=mode,
                            outcome=outcome,
                            request_type=request_type,
                        )
        # model_name is not a label of this family in vLLM.
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            sorted(cache_config),
            registry=reg,
        ).labels(**cache_config).set(1)
        # Counted so far, to turn the engine's cumulative counters into increments.
        self._seen = {
            "queries": 0,
            "hits": 0,
            "host_queries": 0,
            "host_hits": 0,
            "prompt": 0,
            "cached": 0,
            "cached_host": 0,
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
        prompt_tokens_total: int,
        prompt_tokens_cached: int,
        generation_tokens: int,
        num_preemptions: int,
        host_cache_queries: int = 0,
        host_cache_hits: int = 0,
        prompt_tokens_cached_host: int = 0,
    ) -> None:
        """Set the gauges and advance the counters from the engine's cumulative state.

        As in vLLM, ``vllm:prompt_tokens`` counts whole prompts (cached tokens
        included) once each prefill completes; the ``prompt_tokens_by_source``
        split and ``prompt_tokens_cached`` count the same prompts' computed and
        cached parts (``prompt_tokens_cached_host`` of them from the host tier).
        ``prompt_tokens_cached_by_source`` follows the hit counters instead
        (``device``: ``prefix_cache_hits``; ``host``: ``host_cache_hits``), as
        vLLM's logger increments it from the scheduler's prefix-cache stats.
        """
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        # Every simulated wait is for capacity (no LoRA budget, no KV transfer).
        self.num_requests_waiting_by_reason["capacity"].set(num_waiting)
        self.kv_cache_usage_perc.set(kv_cache_usage_perc)
        if iteration_tokens:
            self.iteration_tokens.observe(iteration_tokens)
        seen = self._seen
        cached = prompt_tokens_cached - seen["cached"]
        cached_host = prompt_tokens_cached_host - seen["cached_host"]
        computed = prompt_tokens_total - seen["prompt"] - cached
        if cached > 0:
            self.prompt_tokens_cached.inc(cached)
            if cached > cached_host:
                self.prompt_tokens_by_source["local_cache_hit"].inc(
                    cached - cached_host
                )
        if cached_host > 0:
            self.prompt_tokens_by_source["external_kv_transfer"].inc(cached_host)
        if computed > 0:
            self.prompt_tokens_by_source["local_compute"].inc(computed)
        hits = prefix_cache_hits - seen["hits"]
        if hits > 0:
            self.prompt_tokens_cached_by_source["device"].inc(hits)
        host_hits = host_cache_hits - seen["host_hits"]
        if host_hits > 0:
            self.prompt_tokens_cached_by_source["host"].inc(host_hits)
        for key, total, collector in (
            ("queries", prefix_cache_queries, self.prefix_cache_queries),
            ("hits", prefix_cache_hits, self.prefix_cache_hits),
            (
                "host_queries",
                host_cache_queries,
                self.external_prefix_cache_queries,
            ),
            ("host_hits", host_cache_hits, self.external_prefix_cache_hits),
            ("prompt", prompt_tokens_total, self.prompt_tokens),
            ("cached", prompt_tokens_cached, None),
            ("cached_host", prompt_tokens_cached_host, None),
            ("generation", generation_tokens, self.generation_tokens),
            ("preempt", num_preemptions, self.num_preemptions),
        ):
            delta = total - seen[key]
            if delta > 0:
                if collector is not None:
                    collector.inc(delta)
                seen[key] = total

    def record_admission_rejection(self, reason: str) -> None:
        """Count a request refused by a queue limit (``ADMISSION_REASONS``)."""
        self.admission_rejections[reason].inc()

    def record_pooled(self, prompt_tokens: Sequence[int], seconds: float) -> None:
        """Count an embeddings request's prompts as vLLM's pooling runner does:
        each prompt one finished request (``stop``), its tokens computed
        prompt tokens, the whole request's time each one's end-to-end latency."""
        for n in prompt_tokens:
            self.prompt_tokens.inc(n)
            self.prompt_tokens_by_source["local_compute"].inc(n)
            self.request_prompt_tokens.observe(n)
            self.request_success["stop"].inc()
            self.e2e_request_latency.observe(seconds)

    def observe_first_token(
        self,
        seconds: float,
        *,
        streaming: bool,  # vLLM does not split by it
    ) -> None:
        """Observe one request's time to first token."""
        self.time_to_first_token.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        """Observe the gap between two of a request's tokens."""
        self.inter_token_latency.observe(seconds)

    def record_finished(
        self,
        done: FinishedRequest,
        *,
        arrived_at: float,
        max_tokens: int,
        delivered_at: float | None = None,
        streaming: bool = False,  # vLLM does not split by it
    ) -> None:
        """Observe one finished request's histograms (times from frontend arrival).

        ``delivered_at``: when its first token reached the client, if the replica
        held it back (``Faults.ttft_factor``). The end-to-end latency is the
        frontend's, as vLLM's, so an answer cannot end before it began; the
        queue, prefill, decode and inference times stay the engine's.
        """
        self.request_success[done.finish_reason].inc()
        self.request_prompt_tokens.observe(done.prompt_tokens)
        self.request_generation_tokens.observe(done.output_tokens)
        self.request_params_max_tokens.observe(max_tokens)
        self.request_max_num_generation_tokens.observe(done.output_tokens)
        self.request_params_n.observe(1)
        self.request_num_preemptions.observe(done.num_preemptions)
        self.request_prefill_kv_computed_tokens.observe(
            done.prompt_tokens - done.cached_tokens
        )
        ended_at = max(done.finished_at, delivered_at or done.finished_at)
        self.e2e_request_latency.observe(max(0.0, ended_at - arrived_at))
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
            # vLLM observes every finished request, a one-token answer as 0.
            self.request_time_per_output_token.observe(
                (done.finished_at - done.first_token_at)
                / max(done.output_tokens - 1, 1)
            )

    def render(self) -> bytes:
        """Return the exposition text for ``GET /metrics``."""
        return generate_latest(self.registry)
