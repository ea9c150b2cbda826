"""The shape diffs the simulated replica is held to, on the committed vLLM capture."""

from __future__ import annotations

import json

import pytest

from simengine.conformance import (
    PLATFORM_METRICS,
    Capture,
    diff_json_shapes,
    diff_metrics,
    diff_stream,
    json_shape,
    metric_shapes,
    read_capture,
    stream_facts,
)


@pytest.fixture(scope="module")
def reference() -> Capture:
    return read_capture()


def test_json_shape_keeps_keys_and_types_only() -> None:
    shape = json_shape({"a": 1, "b": [{"c": None, "d": 1.5}], "e": [], "f": True})

    assert shape == {
        "a": "int",
        "b": [{"c": "null", "d": "float"}],
        "e": [],
        "f": "bool",
    }
    assert diff_json_shapes(shape, {**shape, "g": "str"}) == ["$.g: extra"]
    assert diff_json_shapes(shape, {**shape, "a": "str"}) == [
        "$.a: 'str', reference 'int'"
    ]


def test_reference_stream_is_vllms_chunk_sequence(reference: Capture) -> None:
    facts = stream_facts(reference.stream)

    assert facts["order"] == ["role", "content*", "finish", "usage", "done"]
    assert facts["role_delta"] == {"role": "assistant", "content": ""}
    assert (facts["finish_reason"], facts["stop_reason"]) == ("length", None)
    usage = facts["shapes"]["usage"][0]["usage"]
    assert usage["prompt_tokens_details"] == {
        "cached_tokens": "int",
        "created_cache_tokens": "int",
    }
    assert stream_facts(reference.stream_no_usage)["order"] == [
        "role",
        "content*",
        "finish",
        "done",
    ]


def test_stream_diff_is_empty_for_the_same_shape(reference: Capture) -> None:
    other = reference.stream.replace('"content":"case"', '"content":"x"')

    assert diff_stream(reference.stream, other) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        (',"created_cache_tokens":0', "", "created_cache_tokens: missing"),
        ('"finish_reason":"length"', '"finish_reason":"stop"', "finish_reason"),
        ("data: [DONE]\n\n", "", "chunk order"),
        (
            '"logprobs":null,"finish_reason":null,"token_ids"',
            '"finish_reason":null,"token_ids"',
            "logprobs: missing",
        ),
        (
            ',"system_fingerprint":"vllm-0.32.0-f8452c6e"}',
            "}",
            "system_fingerprint: missing",
        ),
    ],
)
def test_stream_diff_names_what_changed(
    reference: Capture, old: str, new: str, problem: str
) -> None:
    assert old in reference.stream
    problems = diff_stream(reference.stream, reference.stream.replace(old, new))

    assert any(problem in p for p in problems), problems


def test_metrics_diff_is_empty_against_itself(reference: Capture) -> None:
    assert diff_metrics(reference.metrics, reference.metrics) == []
    assert set(metric_shapes(reference.metrics)) >= PLATFORM_METRICS


def test_metrics_diff_catches_labels_names_and_buckets(reference: Capture) -> None:
    renamed = reference.metrics.replace('reason="capacity"', 'cause="capacity"')
    rebucketed = reference.metrics.replace('le="0.001"', 'le="0.002"')
    extra = reference.metrics + 'vllm:made_up_total{engine="0"} 1.0\n'

    assert any(
        "num_requests_waiting_by_reason: labels" in p
        for p in diff_metrics(reference.metrics, renamed)
    )
    assert any(
        "time_to_first_token_seconds: buckets" in p
        for p in diff_metrics(reference.metrics, rebucketed)
    )
    assert any("vllm:made_up" in p for p in diff_metrics(reference.metrics, extra))


def test_allowances_cannot_cover_platform_metrics_or_go_stale(
    reference: Capture,
) -> None:
    without = "\n".join(
        line
        for line in reference.metrics.splitlines()
        if not line.startswith("vllm:kv_cache_usage_perc")
    )

    problems = diff_metrics(
        reference.metrics,
        without,
        allowed_missing={"vllm:kv_cache_usage_perc": "x", "vllm:gone": "y"},
    )

    assert (
        "vllm:kv_cache_usage_perc: read by the platform, cannot be allowed missing"
        in problems
    )
    assert "vllm:gone: allowed missing but not in the reference" in problems


def test_reference_plain_body_has_vllms_usage(reference: Capture) -> None:
    usage = json.loads(reference.completion)["usage"]

    assert set(usage["prompt_tokens_details"]) == {
        "cached_tokens",
        "created_cache_tokens",
        "multimodal_tokens",
    }
    assert usage["completion_tokens_details"] is None
