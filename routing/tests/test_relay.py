"""The SSE relay on recorded vLLM bytes, however the network splits them.

``Relay.run`` forwards whole runs of token events untouched and only looks inside
a read that holds anything else (the usage chunk, an error event, ``[DONE]`` or a
cut event). These tests feed it a stream captured from real vLLM, cut at every
size, and check what reaches the client byte for byte, and what the answer's end
(``routing.responses``) is built from. No gateway is constructed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from routing.live import AttemptLoad, LiveLoad
from routing.relay import Relay, RelayOutcome, UpstreamFailed, send_now
from routing.responses import (
    FinalUsage,
    final_event,
    stream_error_event,
    whole_answer,
)
from routing.tests.test_engine_http import (
    END,
    HEAD,
    chunk,
    engine_client,
    fed_response,
    replica,
    until,
)

CAPTURE = Path(__file__).resolve().parents[2] / "simengine/tests/data/vllm_stream.txt"
STREAM = CAPTURE.read_bytes()
EVENTS = [e + b"\n\n" for e in STREAM.split(b"\n\n") if e]
TOKEN_EVENTS = [e for e in EVENTS if b'"choices":[{' in e]
UPSTREAM_USAGE = json.loads(EVENTS[-2][6:])["usage"]
SIZES = [1, 2, 7, 64, 300, 1000, len(STREAM)]


class Reader:
    """The engine's side: hands out the given chunks, then end of stream."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


class Run:
    """One relay over ``chunks``: what it returned, sent and reported."""

    def __init__(self, chunks: list[bytes], *, stream: bool = True) -> None:
        self.sent: list[dict[str, Any]] = []
        self.started = 0
        self.reported: list[int] = []

        async def send(message: Any) -> None:
            self.sent.append(message)

        async def on_first(answer_id: str) -> None:
            self.started += 1
            self.sent.append(
                {"type": "http.response.start", "status": 200, "id": answer_id}
            )

        self.relay = Relay(
            send=send,
            stream=stream,
            request_id="chatcmpl-gateway",
            on_first=on_first,
            on_tokens=self.reported.append,
        )
        self.is_done = asyncio.run(self.relay.run(Reader(chunks)))
        self.outcome: RelayOutcome = self.relay.outcome()

    @property
    def body(self) -> bytes:
        return b"".join(
            m.get("body", b"") for m in self.sent if m["type"] == "http.response.body"
        )


