"""Reads of whole chunks go to the client as the engine framed them, and only those.

``chunk_data`` decides whether a read may skip the parser; ``Relay._push_frames``
whether its data may go out framed. A read it must not pass (a cut chunk, the last
chunk, an odd size line, data that is not whole token events) takes the parser's
path, and what reaches the client is the same stream either way.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from config.asgi_io import Message
from routing.engine_http import EngineClient, EngineResponse, chunk_data
from routing.relay import Relay


def frame(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


@given(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=6))
def test_whole_chunks_give_back_their_data(parts: list[bytes]) -> None:
    assert chunk_data(frame(*parts)) == b"".join(parts)


def chunk_ends(parts: list[bytes]) -> set[int]:
    ends, offset = set(), 0
    for part in parts:
        offset += len(frame(part))
        ends.add(offset)
    return ends


@given(
    st.lists(st.binary(min_size=1, max_size=100), min_size=1, max_size=4),
    st.data(),
)
def test_a_read_cut_inside_from_a_boundary_is_not_whole_chunks(
    parts: list[bytes], data: st.DataObject
) -> None:
    """Read from a chunk boundary, a cut anywhere but at a chunk's end is not
    whole chunks. (From anywhere else it may be: a suffix of chunked data can
    parse as chunks, which is why the gateway only tries a read that starts at a
    boundary; see the next test.)"""
    framed = frame(*parts)
    cut = data.draw(st.integers(min_value=1, max_value=len(framed) - 1))
    if cut not in chunk_ends(parts):
        assert chunk_data(framed[:cut]) is None


_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@example(parts=[b"\0" * 7, b"\0" * 6 + b"A", b"\0" * 7], cuts=[21], at_crlfs=False)
@example(parts=[b"ab\r\ncd", b"e"], cuts=[], at_crlfs=True)
@given(
    parts=st.lists(
        st.binary(min_size=1, max_size=100) | st.just(b"a\r\n0\r\n"),
        min_size=1,
        max_size=4,
    ),
    cuts=st.lists(st.integers(min_value=1, max_value=500), max_size=5),
    at_crlfs=st.booleans(),
)
def test_the_parser_is_between_chunks_exactly_at_a_chunks_end(
    parts: list[bytes], cuts: list[int], at_crlfs: bool
) -> None:
    """What the gateway relies on to skip the parser (``chunk_data``): it tries a
    read only when the parser stopped exactly at the end of a chunk. Whatever
    reads the answer arrives in, it says so only after a read that ended at a
    chunk's end (and misses one only where the read split the chunk's CRLF, which
    costs the skip, not the answer); so the read it tries starts at a boundary,
    where a parse follows the chunks' true sizes.

    The example: three chunks cut at byte 21, where the suffix
    ``A\\r\\n7\\r\\n`` + seven NULs + ``\\r\\n`` happens to be valid framing of
    its own (issue 32's red CI): the parser is not at a boundary there.
    """
    framed = frame(*parts)
    ends = chunk_ends(parts)
    if at_crlfs:  # reads that end in CRLF: after a size line, inside the data
        cuts = [
            *cuts,
            *(i + 2 for i in range(len(framed)) if framed[i:].startswith(b"\r\n")),
        ]
    response = EngineResponse(
        cast(EngineClient, SimpleNamespace(first_token_timeout_s=30.0)), ("r", 1)
    )
    response.data_received(_HEAD)
    position = 0
    for cut in [*sorted({c for c in cuts if c < len(framed)}), len(framed)]:
        read = framed[position:cut]
        response.data_received(read)
        position = cut
        if response._at_boundary:  # what the skip relies on
            assert cut in ends, (cut, sorted(ends))
        elif cut in ends:
            # Missed only when the read split the chunk's CRLF: safe, the next
            # read goes through the parser.
            assert not read.endswith(b"\r\n"), (cut, sorted(ends))


@pytest.mark.parametrize(
    "read",
    [
        b"0\r\n\r\n",  # the last chunk: the parser ends the message
        frame(b"ab") + b"0\r\n\r\n",
        b"2;ext=1\r\nab\r\n",  # a chunk extension
        b"+2\r\nab\r\n",
        b" 2\r\nab\r\n",
        b"0_2\r\nab\r\n",  # int() takes underscores; a client's parser need not
        b"zz\r\nab\r\n",
        b"2\r\nabc\r\n",  # longer than its size
        b"\r\nab\r\n",
        b"",
    ],
)
def test_odd_or_final_chunks_take_the_parsers_path(read: bytes) -> None:
    assert chunk_data(read) is None


TOKEN = b'data: {"id":"x","choices":[{"delta":{"content":" w"}}]}\n\n'
USAGE = b'data: {"id":"x","choices":[],"usage":{"completion_tokens":3}}\n\n'


class FramedReader:
    """An engine's reads, handed to the relay's framed sink once it is set."""

    def __init__(self, head: list[bytes], reads: list[bytes]) -> None:
        self.head = list(head)
        self.reads = list(reads)
        self.declined: list[bytes] = []
        self.framed: Any = None

    def stream_to(self, sink: Any, framed: Any = None) -> None:
        self.framed = framed

    def pause_reading(self) -> None:
        raise AssertionError("no send waits here")

    def resume_reading(self) -> None:
        raise AssertionError("no send waits here")

    async def readany(self) -> bytes:
        if self.head:
            return self.head.pop(0)
        while self.reads:
            read = self.reads.pop(0)
            body = chunk_data(read)
            if self.framed is not None and body is not None and self.framed(read, body):
                continue
            # Declined: the parser's path (here: de-chunk and hand to the task).
            self.declined.append(read)
            return _dechunk(read)
        return b""


def _dechunk(read: bytes) -> bytes:
    out, rest = b"", read
    while rest:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line.split(b";")[0], 16)
        out, rest = out + rest[:size], rest[size + 2 :]
    return out


def relay_over(reader: FramedReader, *, writable: bool = True) -> tuple[bytes, Relay]:
    wire: list[bytes] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            wire.append(frame(message["body"]))

    async def on_first(answer_id: str) -> None:
        return None

    def write_frames(frames: bytes) -> bool:
        if writable:
            wire.append(frames)
        return writable

    relay = Relay(
        send=send,
        stream=True,
        request_id="r",
        on_first=on_first,
        on_tokens=lambda n: None,
        write_frames=write_frames,
    )
    assert asyncio.run(relay.run(reader)) is True
    return _dechunk(b"".join(wire)), relay


def test_token_reads_go_out_framed_and_the_rest_through_the_task() -> None:
    reads = [frame(TOKEN), frame(TOKEN, TOKEN), frame(USAGE + b"data: [DONE]\n\n")]
    reader = FramedReader([TOKEN], reads)
    body, relay = relay_over(reader)
    assert body == TOKEN * 4
    assert relay.events == 4
    assert relay.usage == {"completion_tokens": 3}
    assert reader.declined == [reads[-1]]  # only the usage chunk and [DONE]


def test_a_cut_event_is_never_overtaken_by_a_later_framed_read() -> None:
    # The event's first half ends a read: the relay holds it, and the next read
    # (whole chunks, whole events from the parser's view of its own bytes) must
    # wait for it rather than go out framed ahead of it.
    half = TOKEN.index(b'"choices"')  # the second half holds the event's mark
    reads = [
        frame(TOKEN[:half]),
        frame(TOKEN[half:]),
        frame(TOKEN),
        frame(b"data: [DONE]\n\n"),
    ]
    body, relay = relay_over(FramedReader([TOKEN], reads))
    assert body == TOKEN * 3
    assert relay.events == 3


def test_a_server_that_cannot_write_frames_now_gets_the_read_through_send() -> None:
    reads = [frame(TOKEN), frame(b"data: [DONE]\n\n")]
    reader = FramedReader([TOKEN], reads)
    body, _ = relay_over(reader, writable=False)
    assert body == TOKEN * 2
    assert reader.declined == reads
