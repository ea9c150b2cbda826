"""The SSE relay: an engine's event stream passed to the client as bytes.

Public surface: ``Relay``, ``RelayOutcome``, ``ChunkReader``, ``UpstreamFailed``,
``EVENT_END``, ``HEAD_BYTES``, ``events_text``.

vLLM (and the simulated replica) stream ``data: {...}\\n\\n`` events: a role chunk,
token chunks (each with a non-empty ``choices`` list), one usage chunk
(``"choices":[]``) and ``data: [DONE]``. ``Relay.run`` forwards the token events
untouched, never re-serialised, and keeps only what the gateway needs of the
rest: the engine's id for the answer (from its first event: every chunk of an
engine's stream carries the same one, and the answer's end must too), the
engine's usage, and for a non-streaming answer its text, log probabilities and
finish reason. It does not send the end of the answer: it returns, and the caller
adds the final event (``routing.responses``) or the error event.

The common read, whole token events and nothing else, costs two scans: the count
of event ends must equal the count of ``"choices":[{`` marks. Anything else (a cut
event, the usage chunk, an error event, ``[DONE]``) is split into events.

A failure before the first token raises ``UpstreamFailed``, and the caller may try
another replica; after it, ``run`` returns False and the answer is incomplete.
Output tokens are reported to ``on_tokens`` every few events (the caller lowers
the replica's tokens in flight), not per event: cheap, and within a few tokens of
exact for routing.

With ``capture_head`` (a model under rollout, whose answers the guards judge), the
first ``HEAD_BYTES`` of the content events are kept as they were forwarded, and
``Relay.head_text`` parses them only once the answer has ended; off, the fast path pays
one local check per chunk.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from config.asgi_io import Send

__all__ = [
    "EVENT_END",
    "HEAD_BYTES",
    "ChunkReader",
    "Relay",
    "RelayOutcome",
    "UpstreamFailed",
    "events_text",
]

EVENT_END = b"\n\n"
_USAGE_MARK = b'"choices":[]'
# Every token event of vLLM (and the simulator) has a non-empty choices list; the
# usage chunk, error events and [DONE] do not.
_CONTENT_MARK = b'"choices":[{'
_SHRINK_EVERY = 8
# An engine's id goes into a header and the answer's end: printable ASCII only.
_ANSWER_ID = re.compile(r"[!-~]{1,128}")
# The head of an answer kept for the refusal detector: vLLM's token events are
# about 200 bytes each, so the role chunk and the first eight or so tokens.
HEAD_BYTES = 2048


class UpstreamFailed(Exception):
    """The replica failed before the first token: another may be tried."""


class ChunkReader(Protocol):
    """Where the engine's bytes come from (aiohttp's ``StreamReader``)."""

    async def readany(self) -> bytes:
        """Return the next bytes that arrived; b"" once the stream has ended."""
        ...


@dataclass(frozen=True, slots=True)
class RelayOutcome:
    """What a relay saw: events forwarded, first token time, the engine's usage.

    ``events`` counts content events, the role chunk included. ``answer_id`` is
    the engine's id of the answer (the gateway's request id if the engine's first
    event had none). ``content``, ``logprobs`` (vLLM's ``logprobs.content``
    entries) and ``finish_reason`` are gathered only for a non-streaming answer.
    """

    events: int
    first_token_at: float | None
    usage: dict[str, Any] | None
    answer_id: str = ""
    content: tuple[str, ...] = ()
    logprobs: tuple[dict[str, Any], ...] = ()
    finish_reason: str | None = None


class Relay:
    """Relay one engine stream (one attempt) to the client.

    Its counters are written only by ``run``, and read after it returns or is
    cancelled (a client that left still gets metered for what it was sent).
    """

    __slots__ = (
        "_clock",
        "_content",
        "_head",
        "_logprobs",
        "_on_first",
        "_on_tokens",
        "_send",
        "_stream",
        "answer_id",
        "events",
        "finish_reason",
        "first_token_at",
        "usage",
    )

    def __init__(
        self,
        *,
        send: Send,
        stream: bool,
        request_id: str,
        on_first: Callable[[str], Awaitable[None]],
        on_tokens: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        capture_head: bool = False,
    ) -> None:
        self._send = send
        self._stream = stream
        self._on_first = on_first
        self._on_tokens = on_tokens
        self._clock = clock
        self._content: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        # The first HEAD_BYTES of the content events, kept only when asked.
        self._head: bytearray | None = bytearray() if capture_head else None
        self.answer_id = request_id
        self.events = 0
        self.first_token_at: float | None = None
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def outcome(self) -> RelayOutcome:
        """Return what the relay has seen so far."""
        return RelayOutcome(
            events=self.events,
            first_token_at=self.first_token_at,
            usage=self.usage,
            answer_id=self.answer_id,
            content=tuple(self._content),
            logprobs=tuple(self._logprobs),
            finish_reason=self.finish_reason,
        )

    def head_text(self) -> str:
        """Return the start of the answer's text (``capture_head``, or a
        non-streaming answer); "" when nothing was kept."""
        if self._content:
            return "".join(self._content)
        return events_text(bytes(self._head)) if self._head else ""

    async def run(self, reader: ChunkReader) -> bool:
        """Relay until ``[DONE]`` (True) or a failure after the first token (False).

        Before the first token, ``on_first`` is awaited with the answer's id (the
        caller starts the answer), and the usage chunk and ``[DONE]`` are never
        forwarded.

        Raises:
            UpstreamFailed: the engine failed, sent an error event or ended
                before the first token.
        """
        send = self._send
        started = False
        fast = False  # streaming, past the first event: forward bytes as they come
        unshrunk = 0  # events not yet reported to on_tokens
        buffer = b""
        head = self._head  # None unless capturing: one local check per chunk
        while True:
            try:
                chunk = await reader.readany()
            except (TimeoutError, aiohttp.ClientError, OSError):
                chunk = b""
            if not chunk:
                # The engine went away before [DONE].
                if not started:
                    raise UpstreamFailed("connection closed before the first token")
                return False
            if buffer:
                chunk = buffer + chunk
                buffer = b""
            if (
                fast
                and chunk.endswith(EVENT_END)
                and (events := chunk.count(EVENT_END)) == chunk.count(_CONTENT_MARK)
            ):
                # The common case: whole token events only. Forward the bytes as
                # they came, counting events, without splitting or copying them.
                self.events += events
                unshrunk += events
                if unshrunk >= _SHRINK_EVERY:
                    self._on_tokens(unshrunk)
                    unshrunk = 0
                if head is not None:
                    head += chunk[: HEAD_BYTES - len(head)]
                    if len(head) >= HEAD_BYTES:
                        head = None
                await send(
                    {"type": "http.response.body", "body": chunk, "more_body": True}
                )
                continue
            end = chunk.rfind(EVENT_END)
            if end < 0:
                buffer = chunk
                continue
            complete, buffer = chunk[: end + 2], chunk[end + 2 :]
            out = []
            done = False
            for event in complete.split(EVENT_END):
                if not event:
                    continue
                if event.startswith(b"data: [DONE]"):
                    done = True
                    continue
                if _USAGE_MARK in event:
                    self.usage = json.loads(event[6:]).get("usage") or {}
                    continue
                if event.startswith(b'data: {"error"'):
                    if not started:
                        raise UpstreamFailed("error event before the first token")
                    return False
                out.append(event)
            if out:
                if not started:
                    started = True
                    fast = self._stream
                    self.first_token_at = self._clock()
                    self.answer_id = _answer_id(out[0]) or self.answer_id
                    await self._on_first(self.answer_id)
                # Role chunk included: an estimate until the usage chunk arrives.
                self.events += len(out)
                self._on_tokens(len(out))
                if self._stream:
                    body = EVENT_END.join(out) + EVENT_END
                    if head is not None:
                        head += body[: HEAD_BYTES - len(head)]
                        if len(head) >= HEAD_BYTES:
                            head = None
                    await send(
                        {"type": "http.response.body", "body": body, "more_body": True}
                    )
                else:
                    self._collect(out)
            if done:
                if not started:
                    raise UpstreamFailed("no tokens before [DONE]")
                return True

    def _collect(self, events: list[bytes]) -> None:
        """Gather a non-streaming answer's text and log probabilities from the
        engine's chunks."""
        for event in events:
            chunk = json.loads(event[6:])
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    self._content.append(delta["content"])
                logprobs = choice.get("logprobs")
                if isinstance(logprobs, dict) and logprobs.get("content"):
                    self._logprobs.extend(logprobs["content"])
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]


def events_text(head: bytes) -> str:
    """Return the text of the complete content events in ``head`` (SSE bytes).

    A cut last event, and events that are not JSON chunks, are left out.
    """
    parts: list[str] = []
    for event in head.split(EVENT_END)[:-1]:
        if not event.startswith(b"data: {"):
            continue
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            continue
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        for choice in choices if isinstance(choices, list) else ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            content = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(content, str):
                parts.append(content)
    return "".join(parts)


def _answer_id(event: bytes) -> str | None:
    """Return the id of an engine's chunk (``data: {"id": ...}``), if it has one."""
    try:
        chunk = json.loads(event[6:])
    except ValueError:
        return None
    answer_id = chunk.get("id") if isinstance(chunk, dict) else None
    if isinstance(answer_id, str) and _ANSWER_ID.fullmatch(answer_id):
        return answer_id
    return None
