"""A served request, metered once from one immutable record, and its claim refunded.

Public surface: ``Served``, ``RequestMeter``, ``UsageCounter``.

``RequestMeter.settle`` is the one place a request's end is counted: the Prometheus
figures, the team's usage row (batch work in its own part too), the pool's live
figures (``metering.figures``: role ``pool``, every request, with its prompt and
cached tokens and time per output token), the version's figures for the rollout
guards (role live, baseline or canary under a rollout, the answer's head judged
by the refusal detector), and the refund of what admission charged. ``count_refusal`` counts a request admission refused (429 or 503), and
``refusal`` turns admission's refusal into the client's error.

A team's USD budgets are held here too (``routing.budgets``): ``reserve`` holds a
request's worst case before admission (a 429 ``budget_exceeded`` counted as a
rate-limited request), ``cancel`` gives it back when admission refuses, and
``settle`` moves it to what the usage cost, with the token refund.

Both kinds of 503 a client can get here are counted in the usage row's ``shed``
column and in ``platform_team_shed_total``, whose ``cause`` label tells them apart:
``overload`` (admission shed the request's tier: ``count_refusal``) and
``no_replica`` (admitted, but no replica could start an answer: ``settle``). One
column, not two, because the usage row is what a team is billed and shown: for it
both are the same event (asked, told 503 with Retry-After, served nothing, billed
no token), and ``/v1/organization/usage`` already promises ``shed_requests`` as the
team's 503s. Why the platform could not serve is an operator's question, answered
per cause by the metric. Neither is counted in ``requests`` nor in any token
column.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Protocol

from metering import metrics
from metering.domain.figures import Role, VersionFigures, one_request, tpot_bucket
from metering.domain.usage import UsageCounts, UsageKey
from metering.figures import FigureKey, FigureRecorder
from routing.admission import Admission
from routing.attempt import AttemptResult
from routing.background import BackgroundTasks
from routing.budgets import BudgetGuard, MemoryBudgetStore, Reservation
from routing.domain.admission_control import Rejected, Ticket
from routing.domain.refusals import RefusalDetector
from routing.domain.snapshot import ConfigSnapshot
from routing.plan import ChatPlan
from routing.responses import GatewayError

logger = logging.getLogger(__name__)

__all__ = ["RequestMeter", "Served", "UsageCounter"]


class UsageCounter(Protocol):
    """Where usage is counted until the flush (Redis, or memory)."""

    async def add(self, key: UsageKey, counts: UsageCounts) -> None:
        """Add ``counts`` to the row of ``key``."""
        ...


@dataclass(frozen=True, slots=True)
class Served:
    """One admitted request at its end: its plan, its claim, how its routing ended.

    ``figure_role`` is the role the request's figures count for (None: not
    recorded).
    """

    plan: ChatPlan
    ticket: Ticket
    figure_role: Role | None
    ended: AttemptResult
    # What it holds of its team's USD budgets (None: no budget covers it).
    reservation: Reservation | None = None


class RequestMeter:
    """Meter admitted and refused requests (one per gateway)."""

    def __init__(
        self,
        *,
        region: str,
        figures_bucket_s: int,
        admission: Admission,
        usage_counter: UsageCounter,
        background: BackgroundTasks,
        refusals: RefusalDetector,
        figures: FigureRecorder | None = None,
        budgets: BudgetGuard | None = None,
    ) -> None:
        self.region = region
        # Without a guard, one that knows no budget (a snapshot holds none then).
        self.budgets = budgets or BudgetGuard(store=MemoryBudgetStore())
        self.figures_bucket_s = figures_bucket_s
        self.admission = admission
        self.usage_counter = usage_counter
        self.background = background
        self.refusals = refusals
        self.figures = figures

    async def settle(self, served: Served) -> None:
        """Meter the request once, whatever happened (disconnects included), and
        give its claim back (the refund of the tokens it did not use)."""
        plan, ended = served.plan, served.ended
        usage = ended.usage
        self._observe(plan, ended)
        if ended.is_unserved:
            metrics.count_shed(
                team=plan.team,
                model=plan.resolution.model,
                tier=plan.tier.value,
                cause="no_replica",
            )
            self._count(plan, UsageCounts(shed=1))
        if self.figures is not None:
            self._record_figures(served)
        if usage is not None:
            # Batch work (the batch tier, or a batch job's key at any tier) is
            # counted in the totals and again in its own part: a batch token is a
            # team token.
            is_batch = plan.is_batch_work
            self._count(
                plan,
                UsageCounts(
                    prompt_tokens=usage.prompt_tokens,
                    cached_tokens=min(usage.cached_tokens, usage.prompt_tokens),
                    output_tokens=usage.completion_tokens,
                    requests=1,
                    batch_requests=1 if is_batch else 0,
                    batch_prompt_tokens=usage.prompt_tokens if is_batch else 0,
                    batch_output_tokens=usage.completion_tokens if is_batch else 0,
                ),
            )
        try:
            await self.admission.release(
                served.ticket, used_tokens=usage.total_tokens if usage else 0
            )
        except Exception as exc:
            # The answer is complete: a failed refund must not break the
            # connection. The bucket refills by itself; the slot expires.
            logger.warning("releasing admission failed: %s", type(exc).__name__)
        await self.budgets.settle(served.reservation, usage)

    async def reserve(
        self, plan: ChatPlan, snapshot: ConfigSnapshot
    ) -> Reservation | None:
        """Hold the request's worst case against its team's USD budgets.

        Raises:
            GatewayError: 429 ``budget_exceeded`` (counted as rate limited), or
                503 when the budgets' store fails in a way the guard cannot
                fall back from.
        """
        try:
            return await self.budgets.reserve(plan, snapshot)
        except GatewayError as exc:
            self.count_refusal(plan, exc.status)
            raise
        except Exception as exc:
            logger.warning("budgets unavailable: %s", type(exc).__name__)
            raise GatewayError(
                503,
                "budgets cannot be checked right now; retry shortly",
                code="admission_unavailable",
                headers={"retry-after": "1"},
            ) from None

    async def cancel(self, reservation: Reservation | None) -> None:
        """Give back the budgets' hold of a request admission refused."""
        await self.budgets.cancel(reservation)

    def refusal(
        self, exc: Rejected, plan: ChatPlan, rng: random.Random
    ) -> GatewayError:
        """Count a refusal (metrics and usage) and turn it into the client's error.

        Every 429 and 503 carries Retry-After with up to a second of jitter, so that
        refused clients do not all come back in the same instant (retry storms).
        """
        headers = dict(exc.headers)
        if exc.status in (429, 503):
            self.count_refusal(plan, exc.status)
            jittered = max(1, math.ceil(exc.retry_after_s + rng.random()))
            headers["retry-after"] = str(jittered)
        return GatewayError(
            exc.status,
            exc.message,
            code=exc.code,
            headers=headers,
            error_type="rate_limit_error" if exc.status == 429 else None,
        )

    def _record_figures(self, served: Served) -> None:
        """Add the request's figures: to its pool's live figures (role ``pool``,
        every request, rollout or not), and to its guard role's when it has one."""
        assert self.figures is not None
        plan, ended = served.plan, served.ended
        guard = self._figures(plan, ended)
        if guard is None:
            return
        now = time.time()
        model, version = plan.resolution.model, plan.resolution.version
        usage = ended.usage
        pool = guard
        if usage is not None and guard.answered:
            pool = guard + VersionFigures(
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=min(usage.cached_tokens, usage.prompt_tokens),
                tpot={tpot_bucket(tpot): 1}
                if (tpot := self._tpot(ended)) is not None
                else {},
            )
        roles = [(Role.POOL, pool)]
        if served.figure_role is not None:
            roles.append((served.figure_role, guard))
        for role, figures in roles:
            self.background.spawn(
                self.figures.add(
                    FigureKey.from_time(
                        model, version, role, now, self.figures_bucket_s
                    ),
                    figures,
                    plan.routing_key,
                )
            )

    @staticmethod
    def _tpot(ended: AttemptResult) -> float | None:
        """Seconds per output token after the first; None below two tokens."""
        usage, first_token_at = ended.usage, ended.first_token_at
        if usage is None or first_token_at is None or usage.completion_tokens < 2:
            return None
        return max(0.0, time.monotonic() - first_token_at) / (
            usage.completion_tokens - 1
        )

    def count_refusal(self, plan: ChatPlan, status: int) -> None:
        """Count a request admission refused: ``status`` 429 (rate limited) or 503
        (shed for overload)."""
        metrics.count_rejection(
            team=plan.team,
            model=plan.resolution.model,
            tier=plan.tier.value,
            status=status,
        )
        self._count(
            plan, UsageCounts(rate_limited=1) if status == 429 else UsageCounts(shed=1)
        )

    def _count(self, plan: ChatPlan, counts: UsageCounts) -> None:
        resolution = plan.resolution
        self.background.spawn(
            self.usage_counter.add(
                UsageKey.from_time(
                    plan.team, resolution.model, resolution.version, time.time()
                ),
                counts,
            )
        )

    def _observe(self, plan: ChatPlan, ended: AttemptResult) -> None:
        usage, first_token_at = ended.usage, ended.first_token_at
        metrics.observe_request(
            model=plan.resolution.model,
            version=plan.resolution.version,
            region=self.region,
            team=plan.team,
            outcome=ended.outcome,
            ttft_s=(first_token_at - plan.started_at) if first_token_at else None,
            duration_s=time.monotonic() - plan.started_at,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            output_tokens=usage.completion_tokens if usage else 0,
        )

    def _figures(self, plan: ChatPlan, ended: AttemptResult) -> VersionFigures | None:
        """Return the request's figures for the guards; None for a client's 4xx.

        A complete answer counts its output tokens and whether it opens with a
        refusal; a client that left counts as a request with neither an answer
        nor an error; anything else is an error of the version, by kind.
        """
        first_token_at = ended.first_token_at
        ttft = (first_token_at - plan.started_at) if first_token_at else None
        if ended.outcome == "ok" and ended.usage is not None:
            return one_request(
                ttft_s=ttft,
                output_tokens=ended.usage.completion_tokens,
                refused=self.refusals.is_refusal(ended.head_text),
            )
        if ended.outcome == "client_closed":
            return one_request(ttft_s=ttft, output_tokens=None)
        if ended.is_client_error and ended.error_kind is None:
            return None
        return one_request(
            ttft_s=ttft, output_tokens=None, error_kind=ended.error_kind or "error"
        )
