"""The SSE relay: an engine's event stream passed to the client as bytes.

Public surface: ``Relay``, ``RelayOutcome``, ``ChunkReader``, ``UpstreamFailed``,
``EVENT_END``, ``HEAD_BYTES``, ``events_text``.

vLLM (and the simulated replica) stream ``data: {...}\\n\\n`` events: a role chunk,
token chunks (each with a non-empty ``choices`` list), one usage chunk
(``"choices":[]``) and ``data: [DONE]``. ``Relay.run`` forwards the token events
untouched, never re-serialised, and keeps only what the gateway needs of the
rest: the engine's id for the answer (from its first event: every chunk of an
engine's stream carries the same one, and the answer's end must too), the
engine's usage, and for a non-streaming answer each choice's text (a chat
delta's or a completion's), tool calls, log probabilities and finish reason. It does not send the end of the answer: it returns, and the caller
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

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from config.asgi_io import ChunkedWrite, Send
from routing.domain.stall import ReplicaStalled

__all__ = [
    "EVENT_END",
    "HEAD_BYTES",
    "ChunkReader",
    "GatheredChoice",
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
    """The replica failed before the first token: another may be tried.

    ``is_stall``: the gateway judged the replica stalled (``routing.domain.stall``),
    a fault of that replica, not of the pool's load.
    """

    def __init__(self, message: str, *, is_stall: bool = False) -> None:
        super().__init__(message)
        self.is_stall = is_stall


class ChunkReader(Protocol):
    """Where the engine's bytes come from (``routing.engine_http.EngineResponse``).

    A reader that also has ``stream_to(sink)`` and ``pause_reading`` /
    ``resume_reading`` is streamed by push once the answer has begun (below).
    """

    async def readany(self) -> bytes:
        """Return the next bytes that arrived; b"" once the stream has ended."""
        ...


class _Resumed:
    """Await the rest of a coroutine that was stepped once and suspended."""

    __slots__ = ("coro", "yielded")

    def __init__(self, coro: Any, yielded: Any) -> None:
        self.coro = coro
        self.yielded = yielded

    def __await__(self) -> Any:
        coro, value = self.coro, self.yielded
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation, passed on
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _finish(coro: Any, yielded: Any) -> None:
    await _Resumed(coro, yielded)


def send_now(send: Send, message: dict[str, Any]) -> asyncio.Task[None] | None:
    """Run ``send(message)`` to its end now if it does not wait; None then.

    An ASGI server's ``send`` waits only when the client's socket is full; until
    then it is a plain function call in coroutine's clothing, and stepping it once
    saves a task wake-up per event. When it does wait, the rest runs as a task,
    which is returned.

    Raises:
        Exception: what ``send`` raised before it waited.
    """
    coro: Any = send(message)
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_finish(coro, yielded))


@dataclass(frozen=True, slots=True)
class GatheredChoice:
    """One choice of a non-streaming answer, gathered from the engine's chunks.

    ``content`` is a chat delta's text or a completion's ``text``; ``tool_calls``
    the chat tool calls merged from their deltas (id, type, function name, the
    arguments joined), in their order; ``logprobs`` a chat choice's
    ``logprobs.content`` entries, ``completion_logprobs`` a completion's lists
    (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) joined.
    """

    index: int
    content: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()
    logprobs: tuple[dict[str, Any], ...] = ()
    completion_logprobs: dict[str, list[Any]] | None = None
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class RelayOutcome:
    """What a relay saw: events forwarded, first token time, the engine's usage.

    ``events`` counts content events, role chunks included. ``answer_id`` is
    the engine's id of the answer (the gateway's request id if the engine's first
    event had none). ``choices`` are gathered only for a non-streaming answer,
    by index. ``response`` is a ``/v1/responses`` answer's whole response object,
    from its terminal event (``routing.responses_relay``).
    """

    events: int
    first_token_at: float | None
    usage: dict[str, Any] | None
    answer_id: str = ""
    choices: tuple[GatheredChoice, ...] = ()
    response: dict[str, Any] | None = None

    @property
    def content(self) -> str:
        """The first choice's text ("" when none was gathered)."""
        return self.choices[0].content if self.choices else ""


