"""Shadow traffic: a copy of a request sent to the version under test, answer discarded.

Public surface: ``Shadow``, ``ShadowAnswer``, ``read_shadow_answer``.

A shadow copy never touches the caller's stream and never queues: when
``concurrency`` copies are in flight, further ones are skipped. Its outcome and
time to first token are recorded per version (``platform_shadow_*``), and its
figures as role ``shadow`` (``metering.figures``): TTFT, output tokens, refusal,
error kind, so that a rollout compares the shadow with the live version on the
same traffic before any user sees it. The answer is off the caller's path, so it
is parsed whole; nothing it does (an error, a timeout, a dead replica) reaches the
caller, and ``copy`` never raises.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from metering import metrics
from metering.domain.figures import Role, VersionFigures, one_request
from metering.figures import FigureKey, FigureRecorder
from routing.domain.refusals import HEAD_CHARS, RefusalDetector
from routing.domain.snapshot import ConfigSnapshot
from routing.live import LiveLoad
from routing.plan import ChatPlan, payload_for
from routing.relay import EVENT_END
from routing.traces import NO_TRACE, RequestTrace
from routing.upstream import Upstream

logger = logging.getLogger(__name__)

__all__ = ["Shadow", "ShadowAnswer", "read_shadow_answer"]


@dataclass(frozen=True, slots=True)
class ShadowAnswer:
    """What a shadow answer was, read whole.

    ``first_token_at`` is the clock at the first content event (the role chunk
    included, as the relay counts it); ``output_tokens`` the usage chunk's, else
    the content events with text; ``error_kind`` one of ``ERROR_KINDS`` or None
    for a complete answer; ``text`` its first ``HEAD_CHARS`` characters.
    """

    first_token_at: float | None
    output_tokens: int
    error_kind: str | None
    text: str

    def figures(self, *, started: float, detector: RefusalDetector) -> VersionFigures:
        """Return the answer's figures (TTFT from ``started``)."""
        ttft = (
            self.first_token_at - started if self.first_token_at is not None else None
        )
        if self.error_kind is not None:
            return one_request(
                ttft_s=ttft, output_tokens=None, error_kind=self.error_kind
            )
        return one_request(
            ttft_s=ttft,
            output_tokens=self.output_tokens,
            refused=detector.is_refusal(self.text),
        )


async def read_shadow_answer(
    chunks: AsyncIterator[bytes],
    clock: Callable[[], float],
    *,
    text_chars: int = HEAD_CHARS,
) -> ShadowAnswer:
    """Read an engine's SSE stream to its end and return what it was.

    Complete: ``[DONE]`` after content and no error event. An error event, a
    failed read or an end without ``[DONE]`` is ``broken`` after the first
    content event; before it, ``upstream`` (``timeout`` for a read that timed
    out). ``text`` keeps the first ``text_chars`` characters or so (whole
    events): the refusal detector's head by default, a judge's whole answer
    with a larger bound.
    """
    buffer = b""
    first: float | None = None
    events = 0
    usage_tokens: int | None = None
    text: list[str] = []
    length = 0
    iterator = aiter(chunks)
    while True:
        try:
            chunk = await anext(iterator)
        except StopAsyncIteration:
            break
        except TimeoutError:
            return _failed(first, before="timeout")
        except (aiohttp.ClientError, OSError):
            return _failed(first)
        buffer += chunk
        *complete, buffer = buffer.split(EVENT_END)
        for event in complete:
            if not event:
                continue
            if event.startswith(b"data: [DONE]"):
                if first is None:
                    return _failed(None)
                tokens = usage_tokens if usage_tokens is not None else events
                return ShadowAnswer(first, tokens, None, "".join(text))
            try:
                data = json.loads(event.removeprefix(b"data: "))
            except ValueError:
                continue
            if not isinstance(data, dict):
                continue
            if "error" in data:
                return _failed(first)
            choices = data.get("choices")
            if not choices:
                usage = data.get("usage")
                if isinstance(usage, dict) and isinstance(
                    usage.get("completion_tokens"), int
                ):
                    usage_tokens = usage["completion_tokens"]
                continue
            if first is None:
                first = clock()
            for choice in choices if isinstance(choices, list) else ():
                delta = choice.get("delta") if isinstance(choice, dict) else None
                content = delta.get("content") if isinstance(delta, dict) else None
                if isinstance(content, str) and content:
                    events += 1
                    if length < text_chars:
                        text.append(content)
                        length += len(content)
    return _failed(first)


