"""One attempt at a replica: open, relay, end the answer; return what happened.

Public surface: ``Attempt``, ``AttemptResult``, ``NoFirstToken``, ``Cut``.

An ``Attempt`` is built with all it needs for one replica and run once. It returns
an immutable ``AttemptResult`` (outcome, replica, first-token time, usage, error
kind, and the error the client gets, if any), or raises ``UpstreamFailed`` before
the first token, when another replica may be tried. Cut short after it began (the
client left, a bug), it raises ``Cut``, which holds what was served so far and the
exception to pass on, so that the request is still metered for it. The relay and
the answer's end are the plan's surface's: ``routing.relay`` for chat and
completions, ``routing.responses_relay`` for ``/v1/responses`` (which ends with the
engine's terminal event, or its response object whole).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from config.asgi_io import ChunkedWrite, Send
from metering import metrics
from routing.domain.stall import ReplicaStalled
from routing.embeddings import EngineEmbeddings, embedding_answer, read_embeddings
from routing.engine_http import EngineResponse
from routing.live import AttemptLoad, LiveLoad
from routing.plan import ChatPlan
from routing.relay import Relay, UpstreamFailed
from routing.responses import (
    FinalUsage,
    GatewayError,
    answer_headers,
    final_event,
    respond,
    response_end_event,
    response_error_event,
    stream_error_event,
    upstream_client_error,
    whole_answer,
    whole_completion,
    whole_response,
)
from routing.responses_relay import ResponsesRelay
from routing.upstream import Upstream

logger = logging.getLogger(__name__)

__all__ = ["Attempt", "AttemptResult", "Cut", "NoFirstToken"]

# Where each surface's requests go on the engine (vLLM's and SGLang's paths).
_ENGINE_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
}


class NoFirstToken(UpstreamFailed):
    """The replica sent no first token within the deadline."""


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """What one request's routing ended with.

    ``error_kind`` is how it failed, as the guards count it
    (``metering.domain.figures.ERROR_KINDS``); ``error`` the answer the client
    gets instead of a 200 (raised once the request is metered); ``head_text``
    the answer's head, kept only for the refusal detector.
    """

    outcome: metrics.Outcome
    replica_id: str = ""
    first_token_at: float | None = None
    usage: FinalUsage | None = None
    head_text: str = ""
    error_kind: str | None = None
    error: GatewayError | None = None

    @property
    def is_client_error(self) -> bool:
        """A 4xx the client's request caused: no error of the version."""
        return self.error is not None and self.error.status < 500

    @property
    def is_unserved(self) -> bool:
        """A 503 before any answer: no replica of the pool could start one (none
        serving, every one tried failed before its first token, or the retry
        budget was spent). Nothing was served, so nothing is billed."""
        return (
            self.error is not None and self.error.status == 503 and self.usage is None
        )