def cut(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", SIZES)
def test_relay_passes_token_events_byte_for_byte_and_keeps_the_usage(size: int) -> None:
    run = Run(cut(STREAM, size))

    assert run.is_done is True
    assert run.started == 1
    assert run.sent[0]["type"] == "http.response.start"
    # Every token event, unchanged and in order; nothing of the usage or [DONE].
    assert run.body == b"".join(TOKEN_EVENTS)
    assert all(m.get("more_body", True) for m in run.sent[1:])
    assert run.outcome.events == len(TOKEN_EVENTS)
    assert run.outcome.usage == UPSTREAM_USAGE
    assert run.outcome.first_token_at is not None


@pytest.mark.parametrize("size", SIZES)
def test_final_event_carries_the_engines_usage_and_who_served(size: int) -> None:
    run = Run(cut(STREAM, size))
    usage = FinalUsage.of(run.outcome, prompt_tokens=999)

    end = final_event(
        answer_id="chatcmpl-test",
        model_ref="chat-7b",
        version="v1",
        region="r1",
        replica_id="rep-1",
        usage=usage,
    )

    event, done = end.split(b"\n\n", 1)
    assert done == b"data: [DONE]\n\n"
    final = json.loads(event.removeprefix(b"data: "))
    assert final["choices"] == []
    assert (final["model_version"], final["region"], final["replica_id"]) == (
        "v1",
        "r1",
        "rep-1",
    )
    assert final["usage"]["prompt_tokens"] == UPSTREAM_USAGE["prompt_tokens"]
    assert final["usage"]["completion_tokens"] == UPSTREAM_USAGE["completion_tokens"]
    cached = (UPSTREAM_USAGE.get("prompt_tokens_details") or {}).get("cached_tokens")
    assert final["usage"]["cached_tokens"] == (cached or 0)
    assert final["usage"]["total_tokens"] == usage.total_tokens


def test_relay_does_not_forward_a_usage_chunk_read_with_tokens() -> None:
    last_tokens_and_usage = b"".join(EVENTS[-3:-1])
    chunks = [b"".join(EVENTS[:-3]), last_tokens_and_usage, EVENTS[-1]]

    run = Run(chunks)

    assert run.is_done is True
    assert b"created_cache_tokens" not in run.body  # vLLM's own usage chunk
    assert run.body == b"".join(TOKEN_EVENTS)
    assert run.outcome.events == len(TOKEN_EVENTS)


def test_relay_reports_output_tokens_in_small_steps() -> None:
    events = [EVENTS[0], *TOKEN_EVENTS[1:5] * 5]  # 21 events, one read each

    run = Run(events)

    assert run.is_done is False  # no [DONE]: the engine went away after tokens
    assert sum(run.reported) <= len(events) < sum(run.reported) + 8
    assert all(0 < n <= 8 for n in run.reported)


def test_attempt_load_falls_with_output_and_keeps_the_prompt() -> None:
    live = LiveLoad(
        gateway_id="t", region="r1", redis=None, prefix="t", beat_s=1, missed_beats=3
    )
    load = AttemptLoad(live, "rep-1", tokens=11 + 40, floor=11)
    assert live.tokens_in_flight("rep-1") == 51

    load.shrink(8)
    assert live.tokens_in_flight("rep-1") == 43
    load.shrink(100)  # more than max_tokens: the prompt stays in flight
    assert live.tokens_in_flight("rep-1") == 11
    load.drop()
    assert live.tokens_in_flight("rep-1") == 0


def test_relay_stops_at_an_error_event_after_tokens() -> None:
    error = b'data: {"error": {"message": "engine died", "code": 500}}\n\n'

    run = Run([b"".join(EVENTS[:3]), error])

    assert run.is_done is False
    assert run.body == b"".join(TOKEN_EVENTS[:3])
    assert b"engine died" not in run.body


@pytest.mark.parametrize(
    "chunks",
    [
        [b'data: {"error": {"message": "engine died", "code": 500}}\n\n'],
        [EVENTS[0][:20]],
        [],
        [EVENTS[-2], EVENTS[-1]],  # usage and [DONE] but no token
    ],
    ids=["error-event", "cut-first-event", "empty", "no-token"],
)
def test_relay_failing_before_the_first_token_can_be_retried(
    chunks: list[bytes],
) -> None:
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def on_first(answer_id: str) -> None:
        raise AssertionError("no answer may start")

    relay = Relay(
        send=send,
        stream=True,
        request_id="chatcmpl-gateway",
        on_first=on_first,
        on_tokens=lambda n: None,
    )
    with pytest.raises(UpstreamFailed):
        asyncio.run(relay.run(Reader(chunks)))
    assert sent == []


def test_relay_broken_after_tokens_returns_false_and_counts_what_was_sent() -> None:
    run = Run([b"".join(EVENTS[:4]), EVENTS[4][:30]])

    assert run.is_done is False
    assert run.outcome.events == 4
    assert run.outcome.usage is None
    usage = FinalUsage.of(run.outcome, prompt_tokens=11)
    # Without the engine's usage: the gateway's prompt, events less the role chunk.
    assert (usage.prompt_tokens, usage.completion_tokens) == (11, 3)


def test_stream_error_event_is_openais_error_shape_then_done() -> None:
    event, done = stream_error_event(replica_id="rep-1").split(b"\n\n", 1)

    assert done == b"data: [DONE]\n\n"
    error = json.loads(event.removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_failed"
    assert error["type"] == "server_error"
    assert error["replica_id"] == "rep-1"


@pytest.mark.parametrize("size", [1, 64, len(STREAM)])
def test_non_streaming_relay_collects_the_text_and_sends_nothing(size: int) -> None:
    run = Run(cut(STREAM, size), stream=False)

    assert run.is_done is True
    assert run.body == b""
    text = "".join(
        json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
        for e in TOKEN_EVENTS
    )
    assert "".join(run.outcome.content) == text
    answer = json.loads(
        whole_answer(
            answer_id="chatcmpl-test",
            model_ref="chat-7b",
            version="v1",
            region="r1",
            replica_id="rep-1",
            outcome=run.outcome,
            usage=FinalUsage.of(run.outcome, prompt_tokens=11),
        )
    )
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == text
    assert answer["choices"][0]["finish_reason"] == run.outcome.choices[0].finish_reason
    assert answer["usage"]["completion_tokens"] == UPSTREAM_USAGE["completion_tokens"]


def test_the_answers_id_is_the_engines_from_its_first_event() -> None:
    engine_id = json.loads(EVENTS[0][6:])["id"]
    run = Run(cut(STREAM, 7))

    assert run.sent[0]["id"] == engine_id  # the answer's headers were built with it
    assert run.outcome.answer_id == engine_id
    final = final_event(
        answer_id=run.outcome.answer_id,
        model_ref="chat-7b",
        version="v1",
        region="r1",
        replica_id="rep-1",
        usage=FinalUsage.of(run.outcome, prompt_tokens=11),
    )
    ids = {json.loads(e[6:])["id"] for e in [*TOKEN_EVENTS, final.split(b"\n\n")[0]]}
    assert ids == {engine_id}


@pytest.mark.parametrize(
    "first",
    [
        b'data: {"object":"chat.completion.chunk","choices":[{"index":0}]}\n\n',
        b'data: {"id":"bad id\\r\\nx","choices":[{"index":0}]}\n\n',
        b'data: {"id":7,"choices":[{"index":0}]}\n\n',
    ],
    ids=["no-id", "not-printable", "not-a-string"],
)
def test_an_engine_event_without_a_usable_id_keeps_the_gateways(first: bytes) -> None:
    run = Run([first, *TOKEN_EVENTS[1:], EVENTS[-1]])

    assert run.outcome.answer_id == "chatcmpl-gateway"


def test_final_event_without_usage_is_done_alone() -> None:
    run = Run([STREAM])

    end = final_event(
        answer_id="chatcmpl-test",
        model_ref="chat-7b",
        version="v1",
        region="r1",
        replica_id="rep-1",
        usage=FinalUsage.of(run.outcome, prompt_tokens=11),
        include_usage=False,
    )

    assert end == b"data: [DONE]\n\n"


def test_non_streaming_answer_keeps_the_engines_logprobs() -> None:
    def chunk(text: str, logprob: float, finish: str | None = None) -> bytes:
        entry = {"token": text, "logprob": logprob, "bytes": None, "top_logprobs": []}
        event = {
            "id": "chatcmpl-engine",
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": text},
                    "logprobs": {"content": [entry]},
                    "finish_reason": finish,
                }
            ],
        }
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    run = Run(
        [chunk("a", -0.5), chunk("b", -1.25, "length"), EVENTS[-2], EVENTS[-1]],
        stream=False,
    )
    answer = json.loads(
        whole_answer(
            answer_id=run.outcome.answer_id,
            model_ref="chat-7b",
            version="v1",
            region="r1",
            replica_id="rep-1",
            outcome=run.outcome,
            usage=FinalUsage.of(run.outcome, prompt_tokens=11),
        )
    )

    assert answer["id"] == "chatcmpl-engine"
    choice = answer["choices"][0]
    assert choice["message"]["content"] == "ab"
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-0.5, -1.25]
    assert choice["finish_reason"] == "length"