class _Gathering:
    """A choice being gathered from chunks (``Relay._collect``)."""

    __slots__ = ("calls", "completion_logprobs", "finish_reason", "logprobs", "text")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.logprobs: list[dict[str, Any]] = []
        self.completion_logprobs: dict[str, list[Any]] | None = None
        self.finish_reason: str | None = None

    def add(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):  # a chat chunk
            if delta.get("content"):
                self.text.append(delta["content"])
            for call in delta.get("tool_calls") or ():
                self._add_call(call)
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and logprobs.get("content"):
                self.logprobs.extend(logprobs["content"])
        else:  # a completion chunk
            if choice.get("text"):
                self.text.append(choice["text"])
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict):
                joined = self.completion_logprobs
                if joined is None:
                    joined = self.completion_logprobs = {}
                for name, values in logprobs.items():
                    if isinstance(values, list):
                        joined.setdefault(name, []).extend(values)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def _add_call(self, call: Any) -> None:
        if not isinstance(call, dict):
            return
        index = call.get("index", len(self.calls))
        merged = self.calls.get(index)
        if merged is None:
            merged = self.calls[index] = {
                "id": call.get("id"),
                "type": call.get("type") or "function",
                "function": {"name": None, "arguments": ""},
            }
        if call.get("id"):
            merged["id"] = call["id"]
        function = call.get("function") or {}
        if function.get("name"):
            merged["function"]["name"] = function["name"]
        if function.get("arguments"):
            merged["function"]["arguments"] += function["arguments"]

    def result(self, index: int) -> GatheredChoice:
        return GatheredChoice(
            index=index,
            content="".join(self.text),
            tool_calls=tuple(self.calls[i] for i in sorted(self.calls)),
            logprobs=tuple(self.logprobs),
            completion_logprobs=self.completion_logprobs,
            finish_reason=self.finish_reason,
        )


