"""The live-answer judge: a sampled request's candidate answer against live's.

Public surface: ``LiveJudge``, ``JUDGE_TEXT_CHARS``.

For a model whose rollout plan names a judge (``ModelRecord.judge_model``), a
share of the candidate's requests (shadow copies in a shadow step, canary
requests in a canary step; ``routing.domain.live_judge.JudgeSampler``) is
judged off the caller's path:

1. the request goes once to the candidate and once to the live version (least
   loaded replica of each, as a shadow copy goes), both read whole in memory;
2. the judge model's live version compares the two answers pairwise with the
   eval gate's prompt (``models_registry.domain.judge``), the order shown drawn
   from the request id;
3. the candidate's outcome (win, loss, tie, unreadable) is added to its figures
   in its role (``metering.domain.figures.one_judgement``), which the judge guard
   reads (``rollouts.domain.guards``).

Both answers are regenerated rather than taken from the caller's stream, so a
canary pair and a shadow pair are judged alike and the caller's relay keeps no
text; it costs two generations per judged pair, bounded by the plan's
``per_minute``. Prompt and answer text are never logged, stored or put in a
metric: only the outcome is kept. A pair whose answer or verdict fails is
counted ``incomplete`` in ``platform_live_judgements_total`` and adds nothing
(an error is the error guard's to count). ``judge`` never raises.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from opentelemetry import trace as otel

from metering import metrics
from metering.domain.figures import Role, one_judgement
from metering.figures import FigureKey, FigureRecorder
from routing.domain.live_judge import (
    JudgeSampler,
    judge_body,
    pair_outcome,
    question_messages,
)
from routing.domain.snapshot import ConfigSnapshot
from routing.domain.tiers import Tier
from routing.live import LiveLoad
from routing.plan import ChatPlan, payload_for
from routing.shadow import ShadowAnswer, read_shadow_answer
from routing.traces import NO_TRACE, RequestTrace
from routing.upstream import Upstream

logger = logging.getLogger(__name__)

__all__ = ["JUDGE_TEXT_CHARS", "LiveJudge"]

# The most of each answer the judge is shown (whole events): about 2,000 tokens.
JUDGE_TEXT_CHARS = 8192


class LiveJudge:
    """Judge sampled pairs for the rollout guards (one per gateway process)."""

    def __init__(
        self,
        *,
        live: LiveLoad,
        upstream: Upstream,
        region: str,
        concurrency: int,
        figures: FigureRecorder | None,
        bucket_s: int = 60,
    ) -> None:
        self.live = live
        self.upstream = upstream
        self.region = region
        self.figures = figures
        self.bucket_s = bucket_s
        self._slots = asyncio.Semaphore(concurrency)
        self.sampler = JudgeSampler()

    def offer(
        self,
        plan: ChatPlan,
        snapshot: ConfigSnapshot,
        role: Role | None,
        trace: RequestTrace = NO_TRACE,
        *,
        draw: float,
        now: float | None = None,
    ) -> Coroutine[Any, Any, None] | None:
        """Return the judging of ``plan``'s pair if it is sampled, else None.

        Judged: a chat request to a model whose plan names a judge, that is a
        candidate's (the shadow copy's in a shadow step, the canary's in a canary
        step) and falls in the plan's share and per-minute allowance (``draw``
        uniform in [0, 1)). The judging is a span of ``trace`` (``gateway.live_judge``).
        """
        resolution = plan.resolution
        if self.figures is None or plan.surface != "chat":
            return None
        record = snapshot.models.get(resolution.model)
        if record is None or not record.judge_model:
            return None
        if resolution.shadow_version is not None:
            candidate, live_version = resolution.shadow_version, resolution.version
            judged_role = Role.SHADOW
        elif role is Role.CANARY and record.live_version is not None:
            candidate, live_version = resolution.version, record.live_version
            judged_role = Role.CANARY
        else:
            return None
        if candidate == live_version or not self.sampler.take(
            resolution.model,
            share=record.judge_share,
            per_minute=record.judge_per_minute,
            draw=draw,
            now=time.monotonic() if now is None else now,
        ):
            return None
        return self.judge(
            snapshot,
            model=resolution.model,
            candidate=candidate,
            live_version=live_version,
            role=judged_role,
            payload=plan.payload,
            tier=plan.tier,
            pair_key=plan.request_id,
            trace=trace,
        )

    async def judge(
        self,
        snapshot: ConfigSnapshot,
        *,
        model: str,
        candidate: str,
        live_version: str,
        role: Role,
        payload: bytes,
        tier: Tier,
        pair_key: str,
        clock: Callable[[], float] = time.monotonic,
        trace: RequestTrace = NO_TRACE,
    ) -> None:
        """Judge one request's pair and count the candidate's outcome; never raises.

        ``payload``: the request's engine body, made fit for each version here
        (``routing.plan.payload_for``), off the caller's path. In ``trace``: a
        ``gateway.live_judge`` span (the outcome), under it a client span per
        engine call (both answers and the verdict), each sending its
        ``traceparent``; never a prompt, answer or verdict text.
        """
        record = snapshot.models.get(model)
        judge_model = record.judge_model if record is not None else ""
        if not judge_model or self.figures is None or not self.upstream.is_open:
            return
        if self._slots.locked():
            self._count(model, candidate, "skipped")
            return  # judging never queues behind itself
        async with self._slots:
            span = trace.start(
                "gateway.live_judge",
                attributes={
                    "gen_ai.request.model": model,
                    "platform.version": candidate,
                    "platform.live_version": live_version,
                    "platform.role": role,
                },
            )
            try:
                versions = snapshot.versions
                outcome = await self._pair(
                    _Calls(snapshot, trace, span, clock),
                    judge_model=judge_model,
                    model=model,
                    candidate=candidate,
                    live_version=live_version,
                    candidate_payload=payload_for(
                        payload, tier, versions.get((model, candidate))
                    ),
                    live_payload=payload_for(
                        payload, tier, versions.get((model, live_version))
                    ),
                    pair_key=pair_key,
                )
            except Exception as exc:
                logger.warning("live judge failed: %s", type(exc).__name__)
                outcome = "incomplete"
            span.set_attribute("platform.judge.outcome", outcome)
            span.end()
            self._count(model, candidate, outcome)
            if outcome in ("incomplete", "skipped"):
                return
            await self.figures.add(
                FigureKey.from_time(model, candidate, role, time.time(), self.bucket_s),
                one_judgement(outcome),
                None,
            )

    def _count(self, model: str, version: str, outcome: str) -> None:
        metrics.count_live_judgement(
            model=model, version=version, region=self.region, outcome=outcome
        )

    async def _pair(
        self,
        calls: _Calls,
        *,
        judge_model: str,
        model: str,
        candidate: str,
        live_version: str,
        candidate_payload: bytes,
        live_payload: bytes,
        pair_key: str,
    ) -> str:
        """Return the candidate's outcome, ``incomplete`` or ``skipped``."""
        question = question_messages(json.loads(candidate_payload))
        if question is None:
            return "skipped"
        judge_record = calls.snapshot.models.get(judge_model)
        judge_version = judge_record.live_version if judge_record else None
        if judge_version is None:
            return "incomplete"
        answers = await asyncio.gather(
            self._ask(calls, model, candidate, candidate_payload, "judge_candidate"),
            self._ask(calls, model, live_version, live_payload, "judge_live"),
        )
        if any(a is None or a.error_kind is not None for a in answers):
            return "incomplete"
        ours, theirs = (a.text for a in answers if a is not None)
        body, swapped = judge_body(
            judge_model, question, ours, theirs, pair_key=pair_key
        )
        verdict = await self._ask(
            calls, judge_model, judge_version, body, "judge_verdict"
        )
        if verdict is None or verdict.error_kind is not None:
            return "incomplete"
        return pair_outcome(verdict.text, swapped=swapped)

    async def _ask(
        self, calls: _Calls, model: str, version: str, payload: bytes, purpose: str
    ) -> ShadowAnswer | None:
        """One answer of ``model@version``, read whole (None: no replica, or a
        refusal of the request itself), under a client span of ``purpose``."""
        nodes = self.live.nodes(calls.snapshot, model, version, calls.clock())
        if not nodes:
            return None
        node = min(nodes, key=lambda n: n.tokens_in_flight)
        trace = calls.trace
        span = trace.side_call(
            "chat",
            model=model,
            version=version,
            replica_id=node.replica_id,
            url=node.url,
            purpose=purpose,
            parent=calls.parent,
        )
        status: int | None = None
        answer: ShadowAnswer | None = None
        try:
            async with await self.upstream.chat(
                node.url, payload, traceparent=trace.traceparent(span)
            ) as response:
                status = response.status
                if status == 200:
                    answer = await read_shadow_answer(
                        response.content.iter_any(),
                        calls.clock,
                        text_chars=JUDGE_TEXT_CHARS,
                    )
        except Exception as exc:
            trace.side_ended(span, error_kind=type(exc).__name__)
            if isinstance(exc, (TimeoutError, aiohttp.ClientError, OSError)):
                return None
            raise  # a bug: judge counts the pair incomplete
        error_kind = None if answer is not None else "refused"
        if answer is not None:
            error_kind = answer.error_kind
        trace.side_ended(span, status=status, error_kind=error_kind)
        return answer


@dataclass(frozen=True, slots=True)
class _Calls:
    """What each engine call of one judged pair needs: the snapshot, the
    request's trace and the judging's span (their parent), and the clock."""

    snapshot: ConfigSnapshot
    trace: RequestTrace
    parent: otel.Span
    clock: Callable[[], float]