class Cut(Exception):
    """An attempt cut short after it began: what it served, and why it stopped.

    ``cause`` (a cancellation included) is raised again once the request is
    metered for ``so_far``.
    """

    def __init__(self, so_far: AttemptResult, cause: BaseException) -> None:
        super().__init__(type(cause).__name__)
        self.so_far = so_far
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of one request at one replica."""

    plan: ChatPlan
    replica_id: str
    url: str
    region: str
    rate_limit: dict[str, str]
    first_token_timeout_s: float
    live: LiveLoad
    upstream: Upstream
    send: Send
    before_last_send: Callable[[], None]
    write_frames: ChunkedWrite | None
    capture_head: bool
    # The prompt tokens this replica is expected to compute (its cache holding the
    # rest): owed prefill until the first token (``AttemptLoad.prefilled``).
    prefill_tokens: int = 0
    # Header lines for the engine: the trace's ``traceparent`` (``routing.traces``).
    engine_head: bytes = b""

    async def run(self) -> AttemptResult:
        """Stream the answer and end it (an embeddings answer: send it whole).

        Raises:
            UpstreamFailed: before the first token; another replica may be tried.
            Cut: cut short after the relay began (a cancellation included).
        """
        if self.plan.surface == "embeddings":
            return await self._embed()
        return await self._stream()

    async def _stream(self) -> AttemptResult:
        plan = self.plan
        load = AttemptLoad(
            self.live,
            self.replica_id,
            tokens=plan.request_tokens,
            floor=plan.prompt_tokens,
            prefill=self.prefill_tokens,
        )
        # The first token's deadline, from now (connect and headers included).
        first_token = asyncio.timeout(self.first_token_timeout_s)
        response: EngineResponse | None = None
        relay: Relay | ResponsesRelay | None = None
        is_done = False
        error_kind: str | None = None
        try:
            try:
                async with first_token:
                    response = await self._open()
                    on_first = functools.partial(
                        self._start, first_token, response, load
                    )
                    if plan.surface == "responses":
                        relay = ResponsesRelay(
                            send=self.send,
                            stream=plan.stream,
                            request_id=plan.request_id,
                            on_first=on_first,
                            on_tokens=load.shrink,
                            capture_head=self.capture_head,
                        )
                    else:
                        relay = Relay(
                            send=self.send,
                            stream=plan.stream,
                            request_id=plan.request_id,
                            on_first=on_first,
                            on_tokens=load.shrink,
                            capture_head=self.capture_head,
                            write_frames=self.write_frames,
                        )
                    # The relay loop runs as a task of its own: each engine chunk
                    # then resumes this one coroutine, not the whole chain of
                    # frames above it (the server, the router, the gateway ...
                    # the attempt), which cost about 10% of the relay's CPU per
                    # token. Cancelling this task (the deadline, a client that
                    # left) cancels it.
                    is_done = await asyncio.ensure_future(relay.run(response))
            except TimeoutError:
                if not first_token.expired():
                    raise
                raise NoFirstToken(
                    f"no first token within {self.first_token_timeout_s:g} s"
                ) from None
            if not is_done:
                # Broken after its first token (died, sent an error, or silent for
                # the inter-token timeout): too late to retry, but new requests
                # avoid it for the missed-beat window (by then a dead one stopped
                # beating and a stalled one beats as stalled).
                logger.warning("replica %s broke a stream mid-way", self.replica_id)
                error_kind = "broken"
                self.live.eject(self.replica_id, time.monotonic())
                error = await self._end_broken()
                return self._result(relay, "error", error_kind, error)
            return await self._end(relay)
        except UpstreamFailed:
            raise  # before the first token: the caller tries another replica
        except GatewayError as exc:  # a 4xx the client's request caused
            return self._result(relay, "error", error_kind, exc)
        except asyncio.CancelledError as exc:
            raise Cut(self._result(relay, "client_closed", error_kind), exc) from None
        except Exception as exc:
            raise Cut(self._result(relay, "error", error_kind), exc) from None
        finally:
            if response is not None:
                # A stream read to [DONE] leaves a reusable connection.
                response.release() if is_done else response.close()
            load.drop()

    async def _embed(self) -> AttemptResult:
        """Post an embeddings request and answer the engine's JSON body whole.

        Raises:
            UpstreamFailed: another replica may be tried (``fetch_embeddings``).
            Cut: the client left (or a bug) while the answer was sent.
        """
        try:
            engine = await self.fetch_embeddings()
        except GatewayError as exc:  # a 4xx the client's request caused
            return AttemptResult("error", self.replica_id, error=exc)
        body, answer_id = embedding_answer(
            engine, plan=self.plan, region=self.region, replica_ids=[self.replica_id]
        )
        result = AttemptResult(
            "ok", self.replica_id, first_token_at=time.monotonic(), usage=engine.usage
        )
        await self.send_whole(result, body, answer_id)
        return result

    async def fetch_embeddings(self) -> EngineEmbeddings:
        """Post the plan's embeddings request; return the engine's answer, read.

        Until the body is read whole nothing is sent to the client, so anything
        that fails before (no connection, a 5xx, a broken or malformed body, the
        first-token deadline) lets another replica be tried.

        Raises:
            UpstreamFailed: another replica may be tried.
            GatewayError: a 4xx the client's request caused.
        """
        plan = self.plan
        load = AttemptLoad(
            self.live, self.replica_id, tokens=plan.request_tokens, floor=0
        )
        response: EngineResponse | None = None
        is_done = False
        try:
            try:
                async with asyncio.timeout(self.first_token_timeout_s) as deadline:
                    response = await self._open()
                    raw = await response.read()
            except TimeoutError:
                if not deadline.expired():
                    raise UpstreamFailed("TimeoutError") from None
                raise NoFirstToken(
                    f"no answer within {self.first_token_timeout_s:g} s"
                ) from None
            except OSError as exc:
                raise UpstreamFailed(type(exc).__name__) from None
            is_done = True
            try:
                return read_embeddings(raw, counted=plan.prompt_tokens)
            except ValueError:
                raise UpstreamFailed("a malformed embeddings answer") from None
        finally:
            if response is not None:
                response.release() if is_done else response.close()
            load.drop()

    async def send_whole(
        self, result: AttemptResult, body: bytes, answer_id: str
    ) -> None:
        """Send a whole JSON answer (``result`` is what it served).

        Raises:
            Cut: the client left (or a bug) while the answer was sent.
        """
        self.before_last_send()
        try:
            await respond(
                self.send,
                200,
                body,
                raw_headers=self._headers(answer_id),
            )
        except asyncio.CancelledError as exc:
            raise Cut(
                dataclasses.replace(result, outcome="client_closed"), exc
            ) from None
        except Exception as exc:
            raise Cut(dataclasses.replace(result, outcome="error"), exc) from None

    async def _start(
        self,
        first_token: asyncio.Timeout,
        response: EngineResponse,
        load: AttemptLoad,
        answer_id: str,
    ) -> None:
        """Begin the answer, at its first token."""
        # First, before any await: past here the deadline can no longer cancel an
        # answer that has begun. From now on the replica may stay silent for
        # inter_token_timeout_s between reads (the engine client).
        first_token.reschedule(None)
        load.prefilled()
        response.expect_tokens()
        if self.plan.stream:
            await self.send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": self._headers(answer_id),
                }
            )

    def _headers(self, answer_id: str) -> list[tuple[bytes, bytes]]:
        return answer_headers(
            request_id=answer_id,
            version=self.plan.resolution.version,
            region=self.region,
            replica_id=self.replica_id,
            rate_limit=self.rate_limit,
            stream=self.plan.stream,
        )

    def _result(
        self,
        relay: Relay | ResponsesRelay | None,
        outcome: metrics.Outcome,
        error_kind: str | None,
        error: GatewayError | None = None,
    ) -> AttemptResult:
        """Return what ``relay`` (None: not begun) served so far, ended with
        ``outcome``."""
        if relay is None or not relay.first_token_at:
            return AttemptResult(
                outcome, self.replica_id, error_kind=error_kind, error=error
            )
        return AttemptResult(
            outcome=outcome,
            replica_id=self.replica_id,
            first_token_at=relay.first_token_at,
            usage=FinalUsage.of(
                relay.outcome(),
                prompt_tokens=self.plan.prompt_tokens,
                role_chunks=self.plan.choices if self.plan.surface == "chat" else 0,
            ),
            head_text=relay.head_text() if self.capture_head else "",
            error_kind=error_kind,
            error=error,
        )

    async def _end(self, relay: Relay | ResponsesRelay) -> AttemptResult:
        """Send the answer's end (the final event, or the whole answer)."""
        plan = self.plan
        if isinstance(relay, ResponsesRelay):
            return await self._end_response(relay)
        outcome = relay.outcome()
        result = self._result(relay, "ok", None)
        usage = result.usage
        assert usage is not None  # a relay that read to [DONE] had a first token
        # The answer's id is the engine's (every content chunk carries it), and
        # so is x-request-id.
        served_by = {
            "answer_id": outcome.answer_id,
            "model_ref": plan.model_ref,
            "version": plan.resolution.version,
            "region": self.region,
            "replica_id": self.replica_id,
        }
        self.before_last_send()
        is_chat = plan.surface == "chat"
        if plan.stream:
            await self.send(
                {
                    "type": "http.response.body",
                    "body": final_event(
                        **served_by,
                        usage=usage,
                        include_usage=plan.include_usage,
                        chunk_object=(
                            "chat.completion.chunk" if is_chat else "text_completion"
                        ),
                    ),
                    "more_body": False,
                }
            )
        else:
            whole = whole_answer if is_chat else whole_completion
            body = whole(**served_by, outcome=outcome, usage=usage)
            await respond(
                self.send, 200, body, raw_headers=self._headers(outcome.answer_id)
            )
        return result

    async def _end_response(self, relay: ResponsesRelay) -> AttemptResult:
        """End a ``/v1/responses`` answer with the engine's terminal event, or
        answer its response object whole."""
        result = self._result(relay, "ok", None)
        terminal = relay.terminal
        assert terminal is not None  # a relay that returned True had one
        response = whole_response(
            response=relay.outcome().response or {},
            model_ref=self.plan.model_ref,
            version=self.plan.resolution.version,
            region=self.region,
            replica_id=self.replica_id,
        )
        self.before_last_send()
        if self.plan.stream:
            await self.send(
                {
                    "type": "http.response.body",
                    "body": response_end_event(terminal, response),
                    "more_body": False,
                }
            )
        else:
            await respond(
                self.send,
                200,
                json.dumps(response).encode(),
                raw_headers=self._headers(relay.answer_id),
            )
        return result

    async def _open(self) -> EngineResponse:
        """Send the request to the replica; return its 200 response, body unread.

        Raises:
            UpstreamFailed: no connection, a 5xx, or the engine refused the
                gateway's engine key: another replica may be tried.
            GatewayError: a 4xx the client's request caused, in OpenAI's shape.
        """
        try:
            response = await self.upstream.stream(
                self.url,
                self.plan.payload,
                path=_ENGINE_PATHS[self.plan.surface],
                answers_whole=self.plan.surface == "embeddings",
                extra_head=self.engine_head,
            )
        except (TimeoutError, OSError) as exc:
            if isinstance(exc, ReplicaStalled):
                raise UpstreamFailed(str(exc), is_stall=True) from None
            raise UpstreamFailed(type(exc).__name__) from None
        if response.status == 200:
            return response
        try:
            if response.status >= 500:
                raise UpstreamFailed(f"HTTP {response.status}")
            if response.status in (401, 403):
                # The engine refused the gateway's engine key (vLLM: 401
                # {"error":"Unauthorized"}): the platform's fault, not the client's.
                raise UpstreamFailed(
                    f"HTTP {response.status}: the replica refused the engine API key"
                )
            try:
                body = await response.read()
            except (TimeoutError, OSError) as exc:
                raise UpstreamFailed(type(exc).__name__) from None
            raise upstream_client_error(response.status, body)
        finally:
            response.close()

    async def _end_broken(self) -> GatewayError | None:
        """Tell the client its answer broke after tokens were sent (no retry then).

        A whole answer has not started: its error is returned, for the caller.
        """
        if not self.plan.stream:
            return GatewayError(
                502,
                "the replica failed while answering; the answer is incomplete",
                code="upstream_failed",
                error_type="server_error",
            )
        self.before_last_send()
        error_event = (
            response_error_event
            if self.plan.surface == "responses"
            else stream_error_event
        )
        try:
            await self.send(
                {
                    "type": "http.response.body",
                    "body": error_event(replica_id=self.replica_id),
                    "more_body": False,
                }
            )
        except Exception as exc:  # the client may be gone already
            logger.info("could not send the stream's error event: %r", exc)
        return None
