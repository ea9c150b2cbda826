"""The typed-event relay of ``/v1/responses``: an engine's events passed on as bytes.

Public surface: ``ResponsesRelay``, ``TERMINAL_EVENTS``, ``output_text``.

vLLM streams a response as typed server-sent events, ``event: <type>\\ndata:
{json}\\n\\n``: ``response.created`` and ``response.in_progress``, then the output
(``response.output_item.added``, ``response.content_part.added``, deltas such as
``response.output_text.delta`` or ``response.function_call_arguments.delta``,
their ``.done`` events), and one terminal event, ``response.completed`` (its
``response.status`` says ``completed`` or ``incomplete``), whose ``response``
object holds the usage. vLLM sends no ``data: [DONE]``; one is taken as the end
all the same. An error comes as an ``error`` event (or a ``{"error": ...}`` body).

``ResponsesRelay`` has the interface ``routing.attempt.Attempt`` drives
(``run(reader) -> bool``, ``outcome()``, ``head_text()``, ``first_token_at``):

- the first output event (any event past the opening ones: vLLM sends
  ``response.output_item.added`` with the first token) starts the answer and is
  its first token; the opening events are held until then and forwarded first;
- every event after is forwarded untouched, as it came; a read of whole delta
  events only (the common one) is forwarded without being split;
- each delta event counts as one output token for the tokens-in-flight report;
- the terminal event (``response.completed``, ``response.incomplete``,
  ``response.failed``) is kept, not forwarded: the caller ends the answer with it
  (``routing.attempt``), and its usage is what the request is metered by;
- before the first token an error, or an end without output, raises
  ``UpstreamFailed`` (another replica may be tried); after it ``run`` returns
  False and the answer is incomplete.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from config.asgi_io import Send
from routing.domain.stall import ReplicaStalled
from routing.relay import (
    EVENT_END,
    HEAD_BYTES,
    ChunkReader,
    RelayOutcome,
    UpstreamFailed,
)

__all__ = ["TERMINAL_EVENTS", "ResponsesRelay", "output_text"]

TERMINAL_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed"}
)
# The events that open a response, before any output.
_OPENING_EVENTS = frozenset(
    {"response.created", "response.in_progress", "response.queued"}
)
# Every delta event's first line ends so (a JSON string escapes its newlines):
# a read is whole delta events only when it has as many of these as event ends.
_DELTA_MARK = b'.delta\ndata: {"'
_SHRINK_EVERY = 8
# The id goes into a header and the answer's end: printable ASCII only (as chat's).
_RESPONSE_ID = re.compile(r"[!-~]{1,128}")


class ResponsesRelay:
    """Relay one engine's ``/v1/responses`` stream (one attempt) to the client.

    Its counters are written only by ``run``, and read after it returns or is
    cancelled (a client that left is still metered for what it was sent).
    ``terminal`` is the engine's terminal event, once it came.
    """

    __slots__ = (
        "_clock",
        "_head",
        "_held",
        "_on_first",
        "_on_tokens",
        "_rest",
        "_send",
        "_stream",
        "_unshrunk",
        "answer_id",
        "events",
        "first_token_at",
        "terminal",
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
        self._head: bytearray | None = bytearray() if capture_head else None
        self._held: list[bytes] = []  # the opening events, until the first token
        self._rest = b""  # the start of a cut event, until its end arrives
        self._unshrunk = 0
        self.answer_id = request_id
        self.events = 0  # delta events seen: output tokens, until the usage
        self.first_token_at: float | None = None
        self.terminal: dict[str, Any] | None = None

    def outcome(self) -> RelayOutcome:
        """Return what the relay has seen so far (usage in chat's names)."""
        response = self.terminal.get("response") if self.terminal else None
        if not isinstance(response, dict):
            response = None
        return RelayOutcome(
            events=self.events,
            first_token_at=self.first_token_at,
            usage=_chat_usage(response.get("usage")) if response else None,
            answer_id=self.answer_id,
            response=response,
        )

    def head_text(self) -> str:
        """Return the start of the answer's text: the whole response's output
        text once it came, else the ``capture_head`` bytes' deltas."""
        response = self.terminal.get("response") if self.terminal else None
        if isinstance(response, dict):
            return output_text(response)
        return _delta_text(bytes(self._head)) if self._head else ""

    async def run(self, reader: ChunkReader) -> bool:
        """Relay until the terminal event and the stream's end (True), or a
        failure after the first token (False).

        Raises:
            UpstreamFailed: the engine failed, sent an error event or ended
                before the first token.
        """
        while True:
            failure: BaseException | None = None
            try:
                chunk = await reader.readany()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                chunk, failure = b"", exc
            if not chunk:
                return self._at_end(failure)
            if self._rest:
                chunk = self._rest + chunk
                self._rest = b""
            if deltas := self._whole_deltas(chunk):
                # The common read: whole delta events only, forwarded as they came.
                self._count(deltas)
                await self._forward(chunk)
                continue
            end = chunk.rfind(EVENT_END)
            if end < 0:
                self._rest = chunk
                continue
            complete, self._rest = chunk[: end + 2], chunk[end + 2 :]
            ended = await self._relay_events(complete.split(EVENT_END))
            if ended is not None:
                return ended

    def _at_end(self, failure: BaseException | None) -> bool:
        """The engine's stream ended (``failure``: it broke): True when the answer
        is whole, False when it broke after the first token.

        Raises:
            UpstreamFailed: before the first token.
        """
        if self.terminal is not None:
            return True
        if self.first_token_at is None:
            if isinstance(failure, ReplicaStalled):
                raise UpstreamFailed(str(failure), is_stall=True)
            raise UpstreamFailed("connection closed before the first token")
        return False

    def _whole_deltas(self, chunk: bytes) -> int:
        """Return how many events ``chunk`` is when it is whole delta events of a
        stream that has begun, else 0."""
        if self.first_token_at is None or not self._stream:
            return 0
        if not chunk.endswith(EVENT_END):
            return 0
        events = chunk.count(EVENT_END)
        return events if events == chunk.count(_DELTA_MARK) else 0

    async def _relay_events(self, events: list[bytes]) -> bool | None:
        """Relay whole events one by one; return None to read on, True at a
        whole answer's ``[DONE]``, False at an error after the first token.

        Raises:
            UpstreamFailed: an error, or ``[DONE]`` without an answer, before
                the first token.
        """
        out: list[bytes] = []
        for event in events:
            if not event:
                continue
            kind, data = _parse_event(event)
            if data == b"[DONE]" and self.terminal is not None:
                await self._flush(out)
                return True
            if data == b"[DONE]" or kind == "error" or data.startswith(b'{"error"'):
                if self.first_token_at is None:
                    raise UpstreamFailed("error event before the first token")
                await self._flush(out)
                return False
            if kind in TERMINAL_EVENTS:
                await self._flush(out)
                out = []
                await self._take_terminal(kind, data)
            elif self.first_token_at is None and kind in _OPENING_EVENTS:
                if kind == "response.created":
                    self.answer_id = _response_id(data) or self.answer_id
                self._held.append(event)
            else:
                await self._add_output(kind, event, out)
        await self._flush(out)
        return None

    async def _add_output(self, kind: str, event: bytes, out: list[bytes]) -> None:
        """Add an output event to ``out``; the first begins the answer, after the
        opening events held until then."""
        if self.first_token_at is None:
            # Nothing is in ``out`` yet: every event before this one was held.
            await self._begin()
            held, self._held = self._held, []
            if held and self._stream:
                # Past the head the guards read: the opening events are ~1 kB each.
                await self._send(
                    {
                        "type": "http.response.body",
                        "body": EVENT_END.join(held) + EVENT_END,
                        "more_body": True,
                    }
                )
        if kind.endswith(".delta"):
            self._count(1)
        out.append(event)

    async def _take_terminal(self, kind: str, data: bytes) -> None:
        """Keep the terminal event; a response without output events begins here.

        Raises:
            UpstreamFailed: ``response.failed`` before the first token.
        """
        terminal = json.loads(data)
        if self.first_token_at is None:
            if kind == "response.failed":
                raise UpstreamFailed("the response failed before its first token")
            await self._begin()
            await self._flush(self._held)
            self._held = []
        self.terminal = terminal if isinstance(terminal, dict) else {}

    async def _begin(self) -> None:
        self.first_token_at = self._clock()
        await self._on_first(self.answer_id)

    async def _flush(self, out: list[bytes]) -> None:
        if out and self._stream:
            body = EVENT_END.join(out) + EVENT_END
            await self._forward(body)

    async def _forward(self, body: bytes) -> None:
        head = self._head
        if head is not None and len(head) < HEAD_BYTES:
            head += body[: HEAD_BYTES - len(head)]
        await self._send(
            {"type": "http.response.body", "body": body, "more_body": True}
        )

    def _count(self, deltas: int) -> None:
        self.events += deltas
        self._unshrunk += deltas
        if self._unshrunk >= _SHRINK_EVERY:
            self._on_tokens(self._unshrunk)
            self._unshrunk = 0


def output_text(response: dict[str, Any]) -> str:
    """Return the text of a response object's output messages."""
    parts: list[str] = []
    for item in response.get("output") or ():
        if not isinstance(item, dict) or item.get("type") != "message":
            continue
        for part in item.get("content") or ():
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
    return "".join(parts)


def _parse_event(event: bytes) -> tuple[str, bytes]:
    """Return an event's type (its ``event:`` line, else its data's ``type``) and
    its data."""
    kind = ""
    data: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            kind = line[6:].strip().decode("utf-8", "replace")
        elif line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
    joined = b"\n".join(data)
    if not kind and joined.startswith(b"{"):
        try:
            parsed = json.loads(joined)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("type"), str):
            kind = parsed["type"]
    return kind, joined


