"""The gateway's traces (routing.traces): what is built off, unsampled and sampled."""

from __future__ import annotations

import time

from opentelemetry import trace as otel
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import StatusCode

from routing.domain.policies import RouteDecision
from routing.responses import GatewayError
from routing.traces import NO_TRACE, TRACING_OFF, Tracing, build_tracing

PATH = "/v1/chat/completions"


def tracing(ratio: float) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider.get_tracer("test")), exporter


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_tracing_off_builds_nothing_and_sends_no_traceparent() -> None:
    assert build_tracing(
        is_enabled=False,
        endpoint="",
        sample_ratio=1.0,
        service_name="gateway",
        resource_attributes={},
    ) is (TRACING_OFF)
    trace = TRACING_OFF.start_request("POST", PATH, {})
    assert trace is NO_TRACE
    assert trace.start("gateway.route") is otel.INVALID_SPAN
    with trace.span("gateway.plan") as span:
        assert span is otel.INVALID_SPAN
    assert trace.engine_header(otel.INVALID_SPAN) == b""
    trace.end()


def test_unsampled_request_records_no_span_but_passes_its_context_on() -> None:
    traces, exporter = tracing(0.0)
    trace = traces.start_request("POST", PATH, {})
    assert not trace.is_recording
    assert trace.start("gateway.route") is otel.INVALID_SPAN
    header = trace.engine_header(otel.INVALID_SPAN)
    trace.end()
    # The engine's own ParentBased sampler then leaves the request untraced.
    trace_id = f"{trace.root.get_span_context().trace_id:032x}"
    assert header.startswith(b"traceparent: 00-" + trace_id.encode())
    assert int(header[-4:-2], 16) & 1 == 0  # not sampled
    assert exporter.get_finished_spans() == ()


def test_sampled_request_names_its_steps_under_one_root() -> None:
    traces, exporter = tracing(1.0)
    trace = traces.start_request("POST", PATH, {})
    with trace.span("gateway.authenticate"):
        pass
    trace.routed(
        RouteDecision(("r2", "r1"), "prefix_affinity", skipped_over_bound=1),
        2,
        started_at=time.monotonic(),
    )
    engine = trace.start("chat chat-7b")
    header = trace.engine_header(engine)
    engine.end()
    trace.end()

    spans = by_name(exporter)
    root = spans[f"POST {PATH}"]
    assert root.attributes is not None
    assert root.attributes["http.response.status_code"] == 200
    for name in ("gateway.authenticate", "gateway.route", "chat chat-7b"):
        parent = spans[name].parent
        assert parent is not None
        assert parent.span_id == root.context.span_id
    assert spans["gateway.route"].attributes == {
        "platform.routing.policy": "prefix_affinity",
        "platform.routing.replicas": 2,
        "platform.routing.candidates": 2,
        "platform.routing.skipped_for_load": 1,
        "platform.routing.replica_id": "r2",
        "platform.routing.reason": "skipped_for_load",
    }
    context = spans["chat chat-7b"].context
    assert header.startswith(
        f"traceparent: 00-{context.trace_id:032x}-{context.span_id:016x}-".encode()
    )
    assert int(header[-4:-2], 16) & 1 == 1  # sampled (0x02: a random trace id)


def test_a_refusal_is_noted_by_status_and_code_never_message() -> None:
    traces, exporter = tracing(1.0)
    trace = traces.start_request("POST", PATH, {})
    refusal = GatewayError(429, "team alpha: secret words", code="rate_limited")
    try:
        with trace.span("gateway.admission"):
            raise refusal
    except GatewayError as exc:
        trace.end(exc)

    for span in exporter.get_finished_spans():
        assert span.attributes is not None
        assert span.attributes["http.response.status_code"] == 429
        assert span.attributes["error.type"] == "rate_limited"
        assert span.status.status_code is StatusCode.ERROR
        assert "secret" not in str(span.to_json())


def test_a_clients_traceparent_parents_the_root() -> None:
    traces, exporter = tracing(0.0)
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {b"traceparent": f"00-{trace_id}-{parent_id}-01".encode()}
    # Sampled by its parent, though the ratio is 0 (ParentBased).
    trace = traces.start_request("POST", PATH, headers)
    trace.end()
    (root,) = exporter.get_finished_spans()
    assert f"{root.context.trace_id:032x}" == trace_id
    assert root.parent is not None
    assert f"{root.parent.span_id:016x}" == parent_id
