"""A request is metered once, from its record: refund, usage row, version figures
(the pool's live figures always, the guards' under a rollout)."""

from __future__ import annotations

import asyncio
import time

import pytest

from metering.domain.figures import Role, VersionFigures, one_request
from metering.domain.usage import UsageCounts, UsageKey
from metering.figures import FigureKey
from routing.attempt import AttemptResult
from routing.background import BackgroundTasks
from routing.domain.admission_control import AdmissionRequest, Ticket
from routing.domain.refusals import RefusalDetector
from routing.domain.resolve import Resolution
from routing.domain.snapshot import LimitRecord
from routing.domain.tiers import Tier
from routing.plan import ChatPlan
from routing.request_meter import RequestMeter, Served
from routing.responses import FinalUsage, GatewayError

LIMIT = LimitRecord("alpha", "chat-7b", 10_000, 4, 0.25)


class Recorder:
    """The admission, usage counter and figure recorder, as lists."""

    def __init__(self) -> None:
        self.released: list[int] = []
        self.usage: list[tuple[UsageKey, UsageCounts]] = []
        self.figures: list[tuple[FigureKey, VersionFigures]] = []

    async def admit(self, request: AdmissionRequest) -> Ticket:
        raise AssertionError("not admitted here")

    async def release(self, ticket: Ticket, *, used_tokens: int) -> None:
        self.released.append(used_tokens)

    async def add(self, key: UsageKey, counts: UsageCounts) -> None:
        self.usage.append((key, counts))


class Figures:
    """The figures recorded, per role."""

    def __init__(self) -> None:
        self.keys: list[FigureKey] = []
        self.by_role: dict[str, list[VersionFigures]] = {}

    async def add(
        self, key: FigureKey, figures: VersionFigures, conversation: str | None
    ) -> None:
        self.keys.append(key)
        self.by_role.setdefault(key.role, []).append(figures)

    @property
    def added(self) -> list[VersionFigures]:
        """The guards' figures (every role but ``pool``)."""
        return [f for role, fs in self.by_role.items() if role != Role.POOL for f in fs]

    @property
    def pool(self) -> list[VersionFigures]:
        return self.by_role.get(Role.POOL, [])


def plan(*, tier: Tier = Tier.STANDARD) -> ChatPlan:
    return ChatPlan(
        request_id="chatcmpl-1",
        team="alpha",
        model_ref="chat-7b",
        resolution=Resolution("chat-7b", "v2", False, True, None),
        tier=tier,
        limit=LIMIT,
        prompt_tokens=10,
        max_tokens=20,
        stream=True,
        routing_key="conv-1",
        payload=b"{}",
        started_at=0.0,
    )


def settle(
    ended: AttemptResult, *, role: Role | None, tier: Tier = Tier.STANDARD
) -> tuple[Recorder, Figures]:
    """Settle one request ending with ``ended``; return what was recorded."""
    recorder, figures = Recorder(), Figures()

    async def run() -> None:
        background = BackgroundTasks()
        meter = RequestMeter(
            region="eu",
            figures_bucket_s=60,
            admission=recorder,
            usage_counter=recorder,
            background=background,
            refusals=RefusalDetector(),
            figures=figures,
        )
        ticket = Ticket(
            AdmissionRequest("alpha", "chat-7b", "v2", tier, 10, 20, LIMIT), "a1", 30
        )
        await meter.settle(Served(plan(tier=tier), ticket, role, ended))
        await background.drain()

    asyncio.run(run())
    return recorder, figures


USAGE = FinalUsage(prompt_tokens=10, cached_tokens=4, completion_tokens=7)


def test_an_answer_refunds_what_it_did_not_use_and_counts_its_tokens() -> None:
    recorder, figures = settle(
        AttemptResult("ok", "r1", first_token_at=0.5, usage=USAGE),
        role=Role.CANARY,
    )

    assert recorder.released == [17]
    [(key, counts)] = recorder.usage
    assert (key.team, key.model, key.version) == ("alpha", "chat-7b", "v2")
    assert counts == UsageCounts(
        prompt_tokens=10, cached_tokens=4, output_tokens=7, requests=1
    )
    assert figures.added == [one_request(ttft_s=0.5, output_tokens=7)]


