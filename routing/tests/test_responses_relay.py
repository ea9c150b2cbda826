"""The ``/v1/responses`` relay on recorded vLLM bytes, however the network splits them.

``data/vllm_responses_stream.sse`` is real vLLM 0.32's answer to a streamed
``POST /v1/responses`` (captured for the simulated replica's conformance: two
opening events, the output, ``response.completed`` and no ``[DONE]``). The relay
is fed it cut at every small size and some large ones; what reaches the client is
checked byte for byte, and what the answer's end is built from.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from routing.relay import UpstreamFailed
from routing.responses import (
    FinalUsage,
    response_end_event,
    response_error_event,
    whole_response,
)
from routing.responses_relay import ResponsesRelay, output_text

STREAM = (Path(__file__).parent / "data/vllm_responses_stream.sse").read_bytes()
EVENTS = [e + b"\n\n" for e in STREAM.split(b"\n\n") if e]
TERMINAL = json.loads(EVENTS[-1].split(b"\ndata: ", 1)[1])
# Everything but the terminal event goes to the client as it came.
FORWARDED = b"".join(EVENTS[:-1])
DELTAS = [e for e in EVENTS if e.startswith(b"event: response.output_text.delta\n")]
SIZES = [*range(1, 80), 128, 257, 1000, 2048, len(STREAM)]


class Reader:
    """The engine's side: hands out the given chunks, then end of stream."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


class Run:
    """One relay over ``chunks``: what it returned, sent and reported."""

    def __init__(
        self, chunks: list[bytes], *, stream: bool = True, capture_head: bool = False
    ) -> None:
        self.sent: list[dict[str, Any]] = []
        self.started: list[str] = []
        self.reported: list[int] = []

        async def send(message: Any) -> None:
            self.sent.append(message)

        async def on_first(answer_id: str) -> None:
            self.started.append(answer_id)

        self.relay = ResponsesRelay(
            send=send,
            stream=stream,
            request_id="resp_gateway",
            on_first=on_first,
            on_tokens=self.reported.append,
            capture_head=capture_head,
        )
        self.is_done = asyncio.run(self.relay.run(Reader(chunks)))

    @property
    def body(self) -> bytes:
        return b"".join(m["body"] for m in self.sent)


def cut(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", SIZES)
def test_responses_relay_forwards_events_byte_for_byte(size: int) -> None:
    run = Run(cut(STREAM, size))

    assert run.is_done is True
    assert run.started == ["resp_846a17c852ebcdbf"]  # the engine's id
    assert run.body == FORWARDED
    assert all(m["more_body"] for m in run.sent)
    assert run.relay.terminal == TERMINAL
    outcome = run.relay.outcome()
    assert outcome.events == len(DELTAS) == 2
    assert outcome.response == TERMINAL["response"]
    usage = FinalUsage.of(outcome, prompt_tokens=99, role_chunks=0)
    assert usage == FinalUsage(prompt_tokens=11, cached_tokens=0, completion_tokens=4)


@pytest.mark.parametrize("size", [1, 7, 300, len(STREAM)])
def test_responses_relay_whole_answer_sends_nothing(size: int) -> None:
    run = Run(cut(STREAM, size), stream=False)

    assert run.is_done is True
    assert run.sent == []
    assert run.started == ["resp_846a17c852ebcdbf"]
    assert run.relay.outcome().response == TERMINAL["response"]
    assert run.relay.head_text() == "shutdownGenericAliascasecase"


def test_responses_relay_first_token_is_the_first_output_event() -> None:
    """The opening events are held: the answer begins with the first output."""
    opening = b"".join(EVENTS[:2])
    with pytest.raises(UpstreamFailed):
        Run([opening])  # the stream ended before any output
    run = Run([opening, b"".join(EVENTS[2:4])])
    assert run.started == ["resp_846a17c852ebcdbf"]
    assert run.body == b"".join(EVENTS[:4])
    assert run.is_done is False  # no terminal event: the answer broke


def test_responses_relay_takes_done_as_the_end() -> None:
    run = Run([STREAM + b"data: [DONE]\n\n", b"never read"])
    assert run.is_done is True
    assert run.body == FORWARDED


@pytest.mark.parametrize(
    "error",
    [
        b'event: error\ndata: {"type":"error","code":"x","message":"boom"}\n\n',
        b'data: {"error":{"message":"boom","code":500}}\n\n',
    ],
)
def test_responses_relay_error_before_first_token_can_be_retried(
    error: bytes,
) -> None:
    with pytest.raises(UpstreamFailed):
        Run([EVENTS[0], error])


def test_responses_relay_error_after_first_token_breaks_the_answer() -> None:
    error = b'event: error\ndata: {"type":"error","code":"x","message":"boom"}\n\n'
    run = Run([b"".join(EVENTS[:5]), error, EVENTS[-1]])
    assert run.is_done is False
    assert run.body == b"".join(EVENTS[:5])
    assert run.relay.outcome().events == 1


def test_responses_relay_failed_before_output_can_be_retried() -> None:
    failed = EVENTS[-1].replace(b"response.completed", b"response.failed")
    with pytest.raises(UpstreamFailed):
        Run([b"".join(EVENTS[:2]), failed])


def test_responses_relay_reports_deltas_in_small_steps() -> None:
    delta = DELTAS[0]
    run = Run([b"".join(EVENTS[:4]), *[delta] * 20, EVENTS[-1]])
    assert run.relay.outcome().events == 20
    assert run.reported == [8, 8]  # every 8, the rest left to the usage


def test_responses_relay_keeps_the_head_of_a_stream_for_the_guards() -> None:
    run = Run(
        cut(STREAM[: STREAM.rfind(b"event: response.completed")], 50), capture_head=True
    )
    assert run.is_done is False
    assert run.relay.head_text() == "shutdownGenericAliascasecase"


def test_response_end_event_carries_who_served_it() -> None:
    response = whole_response(
        response=TERMINAL["response"],
        model_ref="chat-7b",
        version="v2",
        region="eu",
        replica_id="r-1",
    )
    event = response_end_event(TERMINAL, response)
    kind, data = event.split(b"\ndata: ")
    assert kind == b"event: response.completed"
    assert event.endswith(b"\n\n")
    sent = json.loads(data)
    assert sent["sequence_number"] == TERMINAL["sequence_number"]
    assert sent["response"]["usage"] == TERMINAL["response"]["usage"]
    assert sent["response"]["model"] == "chat-7b"
    assert (
        sent["response"]["model_version"],
        sent["response"]["region"],
        sent["response"]["replica_id"],
    ) == ("v2", "eu", "r-1")
    assert output_text(sent["response"]) == "shutdownGenericAliascasecase"


def test_response_error_event_is_openais_error_event() -> None:
    event = response_error_event(replica_id="r-1")
    kind, data = event.split(b"\ndata: ")
    assert kind == b"event: error"
    error = json.loads(data)
    assert error["type"] == "error"
    assert error["code"] == "upstream_failed"


@pytest.mark.parametrize(
    "bad_id", [b'""', b'"has space"', b'"' + b"x" * 129 + b'"', b"7"]
)
def test_responses_relay_keeps_its_own_id_when_the_engines_is_unusable(
    bad_id: bytes,
) -> None:
    created = EVENTS[0].replace(b'"id":"resp_846a17c852ebcdbf"', b'"id":' + bad_id, 1)
    run = Run([created, *EVENTS[1:]])
    assert run.started == ["resp_gateway"]
