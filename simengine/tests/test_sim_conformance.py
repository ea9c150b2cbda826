"""The simulated replica against a capture of real vLLM: metrics, SSE, plain body.

The reference files in ``simengine/tests/data/`` were recorded from real vLLM
(the CPU build, tiny Llama; ``tests/test_vllm_fidelity.py`` re-captures and checks
them under ``make test-vllm``). Here the simulated replica answers the same
requests and its answers must have the same shape (``simengine.conformance``);
likewise for tools, structured output, n, ``/v1/completions`` and
``/v1/responses`` (``vllm_surfaces/``, ``simengine.surface_capture``).
"""

from __future__ import annotations

import json
from typing import Any

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
from simengine.surface_capture import (
    CASES,
    SURFACES_DIR,
    Answer,
    capture_surfaces,
    read_surfaces,
    surface_shape,
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


SURFACE_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def reference() -> Capture:
    return read_capture()


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Capture:
    tmp = tmp_path_factory.mktemp("sim-conformance")
    # The reference is a replica of the platform's tiny version, which names a
    # tool-call parser (its metrics then include the parser's family).
    with sim_replica(
        tmp,
        *CAPTURE_SERVER_FLAGS,
        *SURFACE_FLAGS,
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


# -- the surfaces beyond plain chat (simengine/tests/data/vllm_surfaces) ----------------


@pytest.fixture(scope="module")
def surfaces_reference() -> dict[str, Answer]:
    return read_surfaces()


@pytest.fixture(scope="module")
def surfaces_simulated(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Answer]:
    tmp = tmp_path_factory.mktemp("sim-surfaces-conformance")
    with sim_replica(
        tmp,
        *CAPTURE_SERVER_FLAGS,
        *SURFACE_FLAGS,
        "--sim-profile",
        "cpu-tiny",
        model="tiny-llama",
    ) as process:
        return capture_surfaces(process.url, "tiny-llama")


def _tokens_unkeyed(shape: Any) -> Any:
    """A shape with each ``top_logprobs`` map reduced to its value types: its
    keys are the model's tokens, not part of the shape."""
    if isinstance(shape, list):
        return [_tokens_unkeyed(item) for item in shape]
    if not isinstance(shape, dict):
        return shape
    reduced = {}
    for key, item in shape.items():
        if key == "top_logprobs" and isinstance(item, list) and item:
            first = item[0]
            reduced[key] = (
                [sorted({str(v) for v in first.values()})]
                if isinstance(first, dict)
                else item
            )
        else:
            reduced[key] = _tokens_unkeyed(item)
    return reduced


@pytest.mark.parametrize("case", [case.name for case in CASES])
def test_sim_surface_answer_has_vllms_shape(
    case: str,
    surfaces_reference: dict[str, Answer],
    surfaces_simulated: dict[str, Answer],
) -> None:
    reference = _tokens_unkeyed(surface_shape(surfaces_reference[case]))
    simulated = _tokens_unkeyed(surface_shape(surfaces_simulated[case]))
    assert diff_json_shapes(reference, simulated) == []


@pytest.mark.parametrize(
    "case",
    [
        case.name
        for case in CASES
        if case.stream and case.path == "/v1/chat/completions"
    ],
)
def test_sim_surface_chat_stream_has_vllms_chunks(
    case: str,
    surfaces_reference: dict[str, Answer],
    surfaces_simulated: dict[str, Answer],
) -> None:
    problems = diff_stream(surfaces_reference[case].raw, surfaces_simulated[case].raw)
    assert problems == []


def _event_order(raw: str) -> list[str]:
    order: list[str] = []
    for line in raw.splitlines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
            if not order or order[-1] != kind or not kind.endswith(".delta"):
                order.append(kind)
    return order


def test_sim_responses_stream_sends_vllms_events_in_order(
    surfaces_reference: dict[str, Answer],
    surfaces_simulated: dict[str, Answer],
) -> None:
    reference = surfaces_reference["responses_stream"].raw
    simulated = surfaces_simulated["responses_stream"].raw
    assert _event_order(simulated) == _event_order(reference)
    assert "[DONE]" not in simulated
    numbers = [
        json.loads(line.removeprefix("data: "))["sequence_number"]
        for line in simulated.splitlines()
        if line.startswith("data: ")
    ]
    assert numbers == list(range(len(numbers)))


def _facts(answer: Answer) -> Any:
    """The values a client acts on: errors, finish reasons, which message
    fields hold what (not the text a model happens to write)."""
    body = json.loads(answer.raw) if answer.raw.startswith("{") else None
    if body is None:
        return answer.status
    if "error" in body:
        return answer.status, body["error"]
    facts: list[Any] = [answer.status, body.get("status")]
    for choice in body.get("choices", []):
        message = choice.get("message") or {}
        facts.append(
            (
                choice["index"],
                choice.get("finish_reason"),
                message.get("content") == "",
                message.get("content") is None,
                [c["function"]["name"] for c in message.get("tool_calls", [])],
            )
        )
    for item in body.get("output", []):
        facts.append((item["type"], item.get("name"), item.get("status")))
    return facts


@pytest.mark.parametrize(
    "case",
    [
        "chat_tool_named",
        "chat_tool_required",
        "chat_json_schema",
        "chat_json_object",
        "chat_n3_greedy",
        "completion_suffix",
        "responses_tool_named",
        "responses_previous_id",
        "responses_get_stored",
    ],
)
def test_sim_surface_answers_what_vllm_answered(
    case: str,
    surfaces_reference: dict[str, Answer],
    surfaces_simulated: dict[str, Answer],
) -> None:
    reference = _facts(surfaces_reference[case])
    simulated = _facts(surfaces_simulated[case])
    if isinstance(reference, tuple):  # an error: the same but for the id quoted
        assert simulated[0] == reference[0]
        assert simulated[1]["type"] == reference[1]["type"]
        assert simulated[1]["param"] == reference[1]["param"]
        prefix = reference[1]["message"].split("'")[0]
        assert simulated[1]["message"].startswith(prefix)
    else:
        assert simulated == reference


def test_sim_without_a_tool_parser_refuses_tool_choice_as_vllm_does(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    reference = read_surfaces(SURFACES_DIR / "no_tool_parser")
    tmp = tmp_path_factory.mktemp("sim-no-tool-parser")
    with sim_replica(
        tmp, *CAPTURE_SERVER_FLAGS, "--sim-profile", "cpu-tiny", model="tiny-llama"
    ) as process:
        simulated = capture_surfaces(process.url, "tiny-llama", only=reference)
    for name, answer in reference.items():
        got = simulated[name]
        assert (got.status, got.content_type) == (answer.status, answer.content_type)
        assert json.loads(got.raw) == json.loads(answer.raw), name


def test_sim_with_the_responses_store_keeps_responses_as_vllm_does(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = read_surfaces(SURFACES_DIR / "responses_store")
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
    tmp = tmp_path_factory.mktemp("sim-responses-store")
    with sim_replica(
        tmp, *CAPTURE_SERVER_FLAGS, "--sim-profile", "cpu-tiny", model="tiny-llama"
    ) as process:
        simulated = capture_surfaces(process.url, "tiny-llama", only=reference)
    for name, answer in reference.items():
        shape = _tokens_unkeyed(surface_shape(answer))
        assert diff_json_shapes(shape, surface_shape(simulated[name])) == [], name
    first = json.loads(simulated["responses_store_true"].raw)
    follow_up = json.loads(simulated["responses_previous_id"].raw)
    assert follow_up["previous_response_id"] == first["id"]
    # The earlier turn is in the follow-up's prompt.
    assert follow_up["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert json.loads(simulated["responses_get_stored"].raw) == first
