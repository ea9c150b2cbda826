"""The simulated replica run as SGLang (``--sim-engine sglang``), as a real process.

Its answers are diffed against the hand-written SGLang reference
(``engine_nodes/tests/data/sglang-reference/``, see its README) with the same
machinery as the vLLM capture (``engine_nodes.sim.conformance``, engine
``"sglang"``); its ``/metrics`` is read by the platform's own scraper; its key
comes from SGLang's ``--config`` file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_nodes.domain import tokens
from engine_nodes.domain.scrape import parse_metrics_text
from engine_nodes.local_processes import Process, sim_replica
from engine_nodes.sim.conformance import (
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

pytestmark = pytest.mark.e2e

MAX_TOTAL_NUM_TOKENS = 16368  # profile cpu-tiny: (1024 blocks - 1) x 16 tokens


@pytest.fixture(scope="module")
def reference() -> Capture:
    return read_capture(engine="sglang")


def _sglang_replica(tmp: Path, *flags: str) -> Iterator[Process]:
    config = tmp / "sglang-config.json"
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
    THEN they match (type, labels, samples, buckets) and no vllm: family is there."""
    assert diff_metrics(reference.metrics, simulated.metrics, engine="sglang") == []
    assert metric_shapes(simulated.metrics) == {}  # no vllm: families
    assert "vllm:" not in simulated.metrics


def test_sim_streams_have_sglangs_chunks(
    reference: Capture, simulated: Capture
) -> None:
    """GIVEN streams with and without include_usage
    WHEN diffed against SGLang's chunk sequence
    THEN role, content, a separate finish chunk with an empty delta, usage, [DONE]."""
    assert diff_stream(reference.stream, simulated.stream) == []
    assert diff_stream(reference.stream_no_usage, simulated.stream_no_usage) == []
    assert simulated.stream_content_type == reference.stream_content_type
    facts = stream_facts(simulated.stream)
    assert facts["finish_delta"] == {}
    usage = facts["shapes"]["usage"][0]
    assert set(usage) == {"id", "object", "created", "model", "choices", "usage"}


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
    THEN the answers are SGLang's: all but /health and /metrics need the exact
    'Bearer <key>' header."""
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
    """GIVEN the capture's requests done (five answers, one with a prefix hit)
    WHEN engine_nodes.domain.scrape parses the replica's /metrics
    THEN it reads SGLang's pool (one-token pages), counters and gauges."""
    stats = parse_metrics_text(httpx.get(f"{replica.url}/metrics").text)
    families = {
        sample.name: sample.value
        for family in text_string_to_metric_families(simulated.metrics)
        for sample in family.samples
    }
    assert stats.block_size == 1
    assert stats.num_gpu_blocks == MAX_TOTAL_NUM_TOKENS + 1
    assert stats.num_requests_running == stats.num_requests_waiting == 0
    assert stats.kv_cache_usage_perc == 0.0  # cached idle tokens count as free
    assert stats.prefix_cache_queries == families["sglang:prompt_tokens_total"] > 0
    assert stats.prefix_cache_hits == families["sglang:cached_tokens_total"]
    assert stats.prefix_cache_hits >= simulated.cached_tokens > 0
    # 5 + 3 + 3 + 2 + 2 output tokens (ignore_eos), as the capture asked.
    assert stats.generation_tokens == 15


def test_without_enable_metrics_or_caching_sglang_serves_neither(
    tmp_path: Path,
) -> None:
    """GIVEN an SGLang replica started without --enable-metrics, with
    --disable-radix-cache and --enable-cache-report
    WHEN one prompt is asked twice and /metrics is asked for
    THEN /metrics is a 404 (SGLang adds it only with the flag), /health is 200
    with an empty body, and usage never reports cached tokens."""
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
    assert [a["usage"]["prompt_tokens_details"] for a in answers] == [None, None]
    assert answers[1]["model"] == "anything"  # SGLang echoes any model name
