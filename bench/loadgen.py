"""Closed-loop load generator for streaming chat completions (raw asyncio, uvloop).

C users start evenly over ``--ramp-s`` (one stream length); each keeps one
keep-alive connection and sends ``POST /v1/chat/completions`` (stream: true) with a
unique ``x-conversation-id`` again as soon as its previous answer ends. Responses
are parsed with a hand-written HTTP/1.1 + chunked + SSE parser in an
``asyncio.Protocol`` (httpx costs several times more per event than the relays
under test). Per request: TTFT to the first content event, gaps between content
events, tokens, errors (non-200, error events, missing ``[DONE]``, timeouts,
broken connections) and short answers (other than ``--max-tokens`` tokens).

A content event is one token unless ``--token-text`` is given: then it is as many
tokens as its content holds that text (``bench/fake_upstream.py`` writes every
token as ``" word"`` and, with ``--tokens-per-event N``, several per event).

The measurement window opens ``--warmup-s`` after the first user starts and lasts
``--duration-s``; the tool prints ``window start`` and ``window end`` lines as it
crosses them (``bench/gateway.py`` reads CPU counters then) and a final JSON line.

    .venv/bin/python bench/loadgen.py --url http://127.0.0.1:9101 -c 100 \
        --key sk-... --duration-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import secrets
import sys
import time
from array import array
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

try:
    from uvloop import install as install_uvloop
except ImportError:  # pragma: no cover - the bench venv has it

    def install_uvloop() -> None:
        """Keep asyncio's own event loop."""


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simengine.domain.percentiles import percentile  # noqa: E402

_CRLF = b"\r\n"
_HEAD_END = b"\r\n\r\n"
_EVENT_END = b"\n\n"
_CONTENT = b'"content":"'


class Window:
    """The measurement window and what falls in it (shared by all connections)."""

    def __init__(self) -> None:
        self.start = math.inf
        self.end = math.inf
        self.events = 0  # SSE events received in the window (all kinds)
        self.content_events = 0  # events carrying tokens received in the window
        self.tokens = 0  # tokens those events carried
        self.gaps = array("d")  # gaps (s) between content events, ending in it
        self.gaps_all = 0

    def inside(self, now: float) -> bool:
        return self.start <= now < self.end


class Result:
    """One request's outcome."""

    __slots__ = (
        "done",
        "ended",
        "error",
        "first",
        "last",
        "started",
        "status",
        "tokens",
    )

    def __init__(self, started: float) -> None:
        self.started = started
        self.status = 0
        self.first = 0.0
        self.last = 0.0
        self.ended = 0.0
        self.tokens = 0
        self.done = False
        self.error = ""


