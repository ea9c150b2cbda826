"""The simulated replica against a capture of real vLLM: metrics, SSE, plain body.

The reference files in ``simengine/tests/data/`` were recorded from real vLLM
(the CPU build, tiny Llama; ``tests/test_vllm_fidelity.py`` re-captures and checks
them under ``make test-vllm``). Here the simulated replica answers the same
requests and its answers must have the same shape (``simengine.conformance``).
"""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from localrun.processes import sim_replica
from simengine.conformance import (
    CAPTURE_API_KEY,
    CAPTURE_SERVER_FLAGS,
    Capture,
    capture,
    diff_json_shapes,
    diff_metrics,
    diff_stream,
    json_shape,
    read_capture,
)

pytestmark = pytest.mark.e2e

# vLLM metrics the simulated replica leaves out, each with the reason. Every other
# `vllm:` family of the reference must be there with the same type, labels, sample
# names and buckets; those the platform reads can never be left out.
SIM_MISSING_METRICS = {
    "vllm:estimated_flops_per_gpu": (
        "a roofline estimate of the model's FLOPs; the step-time model has no "
        "per-operator FLOP count to report"
    ),
    "vllm:estimated_read_bytes_per_gpu": "as estimated_flops_per_gpu: no byte model",
    "vllm:estimated_write_bytes_per_gpu": "as estimated_flops_per_gpu: no byte model",
}


@pytest.fixture(scope="module")
def reference() -> Capture:
    return read_capture()


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Capture:
    tmp = tmp_path_factory.mktemp("sim-conformance")
    with sim_replica(
        tmp,
        *CAPTURE_SERVER_FLAGS,
        "--sim-profile",
        "cpu-tiny",
        "--api-key",
        CAPTURE_API_KEY,
        model="tiny-llama",
    ) as process:
        return capture(process.url, "tiny-llama")


def test_reference_was_captured_with_a_prefix_hit(reference: Capture) -> None:
    assert reference.cached_tokens > 0
    assert reference.cached_tokens % 128 == 0


def test_sim_metrics_have_vllms_names_types_and_labels(
    reference: Capture, simulated: Capture
) -> None:
    problems = diff_metrics(
        reference.metrics, simulated.metrics, allowed_missing=SIM_MISSING_METRICS
    )
    assert problems == []


def test_sim_stream_with_usage_has_vllms_chunks(
    reference: Capture, simulated: Capture
) -> None:
    assert diff_stream(reference.stream, simulated.stream) == []
    assert simulated.stream_content_type == reference.stream_content_type


def test_sim_stream_without_usage_has_vllms_chunks(
    reference: Capture, simulated: Capture
) -> None:
    assert diff_stream(reference.stream_no_usage, simulated.stream_no_usage) == []


def test_sim_plain_answer_has_vllms_body(
    reference: Capture, simulated: Capture
) -> None:
    ref = json_shape(json.loads(reference.completion))
    got = json_shape(json.loads(simulated.completion))
    assert diff_json_shapes(ref, got) == []


def test_sim_guards_v1_with_the_engine_key_as_vllm_does(
    reference: Capture, simulated: Capture
) -> None:
    assert simulated.auth == reference.auth


def test_sim_reports_the_same_prefix_hit(
    reference: Capture, simulated: Capture
) -> None:
    assert simulated.cached_tokens == reference.cached_tokens


def _counter(metrics: str, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == name
        and all(sample.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.parametrize("side", ["reference", "simulated"])
def test_prompt_token_counters_add_up_as_in_vllm(
    side: str, request: pytest.FixtureRequest
) -> None:
    """vLLM counts whole prompts in prompt_tokens (hits included), split by source."""
    metrics = request.getfixturevalue(side).metrics
    total = _counter(metrics, "vllm:prompt_tokens_total")
    computed = _counter(
        metrics, "vllm:prompt_tokens_by_source_total", source="local_compute"
    )
    hit = _counter(
        metrics, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
    )

    assert total == computed + hit
    assert hit == _counter(metrics, "vllm:prompt_tokens_cached_total") > 0
    assert hit == _counter(metrics, "vllm:prefix_cache_hits_total")