def _failed(first: float | None, *, before: str = "upstream") -> ShadowAnswer:
    """A failed answer: ``broken`` after its first content event, else ``before``."""
    return ShadowAnswer(first, 0, "broken" if first is not None else before, "")


class Shadow:
    """Send shadow copies to the least loaded replica of the shadow version."""

    def __init__(
        self,
        *,
        live: LiveLoad,
        upstream: Upstream,
        region: str,
        concurrency: int,
        figures: FigureRecorder | None = None,
        detector: RefusalDetector | None = None,
        bucket_s: int = 60,
    ) -> None:
        self.live = live
        self.upstream = upstream
        self.region = region
        self.figures = figures
        self.detector = detector or RefusalDetector()
        self.bucket_s = bucket_s
        self._slots = asyncio.Semaphore(concurrency)

    def offer(
        self, plan: ChatPlan, snapshot: ConfigSnapshot, trace: RequestTrace = NO_TRACE
    ) -> Coroutine[Any, Any, None] | None:
        """Return the shadow copy of ``plan`` if its resolution names a shadow
        version, else None. Shadow versions are judged on chat answers only; the
        copy's engine span is a child of ``trace``'s root."""
        resolution = plan.resolution
        if resolution.shadow_version is None or plan.surface != "chat":
            return None
        return self.copy(
            snapshot,
            model=resolution.model,
            version=resolution.shadow_version,
            payload=payload_for(
                plan.payload,
                plan.tier,
                snapshot.versions.get((resolution.model, resolution.shadow_version)),
            ),
            conversation=plan.routing_key,
            trace=trace,
        )

    async def copy(
        self,
        snapshot: ConfigSnapshot,
        *,
        model: str,
        version: str,
        payload: bytes,
        conversation: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        trace: RequestTrace = NO_TRACE,
    ) -> None:
        """Send ``payload`` to ``model@version``; read the answer, record, discard.

        The call is a client span of ``trace`` (purpose ``shadow``), whose
        ``traceparent`` goes to the engine. Never raises: whatever the shadow
        does stays here.
        """
        if self._slots.locked() or not self.upstream.is_open:
            return  # shadows never queue behind each other or the caller
        async with self._slots:
            nodes = self.live.nodes(snapshot, model, version, clock())
            if not nodes:
                return
            node = min(nodes, key=lambda n: n.tokens_in_flight)
            started = clock()
            span = trace.side_call(
                "chat",
                model=model,
                version=version,
                replica_id=node.replica_id,
                url=node.url,
                purpose="shadow",
            )
            status, answer = await self._read(
                node.url, payload, clock, trace.traceparent(span)
            )
            trace.side_ended(
                span,
                status=status,
                error_kind=answer.error_kind if answer else "refused",
            )
            if answer is None:
                # The caller's own request refused (as live refuses it): no
                # figure of the version, as for live's 4xx.
                return
            first = answer.first_token_at
            metrics.observe_shadow(
                model=model,
                version=version,
                region=self.region,
                outcome="ok" if answer.error_kind is None else "error",
                ttft_s=(first - started) if first is not None else None,
            )
            if self.figures is not None:
                await self.figures.add(
                    FigureKey.from_time(
                        model, version, Role.SHADOW, time.time(), self.bucket_s
                    ),
                    answer.figures(started=started, detector=self.detector),
                    conversation,
                )

    async def _read(
        self,
        url: str,
        payload: bytes,
        clock: Callable[[], float],
        traceparent: str,
    ) -> tuple[int | None, ShadowAnswer | None]:
        """Send the copy and read its answer whole: (HTTP status, answer); the
        answer is None when the engine refused the request itself (a 4xx)."""
        status = None
        try:
            async with await self.upstream.chat(
                url, payload, traceparent=traceparent
            ) as response:
                status = response.status
                if 400 <= status < 500 and status not in (401, 403):
                    return status, None
                if status != 200:
                    return status, ShadowAnswer(None, 0, "upstream", "")
                answer = await read_shadow_answer(response.content.iter_any(), clock)
        except TimeoutError:
            answer = ShadowAnswer(None, 0, "timeout", "")
        except (aiohttp.ClientError, OSError):
            answer = ShadowAnswer(None, 0, "upstream", "")
        except Exception as exc:
            # A bug here must not surface anywhere near the caller either.
            logger.warning("shadow copy failed: %s", type(exc).__name__)
            answer = ShadowAnswer(None, 0, "error", "")
        return status, answer