def test_batch_work_is_counted_again_in_its_own_part() -> None:
    recorder, _ = settle(
        AttemptResult("ok", "r1", first_token_at=0.5, usage=USAGE),
        role=None,
        tier=Tier.BATCH,
    )

    [(_, counts)] = recorder.usage
    assert (counts.batch_requests, counts.batch_prompt_tokens) == (1, 10)
    assert counts.batch_output_tokens == 7


def test_a_client_that_left_mid_answer_pays_for_what_it_was_sent() -> None:
    recorder, figures = settle(
        AttemptResult("client_closed", "r1", first_token_at=0.5, usage=USAGE),
        role=Role.LIVE,
    )

    assert recorder.released == [17]
    assert [counts.output_tokens for _, counts in recorder.usage] == [7]
    assert figures.added == [one_request(ttft_s=0.5, output_tokens=None)]


def test_a_client_error_is_no_error_of_the_version() -> None:
    bad = GatewayError(400, "bad request", code="invalid_request")
    recorder, figures = settle(AttemptResult("error", "r1", error=bad), role=Role.LIVE)

    assert recorder.released == [0]  # all refunded
    assert recorder.usage == []
    assert figures.added == []


@pytest.mark.parametrize("kind", ["timeout", "upstream", "broken"])
def test_a_failure_counts_as_an_error_of_the_version_by_kind(kind: str) -> None:
    failed = GatewayError(503, "no replica", code="no_replica_available")
    recorder, figures = settle(
        AttemptResult("error", error_kind=kind, error=failed), role=Role.CANARY
    )

    assert recorder.released == [0]
    assert figures.added == [
        one_request(ttft_s=None, output_tokens=None, error_kind=kind)
    ]


def test_a_request_outside_a_rollout_records_only_its_pools_figures() -> None:
    _, figures = settle(
        AttemptResult("ok", "r1", first_token_at=0.5, usage=USAGE), role=None
    )

    assert figures.added == []
    [pool] = figures.pool
    assert (pool.requests, pool.answered, pool.output_tokens) == (1, 1, 7)
    assert (pool.prompt_tokens, pool.cached_tokens) == (10, 4)
    assert pool.ttft_quantile(0.95) == one_request(
        ttft_s=0.5, output_tokens=7
    ).ttft_quantile(0.95)
    assert {(k.model, k.version, k.role) for k in figures.keys} == {
        ("chat-7b", "v2", "pool")
    }


def test_a_request_under_a_rollout_counts_for_its_pool_and_its_role() -> None:
    # Six tokens after the first, 0.6 s after it: 0.1 s per output token.
    first = time.monotonic() - 0.6
    _, figures = settle(
        AttemptResult("ok", "r1", first_token_at=first, usage=USAGE),
        role=Role.CANARY,
    )

    [guard] = figures.by_role[Role.CANARY]
    [pool] = figures.pool
    assert guard.prompt_tokens == 0 and guard.tpot == {}  # the guards' as before
    assert pool.requests == guard.requests == 1
    tpot = pool.tpot_quantile(0.5)
    assert tpot is not None and 0.1 <= tpot <= 0.13


def test_a_failure_counts_for_its_pool_without_tokens() -> None:
    failed = GatewayError(503, "no replica", code="no_replica_available")
    _, figures = settle(
        AttemptResult("error", error_kind="upstream", error=failed), role=None
    )

    assert figures.pool == [
        one_request(ttft_s=None, output_tokens=None, error_kind="upstream")
    ]


def test_a_503_before_any_answer_is_counted_as_shed_and_billed_nothing() -> None:
    for code in ("no_replica_available", "retry_budget_exhausted"):
        failed = GatewayError(503, "no replica", code=code)
        recorder, _ = settle(
            AttemptResult("error", error_kind="upstream", error=failed), role=None
        )

        assert recorder.released == [0]
        [(key, counts)] = recorder.usage
        assert (key.team, key.version) == ("alpha", "v2")
        assert counts == UsageCounts(shed=1)


def test_a_failure_after_tokens_were_sent_is_no_shed() -> None:
    broken = GatewayError(502, "the replica failed", code="upstream_failed")
    recorder, _ = settle(
        AttemptResult("error", "r1", 0.5, usage=USAGE, error=broken), role=None
    )

    [(_, counts)] = recorder.usage
    assert counts.shed == 0
    assert counts.output_tokens == 7