def _response_id(data: bytes) -> str | None:
    """Return the id of ``response.created``'s response, if it is usable."""
    try:
        event = json.loads(data)
    except ValueError:
        return None
    response = event.get("response") if isinstance(event, dict) else None
    answer_id = response.get("id") if isinstance(response, dict) else None
    if isinstance(answer_id, str) and _RESPONSE_ID.fullmatch(answer_id):
        return answer_id
    return None


def _chat_usage(usage: Any) -> dict[str, Any] | None:
    """Return a response's usage in the names ``FinalUsage.of`` reads."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details") or {}
    return {
        "prompt_tokens": int(usage.get("input_tokens") or 0),
        "completion_tokens": int(usage.get("output_tokens") or 0),
        "prompt_tokens_details": {
            "cached_tokens": int(details.get("cached_tokens") or 0)
            if isinstance(details, dict)
            else 0
        },
    }


def _delta_text(head: bytes) -> str:
    """Return the text of the complete ``response.output_text.delta`` events in
    ``head``."""
    parts: list[str] = []
    for event in head.split(EVENT_END)[:-1]:
        kind, data = _parse_event(event)
        if kind != "response.output_text.delta":
            continue
        try:
            delta = json.loads(data).get("delta")
        except (ValueError, AttributeError):
            continue
        if isinstance(delta, str):
            parts.append(delta)
    return "".join(parts)
