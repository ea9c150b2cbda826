"""The relay's head capture (``capture_head``): the start of an answer's text, kept
bounded for the refusal detector, without changing a byte the client gets."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from routing.relay import HEAD_BYTES, Relay, events_text

CAPTURE = Path(__file__).resolve().parents[2] / "simengine/tests/data/vllm_stream.txt"
EVENTS = [e + b"\n\n" for e in CAPTURE.read_bytes().split(b"\n\n") if e]
TOKEN_EVENTS = [e for e in EVENTS if b'"choices":[{' in e]
# A long answer: the captured token events again and again, then the usage and
# [DONE] of the capture.
LONG = b"".join(TOKEN_EVENTS[:1] + TOKEN_EVENTS[1:] * 40 + EVENTS[len(TOKEN_EVENTS) :])


def _text(events: list[bytes]) -> str:
    out = []
    for event in events:
        for choice in json.loads(event[6:]).get("choices") or ():
            out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


FULL_TEXT = _text([e for e in LONG.split(b"\n\n") if b'"choices":[{' in e])


class Reader:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


def _relay(chunks: list[bytes], *, capture_head: bool, stream: bool = True) -> Any:
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        sent.append(message.get("body", b""))

    async def on_first(answer_id: str) -> None:
        return None

    relay = Relay(
        send=send,
        stream=stream,
        request_id="chatcmpl-gateway",
        on_first=on_first,
        on_tokens=lambda n: None,
        capture_head=capture_head,
    )
    assert asyncio.run(relay.run(Reader(chunks)))
    return relay, b"".join(sent)


def _cut(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 7, 64, 300, 1000, 5000, len(LONG)])
def test_head_is_a_bounded_prefix_of_the_text_and_changes_no_byte(size: int) -> None:
    captured, with_head = _relay(_cut(LONG, size), capture_head=True)
    plain, without = _relay(_cut(LONG, size), capture_head=False)
    assert with_head == without
    text = captured.head_text()
    assert text and FULL_TEXT.startswith(text)
    assert len(captured._head) <= HEAD_BYTES
    # The first several tokens are there whatever the cut (only the last, cut
    # event of the head is left out).
    assert len(text) >= len(_text(TOKEN_EVENTS[: 1 + 6]))
    assert plain.head_text() == ""


def test_non_streaming_answer_head_is_its_collected_text() -> None:
    relay, _ = _relay([LONG], capture_head=True, stream=False)
    assert relay.head_text() == FULL_TEXT


def test_head_text_skips_cut_and_foreign_events() -> None:
    head = b"".join(TOKEN_EVENTS[:3]) + b"data: [DONE]\n\n" + TOKEN_EVENTS[3][:40]
    assert events_text(head) == _text(TOKEN_EVENTS[:3])
    assert events_text(b'data: {"choices": "x"}\n\ndata: {nope\n\n') == ""
