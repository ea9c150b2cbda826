"""A cheap stand-in for a vLLM replica: vLLM-shaped SSE at a fixed token rate.

A raw uvloop ``asyncio.Protocol`` HTTP/1.1 server (keep-alive, chunked transfer)
for the gateway benchmark (``bench/gateway.py``). ``POST /v1/chat/completions``
answers a streaming chat completion the way vLLM does: a role chunk, one
``chat.completion.chunk`` event (~200 bytes) per token, the last one with
``finish_reason: "length"``, the usage chunk, then ``data: [DONE]``. Tokens leave
on an absolute schedule (token k at start + k / rate; the first one at once), and
one timer loop ticks every open stream, so 1,000 streams cost a few thousand heap
operations a second rather than one sleeping task each. ``GET /health`` answers
200 and ``GET /metrics`` a minimal vLLM exposition.

``--tokens-per-event N`` coalesces tokens as vLLM does under load (or with
``--stream-interval N``): after the first token, which still leaves at once and
alone, each event carries the next N tokens and leaves when the last of them is
due; the final event carries what is left. Every token is the text ``" word"``
(so a client counts an event's tokens by counting it), and the usage chunk
counts tokens, not events. Run from the repository root:

    .venv/bin/python bench/fake_upstream.py --port 9101 [--rate 30] \
        [--tokens-per-event 1]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import secrets
import signal
import time
from typing import cast

try:
    from uvloop import install as install_uvloop
except ImportError:  # pragma: no cover - the bench venv has it

    def install_uvloop() -> None:
        """Keep asyncio's own event loop."""


MODEL = "chat-7b"
TOKEN_TEXT = " word"  # every token's text: clients count tokens by it
_HEAD_END = b"\r\n\r\n"
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n"
    b"\r\n"
)
_LAST_CHUNK = b"0\r\n\r\n"


def _frame(payload: bytes) -> bytes:
    """Return ``payload`` as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(obj: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _plain(status: str, body: bytes, content_type: str, *, close: bool) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(body)}\r\n"
        f"connection: {'close' if close else 'keep-alive'}\r\n\r\n"
    )
    return head.encode() + body


class Stats:
    """Counters for /metrics."""

    running = 0
    requests = 0
    prompt_tokens = 0
    generation_tokens = 0


class Stream:
    """One streaming answer in progress."""

    __slots__ = (
        "conn",
        "created",
        "done",
        "left",
        "next_at",
        "prompt",
        "regular",
        "rid",
        "started_at",
        "total",
    )

    def __init__(self, conn: Connection, total: int, prompt: int, now: float) -> None:
        self.conn = conn
        self.rid = "chatcmpl-" + secrets.token_hex(16)
        self.created = int(time.time())
        self.total = total
        self.left = total
        self.prompt = prompt
        self.started_at = now
        self.next_at = now
        self.done = False
        self.regular: bytes | None = None  # the event of a full group, once built

    def common(self) -> dict[str, object]:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": MODEL,
        }

    def first(self) -> bytes:
        """The role chunk, as vLLM sends it before the first token."""
        role = {
            **self.common(),
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        return _frame(_event(role))

    def tokens(self, count: int, *, last: bool) -> bytes:
        """One event carrying ``count`` tokens."""
        chunk = {
            **self.common(),
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": TOKEN_TEXT * count},
                    "logprobs": None,
                    "finish_reason": "length" if last else None,
                }
            ],
        }
        return _frame(_event(chunk))

    def tail(self) -> bytes:
        usage = {
            **self.common(),
            "choices": [],
            "usage": {
                "prompt_tokens": self.prompt,
                "total_tokens": self.prompt + self.total,
                "completion_tokens": self.total,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
        return _frame(_event(usage)) + _frame(b"data: [DONE]\n\n") + _LAST_CHUNK


class Ticker:
    """One timer loop for every stream: a heap of (due time, seq, stream).

    The loop wakes at the earliest due time but at most once per ``min_step_s``
    and then sends every token due by then, so 1,000 streams cost about a
    thousand wake-ups a second, not one timer per token.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        rate: float,
        min_step_s: float = 0.001,
        tokens_per_event: int = 1,
    ) -> None:
        self.loop = loop
        self.interval = 1.0 / rate
        self.min_step_s = min_step_s
        self.tokens_per_event = tokens_per_event
        self.heap: list[tuple[float, int, Stream]] = []
        self.seq = itertools.count()
        self.wake = asyncio.Event()

    def add(self, stream: Stream) -> None:
        heapq.heappush(self.heap, (stream.next_at, next(self.seq), stream))
        # A new stream is never due before the current head (it is one interval
        # away), so only an idle loop needs waking.
        self.wake.set()

    async def run(self) -> None:
        heap = self.heap
        loop = self.loop
        push, pop = heapq.heappush, heapq.heappop
        while True:
            if not heap:
                self.wake.clear()
                await self.wake.wait()
                continue
            now = loop.time()
            while heap and heap[0][0] <= now:
                _, _, stream = pop(heap)
                if self.emit(stream):
                    push(heap, (stream.next_at, next(self.seq), stream))
            if heap:
                delay = max(heap[0][0] - loop.time(), self.min_step_s)
                await asyncio.sleep(delay)

    def emit(self, stream: Stream) -> bool:
        """Send the stream's next event; return whether it has more to send.

        The first event carries one token, the others up to ``tokens_per_event``;
        ``next_at`` becomes the due time of the last token of the next event.
        """
        conn = stream.conn
        if conn.closed or stream.done:
            if not stream.done:
                stream.done = True
                Stats.running -= 1
            return False
        first = stream.left == stream.total
        count = 1 if first else min(self.tokens_per_event, stream.left)
        stream.left -= count
        Stats.generation_tokens += count
        if stream.left <= 0:
            conn.transport.write(stream.tokens(count, last=True) + stream.tail())
            stream.done = True
            Stats.running -= 1
            conn.finish_stream()
            return False
        if count != self.tokens_per_event:
            conn.transport.write(stream.tokens(count, last=False))
        else:
            if stream.regular is None:
                stream.regular = stream.tokens(count, last=False)
            conn.transport.write(stream.regular)
        sent = stream.total - stream.left
        last_due = sent - 1 + min(self.tokens_per_event, stream.left)
        stream.next_at = stream.started_at + last_due * self.interval
        return True


