"""The simulated replica run as SGLang (``--sim-engine sglang``), as a real process.

Its answers are diffed against the reference captured from real SGLang 0.5.23
(``simengine/tests/data/sglang-reference/``, see its README;
``tests/test_sglang_real.py`` re-captures it) with the same machinery as the vLLM
capture (``simengine.conformance``, engine ``"sglang"``); its ``/metrics``
is read by the platform's own scraper; its key comes from SGLang's ``--config``
file. Of real SGLang's 83 metric families the simulator exports the 14 it has
figures for (and ``num_aborted_requests_total`` once a request is aborted);
``SIM_MISSING_METRICS`` names the others, each with why.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_nodes.domain.scrape import parse_metrics_text
from localrun.processes import Process, sim_replica
from simengine.conformance import (
    CAPTURE_API_KEY,
    SGLANG_CAPTURE_SERVER_FLAGS,
    Capture,
    capture,
    diff_json_shapes,
    diff_metrics,
    diff_stream,
    json_shape,
    metric_shapes,
    read_capture,
    repeated_prompt_messages,
    stream_facts,
)
from simengine.domain import tokens

pytestmark = pytest.mark.e2e

MAX_TOTAL_NUM_TOKENS = 16368  # profile cpu-tiny: (1024 blocks - 1) x 16 tokens

_LEFT_OUT = {
    "no speculative decoding in the simulator": (
        "spec_accept_length spec_accept_rate spec_block_accept_length "
        "spec_cap_length spec_num_draft_tokens spec_num_steps"
    ),
    "no data-parallel attention, prefill/decode disaggregation or paused (PD) queues": (
        "dp_attention_pairs dp_attention_steps dp_attention_sync_wait_seconds "
        "dp_attention_token_imbalance_ratio dp_attention_tokens "
        "num_decode_deferred_kv_release_reqs num_decode_host_receive_queue_reqs "
        "num_decode_prealloc_queue_reqs num_decode_transfer_queue_reqs "
        "num_prefill_bootstrap_queue_reqs num_prefill_inflight_queue_reqs "
        "num_paused_reqs pending_prealloc_token_usage prealloc_full_token_usage "
        "prealloc_swa_token_usage"
    ),
    "no Mamba or sliding-window pools (the tiny Llama has full attention only)": (
        "mamba_available_tokens mamba_evictable_tokens mamba_usage "
        "mamba_used_tokens swa_available_tokens swa_evictable_tokens "
        "swa_token_usage swa_used_tokens full_token_usage"
    ),
    "no CUDA graphs or device memory accounting in the step-time model": (
        "cuda_graph_passes is_cuda_graph graph_memory_usage_gb "
        "kv_cache_memory_usage_gb weight_memory_usage_gb "
        "startup_available_gpu_memory_gb startup_cuda_graph_time_seconds "
        "startup_time_seconds"
    ),
    "no routing keys, grammar backend or retraction": (
        "routing_key_all_req_count routing_key_running_req_count "
        "routing_keys_active num_unique_running_routing_keys "
        "num_grammar_queue_reqs num_retracted_reqs"
    ),
    "process and scheduler-loop accounting of the real Python processes": (
        "process_cpu_seconds scheduler_process_cpu_seconds scheduler_idle_seconds "
        "scheduler_stage_seconds per_stage_req_latency_seconds utilization "
        "fwd_occupancy realtime_tokens"
    ),
    "the HTTP server's own request counters (the gateway counts requests)": (
        "http_requests http_requests_active http_responses"
    ),
    "scheduler internals the platform does not read (pool shape is in "
    "max_total_num_tokens and token_usage)": (
        "context_len page_size num_pages kv_available_tokens kv_evictable_tokens "
        "kv_used_tokens decode_sum_seq_lens new_token_ratio prefill_effective_tokens"
    ),
    "per-request size and latency histograms the platform does not read": (
        "prompt_tokens_histogram uncached_prompt_tokens_histogram "
        "generation_tokens_histogram queue_time_seconds "
        "request_time_per_output_token_seconds"
    ),
}
# Real SGLang's families the simulated replica leaves out, each with the reason;
# the platform's own (SGLANG_PLATFORM_METRICS) can never be.
SIM_MISSING_METRICS = {
    f"sglang:{name}": reason
    for reason, names in _LEFT_OUT.items()
    for name in names.split()
}


@pytest.fixture(scope="module")
def reference() -> Capture:
    return read_capture(engine="sglang")


def _sglang_replica(tmp: Path, *flags: str) -> Iterator[Process]:
    config = tmp / "sglang-config.yaml"  # SGLang takes only .yaml/.yml
    config.write_text(json.dumps({"api-key": CAPTURE_API_KEY}))
    config.chmod(0o600)
    with sim_replica(
        tmp,
        "--sim-engine",
        "sglang",
        *SGLANG_CAPTURE_SERVER_FLAGS,
        "--config",
        str(config),
        "--sim-profile",
        "cpu-tiny",
        *flags,
        model="tiny-llama",
    ) as process:
        yield process


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from _sglang_replica(tmp_path_factory.mktemp("sim-sglang"))


@pytest.fixture(scope="module")
def simulated(replica: Process) -> Capture:
    return capture(replica.url, "tiny-llama")


def test_sim_metrics_have_sglangs_names_types_labels_and_buckets(
    reference: Capture, simulated: Capture
) -> None:
    """GIVEN the simulated SGLang replica after the capture requests
    WHEN its /metrics is diffed against SGLang's families
    THEN they match (type, labels, samples, buckets) but for the families left
    out with a reason, and no vllm: family is there."""
    problems = diff_metrics(
        reference.metrics,
        simulated.metrics,
        allowed_missing=SIM_MISSING_METRICS,
        engine="sglang",
    )
    assert problems == []
    assert len(metric_shapes(reference.metrics, engine="sglang")) == 83
    assert metric_shapes(simulated.metrics) == {}  # no vllm: families
    assert "vllm:" not in simulated.metrics


def test_sim_streams_have_sglangs_chunks(
    reference: Capture, simulated: Capture
) -> None:
    """GIVEN streams with and without include_usage
    WHEN diffed against SGLang's chunk sequence
    THEN role, content, a separate finish chunk whose delta is only
    reasoning_content null, usage, [DONE]."""
    assert diff_stream(reference.stream, simulated.stream) == []
    assert diff_stream(reference.stream_no_usage, simulated.stream_no_usage) == []
    assert simulated.stream_content_type == reference.stream_content_type
    facts = stream_facts(simulated.stream)
    assert facts["finish_delta"] == "non-empty"  # {"reasoning_content": null}
    assert '"delta":{"reasoning_content":null},' in simulated.stream
    usage = facts["shapes"]["usage"][0]
    assert set(usage) == {"id", "object", "created", "model", "choices", "usage"}
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": "int"}


def test_sim_plain_answer_has_sglangs_body(
    reference: Capture, simulated: Capture
) -> None:
    ref = json_shape(json.loads(reference.completion))
    got = json_shape(json.loads(simulated.completion))
    assert diff_json_shapes(ref, got) == []


def test_sim_guards_with_the_key_from_its_config_file_as_sglang_does(
    reference: Capture, simulated: Capture
) -> None:
    """GIVEN the key only in the --config file
    WHEN every auth probe is sent
    THEN the answers are SGLang's: all but /health and /metrics need
    'Bearer <key>' (the scheme in any case)."""
    assert simulated.auth == reference.auth


def test_sim_reuses_the_prefix_to_the_token(simulated: Capture) -> None:
    """GIVEN the long prompt asked twice with different questions
    WHEN the second is answered
    THEN its cached tokens are the prompts' common prefix, to the token."""
    one, two = (
        tokens.encode(tokens.render_chat(repeated_prompt_messages(q)))
        for q in ("one", "two")
    )
    common = next(i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a != b)
    assert common % 16 != 0  # more than 16-token blocks could give
    assert simulated.cached_tokens == min(common, len(two) - 1)