class Client(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, window: Window, token_text: bytes = b"") -> None:
        self.window = window
        self.token_text = token_text
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.buf = bytearray()
        self.sse = bytearray()
        self.result: Result | None = None
        self.waiter: asyncio.Future[Result] | None = None
        self.body_text = b""
        self._reset()

    def _reset(self) -> None:
        self.in_head = True
        self.chunked = False
        self.length = -1
        self.chunk_left = -1  # -1: expecting a size line
        self.buf.clear()
        self.sse.clear()
        self.body_text = b""

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP connection's transport: asyncio's, or uvloop's with the same methods.
        self.transport = cast("asyncio.Transport", transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.result is not None:
            self._fail("connection closed mid-answer")

    def data_received(self, data: bytes) -> None:
        if self.result is None:
            return
        self.buf += data
        now = time.perf_counter()
        if self.in_head and not self._head():
            return
        if self.result is not None:
            self._body(now)

    # -- requests -------------------------------------------------------------------------

    def request(self, raw: bytes) -> asyncio.Future[Result]:
        assert self.transport is not None
        self._reset()
        self.result = Result(time.perf_counter())
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self.waiter

    def _complete(self) -> None:
        result, waiter = self.result, self.waiter
        self.result = self.waiter = None
        if result is not None:
            result.ended = time.perf_counter()
            if waiter is not None and not waiter.done():
                waiter.set_result(result)

    def _fail(self, why: str) -> None:
        if self.result is not None and not self.result.error:
            self.result.error = why
        self._complete()

    def _head(self) -> bool:
        end = self.buf.find(_HEAD_END)
        if end < 0:
            return False
        lines = bytes(self.buf[:end]).split(_CRLF)
        del self.buf[: end + 4]
        self.in_head = False
        assert self.result is not None
        try:
            self.result.status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            self._fail("bad status line")
            return False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                self.chunked = True
            elif name == b"content-length":
                self.length = int(value.strip())
        return True

    def _body(self, now: float) -> None:
        buf = self.buf
        if not self.chunked:
            if self.length < 0 or len(buf) < self.length:
                return  # a body without a length is not expected here
            self._payload(bytes(buf[: self.length]), now)
            del buf[: self.length]
            self._finish_response()
            return
        while True:
            if self.chunk_left == -1:  # a size line
                end = buf.find(_CRLF)
                if end < 0:
                    break
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                del buf[: end + 2]
                self.chunk_left = size if size else -2
                continue
            if self.chunk_left == -2:  # the CRLF after the last chunk
                if len(buf) < 2:
                    break
                del buf[:2]
                self._finish_response()
                return
            if len(buf) < self.chunk_left + 2:
                break
            self._payload(bytes(buf[: self.chunk_left]), now)
            del buf[: self.chunk_left + 2]
            self.chunk_left = -1

    def _payload(self, data: bytes, now: float) -> None:
        assert self.result is not None
        if self.result.status != 200:
            if len(self.body_text) < 300:
                self.body_text += data
            return
        self.sse += data
        self._events(now)

    def _events(self, now: float) -> None:
        result = self.result
        assert result is not None
        sse = self.sse
        end = sse.rfind(_EVENT_END)
        if end < 0:
            return
        chunk = bytes(sse[:end])
        del sse[: end + 2]
        window = self.window
        inside = window.start <= now < window.end
        for event in chunk.split(_EVENT_END):
            if not event:
                continue
            if inside:
                window.events += 1
            if event.startswith(b"data: [DONE]"):
                result.done = True
                continue
            if event.startswith(b'data: {"error"'):
                if not result.error:
                    result.error = "error event"
                continue
            at = event.find(_CONTENT)
            if at < 0 or event[at + 11 : at + 12] == b'"':
                continue  # role chunk, usage chunk
            tokens = 1
            if self.token_text:
                start = at + 11
                tokens = event.count(self.token_text, start, event.find(b'"', start))
            if result.tokens == 0:
                result.first = now
            else:
                window.gaps_all += 1
                if inside:
                    window.gaps.append(now - result.last)
            if inside:
                window.content_events += 1
                window.tokens += tokens
            result.tokens += tokens
            result.last = now

    def _finish_response(self) -> None:
        result = self.result
        assert result is not None
        if result.status != 200:
            result.error = f"HTTP {result.status}: {self.body_text[:200]!r}"
        elif not result.done and not result.error:
            result.error = "no [DONE]"
        self._complete()


def build_request(
    host: str, path: str, key: str, conv: str, body: bytes, priority: str = ""
) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\n"
        f"host: {host}\r\n"
        f"authorization: Bearer {key}\r\n"
        f"x-conversation-id: {conv}\r\n"
        + (f"x-priority: {priority}\r\n" if priority else "")
        + "content-type: application/json\r\n"
        "accept: text/event-stream\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def run(args: argparse.Namespace) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    window = Window()
    targets = []
    for url in args.url:
        parts = urlsplit(url)
        targets.append((parts.hostname or "127.0.0.1", parts.port or 80, parts.netloc))
    run_id = secrets.token_hex(3)
    token_text = args.token_text.encode()
    results: list[Result] = []
    errors_by_kind: dict[str, int] = {}
    samples: list[str] = []
    t0 = time.perf_counter()
    window.start = t0 + args.warmup_s
    window.end = window.start + args.duration_s
    stop_at = window.end
    answer_s = args.max_tokens / args.rate
    request_timeout = answer_s * 3 + 30

    def record(result: Result) -> None:
        results.append(result)
        if result.error:
            kind = result.error.split(":", 1)[0]
            errors_by_kind[kind] = errors_by_kind.get(kind, 0) + 1
            if len(samples) < 5:
                samples.append(result.error)

    # A system prompt every request shares (one stand-in token per word).
    system = (
        [{"role": "system", "content": "word" + " word" * (args.system_words - 1)}]
        if args.system_words > 0
        else []
    )

    async def user(index: int) -> None:
        await asyncio.sleep(index * args.ramp_s / args.concurrency)
        host, port, netloc = targets[index % len(targets)]
        client: Client | None = None
        sent = 0
        try:
            while time.perf_counter() < stop_at:
                if client is None or client.closed:
                    try:
                        _, client = await loop.create_connection(
                            lambda: Client(window, token_text), host, port
                        )
                    except OSError as exc:
                        failed = Result(time.perf_counter())
                        failed.error = f"connect: {type(exc).__name__}"
                        failed.ended = failed.started
                        record(failed)
                        client = None
                        await asyncio.sleep(0.5)
                        continue
                sent += 1
                conv = f"bench-{run_id}-{index}-{sent}"
                content = f"Request {conv}: tell me a long story about streams."
                body = json.dumps(
                    {
                        "model": args.model,
                        "messages": [*system, {"role": "user", "content": content}],
                        "max_tokens": args.max_tokens,
                        "stream": True,
                    },
                    separators=(",", ":"),
                ).encode()
                future = client.request(
                    build_request(
                        netloc, args.path, args.key, conv, body, args.priority
                    )
                )
                try:
                    result = await asyncio.wait_for(future, request_timeout)
                except TimeoutError:
                    result = client.result or Result(time.perf_counter())
                    result.error = "timeout"
                    result.ended = time.perf_counter()
                    client.result = None
                    client.closed = True
                record(result)
                if result.error and client.transport is not None:
                    client.transport.close()
                    client = None
        finally:
            # Answers in flight at the end are cut off: they belong to no window.
            if client is not None and client.transport is not None:
                client.result = None
                client.transport.close()

    async def marks() -> None:
        await asyncio.sleep(max(0.0, window.start - time.perf_counter()))
        cpu_at_start.append(time.process_time())
        print("window start", flush=True)
        await asyncio.sleep(max(0.0, window.end - time.perf_counter()))
        cpu_at_start.append(time.process_time())
        print("window end", flush=True)

    cpu_at_start: list[float] = []
    users = [asyncio.create_task(user(i)) for i in range(args.concurrency)]
    await marks()
    # Answers in flight at the end are cut off: they belong to no window.
    for task in users:
        task.cancel()
    await asyncio.gather(*users, return_exceptions=True)

    in_window = [r for r in results if window.start <= r.started < window.end]
    ttft = [
        (r.first - r.started) * 1000
        for r in in_window
        if r.tokens and r.first < window.end
    ]
    gaps = [g * 1000 for g in window.gaps]
    errors_window = sum(
        1 for r in results if r.error and window.start <= r.ended < window.end
    )
    short = sum(
        1 for r in results if not r.error and r.done and r.tokens != args.max_tokens
    )
    duration = window.end - window.start
    return {
        "concurrency": args.concurrency,
        "urls": args.url,
        "window_s": duration,
        "requests_completed": len(results),
        "requests_started_in_window": len(in_window),
        "requests_ended_in_window": sum(
            1 for r in results if window.start <= r.ended < window.end
        ),
        "events_per_s": window.events / duration,
        "content_events_per_s": window.content_events / duration,
        "tokens_per_s": window.tokens / duration,
        "events_in_window": window.events,
        "content_events_in_window": window.content_events,
        "tokens_in_window": window.tokens,
        "tokens_per_content_event": (
            window.tokens / window.content_events if window.content_events else None
        ),
        "nominal_tokens_per_s": args.concurrency * args.rate,
        "ttft_ms": {
            "n": len(ttft),
            "p50": percentile(ttft, 0.50),
            "p90": percentile(ttft, 0.90),
            "p99": percentile(ttft, 0.99),
            "max": max(ttft) if ttft else None,
        },
        "gap_ms": {
            "n": len(gaps),
            "p50": percentile(gaps, 0.50),
            "p99": percentile(gaps, 0.99),
            "p999": percentile(gaps, 0.999),
            "max": max(gaps) if gaps else None,
        },
        "errors": sum(1 for r in results if r.error),
        "errors_in_window": errors_window,
        "errors_by_kind": errors_by_kind,
        "error_samples": samples,
        "short_answers": short,
        "loadgen_cpu_cores": (cpu_at_start[1] - cpu_at_start[0]) / duration,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--url",
        action="append",
        required=True,
        help="base URL (repeat to spread users over several)",
    )
    parser.add_argument("--path", default="/v1/chat/completions")
    parser.add_argument("-c", "--concurrency", type=int, required=True)
    parser.add_argument("--key", default="none")
    parser.add_argument("--model", default="chat-7b")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument(
        "--priority",
        choices=["", "interactive", "standard", "batch"],
        default="",
        help="x-priority header of every request (default: none, i.e. standard)",
    )
    parser.add_argument("--rate", type=float, default=30.0, help="engine tokens/s")
    parser.add_argument(
        "--token-text",
        default="",
        help="count a content event's tokens as the times its content holds this "
        "text (default: one token per content event)",
    )
    parser.add_argument(
        "--system-words",
        type=int,
        default=0,
        help="open every request with a system prompt of this many words (about "
        "as many tokens; default none)",
    )
    parser.add_argument("--ramp-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--duration-s", type=float, default=20.0)
    args = parser.parse_args()
    install_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        result = asyncio.run(run(args))
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
