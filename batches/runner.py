"""The batch runner: one job's lines through the gateway, paced by the scheduler.

Each line is posted to the gateway's endpoint of its batch (``/v1/chat/completions``
or ``/v1/embeddings``), so it takes the same way as a live request of that API.

Public surface: ``run_batch``, ``dispatch``, ``mark_handed_on``, ``Outcome``; its knobs
from the settings are ``batches.knobs``'.

``dispatch`` (Celery beat, every ``PLATFORM_BATCH_DISPATCH_S``) hands each active
batch without a live runner to a ``run_batch`` task (queue ``batches``; cancelled,
expired and half-ended batches too: the runner ends them, so the beat worker's
queue never waits on a batch). ``run_batch`` works one job for
``PLATFORM_BATCH_SLICE_S`` and hands it on:

1. **One runner per job.** It takes the job's lease (``Batch.runner`` and
   ``lease_until``, renewed every third of ``PLATFORM_BATCH_LEASE_S``); a job whose
   lease is held is left alone. A runner that was killed stops renewing, and the
   next dispatch after its lease ran out starts another.
2. **Per-line idempotency.** Taking the lease puts the dead runner's claimed lines
   back to pending (their answers were never written, so they run again); a line
   is claimed (``running``, with this runner's id) before it is sent, and its
   result is written only while that claim holds (``status='running' AND
   runner=me``), in the same transaction as the job's counts. A line that finished
   is never run again, and none is lost; a line whose answer arrived at a killed
   runner runs twice at the engine and is written once.
3. **Pacing** is ``batches.domain.scheduler.plan_job`` every tick (the fleet
   simulator calls the same): how many new lines go now and at which tier
   (``x-priority: batch``, or ``standard`` once the deadline needs it). A 503
   (shed: the pool is busy) or 429 puts the line back to pending, halves the
   window and pauses for the Retry-After; so under interactive load a batch backs
   off to one line and waits. Ahead of that, the batch guard's forecast
   (``batches.domain.guard.batch_window_share`` over the autoscaler's trend of
   the model's demand, ``services.demand_trend``) shrinks the share of the
   window in flight before a ramp arrives. A 5xx or no answer is tried again up to
   ``PLATFORM_BATCH_MAX_ATTEMPTS``; any other answer is the line's result (4xx
   lines go to the error file with the gateway's body).
4. **The job's record** carries the scheduler's decision (``priority``,
   ``at_risk`` since when, ``projected_finish_at``, ``schedule_reason``), so the
   batch object says what is happening and why.

HTTP is done in a thread pool (threads only send; every database write is on the
runner's own thread).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import Count, F, Q, Sum

from batches import services
from batches.domain.guard import batch_window_share, guarded_send
from batches.domain.scheduler import (
    Escalation,
    JobView,
    Pace,
    Throughput,
    after_answer,
    after_refusal,
    plan_job,
)
from batches.knobs import guard_settings, scheduler_settings
from batches.models import Batch, BatchLine

logger = logging.getLogger(__name__)

__all__ = [
    "Outcome",
    "dispatch",
    "mark_handed_on",
    "run_batch",
]

_TICK_S = 0.25
# How often the runner rereads the job's status, and writes the scheduler's
# reason when only its figures changed.
_LOOK_S = 1.0
# A key minted for a batch is known to the gateways at their next snapshot
# refresh; a 401 before this is "not yet", after it the line's answer.
_KEY_GRACE_S = 60.0
# Answers that are the line's own trouble: tried again, up to the attempts.
_RETRYABLE = frozenset({408, 409, 500})
_REFUSED = frozenset({429, 503})
# No gateway (refused connection) or a proxy's 502/504: the whole job waits,
# backing off, and no line loses an attempt to an outage.
_OUTAGE = frozenset({502, 504})
_OUTAGE_PAUSE_MAX_S = 60.0
_RETRY_AFTER_MAX_S = 300.0


class Outcome(enum.StrEnum):
    BUSY = "busy"  # another runner holds the job, or it is not active
    CONTINUE = "continue"  # the slice ended; the job goes on
    ENDED = "ended"  # the job was finalised
    LOST = "lost"  # the lease was taken over


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int | None  # None: no answer at all
    body: Any
    retry_after_s: float | None
    tokens: int
    problem: str = ""
    unreachable: bool = False  # the connection was never made


@dataclass(slots=True)
class _Claimed:
    pk: int
    index: int
    custom_id: str
    body: dict[str, Any]
    attempts: int
    tier: str


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


# -- the lease --------------------------------------------------------------------


def _take_lease(batch_id: str, me: str, now: float) -> bool:
    lease = _utc(now + settings.PLATFORM_BATCH_LEASE_S)
    taken = (
        Batch.objects.filter(pk=batch_id)
        .filter(
            Q(lease_until__isnull=True) | Q(lease_until__lt=_utc(now)) | Q(runner=me)
        )
        .exclude(status__in=Batch.ENDED)
        .update(runner=me, lease_until=lease)
    )
    return bool(taken)


def _renew(batch_id: str, me: str, now: float) -> bool:
    lease = _utc(now + settings.PLATFORM_BATCH_LEASE_S)
    return bool(Batch.objects.filter(pk=batch_id, runner=me).update(lease_until=lease))


def _release(batch_id: str, me: str) -> None:
    Batch.objects.filter(pk=batch_id, runner=me).update(runner="", lease_until=None)


# -- dispatch (beat) ----------------------------------------------------------------


def dispatch(
    *, enqueue: Callable[[str], None], now: float | None = None
) -> dict[str, int]:
    """Hand every batch that needs a runner and has none to one; return how many.

    That is every active batch (in progress, or cancelling: the runner ends it)
    and every one left ``finalizing`` by a runner that died while ending it. A
    batch handed on within the last lease is left alone (its task may still be
    queued); the task expires after two leases, so the queue never piles up.
    """
    now = time.time() if now is None else now
    free = Q(lease_until__isnull=True) | Q(lease_until__lt=_utc(now))
    recent = Q(dispatched_at__gte=_utc(now - settings.PLATFORM_BATCH_LEASE_S))
    waiting = (
        Batch.objects.filter(free)
        .filter(status__in=(*Batch.ACTIVE, Batch.Status.FINALIZING))
        .exclude(recent)
        .values_list("pk", flat=True)
    )
    started = 0
    for batch_id in waiting:
        enqueue(batch_id)
        started += 1
    return {"started": started}


def mark_handed_on(batch_id: str) -> None:
    """Record that a runner task was queued for the batch now, so ``dispatch``
    leaves it alone for a lease (``control.tasks`` queues the task itself)."""
    Batch.objects.filter(pk=batch_id).update(dispatched_at=_utc(time.time()))


# -- one slice of one job -------------------------------------------------------------


def run_batch(
    batch_id: str,
    *,
    slice_s: float | None = None,
    clock: Callable[[], float] = time.time,
    transport: httpx.BaseTransport | None = None,
) -> Outcome:
    """Work on one job for a slice; see the module docstring."""
    me = f"runner-{uuid.uuid4().hex[:12]}"
    now = clock()
    if not _take_lease(batch_id, me, now):
        return Outcome.BUSY
    try:
        batch = Batch.objects.get(pk=batch_id)
        if batch.status == Batch.Status.FINALIZING:
            # A runner died while ending it: end it the same way.
            services.finalize(batch.id, batch.ending, now=_utc(clock()))
            return Outcome.ENDED
        if batch.status not in Batch.ACTIVE:
            return Outcome.BUSY
        if batch.started_at is None:
            batch.started_at = _utc(now)
            Batch.objects.filter(pk=batch.pk).update(started_at=batch.started_at)
        # Whatever a previous runner had claimed and not written runs again.
        orphans = (
            BatchLine.objects.filter(batch_id=batch_id, status=BatchLine.Status.RUNNING)
            .exclude(runner=me)
            .update(status=BatchLine.Status.PENDING, runner="")
        )
        if orphans:
            logger.info(
                "batch %s: %d lines of a lost runner run again", batch_id, orphans
            )
        with _Job(batch, me, clock=clock, transport=transport) as job:
            return job.run(slice_s or settings.PLATFORM_BATCH_SLICE_S)
    finally:
        _release(batch_id, me)


class _Job:
    """The state of one job during a runner's slice."""

    def __init__(
        self,
        batch: Batch,
        me: str,
        *,
        clock: Callable[[], float],
        transport: httpx.BaseTransport | None,
    ) -> None:
        self.batch = batch
        self.me = me
        self.clock = clock
        self.settings = scheduler_settings()
        self.guard = guard_settings()
        # The share of its window the job may keep in flight, from the forecast.
        self.window_share = self._window_share()
        self.pace = Pace.start(self.settings)
        self.secret = services.batch_key_secret(batch.id)
        # The batch's endpoint (checked at creation): chat completions or
        # embeddings, each line sent as a live request of that API is.
        self.url = f"{settings.PLATFORM_BATCH_GATEWAY_URL.rstrip('/')}{batch.endpoint}"
        self.client = httpx.Client(
            transport=transport,
            timeout=settings.PLATFORM_BATCH_REQUEST_TIMEOUT_S,
            limits=httpx.Limits(
                max_connections=self.settings.max_window,
                max_keepalive_connections=self.settings.max_window,
            ),
        )
        self.pool = ThreadPoolExecutor(
            self.settings.max_window, thread_name_prefix=f"batch-{batch.id[-6:]}"
        )
        self.in_flight: dict[Future[_Answer], _Claimed] = {}
        self.started_at = (batch.started_at or batch.created_at).timestamp()
        self.throughput = Throughput(self.settings.rate_window_s)
        self.throughput.start(self.started_at)
        horizon = _utc(clock() - self.settings.rate_window_s)
        for finished_at, tokens in BatchLine.objects.filter(
            batch=batch, status=BatchLine.Status.DONE, finished_at__gte=horizon
        ).values_list("finished_at", "tokens"):
            if finished_at is not None:
                self.throughput.add(finished_at.timestamp(), tokens)
        done = BatchLine.objects.filter(
            batch=batch, status=BatchLine.Status.DONE
        ).aggregate(lines=Count("pk"), tokens=Sum("tokens"))
        self.done_lines: int = done["lines"]
        # Tokens of every finished line (the scheduler's mean rate), kept running.
        self.done_tokens: int = done["tokens"] or 0
        self.standard_tokens_s = services.team_tokens_per_minute(batch) / 60.0
        self.escalation = Escalation(batch.priority)
        self.key_made_at = (
            batch.key.created_at if batch.key else batch.created_at
        ).timestamp()
        self.last_saved: tuple[Any, ...] = ()
        self.saved_at = 0.0
        self.outages = 0  # answers in a row that were no gateway at all

    def _window_share(self) -> float:
        trend = services.demand_trend(
            self.batch.model_id, horizon_s=self.guard.horizon_s
        )
        return batch_window_share(self.guard, trend)

    @property
    def tokens_per_line(self) -> float | None:
        """The mean tokens of a finished line; None before one finished."""
        return self.done_tokens / self.done_lines if self.done_lines else None

    def __enter__(self) -> _Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()

    # -- the loop ------------------------------------------------------------------

    def run(self, slice_s: float) -> Outcome:
        started = self.clock()
        renewed = looked = started
        status = self.batch.status
        while True:
            now = self.clock()
            if now - renewed >= settings.PLATFORM_BATCH_LEASE_S / 3:
                if not _renew(self.batch.id, self.me, now):
                    self._drain()
                    return Outcome.LOST
                renewed = now
            if now - looked >= _LOOK_S:
                # A cancel arrives through the API: seen within a second.
                status = Batch.objects.values_list("status", flat=True).get(
                    pk=self.batch.id
                )
                self.window_share = self._window_share()
                looked = now
            if status == Batch.Status.CANCELLING:
                return self._end(Batch.Status.CANCELLED)
            remaining = BatchLine.objects.filter(
                batch_id=self.batch.id,
                status__in=(BatchLine.Status.PENDING, BatchLine.Status.RUNNING),
            ).count()
            plan = plan_job(
                JobView(
                    remaining_lines=remaining,
                    in_flight=len(self.in_flight),
                    tokens_per_line=self.tokens_per_line,
                    deadline_at=self.batch.deadline_at.timestamp(),
                    started_at=self.started_at,
                    escalation=self.escalation,
                    rate_tokens_s=self.throughput.rate(now),
                    standard_tokens_s=self.standard_tokens_s,
                    done_tokens=self.done_tokens,
                    standard_share=max(self.window_share, self.guard.raised_share),
                ),
                self.pace,
                now=now,
                settings=self.settings,
            )
            self._save_plan(plan, now)
            if plan.expired:
                return self._end(Batch.Status.EXPIRED)
            if remaining == 0 and not self.in_flight:
                return self._end(Batch.Status.COMPLETED)
            if now - started >= slice_s:
                self._drain()
                return Outcome.CONTINUE
            self.escalation = plan.escalation
            # The forecast's back-off (batches.domain.guard); a job raised for its
            # deadline keeps the guard's raised_share.
            raised = plan.escalation is Escalation.STANDARD
            send = guarded_send(
                plan.send,
                window=self.pace.window,
                in_flight=len(self.in_flight),
                share=self.window_share,
                floor=self.guard.raised_share if raised else 0.0,
            )
            if send:
                self._send(self._claim(send, plan.escalation.value))
            self._collect(_TICK_S)

    def _end(self, ending: str) -> Outcome:
        self._drain()
        services.finalize(self.batch.id, ending, now=_utc(self.clock()))
        return Outcome.ENDED

    def _drain(self) -> None:
        """Wait for every line in flight and write what came back."""
        while self.in_flight:
            self._collect(_TICK_S)
            _renew(self.batch.id, self.me, self.clock())

    # -- lines ---------------------------------------------------------------------

    def _claim(self, n: int, tier: str) -> list[_Claimed]:
        self._fail_abandoned()
        with transaction.atomic():
            ids = list(
                BatchLine.objects.select_for_update(skip_locked=True)
                .filter(batch_id=self.batch.id, status=BatchLine.Status.PENDING)
                .order_by("index")
                .values_list("pk", flat=True)[:n]
            )
            if not ids:
                return []
            BatchLine.objects.filter(pk__in=ids).update(
                status=BatchLine.Status.RUNNING,
                runner=self.me,
                attempts=F("attempts") + 1,
                tier=tier,
            )
            rows = BatchLine.objects.filter(pk__in=ids).values_list(
                "pk", "index", "custom_id", "body", "attempts"
            )
            return [
                _Claimed(pk, index, custom_id, body or {}, attempts, tier)
                for pk, index, custom_id, body, attempts in rows
            ]

    def _fail_abandoned(self) -> None:
        """Fail the pending lines that used up their attempts without an answer
        being written (their runner died each time: a line that kills it)."""
        most = settings.PLATFORM_BATCH_MAX_ATTEMPTS
        with transaction.atomic():
            failed = BatchLine.objects.filter(
                batch_id=self.batch.id,
                status=BatchLine.Status.PENDING,
                attempts__gte=most,
            ).update(
                status=BatchLine.Status.FAILED,
                finished_at=_utc(self.clock()),
                error={
                    "code": "no_answer",
                    "message": f"no answer was recorded in {most} attempts",
                },
            )
            if failed:
                Batch.objects.filter(pk=self.batch.id).update(
                    failed=F("failed") + failed
                )

    def _send(self, lines: list[_Claimed]) -> None:
        for line in lines:
            future = self.pool.submit(self._post, line)
            self.in_flight[future] = line

    def _post(self, line: _Claimed) -> _Answer:
        headers = {
            "authorization": f"Bearer {self.secret}",
            "x-priority": line.tier,
            "x-request-id": f"{self.batch.id}-{line.index}-{line.attempts}",
        }
        try:
            response = self.client.post(self.url, json=line.body, headers=headers)
        except httpx.ConnectError as exc:
            return _Answer(None, None, None, 0, type(exc).__name__, unreachable=True)
        except httpx.HTTPError as exc:
            return _Answer(None, None, None, 0, type(exc).__name__)
        try:
            body = response.json()
        except ValueError:
            body = {"error": {"message": response.text[:500], "type": "server_error"}}
        # An embeddings answer's usage has no completion_tokens: its input only.
        usage = body.get("usage") if isinstance(body, dict) else None
        tokens = 0
        if isinstance(usage, dict):
            tokens = int(usage.get("prompt_tokens") or 0) + int(
                usage.get("completion_tokens") or 0
            )
        return _Answer(
            response.status_code,
            _storable(body),
            _retry_after(response.headers.get("retry-after")),
            tokens,
        )

    def _collect(self, timeout_s: float) -> None:
        if not self.in_flight:
            time.sleep(timeout_s)  # nothing to wait on: the tick's pause
            return
        done, _ = wait(
            list(self.in_flight), timeout=timeout_s, return_when=FIRST_COMPLETED
        )
        for future in done:
            line = self.in_flight.pop(future)
            try:
                answer = future.result()
            except Exception as exc:  # a bug in _post: the line is tried again
                logger.exception("batch %s line %d", self.batch.id, line.index)
                answer = _Answer(None, None, None, 0, type(exc).__name__)
            self._record(line, answer)

    def _record(self, line: _Claimed, answer: _Answer) -> None:
        now = self.clock()
        status = answer.status
        if status is not None and 200 <= status < 300:
            self.outages = 0
            if self._finish(line, BatchLine.Status.DONE, answer, now):
                self.throughput.add(now, answer.tokens)
                self.done_lines += 1
                self.done_tokens += answer.tokens
            self.pace = after_answer(self.pace, self.settings)
            return
        refused = status in _REFUSED or (
            status == 401 and now - self.key_made_at < _KEY_GRACE_S
        )
        if refused:
            self._release_line(line, count_attempt=False)
            Batch.objects.filter(pk=self.batch.id).update(refused=F("refused") + 1)
            self.pace = after_refusal(
                self.pace,
                now=now,
                retry_after_s=answer.retry_after_s,
                settings=self.settings,
            )
            return
        if answer.unreachable or status in _OUTAGE:
            self._release_line(line, count_attempt=False)
            self.outages += 1
            self.pace = after_refusal(
                self.pace,
                now=now,
                retry_after_s=min(_OUTAGE_PAUSE_MAX_S, 2.0 ** min(self.outages, 6)),
                settings=self.settings,
            )
            return
        self.outages = 0
        transient = status is None or status in _RETRYABLE
        if transient and line.attempts < settings.PLATFORM_BATCH_MAX_ATTEMPTS:
            self._release_line(line, count_attempt=True)
            self.pace = after_refusal(
                self.pace,
                now=now,
                retry_after_s=answer.retry_after_s,
                settings=self.settings,
            )
            return
        self._finish(line, BatchLine.Status.FAILED, answer, now)

    def _finish(self, line: _Claimed, status: str, answer: _Answer, now: float) -> bool:
        """Write the line's result once, while this runner's claim holds."""
        fields: dict[str, Any] = {
            "status": status,
            "finished_at": _utc(now),
            "tokens": answer.tokens,
        }
        if answer.status is not None:
            fields.update(status_code=answer.status, response=answer.body)
        else:
            fields["error"] = {
                "code": "no_answer",
                "message": f"the gateway gave no answer after {line.attempts} attempts "
                f"({answer.problem})",
            }
        try:
            return self._write(line, status, fields)
        except DatabaseError:
            # An answer the database will not take: the line fails, saying so,
            # rather than killing the runner and coming back forever.
            logger.exception(
                "batch %s line %d: answer not stored", self.batch.id, line.index
            )
            fields = {
                "status": BatchLine.Status.FAILED,
                "finished_at": _utc(now),
                "error": {
                    "code": "answer_unstorable",
                    "message": "the answer could not be stored",
                },
            }
            return self._write(line, BatchLine.Status.FAILED, fields)

    def _write(self, line: _Claimed, status: str, fields: dict[str, Any]) -> bool:
        counter = "completed" if status == BatchLine.Status.DONE else "failed"
        with transaction.atomic():
            written = BatchLine.objects.filter(
                pk=line.pk, status=BatchLine.Status.RUNNING, runner=self.me
            ).update(**fields)
            if written:
                Batch.objects.filter(pk=self.batch.id).update(
                    **{counter: F(counter) + 1}
                )
        return bool(written)

    def _release_line(self, line: _Claimed, *, count_attempt: bool) -> None:
        changes: dict[str, Any] = {"status": BatchLine.Status.PENDING, "runner": ""}
        if not count_attempt:
            changes["attempts"] = F("attempts") - 1
        BatchLine.objects.filter(
            pk=line.pk, status=BatchLine.Status.RUNNING, runner=self.me
        ).update(**changes)

    # -- what the job says ------------------------------------------------------------

    def _save_plan(self, plan: Any, now: float) -> None:
        projected = (
            _utc(plan.projected_finish_at)
            if plan.projected_finish_at is not None
            and math.isfinite(plan.projected_finish_at)
            else None
        )
        key = (plan.escalation, plan.at_risk)
        if key == self.last_saved and now - self.saved_at < _LOOK_S:
            return
        self.last_saved, self.saved_at = key, now
        changes: dict[str, Any] = {
            "priority": plan.escalation.value,
            "at_risk": plan.at_risk,
            "schedule_reason": plan.reason[:300],
            "projected_finish_at": projected,
        }
        if (
            plan.escalation is Escalation.STANDARD
            and self.escalation is Escalation.BATCH
        ):
            changes["escalated_at"] = _utc(now)
        batch = Batch.objects.filter(pk=self.batch.id, runner=self.me)
        if plan.at_risk:
            batch.filter(at_risk_since__isnull=True).update(at_risk_since=_utc(now))
        batch.update(**changes)


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header, within [0, 300]; None when absent or odd."""
    if not value:
        return None
    with contextlib.suppress(ValueError):
        seconds = float(value)
        if math.isfinite(seconds):
            return min(_RETRY_AFTER_MAX_S, max(0.0, seconds))
    return None


def _storable(value: Any) -> Any:
    """``value`` with every NUL character replaced (jsonb cannot hold one)."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_storable(k): _storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v) for v in value]
    return value
