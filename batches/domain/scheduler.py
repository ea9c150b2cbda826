"""The batch scheduler's policy: how many of a job's lines go now, at which tier,
and whether its deadline is at risk (seed step 10, "batch requests run only on idle
capacity").

Public surface: ``SchedulerSettings``, ``Pace``, ``Throughput``, ``JobView``,
``JobPlan``, ``plan_job``, ``job_rate``, ``after_answer``, ``after_refusal``,
``Escalation``.

One pure policy for the live runner (``batches.runner``) and the fleet simulator
(``drills.domain.batch_drill``): it never reads a clock (``now`` comes in, unix
seconds live, virtual seconds in the simulator) and performs nothing.

How a job is paced:

1. **Idle capacity only, by default.** A job's lines go to the gateway at the batch
   tier, so admission runs them only while the pool has idle room and queues or
   sheds them first under load. The job keeps at most ``Pace.window`` lines in
   flight: one more after every answer (up to ``max_window``), half as many after a
   refusal (503 shed, 429), and nothing new until the refusal's Retry-After has
   passed (``Pace.paused_until``). Under interactive load the job therefore backs
   off to one line and pauses; when the load goes, the window grows back.
2. **The deadline is watched from the start.** The job's *rate* is the higher of
   two: its *recent rate*, the tokens per second its lines finished over the last
   ``rate_window_s`` (``Throughput``: what the idle capacity gives it now), and its
   *mean rate*, the tokens of its finished lines over the time since it began
   sending (``JobView.done_tokens`` over ``now - started_at``: its pace so far).
   Its *projected finish* is ``now + remaining_tokens / rate`` (remaining lines
   times the mean tokens of a finished line, or ``estimated_tokens_per_line``
   before any finished). Why the higher: idle capacity follows the day's load, so
   the last minute is a poor forecast for a job with hours left; a day-long job
   that ran fast all night would, on the recent rate alone, project a miss at the
   first hour of the morning rise and (rule 3: escalation is kept) run the whole
   peak at the standard tier, crowding the interactive traffic, though idle
   capacity alone finishes it by the evening. With the higher of the two a job is
   raised only when neither its pace so far nor its pace now would finish it in
   time: when it has fallen behind its own schedule, as a stall makes the mean
   fall. The recent rate still counts for a young job (its mean includes the
   window's opening, rule 3) and when the load falls and idle capacity grows; the
   lower of the two would escalate even sooner than the recent rate alone.
3. **Escalation** (``Escalation.STANDARD``): when the projected finish, padded by
   ``safety``, passes the deadline, the job's remaining lines go at the standard
   tier: ahead of batch in every queue, inside the team's own limits (the gateway
   still charges its tokens per minute), never ahead of interactive traffic. A job
   is judged only once it has been sending for ``min_observed_s`` (its window
   opening) plus a whole ``rate_window_s``, so that its rate measures the idle
   capacity and not its own start: no answer comes back for a whole line's length
   (10 s for 300 tokens at 30 a second) and the window opens from
   ``initial_window`` lines, so a rate taken earlier is a fraction of what the pool
   gives and would escalate every job with a real deadline at its first verdict.
   A job with less time left than that is judged at once. Escalation is kept for
   the rest of the job: a job that went back to idle-only at the first lull would
   flap.
   ``SchedulerSettings.escalate`` false turns this rule off (idle-only
   scheduling: the fleet simulator's comparison case); rules 4 and 5 still hold,
   with the rate seen as the best the job can get.
4. **At risk, early**: when even the standard tier's rate cannot finish the
   remaining work before the deadline, the job is reported at risk with the
   projected finish, at the first tick that shows it, not at the end. That rate is
   the team's tokens per minute over 60 (``JobView.standard_tokens_s``), never less
   than the job's rate (rule 2); and once the job is at the standard tier, no more
   than its own window carries there: ``max_window`` lines in flight at the recent
   rate per line in flight (``recent * max_window / in_flight``). A job whose
   window is full at 64 lines of 10 s makes 3,200 tokens/s whatever its team's
   limit; at the batch tier the rate per line also counts the lines' waits in the
   admission queue, which the standard tier would not have, so it is not used
   there. And no more than the batch guard leaves a raised job
   (``JobView.standard_share``: the larger of the forecast's back-off and the
   guard's ``raised_share``, ``batches.domain.guard``): while the guard holds
   raised jobs back at a peak, the standard tier carries nothing new, and a job
   that has no rate of its own to show is reported at risk then, not when the
   peak is over and its deadline with it.
5. **Expiry**: at the deadline, a job with lines left is expired; what finished is
   kept (the runner writes the partial output and marks the rest expired).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, replace

__all__ = [
    "Escalation",
    "JobPlan",
    "JobView",
    "Pace",
    "SchedulerSettings",
    "Throughput",
    "after_answer",
    "after_refusal",
    "job_rate",
    "plan_job",
]


class Escalation(enum.StrEnum):
    """The tier a job's lines go at."""

    BATCH = "batch"  # idle capacity only
    STANDARD = "standard"  # raised to meet the deadline


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """The policy's knobs (``PLATFORM_BATCH_*`` settings live)."""

    initial_window: int = 4
    max_window: int = 64
    # The projected finish is padded by this factor before it is compared with the
    # deadline: a job escalates while a quarter of its time is still spare.
    safety: float = 1.25
    # No verdict on a job's rate before it has been sending this long plus a whole
    # rate window (rule 3): it should cover the window's opening, about
    # log2(max_window / initial_window) lines' lengths.
    min_observed_s: float = 30.0
    # The rate is measured over this much recent time.
    rate_window_s: float = 60.0
    # Before any line finished, a line is assumed to cost this many tokens.
    estimated_tokens_per_line: float = 500.0
    # A refusal without Retry-After pauses the job this long.
    default_pause_s: float = 1.0
    # False: idle-only scheduling, never raise a job to the standard tier (rule 3
    # off); it is still reported at risk and expired.
    escalate: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.initial_window <= self.max_window:
            raise ValueError("need 1 <= initial_window <= max_window")
        if self.safety < 1.0:
            raise ValueError("safety must be at least 1")
        for name in ("min_observed_s", "rate_window_s", "estimated_tokens_per_line"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, slots=True)
