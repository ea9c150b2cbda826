"""Every call the gateway makes to an engine carries the request's trace context.

The answer's own call is ``routing/tests/test_traces.py``'s; here the others, each
under a client span of its own (``RequestTrace.side_call``): ``POST /tokenize``'s
try, the chunks of a split embeddings request, a shadow copy, and the live
judge's two answers and verdict. The replica is a tiny aiohttp app on the
gateway's own event loop that keeps the headers it was sent.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from localrun.processes import free_port
from metering.domain.figures import Role
from metering.figures import MemoryFigureRecorder
from routing.domain.snapshot import ConfigSnapshot
from routing.domain.tiers import Tier
from routing.live_judge import LiveJudge
from routing.tests.embedded_gateway import EMBEDDING_MODEL, MODEL, EmbeddedGateway
from routing.traces import Tracing

CAPTURE = Path(__file__).resolve().parents[2] / "simengine/tests/data/vllm_stream.txt"
SECRET = "a prompt no span may hold"
CHAT_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "stream": True}
).encode()
# Enough inputs and tokens for the default rule to split them over 2 replicas.
SPLIT_INPUTS = [f"text {i} " + "word " * 20 for i in range(40)]


class Replica:
    """Answers chat (vLLM's captured stream), embeddings and tokenize, keeping
    each request's path and ``traceparent``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []

    async def chat(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("traceparent")))
        return web.Response(body=CAPTURE.read_bytes(), content_type="text/event-stream")

    async def tokenize(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("traceparent")))
        return web.json_response(
            {"count": 2, "max_model_len": 8192, "tokens": [1, 2], "token_strs": None}
        )

    async def embed(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("traceparent")))
        inputs = (await request.json())["input"]
        return web.json_response(
            {
                "id": "embd-1",
                "object": "list",
                "created": 1,
                "model": EMBEDDING_MODEL,
                "data": [
                    {"index": i, "object": "embedding", "embedding": [0.5] * 4}
                    for i in range(len(inputs))
                ],
                "usage": {"prompt_tokens": 7, "total_tokens": 7},
            }
        )