class Relay:
    """Relay one engine stream (one attempt) to the client.

    Its counters are written only by ``run``, and read after it returns or is
    cancelled (a client that left still gets metered for what it was sent).
    """

    __slots__ = (
        "_choices",
        "_clock",
        "_head",
        "_on_first",
        "_on_tokens",
        "_pending",
        "_reader",
        "_rest",
        "_send",
        "_send_failed",
        "_sending",
        "_stream",
        "_unshrunk",
        "_write_frames",
        "answer_id",
        "events",
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
        write_frames: ChunkedWrite | None = None,
    ) -> None:
        self._send = send
        # The server's chunk-frame write (config.http_protocol), when it has one.
        self._write_frames = write_frames
        self._stream = stream
        self._on_first = on_first
        self._on_tokens = on_tokens
        self._clock = clock
        self._choices: dict[int, _Gathering] = {}
        # The first HEAD_BYTES of the content events, kept only when asked.
        self._head: bytearray | None = bytearray() if capture_head else None
        self.answer_id = request_id
        self._unshrunk = 0  # events not yet reported to on_tokens
        self._rest = b""  # the start of a cut event, until its end arrives
        self._reader: Any = None  # the reader streamed by push, once begun
        self._pending: asyncio.Task[None] | None = None  # a push send that waits
        self._send_failed = False
        self._sending = False  # run's own send is under way: push must wait
        self.events = 0
        self.first_token_at: float | None = None
        self.usage: dict[str, Any] | None = None

    def outcome(self) -> RelayOutcome:
        """Return what the relay has seen so far."""
        return RelayOutcome(
            events=self.events,
            first_token_at=self.first_token_at,
            usage=self.usage,
            answer_id=self.answer_id,
            choices=tuple(
                self._choices[index].result(index) for index in sorted(self._choices)
            ),
        )

    def head_text(self) -> str:
        """Return the start of the answer's text (``capture_head``, or a
        non-streaming answer); "" when nothing was kept."""
        first = self._choices.get(0)
        if first is not None and first.text:
            return "".join(first.text)
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
        started = False
        fast = False  # streaming, past the first event: forward bytes as they come
        while True:
            failure: BaseException | None = None
            try:
                chunk = await reader.readany()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                chunk, failure = b"", exc
            if not chunk:
                # The engine went away before [DONE].
                if not started:
                    if isinstance(failure, ReplicaStalled):
                        raise UpstreamFailed(str(failure), is_stall=True)
                    raise UpstreamFailed("connection closed before the first token")
                await self._wait_pending()
                return False
            if self._rest:
                chunk = self._rest + chunk
                self._rest = b""
            if fast and (events := _whole_token_events(chunk)):
                # The common case: whole token events only. Forward the bytes as
                # they came, counting events, without splitting or copying them.
                self._count(chunk, events)
                await self._send_in_order(chunk)
                continue
            end = chunk.rfind(EVENT_END)
            if end < 0:
                self._rest = chunk
                continue
            complete, self._rest = chunk[: end + 2], chunk[end + 2 :]
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
                    await self._wait_pending()
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
                    self._keep_head(body)
                    await self._send_in_order(body)
                    if self._reader is None and hasattr(reader, "stream_to"):
                        # From here on, reads of whole token events are sent from
                        # the reader's side (``_push``), without waking this task;
                        # as the engine framed them, where the server can write
                        # frames (``_push_frames``).
                        self._reader = reader
                        reader.stream_to(
                            self._push,
                            self._push_frames if self._write_frames else None,
                        )
                else:
                    self._collect(out)
            if done:
                if not started:
                    raise UpstreamFailed("no tokens before [DONE]")
                await self._wait_pending()
                return True

    def _push(self, chunk: bytes) -> bool:
        """Forward one read of whole token events from the reader's side, now;
        False leaves anything else (and everything while a send waits) to ``run``.

        A send that has to wait (the client's socket is full) pauses reading the
        replica until it is done: the replica's stream waits with the client.
        """
        events = self._pushable(chunk)
        if not events:
            return False
        try:
            pending = send_now(
                self._send,
                {"type": "http.response.body", "body": chunk, "more_body": True},
            )
        except Exception:
            # Not sent: ``run`` sends it again, and meets the error itself.
            self._send_failed = True
            return False
        self._count(chunk, events)
        if pending is not None:
            self._pending = pending
            reader = self._reader
            reader.pause_reading()
            pending.add_done_callback(self._pending_done)
        return True

    def _push_frames(self, frames: bytes, body: bytes) -> bool:
        """Forward a read of whole chunks as the engine framed them, if ``body``
        (their data) is whole token events and the server can write it now."""
        events = self._pushable(body)
        if not events:
            return False
        assert self._write_frames is not None
        if not self._write_frames(frames):
            return False
        self._count(body, events)
        return True

    def _pushable(self, body: bytes) -> int:
        """Return how many token events ``body`` is if a push may send it now;
        0 while an earlier send is under way or the start of a cut event is
        held, after a failed send, or when ``body`` is not whole token events."""
        if self._pending is not None or self._sending or self._rest:
            return 0
        return 0 if self._send_failed else _whole_token_events(body)

    def _pending_done(self, task: asyncio.Task[None]) -> None:
        self._pending = None
        if task.cancelled() or task.exception() is not None:
            self._send_failed = True
        self._reader.resume_reading()

    async def _send_in_order(self, body: bytes) -> None:
        """Send from ``run``, after a push send that waits and before any push
        of later reads (``_push`` declines while this one is under way)."""
        await self._wait_pending()
        self._sending = True
        try:
            await self._send(
                {"type": "http.response.body", "body": body, "more_body": True}
            )
        finally:
            self._sending = False

    async def _wait_pending(self) -> None:
        """Let a push send that waits finish first: events stay in order."""
        pending = self._pending
        if pending is not None:
            await asyncio.wait((pending,))

    def _count(self, chunk: bytes, events: int) -> None:
        """Count forwarded token events, report them every few, keep the head."""
        self.events += events
        self._unshrunk += events
        if self._unshrunk >= _SHRINK_EVERY:
            self._on_tokens(self._unshrunk)
            self._unshrunk = 0
        if self._head is not None:
            self._keep_head(chunk)

    def _keep_head(self, body: bytes) -> None:
        head = self._head
        if head is not None and len(head) < HEAD_BYTES:
            head += body[: HEAD_BYTES - len(head)]

    def _collect(self, events: list[bytes]) -> None:
        """Gather a non-streaming answer's choices from the engine's chunks."""
        for event in events:
            chunk = json.loads(event[6:])
            for choice in chunk.get("choices") or ():
                index = choice.get("index", 0)
                gathering = self._choices.get(index)
                if gathering is None:
                    gathering = self._choices[index] = _Gathering()
                gathering.add(choice)


def _whole_token_events(body: bytes) -> int:
    """Return how many events ``body`` is if it is whole token events only, else 0:
    as many event ends as ``"choices":[{`` marks, and it ends with one."""
    if not body.endswith(EVENT_END):
        return 0
    events = body.count(EVENT_END)
    return events if events == body.count(_CONTENT_MARK) else 0


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