# -- push mode -------------------------------------------------------------------------
#
# Past the first token, ``Relay.run`` hands the reader a sink (``stream_to``) and
# reads of whole token events are sent from the reader's side (``send_now``). The
# reader here is a real ``EngineResponse`` whose socket reads the test feeds
# (``fed_response``), or one on a real socket.


class Gated:
    """An ASGI ``send`` that waits on the calls in ``gated`` until the test opens
    their gate; a body counts as sent (written) once the call returns."""

    def __init__(self, gated: set[int], relay_task: list[asyncio.Task[Any]]) -> None:
        self.gated = gated
        self.gates = {n: asyncio.Event() for n in gated}
        self.calls = 0
        self.waiting: set[int] = set()
        self.bodies: list[bytes] = []
        self.pushed = 0  # calls made outside the relay's task: by push
        self._relay_task = relay_task

    async def __call__(self, message: Any) -> None:
        call = self.calls
        self.calls += 1
        if asyncio.current_task() is not self._relay_task[0]:
            self.pushed += 1
        if call in self.gates:
            self.waiting.add(call)
            await self.gates[call].wait()
            self.waiting.discard(call)
        if message["type"] == "http.response.body":
            self.bodies.append(message["body"])


class PushRun:
    """A relay over a fed ``EngineResponse``; the test feeds reads one by one."""

    def __init__(self, gated: set[int] | None = None) -> None:
        self._task: list[asyncio.Task[Any]] = []
        self.send = Gated(gated or set(), self._task)
        self.relay = Relay(
            send=self.send,
            stream=True,
            request_id="chatcmpl-gateway",
            on_first=self._on_first,
            on_tokens=lambda n: None,
        )

    async def _on_first(self, answer_id: str) -> None:
        return None

    async def start(self) -> None:
        self.response, self.transport = await fed_response()
        self.task = asyncio.ensure_future(self.relay.run(self.response))
        self._task.append(self.task)

    def feed(self, *events: bytes) -> None:
        """One socket read: ``events`` joined, as one HTTP chunk."""
        assert not self.transport.paused, "a paused socket gives no reads"
        self.response.data_received(chunk(b"".join(events)))

    def end(self) -> None:
        self.response.data_received(chunk(EVENTS[-2] + EVENTS[-1]) + END)