@pytest.fixture(params=[1.0], ids=["sampled"])
def served(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[EmbeddedGateway, Replica, InMemorySpanExporter]]:
    """A traced gateway (sampling ratio ``param``) with two embedding replicas and
    one chat replica, all this one app."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(request.param)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    replica = Replica()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", replica.chat)
    app.router.add_post("/v1/embeddings", replica.embed)
    app.router.add_post("/tokenize", replica.tokenize)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    port = free_port()
    with EmbeddedGateway(
        f"http://127.0.0.1:{port}",
        embedding=True,
        embedding_replicas=2,
        tracing=Tracing(provider.get_tracer("test")),
    ) as gateway:
        gateway.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", port)
        gateway.loop.run_until_complete(site.start())
        try:
            yield gateway, replica, exporter
        finally:
            gateway.loop.run_until_complete(runner.cleanup())


def snapshot_of(gateway: EmbeddedGateway) -> ConfigSnapshot:
    snapshot = gateway.snapshots.current
    assert snapshot is not None
    return snapshot


def traceparent_of(span: ReadableSpan) -> str:
    context = span.context
    return (
        f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    )


def client_spans(exporter: InMemorySpanExporter, purpose: str) -> list[ReadableSpan]:
    return [
        span
        for span in exporter.get_finished_spans()
        if span.attributes is not None
        and span.attributes.get("platform.purpose") == purpose
    ]


def assert_no_text(exporter: InMemorySpanExporter, *texts: str) -> None:
    for span in exporter.get_finished_spans():
        for text in texts:
            assert text not in span.to_json(), span.name


def test_tokenize_sends_the_traceparent_of_its_client_span(
    served: tuple[EmbeddedGateway, Replica, InMemorySpanExporter],
) -> None:
    gateway, replica, exporter = served
    answer = gateway.request("/tokenize", {"model": MODEL, "prompt": SECRET})
    assert answer.status == 200
    (span,) = client_spans(exporter, "tokenize")
    assert span.name == f"tokenize {MODEL}"
    assert replica.seen == [("/tokenize", traceparent_of(span))]
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "POST /tokenize"]
    assert span.parent is not None and span.parent.span_id == root.context.span_id
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 200
    assert_no_text(exporter, SECRET)


def test_each_chunk_of_a_split_embeddings_request_sends_its_own_traceparent(
    served: tuple[EmbeddedGateway, Replica, InMemorySpanExporter],
) -> None:
    gateway, replica, exporter = served
    answer = gateway.request(
        "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": SPLIT_INPUTS}
    )
    assert answer.status == 200, answer.body
    spans = client_spans(exporter, "split")
    chunks = [s.attributes["platform.chunk"] for s in spans if s.attributes]
    assert sorted(int(str(chunk)) for chunk in chunks) == [0, 1]
    assert sorted(replica.seen) == sorted(
        ("/v1/embeddings", traceparent_of(span)) for span in spans
    )
    (root,) = [s for s in exporter.get_finished_spans() if s.name.startswith("POST")]
    for span in spans:
        assert span.parent is not None and span.parent.span_id == root.context.span_id
        assert span.attributes is not None
        assert span.attributes["gen_ai.usage.input_tokens"] == 7
    assert_no_text(exporter, "word word")


def test_a_shadow_copy_sends_the_traceparent_of_its_client_span(
    served: tuple[EmbeddedGateway, Replica, InMemorySpanExporter],
) -> None:
    gateway, replica, exporter = served
    trace = gateway.app.tracing.start_request("POST", "/v1/chat/completions", {})
    gateway.loop.run_until_complete(
        gateway.app.chat.shadow.copy(
            snapshot_of(gateway),
            model=MODEL,
            version="v1",
            payload=CHAT_BODY,
            trace=trace,
        )
    )
    trace.end()
    (span,) = client_spans(exporter, "shadow")
    assert span.name == f"chat {MODEL}"
    assert replica.seen == [("/v1/chat/completions", traceparent_of(span))]
    assert span.parent is not None
    assert span.parent.span_id == trace.root.get_span_context().span_id
    assert_no_text(exporter, SECRET, "shutdown")  # nor the answer's text


def test_the_live_judges_three_calls_send_their_traceparents(
    served: tuple[EmbeddedGateway, Replica, InMemorySpanExporter],
) -> None:
    """GIVEN chat-7b judged by itself (one version: candidate and live are v1)
    WHEN a pair is judged under a request's trace
    THEN both answers and the verdict went out with the traceparent of their
    own client spans, children of the gateway.live_judge span."""
    gateway, replica, exporter = served
    snapshot = snapshot_of(gateway)
    record = dataclasses.replace(snapshot.models[MODEL], judge_model=MODEL)
    snapshot = dataclasses.replace(snapshot, models={**snapshot.models, MODEL: record})
    judge = LiveJudge(
        live=gateway.live,
        upstream=gateway.upstream,
        region="embedded",
        concurrency=1,
        figures=MemoryFigureRecorder(),
    )
    trace = gateway.app.tracing.start_request("POST", "/v1/chat/completions", {})
    gateway.loop.run_until_complete(
        judge.judge(
            snapshot,
            model=MODEL,
            candidate="v1",
            live_version="v1",
            role=Role.CANARY,
            payload=CHAT_BODY,
            tier=Tier.STANDARD,
            pair_key="chatcmpl-1",
            trace=trace,
        )
    )
    trace.end()
    (judging,) = [
        s for s in exporter.get_finished_spans() if s.name == "gateway.live_judge"
    ]
    calls = {
        purpose: client_spans(exporter, purpose)
        for purpose in ("judge_candidate", "judge_live", "judge_verdict")
    }
    assert all(len(spans) == 1 for spans in calls.values()), calls
    sent = sorted(
        str(tp) for path, tp in replica.seen if path == "/v1/chat/completions"
    )
    assert sent == sorted(traceparent_of(spans[0]) for spans in calls.values())
    for (span,) in calls.values():
        assert span.parent is not None
        assert span.parent.span_id == judging.context.span_id
    assert judging.attributes is not None
    assert judging.attributes["platform.judge.outcome"] != "incomplete"
    assert_no_text(exporter, SECRET, "shutdown")


@pytest.mark.parametrize("served", [0.0], indirect=True, ids=["unsampled"])
def test_unsampled_side_calls_still_pass_the_context_on_unsampled(
    served: tuple[EmbeddedGateway, Replica, Any],
) -> None:
    """An engine whose sampler is ParentBased (vLLM's) then traces nothing."""
    gateway, replica, exporter = served
    gateway.request("/tokenize", {"model": MODEL, "prompt": "hello"})
    trace = gateway.app.tracing.start_request("POST", "/v1/chat/completions", {})
    gateway.loop.run_until_complete(
        gateway.app.chat.shadow.copy(
            snapshot_of(gateway),
            model=MODEL,
            version="v1",
            payload=CHAT_BODY,
            trace=trace,
        )
    )
    trace.end()
    assert [path for path, _ in replica.seen] == ["/tokenize", "/v1/chat/completions"]
    for _, traceparent in replica.seen:
        assert traceparent is not None
        assert int(traceparent[-2:], 16) & 1 == 0  # not sampled
    root_id = f"{trace.root.get_span_context().span_id:016x}"
    assert replica.seen[1][1] is not None and root_id in replica.seen[1][1]
    assert exporter.get_finished_spans() == ()
