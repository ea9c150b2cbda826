"""The gateway's relay loop on recorded vLLM bytes, however the network splits them.

``Gateway._forward`` forwards whole runs of token events untouched and only looks
inside a read that holds anything else (the usage chunk, an error event, ``[DONE]``
or a cut event). These tests feed it a stream captured from real vLLM, cut at every
size, and check what reaches the client byte for byte.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from routing.domain.resolve import Resolution
from routing.domain.tiers import Tier
from routing.gateway import Gateway, GatewaySettings, _Call, _UpstreamFailed
from routing.live import LiveLoad

CAPTURE = (
    Path(__file__).resolve().parents[2] / "engine_nodes/tests/data/vllm_stream.txt"
)
STREAM = CAPTURE.read_bytes()
EVENTS = [e + b"\n\n" for e in STREAM.split(b"\n\n") if e]
TOKEN_EVENTS = [e for e in EVENTS if b'"choices":[{' in e]
UPSTREAM_USAGE = json.loads(EVENTS[-2][6:])["usage"]


class _Reader:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


class _Response:
    def __init__(self, chunks: list[bytes]) -> None:
        self.content = _Reader(chunks)


class _Ticket:
    headers: dict[str, str] = {}


def _gateway() -> Gateway:
    live = LiveLoad(
        gateway_id="test", region="r1", redis=None, prefix="t", beat_s=1, missed_beats=3
    )
    return Gateway(
        settings=GatewaySettings(region="r1"),
        load_snapshot=None,  # type: ignore[arg-type]
        live=live,
        usage_counter=None,
    )


def _call(stream: bool = True, max_tokens: int = 5) -> _Call:
    return _Call(
        request_id="chatcmpl-test",
        team="team-a",
        model_ref="chat-7b",
        resolution=Resolution(
            model="chat-7b",
            version="v1",
            is_pinned=False,
            is_canary=False,
            shadow_version=None,
        ),
        tier=Tier.STANDARD,
        prompt_tokens=11,
        max_tokens=max_tokens,
        stream=stream,
        started_at=0.0,
        replica_id="rep-1",
        in_flight=11 + max_tokens,
    )


def _relay(
    chunks: list[bytes],
    stream: bool = True,
    *,
    call: _Call | None = None,
    gateway: Gateway | None = None,
) -> tuple[str, _Call, list[Any]]:
    """Run ``_forward`` over ``chunks``; return its outcome, the call and what was sent."""
    gateway, call, sent = gateway or _gateway(), call or _call(stream), []
    gateway.live.add("rep-1", call.in_flight)

    async def send(message: Any) -> None:
        sent.append(message)

    outcome = asyncio.run(gateway._forward(call, _Response(chunks), send, _Ticket()))
    return outcome, call, sent


def _cut(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def _body(sent: list[Any]) -> bytes:
    return b"".join(
        m.get("body", b"") for m in sent if m["type"] == "http.response.body"
    )


@pytest.mark.parametrize("size", [1, 2, 7, 64, 300, 1000, len(STREAM)])
def test_token_events_pass_byte_for_byte_then_the_gateways_usage(size: int):
    outcome, call, sent = _relay(_cut(STREAM, size))

    assert outcome == "ok"
    assert sent[0]["type"] == "http.response.start"
    body = _body(sent)
    forwarded = b"".join(TOKEN_EVENTS)
    assert body.startswith(forwarded)
    final_event, done = body[len(forwarded) :].split(b"\n\n", 1)
    assert done == b"data: [DONE]\n\n"
    final = json.loads(final_event.removeprefix(b"data: "))
    assert final["choices"] == []
    assert final["replica_id"] == "rep-1"
    assert final["usage"]["completion_tokens"] == UPSTREAM_USAGE["completion_tokens"]
    assert final["usage"]["prompt_tokens"] == UPSTREAM_USAGE["prompt_tokens"]
    assert sent[-1]["more_body"] is False
    assert call.events == len(TOKEN_EVENTS)
    assert call.usage["completion_tokens"] == UPSTREAM_USAGE["completion_tokens"]


def test_the_usage_chunk_in_the_same_read_as_tokens_is_not_forwarded_raw():
    last_tokens_and_usage = b"".join(EVENTS[-3:-1])
    chunks = [b"".join(EVENTS[:-3]), last_tokens_and_usage, EVENTS[-1]]

    outcome, call, sent = _relay(chunks)

    assert outcome == "ok"
    assert b"created_cache_tokens" not in _body(sent)  # vLLM's own usage chunk
    assert call.events == len(TOKEN_EVENTS)


def test_tokens_in_flight_fall_as_events_pass_and_leave_the_prompt():
    gateway, call = _gateway(), _call(max_tokens=40)

    events = [EVENTS[0], *TOKEN_EVENTS[1:5] * 5]  # 21 events, one read each
    _relay(events, call=call, gateway=gateway)

    # Lowered in steps of a few events, never below the prompt.
    exact = call.prompt_tokens + call.max_tokens - len(events)
    assert exact <= call.in_flight < exact + 8
    assert gateway.live.tokens_in_flight("rep-1") == call.in_flight


def test_an_error_event_after_tokens_ends_the_stream_with_an_error():
    error = b'data: {"error": {"message": "engine died", "code": 500}}\n\n'

    outcome, _, sent = _relay([b"".join(EVENTS[:3]), error])

    assert outcome == "error"
    body = _body(sent)
    assert body.startswith(b"".join(TOKEN_EVENTS[:3]))
    assert b'"code": "upstream_failed"' in body
    assert body.endswith(b"data: [DONE]\n\n")


def test_an_error_or_a_close_before_the_first_token_can_be_retried():
    error = b'data: {"error": {"message": "engine died", "code": 500}}\n\n'
    for chunks in ([error], [EVENTS[0][:20]], []):
        with pytest.raises(_UpstreamFailed):
            _relay(chunks)


def test_a_stream_that_breaks_after_tokens_ends_with_an_error_event():
    outcome, call, sent = _relay([b"".join(EVENTS[:4]), EVENTS[4][:30]])

    assert outcome == "error"
    assert call.events == 4
    assert b'"code": "upstream_failed"' in _body(sent)


def test_a_non_streaming_answer_collects_the_text():
    outcome, _, sent = _relay(_cut(STREAM, 64), stream=False)

    assert outcome == "ok"
    answer = json.loads(_body(sent))
    text = "".join(
        json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
        for e in TOKEN_EVENTS
    )
    assert answer["choices"][0]["message"]["content"] == text
    assert answer["usage"]["completion_tokens"] == UPSTREAM_USAGE["completion_tokens"]
