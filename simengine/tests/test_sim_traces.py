"""The simulated replica's spans (simengine.traces): vLLM's ``llm_request``,
parented by the request's ``traceparent``, without prompt text."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind

from simengine import cli
from simengine.server import build_app
from simengine.traces import EngineTracer

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PROMPT = "the walrus recites prime numbers backwards"


def test_a_chat_request_is_one_server_span_under_its_traceparent() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    args = cli.parse_args(cli.build_parser(), ["--model", "m", "--sim-a-ms", "0.1"])
    options, faults = cli.options_from_args(args)
    app = build_app(
        options, faults=faults, tracer=EngineTracer(provider.get_tracer("vllm"))
    )

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as c:
            return await c.post(
                "/v1/chat/completions",
                json={
                    "model": "m",
                    "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": 3,
                    "ignore_eos": True,
                    "stream": True,
                },
                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
            )

    response = asyncio.run(ask())
    assert response.status_code == 200
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request"
    assert span.kind is SpanKind.SERVER
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT_ID
    attributes: dict[str, Any] = dict(span.attributes or {})
    assert attributes["gen_ai.usage.completion_tokens"] == 3
    assert attributes["gen_ai.request.max_tokens"] == 3
    assert attributes["gen_ai.latency.time_to_first_token"] > 0
    assert PROMPT.split()[1] not in json.dumps(attributes)