def test_push_relay_sends_every_byte_in_order_from_the_readers_side() -> None:
    async def scenario() -> tuple[PushRun, bool]:
        run = PushRun()
        await run.start()
        run.feed(EVENTS[0])
        await until(lambda: run.send.calls == 1)
        for event in TOKEN_EVENTS[1:4]:
            run.feed(event)
        run.feed(*TOKEN_EVENTS[4:])
        run.end()
        return run, await asyncio.wait_for(run.task, 10)

    run, is_done = asyncio.run(scenario())
    assert is_done is True
    assert run.send.bodies == [
        EVENTS[0],
        *TOKEN_EVENTS[1:4],
        b"".join(TOKEN_EVENTS[4:]),
    ]
    assert run.send.pushed == 4  # every token read, none by the relay's task
    outcome = run.relay.outcome()
    assert outcome.events == len(TOKEN_EVENTS)
    assert outcome.usage == UPSTREAM_USAGE


def test_a_push_send_that_waits_pauses_the_reader_and_keeps_the_order() -> None:
    """GIVEN a client whose send waits (a full socket) on a pushed read
    THEN reading stops until that send is done, a read already taken waits for
    it, and the relay's task still handles the usage and ``[DONE]``."""

    async def scenario() -> tuple[PushRun, bool, list[bool]]:
        run = PushRun(gated={1, 3})
        await run.start()
        run.feed(EVENTS[0])
        await until(lambda: run.send.calls == 1)
        run.feed(TOKEN_EVENTS[1])  # pushed; its send waits
        paused = [run.transport.paused, run.response.is_paused]
        run.send.gates[1].set()
        await until(lambda: not run.transport.paused)
        paused.append(run.response.is_paused)
        run.feed(TOKEN_EVENTS[2])  # pushed at once
        run.feed(TOKEN_EVENTS[3])  # pushed; waits
        paused.append(run.transport.paused)
        # A read that was already off the socket: for the relay's task, which
        # must let the waiting send finish first.
        run.response.data_received(chunk(TOKEN_EVENTS[4]))
        await until(lambda: run.send.waiting == {3})
        run.send.gates[3].set()
        await until(lambda: run.send.calls == 5 and not run.send.waiting)
        run.feed(TOKEN_EVENTS[5])
        run.end()
        return run, await asyncio.wait_for(run.task, 10), paused

    run, is_done, paused = asyncio.run(scenario())
    assert paused == [True, True, False, True]
    assert is_done is True
    assert run.send.bodies == TOKEN_EVENTS
    assert not run.transport.paused
    outcome = run.relay.outcome()
    assert outcome.events == len(TOKEN_EVENTS)
    assert outcome.usage == UPSTREAM_USAGE


@pytest.mark.parametrize(
    "gated",
    [
        set(),
        {2},
    ],
    ids=["sends-at-once", "relay-send-waits"],
)
def test_a_cut_event_held_by_the_relay_is_not_overtaken_by_push(
    gated: set[int],
) -> None:
    """GIVEN an event cut across two reads (the relay's task holds its start)
    THEN it reaches the client before the read after it, even when the relay's
    send of it waits (call 2: role chunk 0, event 1, the completed event 2)."""

    async def scenario() -> tuple[PushRun, bool]:
        run = PushRun(gated=gated)
        await run.start()
        run.feed(EVENTS[0])
        await until(lambda: run.send.calls == 1)
        run.feed(TOKEN_EVENTS[1], TOKEN_EVENTS[2][:30])  # cut: for the relay's task
        await until(lambda: run.send.calls == 2)
        run.feed(TOKEN_EVENTS[2][30:])  # declined: the start is held
        await until(lambda: run.send.calls == 3)
        run.feed(TOKEN_EVENTS[3])  # the relay's send of event 2 may still wait
        for call in gated:
            run.send.gates[call].set()
        await until(lambda: run.send.calls == 4 and not run.send.waiting)
        run.feed(*TOKEN_EVENTS[4:])
        run.end()
        return run, await asyncio.wait_for(run.task, 10)

    run, is_done = asyncio.run(scenario())
    assert is_done is True
    assert run.send.bodies == [*TOKEN_EVENTS[:4], b"".join(TOKEN_EVENTS[4:])]
    # Event 3 goes by push, unless it came while the relay's own send waited: then
    # the task sends it after event 2. The last read goes by push.
    assert run.send.pushed == (1 if gated else 2)
    assert run.relay.outcome().events == len(TOKEN_EVENTS)