def test_the_platform_scraper_reads_the_sims_sglang_metrics(
    replica: Process, simulated: Capture
) -> None:
    """GIVEN the capture's requests done (five answers, one with a prefix hit, and
    the auth probe SGLang lets through with a lowercase 'bearer')
    WHEN engine_nodes.domain.scrape parses the replica's /metrics
    THEN it reads SGLang's pool (one-token pages), and its counters are the sums
    over SGLang's is_streaming series."""
    text = httpx.get(f"{replica.url}/metrics").text
    stats = parse_metrics_text(text)
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    assert stats.block_size == 1
    assert stats.num_gpu_blocks == MAX_TOTAL_NUM_TOKENS + 1
    assert stats.num_requests_running == stats.num_requests_waiting == 0
    assert stats.kv_cache_usage_perc == 0.0  # cached idle tokens count as free
    assert stats.prefix_cache_queries == totals["sglang:prompt_tokens_total"] > 0
    assert stats.prefix_cache_hits == totals["sglang:cached_tokens_total"]
    assert stats.prefix_cache_hits >= simulated.cached_tokens > 0
    # 5 + 3 + 3 + 2 + 2 output tokens (ignore_eos), as the capture asked, and
    # the lowercase-scheme probe's one.
    assert stats.generation_tokens == 16
    assert totals["sglang:num_requests_total"] == 6
    streamed = {
        sample.labels["is_streaming"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sglang:num_requests_total"
    }
    assert streamed == {"true": 2.0, "false": 4.0}  # the capture's two streams


def test_without_enable_metrics_or_caching_sglang_serves_neither(
    tmp_path: Path,
) -> None:
    """GIVEN an SGLang replica started without --enable-metrics, with
    --disable-radix-cache and --enable-cache-report
    WHEN one prompt is asked twice and /metrics is asked for
    THEN /metrics is a 404 (SGLang adds it only with the flag), /health is 200
    with an empty body, and usage reports no cached tokens (0, as SGLang's
    cache report does without a hit)."""
    with sim_replica(
        tmp_path,
        "--sim-engine",
        "sglang",
        "--disable-radix-cache",
        "--enable-cache-report",
        "--sim-profile",
        "cpu-tiny",
        model="tiny-llama",
    ) as process:
        metrics = httpx.get(f"{process.url}/metrics")
        assert metrics.status_code == 404
        assert metrics.json()["object"] == "error"  # SGLang's flat ErrorResponse
        health = httpx.get(f"{process.url}/health")
        assert (health.status_code, health.content) == (200, b"")
        body = {
            "model": "anything",
            "messages": [{"role": "user", "content": "the same words " * 40}],
            "max_tokens": 2,
        }
        answers = [
            httpx.post(f"{process.url}/v1/chat/completions", json=body).json()
            for _ in range(2)
        ]
    assert [a["usage"]["prompt_tokens_details"] for a in answers] == [
        {"cached_tokens": 0},
        {"cached_tokens": 0},
    ]
    assert answers[1]["model"] == "anything"  # SGLang echoes any model name
