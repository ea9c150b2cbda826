"""``POST /v1/responses`` through the gateway, in process, to a replica that answers
with real vLLM 0.32 bytes.

The replica is a tiny aiohttp app on the gateway's own event loop that answers
``/v1/responses`` with ``data/vllm_responses_stream.sse`` (captured from vLLM),
cut in small writes, and keeps the bodies it was sent. The gateway is the
``EmbeddedGateway``, so the test reads what was metered and charged. What users
see through real processes and the openai SDK is ``test_responses_e2e.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from localrun.processes import free_port
from metering.domain.usage import UsageCounts
from routing.tests.embedded_gateway import MODEL, EmbeddedGateway

STREAM = (Path(__file__).parent / "data/vllm_responses_stream.sse").read_bytes()
EVENTS = [e + b"\n\n" for e in STREAM.split(b"\n\n") if e]
TERMINAL = json.loads(EVENTS[-1].split(b"\ndata: ", 1)[1])
ENGINE_USAGE = TERMINAL["response"]["usage"]


class Replica:
    """A replica that answers every response with the captured stream."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def respond(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, len(STREAM), 97):
            await response.write(STREAM[start : start + 97])
        await response.write_eof()
        return response


@pytest.fixture
def served() -> Iterator[tuple[EmbeddedGateway, Replica]]:
    replica = Replica()
    app = web.Application()
    app.router.add_post("/v1/responses", replica.respond)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    port = free_port()
    with EmbeddedGateway(f"http://127.0.0.1:{port}") as gateway:
        # On the gateway's loop, which runs while it serves a request.
        gateway.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", port)
        gateway.loop.run_until_complete(site.start())
        try:
            yield gateway, replica
        finally:
            gateway.loop.run_until_complete(runner.cleanup())


def metered(gateway: EmbeddedGateway) -> UsageCounts:
    return sum(gateway.metered().values(), UsageCounts())


def test_whole_response_is_the_engines_with_who_served_it(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    answer = gateway.request(
        "/v1/responses", {"model": MODEL, "input": "hello", "max_output_tokens": 4}
    )
    assert answer.status == 200, answer.body[:300]
    body = answer.json()
    served_by = {
        "model": MODEL,
        "model_version": "v1",
        "region": "embedded",
        "replica_id": f"{MODEL}-v1-embedded-0",
    }
    assert body == {**TERMINAL["response"], **served_by}
    assert answer.headers["x-request-id"] == TERMINAL["response"]["id"]
    assert answer.headers["x-model-version"] == "v1"
    sent = replica.bodies[-1]
    assert (sent["stream"], sent["store"], sent["max_output_tokens"]) == (
        True,
        False,
        4,
    )
    usage = metered(gateway)
    assert usage.prompt_tokens == ENGINE_USAGE["input_tokens"]
    assert usage.output_tokens == ENGINE_USAGE["output_tokens"]
    assert usage.requests == 1


def test_streamed_response_forwards_the_engines_events(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, _ = served
    answer = gateway.request(
        "/v1/responses",
        {"model": MODEL, "input": "hello", "stream": True, "store": False},
    )
    assert answer.status == 200, answer.body[:300]
    assert answer.headers["content-type"].startswith("text/event-stream")
    forwarded, end = answer.body.rsplit(b"event: response.completed\n", 1)
    assert forwarded == b"".join(EVENTS[:-1])
    final = json.loads(end.removeprefix(b"data: "))
    assert final["sequence_number"] == TERMINAL["sequence_number"]
    assert final["response"]["usage"] == ENGINE_USAGE
    assert final["response"]["replica_id"] == f"{MODEL}-v1-embedded-0"
    usage = metered(gateway)
    assert (usage.prompt_tokens, usage.output_tokens) == (
        ENGINE_USAGE["input_tokens"],
        ENGINE_USAGE["output_tokens"],
    )


@pytest.mark.parametrize(
    ("field", "value", "param", "code"),
    [
        ("store", True, "store", "unsupported_value"),
        ("previous_response_id", "resp_1", "previous_response_id", None),
        ("background", True, "background", "unsupported_value"),
        ("conversation", "conv_1", "conversation", None),
    ],
)
def test_stored_state_is_refused_before_admission(
    served: tuple[EmbeddedGateway, Replica],
    field: str,
    value: Any,
    param: str,
    code: str | None,
) -> None:
    gateway, replica = served
    answer = gateway.request(
        "/v1/responses", {"model": MODEL, "input": "hello", field: value}
    )
    assert answer.status == 400
    error = answer.json()["error"]
    assert error["param"] == param
    assert error["code"] == (code or "unsupported_parameter")
    assert not gateway.is_charged()
    assert replica.bodies == []
    assert metered(gateway) == UsageCounts()


def test_responses_takes_only_post(served: tuple[EmbeddedGateway, Replica]) -> None:
    gateway, _ = served
    answer = gateway.request("/v1/responses", method="GET")
    assert answer.status == 405
    assert answer.headers["allow"] == "POST"