class Pace:
    """How fast one job sends: its window of lines in flight, and a pause."""

    window: int
    paused_until: float = 0.0

    @classmethod
    def start(cls, settings: SchedulerSettings) -> Pace:
        return cls(window=settings.initial_window)


def after_answer(pace: Pace, settings: SchedulerSettings) -> Pace:
    """One more line in flight after a line was answered (additive increase)."""
    return replace(pace, window=min(settings.max_window, pace.window + 1))


def after_refusal(
    pace: Pace, *, now: float, retry_after_s: float | None, settings: SchedulerSettings
) -> Pace:
    """Half the window and a pause until the Retry-After after a 503 or 429."""
    pause = retry_after_s if retry_after_s and retry_after_s > 0 else None
    return Pace(
        window=max(1, pace.window // 2),
        paused_until=max(pace.paused_until, now + (pause or settings.default_pause_s)),
    )


class Throughput:
    """Tokens finished over a sliding window of time (the job's rate)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._sum = 0
        self._first_at: float | None = None

    def add(self, at: float, tokens: int) -> None:
        if self._first_at is None:
            self._first_at = at
        self._events.append((at, tokens))
        self._sum += tokens

    def start(self, at: float) -> None:
        """Mark when the job began sending (the rate's window opens here)."""
        if self._first_at is None or at < self._first_at:
            self._first_at = at

    def rate(self, now: float) -> float | None:
        """Tokens per second over the window; None before any time has passed."""
        horizon = now - self.window_s
        while self._events and self._events[0][0] < horizon:
            self._sum -= self._events.popleft()[1]
        if self._first_at is None:
            return None
        span = min(self.window_s, now - self._first_at)
        if span <= 0:
            return None
        return self._sum / span


@dataclass(frozen=True, slots=True)
class JobView:
    """What the scheduler knows of one job at ``now``."""

    remaining_lines: int  # not yet finished (pending or in flight)
    in_flight: int
    tokens_per_line: float | None  # mean tokens of a finished line; None before one
    deadline_at: float
    started_at: float  # when the job began sending
    escalation: Escalation
    rate_tokens_s: float | None  # ``Throughput.rate``: the recent rate
    standard_tokens_s: float  # the team's tokens per minute / 60 (its ceiling)
    done_tokens: int  # tokens of every finished line (the mean rate's, rule 2)
    # The share of its window the batch guard lets a raised job keep now (rule 4);
    # 1 without a guard.
    standard_share: float = 1.0


def job_rate(job: JobView, now: float) -> float:
    """The job's rate (rule 2): the higher of its recent and its mean rate; 0 while
    neither is known."""
    recent = job.rate_tokens_s or 0.0
    elapsed = now - job.started_at
    mean = job.done_tokens / elapsed if elapsed > 0 else 0.0
    return recent if recent > mean else mean


@dataclass(frozen=True, slots=True)
class JobPlan:
    """The decision for one job now, with its reason."""

    send: int  # new lines to send now
    escalation: Escalation
    at_risk: bool
    expired: bool
    projected_finish_at: float | None  # None while the rate is unknown or zero
    reason: str


def plan_job(
    job: JobView, pace: Pace, *, now: float, settings: SchedulerSettings
) -> JobPlan:
    """Decide what the job does now (rules 1-5 of the module docstring)."""
    if job.remaining_lines <= 0:
        return JobPlan(
            send=0,
            escalation=job.escalation,
            at_risk=False,
            expired=False,
            projected_finish_at=now,
            reason="all lines finished",
        )
    if now >= job.deadline_at:
        return JobPlan(
            send=0,
            escalation=job.escalation,
            at_risk=True,
            expired=True,
            projected_finish_at=None,
            reason=f"deadline passed with {job.remaining_lines} lines unfinished",
        )
    per_line = job.tokens_per_line or settings.estimated_tokens_per_line
    remaining_tokens = job.remaining_lines * per_line
    left_s = job.deadline_at - now
    rate = job_rate(job, now)
    projected = now + remaining_tokens / rate if rate > 0 else None
    # Judged on a whole rate window after the window's opening (rule 3).
    observe_s = settings.min_observed_s + settings.rate_window_s
    observed = now - job.started_at >= observe_s
    escalation = job.escalation
    if (
        settings.escalate
        and escalation is Escalation.BATCH
        and (observed or left_s < observe_s)
    ):
        late = projected is None or now + (projected - now) * settings.safety > (
            job.deadline_at
        )
        if late:
            escalation = Escalation.STANDARD
    # The best rate the job may get (rule 4): the standard tier's; once its rate
    # is measured there, within what its window carries; idle-only, the rate seen.
    standard_rate = rate
    if settings.escalate:
        window_rate = math.inf
        recent = job.rate_tokens_s or 0.0
        if job.escalation is Escalation.STANDARD and recent > 0 and job.in_flight > 0:
            window_rate = recent * settings.max_window / job.in_flight
        standard_rate = max(
            rate, min(job.standard_tokens_s, window_rate) * job.standard_share
        )
    need_s = remaining_tokens / standard_rate if standard_rate > 0 else math.inf
    at_risk = need_s > left_s and (observed or left_s < observe_s)

    send = 0
    if now >= pace.paused_until:
        send = max(
            0, min(pace.window - job.in_flight, job.remaining_lines - job.in_flight)
        )
    reason = _reason(
        job,
        escalation,
        rate=rate,
        at_risk=at_risk,
        projected=projected,
        need_s=need_s,
        left_s=left_s,
        pace=pace,
        now=now,
        may_escalate=settings.escalate,
    )
    return JobPlan(
        send=send,
        escalation=escalation,
        at_risk=at_risk,
        expired=False,
        projected_finish_at=projected,
        reason=reason,
    )


def _reason(
    job: JobView,
    escalation: Escalation,
    *,
    rate: float,
    at_risk: bool,
    projected: float | None,
    need_s: float,
    left_s: float,
    pace: Pace,
    now: float,
    may_escalate: bool,
) -> str:
    seen = f"{rate:.0f} tokens/s idle" if rate else "no idle capacity seen yet"
    if at_risk:
        short = "never" if math.isinf(need_s) else f"{need_s - left_s:.0f} s late"
        where = "even at the standard tier" if may_escalate else "on idle capacity"
        text = f"at risk: {where} it finishes {short} ({seen})"
    elif escalation is Escalation.STANDARD and job.escalation is Escalation.BATCH:
        text = f"raised to the standard tier: at {seen} it would miss the deadline"
    elif escalation is Escalation.STANDARD:
        text = f"on the standard tier to meet the deadline ({seen})"
    elif projected is not None:
        text = f"on idle capacity, projected to finish {job.deadline_at - projected:.0f} s early ({seen})"
    else:
        text = f"on idle capacity ({seen})"
    if now < pace.paused_until:
        text += f"; paused {pace.paused_until - now:.0f} s: the pool is busy"
    return text
