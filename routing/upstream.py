"""The gateway's HTTP client to its engine replicas.

Public surface: ``Upstream``.

The token stream of a chat answer goes over ``routing.engine_http`` (an
``EngineClient``: kept-alive connections that push each read to the relay, see
there); the rest (``/tokenize``, shadow copies, the live judge's answers) over
one aiohttp ``ClientSession`` per gateway process, opened at start and closed at
stop, with no connection limit (every stream holds one connection) and a connect
timeout (a replica that does not accept in time is failed over before the first
token). The engine API key, when one is set, is sent with every request; an
engine that refuses it is the platform's failure, not the client's. Each call
sends the request's ``traceparent`` (``routing.traces``) when tracing is on.

Reads time out on a silent replica (aiohttp's ``sock_read``: the time since the
socket last gave bytes, re-armed by aiohttp on each arrival, stopped while the
client's backpressure pauses reading): ``first_token_timeout_s`` until the first
token, then ``inter_token_timeout_s`` once ``expect_tokens`` is called. A read that
times out raises a ``TimeoutError``, which the relay takes for the stream's end.
What this costs per chunk is aiohttp re-arming its one timer on each arrival (about
2 us of CPU on uvloop), no task or ``wait_for`` per read.
"""

from __future__ import annotations

import aiohttp

from routing.engine_http import EngineClient, EngineResponse

__all__ = ["Upstream"]


class Upstream:
    """POST chat completions to replicas over one pooled session."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        first_token_timeout_s: float = 30.0,
        inter_token_timeout_s: float = 15.0,
        engine_api_key: str = "",
        stall_after_s: float | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.inter_token_timeout_s = inter_token_timeout_s
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=first_token_timeout_s
        )
        self.headers = {"content-type": "application/json"}
        if engine_api_key:
            self.headers["authorization"] = f"Bearer {engine_api_key}"
        self._session: aiohttp.ClientSession | None = None
        self.engine = EngineClient(
            connect_timeout_s=connect_timeout_s,
            first_token_timeout_s=first_token_timeout_s,
            inter_token_timeout_s=inter_token_timeout_s,
            engine_api_key=engine_api_key,
            stall_after_s=stall_after_s,
        )

    @property
    def is_open(self) -> bool:
        """True between ``open`` and ``close``."""
        return self._session is not None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Return the open session.

        Raises:
            RuntimeError: the upstream is not open.
        """
        if self._session is None:
            raise RuntimeError("the upstream session is not open")
        return self._session

    async def open(self) -> None:
        """Open the session (on the running event loop); a no-op when open."""
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=4.0, enable_cleanup_closed=True
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
        )
        await self.engine.open()

    async def close(self) -> None:
        """Close the session and its connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None
            await self.engine.close()

    async def stream(
        self,
        base_url: str,
        payload: bytes,
        *,
        path: str = "/v1/chat/completions",
        answers_whole: bool = False,
        extra_head: bytes = b"",
    ) -> EngineResponse:
        """POST ``payload`` to a replica's ``path`` (chat completions by default)
        over the engine client; return the response once its head arrived.

        Until ``EngineResponse.expect_tokens``, a read fails after
        ``first_token_timeout_s`` of silence (waiting for the head included).
        ``answers_whole``: the answer is one body (embeddings), never failed by
        the stall rule (``routing.domain.stall``). ``extra_head``: header lines
        (the trace's ``traceparent``).
        """
        return await self.engine.post(
            base_url, path, payload, answers_whole=answers_whole, extra_head=extra_head
        )

    async def chat(
        self, base_url: str, payload: bytes, *, traceparent: str = ""
    ) -> aiohttp.ClientResponse:
        """POST ``payload`` to a replica's ``/v1/chat/completions``; return the
        response once its headers arrived (the body streams from ``.content``).

        Until ``expect_tokens``, a read fails after ``first_token_timeout_s`` of
        silence (waiting for the headers included). ``traceparent``: the W3C
        trace context to send (none when empty).
        """
        return await self.session.post(
            f"{base_url}/v1/chat/completions",
            data=payload,
            headers=self.headers_with(traceparent),
            timeout=self._timeout,
        )

    def headers_with(self, traceparent: str) -> dict[str, str]:
        """Return the engine request headers, with ``traceparent`` if not empty."""
        if not traceparent:
            return self.headers
        return {**self.headers, "traceparent": traceparent}

    def expect_tokens(self, response: aiohttp.ClientResponse) -> None:
        """The first token arrived: from now on a read of ``response`` fails after
        ``inter_token_timeout_s`` of silence.

        Uses the connection protocol's ``read_timeout``, which aiohttp itself sets
        this way (``ws_connect``), and re-arms the timer at once: a replica that
        stalls right after its first token is caught too.
        """
        connection = response.connection
        protocol = connection.protocol if connection is not None else None
        if protocol is None:
            return  # the body was already read in full: nothing left to time
        protocol.read_timeout = self.inter_token_timeout_s
        protocol.start_timeout()