@pytest.mark.parametrize("size", [200, 600])
def test_push_relay_over_a_real_socket_with_a_send_that_waits(size: int) -> None:
    """A real ``EngineResponse`` on a socket, whole events per write, and a client
    whose every other send waits a loop turn: every byte arrives in order."""
    writes = [b"".join(TOKEN_EVENTS[i : i + 2]) for i in range(0, len(TOKEN_EVENTS), 2)]
    writes.append(EVENTS[-2] + EVENTS[-1])

    async def answer(writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD)
        for data in writes:
            writer.write(chunk(data))
            await writer.drain()
            await asyncio.sleep(0)  # a read each, mostly
        writer.write(END)
        return True

    async def scenario() -> tuple[list[bytes], bool, RelayOutcome, int]:
        bodies: list[bytes] = []
        calls = 0

        async def send(message: Any) -> None:
            nonlocal calls
            calls += 1
            if calls % 2 == 0:
                waited = asyncio.Event()
                asyncio.get_running_loop().call_soon(waited.set)
                await waited.wait()
            bodies.append(message["body"])

        async with replica(answer) as served, engine_client() as client:
            response = await client.post(served.url, "/v1/chat/completions", b"{}")
            relay = Relay(
                send=send,
                stream=True,
                request_id="chatcmpl-gateway",
                on_first=_no_start,
                on_tokens=lambda n: None,
            )
            is_done = await asyncio.wait_for(relay.run(response), 10)
            paused = response.is_paused
            response.release()
            return bodies, is_done, relay.outcome(), paused

    bodies, is_done, outcome, paused = asyncio.run(scenario())
    assert is_done is True
    assert b"".join(bodies) == b"".join(TOKEN_EVENTS)
    assert outcome.usage == UPSTREAM_USAGE
    assert outcome.events == len(TOKEN_EVENTS)
    assert not paused


async def _no_start(answer_id: str) -> None:
    return None


# -- send_now --------------------------------------------------------------------------


def test_send_now_runs_a_send_that_does_not_wait_to_its_end() -> None:
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def scenario() -> asyncio.Task[None] | None:
        return send_now(send, {"n": 1})

    assert asyncio.run(scenario()) is None
    assert sent == [{"n": 1}]


def test_send_now_finishes_a_send_that_waits_as_a_task() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        steps: list[str] = []
        gate = asyncio.Event()

        async def send(message: Any) -> None:
            steps.append("begun")
            await gate.wait()
            steps.append("written")

        task = send_now(send, {})
        assert task is not None
        before = list(steps)
        await asyncio.sleep(0)
        assert not task.done()
        gate.set()
        await asyncio.wait_for(task, 5)
        return before, steps

    before, steps = asyncio.run(scenario())
    assert before == ["begun"]
    assert steps == ["begun", "written"]


def test_send_now_raises_what_send_raised_before_it_waited() -> None:
    async def send(message: Any) -> None:
        raise ConnectionResetError("client gone")

    async def scenario() -> None:
        send_now(send, {})

    with pytest.raises(ConnectionResetError, match="client gone"):
        asyncio.run(scenario())


def test_send_now_task_fails_with_what_send_raised_after_it_waited() -> None:
    async def scenario() -> None:
        async def send(message: Any) -> None:
            await asyncio.sleep(0)
            raise ConnectionResetError("client gone")

        task = send_now(send, {})
        assert task is not None
        await asyncio.wait_for(task, 5)

    with pytest.raises(ConnectionResetError, match="client gone"):
        asyncio.run(scenario())