class Connection(asyncio.Protocol):
    """One client connection: parses requests one at a time (no pipelining)."""

    ticker: Ticker
    transport: asyncio.Transport  # set by connection_made, before any data

    def __init__(self) -> None:
        self.buffer = b""
        self.closed = False
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP server's transport: asyncio's, or uvloop's with the same methods.
        self.transport = cast("asyncio.Transport", transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self.parse()

    def finish_stream(self) -> None:
        self.busy = False
        if self.buffer:
            self.parse()

    def parse(self) -> None:
        while not self.busy and not self.closed:
            end = self.buffer.find(_HEAD_END)
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1")
            lines = head.split("\r\n")
            try:
                method, path, _ = lines[0].split(" ", 2)
            except ValueError:
                self.transport.close()
                return
            length = 0
            close = False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value.strip())
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self.handle(method, path.split("?", 1)[0], body, close=close)

    def handle(self, method: str, path: str, body: bytes, *, close: bool) -> None:
        write = self.transport.write
        if method == "GET" and path == "/health":
            write(_plain("200 OK", b"", "text/plain", close=close))
        elif method == "GET" and path == "/metrics":
            write(_plain("200 OK", metrics_text(), "text/plain", close=close))
        elif method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            write(
                _plain(
                    "200 OK",
                    json.dumps(models).encode(),
                    "application/json",
                    close=close,
                )
            )
        elif method == "POST" and path == "/v1/chat/completions":
            self.chat(body)
            return
        else:
            write(_plain("404 Not Found", b"{}", "application/json", close=close))
        if close:
            self.transport.close()

    def chat(self, raw: bytes) -> None:
        try:
            body = json.loads(raw)
            total = int(
                body.get("max_tokens") or body.get("max_completion_tokens") or 300
            )
            text = json.dumps(body.get("messages") or [])
        except (ValueError, TypeError, AttributeError):
            error = b'{"object":"error","message":"bad body","code":400}'
            self.transport.write(
                _plain("400 Bad Request", error, "application/json", close=False)
            )
            return
        prompt = max(1, len(text) // 4)
        stream = Stream(self, max(1, total), prompt, self.ticker.loop.time())
        Stats.requests += 1
        Stats.running += 1
        Stats.prompt_tokens += prompt
        self.busy = True
        self.transport.write(_SSE_HEAD + stream.first())
        # The first token leaves at once, with the role chunk (the schedule's t=0).
        if self.ticker.emit(stream):
            self.ticker.add(stream)


def metrics_text() -> bytes:
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{model_name="{MODEL}"}} {Stats.running}',
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0',
        "# TYPE vllm:prompt_tokens_total counter",
        f'vllm:prompt_tokens_total{{model_name="{MODEL}"}} {Stats.prompt_tokens}',
        "# TYPE vllm:generation_tokens_total counter",
        f'vllm:generation_tokens_total{{model_name="{MODEL}"}} {Stats.generation_tokens}',
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{model_name="{MODEL}"}} {Stats.requests}',
        "",
    ]
    return "\n".join(lines).encode()


async def serve(host: str, port: int, rate: float, tokens_per_event: int) -> None:
    loop = asyncio.get_running_loop()
    ticker = Ticker(loop, rate, tokens_per_event=tokens_per_event)
    Connection.ticker = ticker
    server = await loop.create_server(Connection, host, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(ticker.run())
    print(
        f"fake upstream on http://{host}:{port} at {rate:g} tokens/s, "
        f"{tokens_per_event} per event",
        flush=True,
    )
    await stop.wait()
    task.cancel()
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate", type=float, default=30.0, help="tokens/s per stream")
    parser.add_argument(
        "--tokens-per-event",
        type=int,
        default=1,
        help="tokens coalesced into one SSE event after the first (vLLM under load)",
    )
    args = parser.parse_args()
    if args.tokens_per_event < 1:
        parser.error("--tokens-per-event must be 1 or more")
    install_uvloop()
    asyncio.run(serve(args.host, args.port, args.rate, args.tokens_per_event))


if __name__ == "__main__":
    main()
