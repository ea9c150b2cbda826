"""Traces end to end: one streamed request through a real gateway and simulated
replica, its spans received by an OTLP/HTTP collector process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from django.utils import timezone

from localrun.processes import wait_until
from rollouts import services as rollouts
from tests.live import LivePlatform, start_platform
from tests.otlp_collector import read_spans, running_collector

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Said in the prompt only: no attribute of any span may carry it.
SECRET = "zebra-quartz-7731 the plum heron sings at midnight"
GATEWAY_STEPS = {
    "gateway.authenticate",
    "gateway.plan",
    "gateway.admission",
    "gateway.route",
    "gateway.relay",
}


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Run the OTLP/HTTP receiver; yield its traces URL and its spans file."""
    out = tmp_path_factory.mktemp("otlp") / "spans.jsonl"
    with running_collector(out) as url:
        yield url, out


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    collector: tuple[str, Path],
) -> Iterator[LivePlatform]:
    url, _ = collector
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp_path_factory.mktemp("platform"),
            pools={"v1": 1, "v2": 1},  # v2 for the shadow copy
            PLATFORM_TRACES_ENABLED="true",
            PLATFORM_TRACES_ENDPOINT=url,
            PLATFORM_TRACES_SAMPLE_RATIO="1",
            # Export within 0.1 s, not the SDK's 5 s (gateway and replica).
            OTEL_BSP_SCHEDULE_DELAY="100",
        ) as live,
    ):
        yield live


def trace_of(spans_file: Path, answer_id: str) -> list[dict[str, Any]]:
    """Wait for the trace whose replica span names ``answer_id`` to hold the
    gateway's root; return its spans."""

    def whole() -> list[dict[str, Any]] | None:
        spans = read_spans(spans_file)
        engine = [
            s
            for s in spans
            if s["name"] == "llm_request"
            and s["attributes"].get("gen_ai.request.id") == answer_id
        ]
        if not engine:
            return None
        trace = [s for s in spans if s["trace_id"] == engine[0]["trace_id"]]
        names = {s["name"] for s in trace}
        # The gateway's root (a server span) ends last, after the answer, and
        # may come in a later export batch than its children: wait for it too.
        root = any(s["kind"] == 2 and s["name"].startswith("POST ") for s in trace)
        if not names >= GATEWAY_STEPS or not root:
            return None
        return trace

    # Generous: on a loaded machine the exporters' batches come late.
    return wait_until(whole, timeout_s=60, message=f"the trace of {answer_id}")


def test_one_streamed_request_is_one_trace_across_gateway_and_replica(
    platform: LivePlatform, collector: tuple[str, Path]
) -> None:
    _, spans_file = collector
    stream = platform.client("alpha").chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": SECRET}],
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    answer_id = chunks[0].id
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    trace = trace_of(spans_file, answer_id)

    by_name = {s["name"]: s for s in trace}
    root = next(s for s in trace if s["parent_span_id"] == "")
    assert root["service"] == "gateway"
    assert root["name"] == "POST /v1/chat/completions"
    attributes = root["attributes"]
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "chat-7b"
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["platform.team"] == "alpha"
    assert attributes["platform.tier"] == "standard"
    assert attributes["platform.version"] == "v1"
    assert attributes["platform.region"] == "e2e"
    assert attributes["http.response.status_code"] == 200
    # Every gateway step hangs under the root.
    for name in GATEWAY_STEPS:
        assert by_name[name]["parent_span_id"] == root["span_id"], name
    assert by_name["gateway.admission"]["attributes"]["platform.tier"] == "standard"
    route = by_name["gateway.route"]["attributes"]
    assert route["platform.routing.reason"] == "owner"
    assert route["platform.routing.replica_id"].startswith("chat-7b-v1-e2e-")
    # The engine call: a GenAI client span, parent of the replica's own span.
    engine = by_name["chat chat-7b"]
    assert engine["kind"] == 3  # CLIENT
    assert engine["parent_span_id"] == root["span_id"]
    assert engine["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert engine["attributes"]["platform.ttft_ms"] > 0
    assert [e["name"] for e in engine["events"]] == ["gen_ai.first_token"]
    replica = by_name["llm_request"]
    assert replica["service"] == "vllm"
    assert replica["kind"] == 2  # SERVER
    assert replica["parent_span_id"] == engine["span_id"]
    assert replica["attributes"]["gen_ai.usage.completion_tokens"] == 5
    assert replica["attributes"]["gen_ai.latency.time_to_first_token"] > 0
    # No prompt or answer text anywhere in the spans.
    dumped = json.dumps(trace)
    assert SECRET not in dumped
    for word in SECRET.split() + [w for w in text.split() if len(w) > 6]:
        if len(word) > 6:
            assert word not in dumped, word


def test_a_clients_traceparent_is_the_traces_parent(
    platform: LivePlatform, collector: tuple[str, Path]
) -> None:
    _, spans_file = collector
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    chunks = list(
        platform.client("alpha").chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=2,
            stream=True,
            extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        )
    )

    trace = trace_of(spans_file, chunks[0].id)

    assert {s["trace_id"] for s in trace} == {trace_id}
    root = next(s for s in trace if s["name"] == "POST /v1/chat/completions")
    assert root["parent_span_id"] == parent_id


def test_a_shadow_copy_joins_the_requests_trace(
    platform: LivePlatform, collector: tuple[str, Path], unblocked: None
) -> None:
    """GIVEN v2 shadowing all of chat-7b's requests
    WHEN a request is answered by v1
    THEN its copy to v2 is a client span of the request's trace (purpose
    shadow), and v2's replica span hangs under it: the copy sent its own
    traceparent. No prompt text in any of them."""
    _, spans_file = collector
    rollouts.set_rollout(
        model_id="chat-7b",
        version="v2",
        stage="shadow",
        percent=100,
        now=timezone.now(),
    )
    try:

        def copied() -> tuple[dict[str, Any], ...] | None:
            platform.client("alpha").chat.completions.create(
                model="chat-7b",
                messages=[{"role": "user", "content": SECRET}],
                max_tokens=3,
            )
            spans = read_spans(spans_file)
            by_id = {s["span_id"]: s for s in spans}
            for copy in spans:
                if copy["attributes"].get("platform.purpose") != "shadow":
                    continue
                root = by_id.get(copy["parent_span_id"])
                replica = [s for s in spans if s["parent_span_id"] == copy["span_id"]]
                if root is not None and replica:
                    return copy, root, replica[0]
            return None

        copy, root, replica = wait_until(
            copied, timeout_s=60, interval_s=0.5, message="a shadow copy's trace"
        )
    finally:
        rollouts.set_alias(model_id="chat-7b", version="v1")
    assert copy["kind"] == 3  # CLIENT
    assert copy["name"] == "chat chat-7b"
    assert copy["attributes"]["platform.version"] == "v2"
    assert root["name"] == "POST /v1/chat/completions"
    assert replica["name"] == "llm_request"
    assert replica["service"] == "vllm"
    assert {copy["trace_id"], root["trace_id"], replica["trace_id"]} == {
        root["trace_id"]
    }
    assert SECRET not in json.dumps([copy, root, replica])
