"""The admission sequence, driven step by step as the gateway and the simulator drive it."""

from __future__ import annotations

from typing import TypedDict

import pytest

from routing.domain.admission import Outcome, PoolState, Verdict
from routing.domain.admission_control import (
    AdmissionControl,
    AdmissionOptions,
    AdmissionRequest,
    ChargeAndAcquire,
    RefundAndRelease,
    Rejected,
    ShedWaiting,
    Steps,
    Ticket,
    WaitInQueue,
)
from routing.domain.limit_table import BucketTable, Claim, LimitTable, SlotTable
from routing.domain.limiter import ChargeTooLarge
from routing.domain.snapshot import LimitRecord
from routing.domain.tiers import Tier

POOL = ("chat-7b", "v1")
NOW = 1000.0


class Pool:
    """A pool of fixed capacity whose load is what admission counted into it."""

    def __init__(self, capacity: int | None = 10_000) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.teams: dict[str, int] = {}

    def state(self, model: str, version: str) -> PoolState | None:
        if self.capacity is None:
            return None
        return PoolState(self.capacity, self.in_flight, dict(self.teams))

    def take(
        self, model: str, version: str, team: str, tokens: int, tier: Tier
    ) -> None:
        self.in_flight += tokens
        self.teams[team] = self.teams.get(team, 0) + tokens

    def give_back(
        self, model: str, version: str, team: str, tokens: int, tier: Tier
    ) -> None:
        self.in_flight -= tokens
        self.teams[team] -= tokens


class Driver:
    """Performs effects on an in-memory LimitTable, recording them, at ``NOW``."""

    def __init__(self, pool: Pool, options: AdmissionOptions | None = None) -> None:
        self.pool = pool
        self.control = AdmissionControl(pool, options or AdmissionOptions())
        self.limits = LimitTable(BucketTable(), SlotTable())
        self.effects: list[object] = []

    def start(
        self, request: AdmissionRequest, admission_id: str
    ) -> tuple[Steps, object]:
        """Begin the sequence; perform limit effects until it returns, raises or waits."""
        steps = self.control.admit(request, admission_id, NOW)
        return steps, self.resume(steps, None)

    def resume(
        self,
        steps: Steps,
        reply: Claim | Verdict | None,
        error: BaseException | None = None,
    ) -> object:
        """Run on; return the Ticket, the Rejected, or the WaitInQueue it stopped at."""
        while True:
            try:
                effect = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value
            except Rejected as refused:
                return refused
            self.effects.append(effect)
            reply, error = None, None
            if isinstance(effect, ChargeAndAcquire):
                try:
                    reply = effect.apply(self.limits, NOW)
                except ChargeTooLarge as exc:
                    error = exc
            elif isinstance(effect, RefundAndRelease):
                effect.apply(self.limits, NOW)
            elif isinstance(effect, WaitInQueue):
                return effect

    def refund(self, effect: RefundAndRelease) -> None:
        effect.apply(self.limits, NOW)

    def tokens_left(self, team: str, capacity: int) -> float:
        return self.limits.buckets.peek(
            f"{team}:chat-7b", capacity=capacity, refill_per_s=capacity / 60, now=NOW
        ).tokens

    def slots(self, team: str) -> int:
        return self.limits.slots.count(f"{team}:chat-7b", NOW)


class TeamLimits(TypedDict, total=False):
    """The ``request`` keyword arguments that set the team's limits."""

    tokens_per_minute: int
    max_concurrency: int


def request(
    team: str,
    tokens: int,
    *,
    tier: Tier = Tier.STANDARD,
    tokens_per_minute: int = 10**9,
    max_concurrency: int = 10**6,
    share: float = 0.0,
    region_share: float = 1.0,
) -> AdmissionRequest:
    return AdmissionRequest(
        team=team,
        model="chat-7b",
        version="v1",
        tier=tier,
        prompt_tokens=tokens // 2,
        max_tokens=tokens - tokens // 2,
        limit=LimitRecord(team, "chat-7b", tokens_per_minute, max_concurrency, share),
        region_share=region_share,
    )


def test_admit_charges_takes_a_slot_and_counts_the_pool() -> None:
    driver = Driver(Pool())

    _, ticket = driver.start(request("a", 600, tokens_per_minute=1000), "r1")

    assert isinstance(ticket, Ticket)
    charge = driver.effects[0]
    assert isinstance(charge, ChargeAndAcquire)
    assert (charge.key, charge.amount, charge.capacity) == ("a:chat-7b", 600, 1000)
    assert ticket.headers["x-ratelimit-remaining-tokens"] == "400"
    assert driver.pool.in_flight == 600
    assert driver.pool.teams == {"a": 600}
    assert driver.slots("a") == 1


def test_release_refunds_the_unused_part_once_and_empties_the_pool() -> None:
    driver = Driver(Pool())
    _, ticket = driver.start(request("a", 600, tokens_per_minute=1000), "r1")
    assert isinstance(ticket, Ticket)

    refund = driver.control.release(ticket, used_tokens=100)

    assert isinstance(refund, RefundAndRelease)
    assert refund.amount == 500
    driver.refund(refund)
    assert driver.tokens_left("a", 1000) == 900
    assert driver.slots("a") == 0
    assert driver.pool.in_flight == 0
    assert driver.control.release(ticket, used_tokens=0) is None


def test_region_share_sizes_the_bucket_the_refill_and_the_slots() -> None:
    driver = Driver(Pool())

    def quarter(tokens: int) -> AdmissionRequest:
        return request(
            "a", tokens, tokens_per_minute=6000, max_concurrency=4, region_share=0.25
        )

    _, ticket = driver.start(quarter(1000), "r1")
    _, refused = driver.start(quarter(1000), "r2")

    assert isinstance(ticket, Ticket)
    charge = driver.effects[0]
    assert isinstance(charge, ChargeAndAcquire)
    assert (charge.capacity, charge.refill_per_s, charge.limit) == (1500, 25.0, 1)
    assert isinstance(refused, Rejected)
    assert refused.code == "rate_limit_exceeded"
    assert "6000 tokens per minute over all regions, 25% of it here" in refused.message
    refund = driver.control.release(ticket, used_tokens=100)
    assert isinstance(refund, RefundAndRelease)
    assert (refund.capacity, refund.refill_per_s) == (1500, 25.0)


def test_region_share_never_turns_an_allowed_request_into_a_400() -> None:
    driver = Driver(Pool())

    _, ticket = driver.start(
        request("a", 4000, tokens_per_minute=6000, region_share=0.05), "r1"
    )
    _, too_big = driver.start(
        request("b", 7000, tokens_per_minute=6000, region_share=0.05), "r2"
    )

    assert isinstance(ticket, Ticket)
    assert isinstance(too_big, Rejected)
    assert too_big.code == "request_exceeds_token_limit"
    assert "limit is 6000 tokens per minute" in too_big.message


@pytest.mark.parametrize(
    ("limits", "code"),
    [
        ({"tokens_per_minute": 500}, "request_exceeds_token_limit"),
        (
            {"tokens_per_minute": 1000, "max_concurrency": 0},
            "concurrency_limit_exceeded",
        ),
    ],
)
def test_limit_refusals_hold_nothing(limits: TeamLimits, code: str) -> None:
    driver = Driver(Pool())

    _, refused = driver.start(request("a", 600, **limits), "r1")

    assert isinstance(refused, Rejected)
    assert refused.code == code
    assert not any(isinstance(e, RefundAndRelease) for e in driver.effects)
    assert driver.pool.in_flight == 0
    assert driver.slots("a") == 0


def test_an_empty_bucket_is_a_429_with_the_wait() -> None:
    driver = Driver(Pool())
    driver.start(request("a", 600, tokens_per_minute=1000), "r1")

    _, refused = driver.start(request("a", 600, tokens_per_minute=1000), "r2")

    assert isinstance(refused, Rejected)
    assert (refused.status, refused.code) == (429, "rate_limit_exceeded")
    assert refused.retry_after_s == 12  # 200 tokens short at 1000/60 per second
    assert driver.slots("a") == 1


def test_a_pool_refusal_gives_back_the_charge_and_the_slot() -> None:
    driver = Driver(Pool(capacity=1000))
    driver.start(request("hog", 1000, share=1.0), "hog")

    _, refused = driver.start(request("a", 600, tokens_per_minute=1000), "r1")

    assert isinstance(refused, Rejected)
    assert (refused.status, refused.code) == (429, "over_guaranteed_share")
    give_back = driver.effects[-1]
    assert isinstance(give_back, RefundAndRelease) and give_back.amount == 600
    assert driver.tokens_left("a", 1000) == 1000
    assert driver.slots("a") == 0
    assert driver.pool.teams.get("a", 0) == 0


def test_a_request_larger_than_the_bucket_is_a_400_showing_the_bucket() -> None:
    driver = Driver(Pool())
    driver.start(request("a", 300, tokens_per_minute=500), "r1")

    _, refused = driver.start(request("a", 600, tokens_per_minute=500), "r2")

    assert isinstance(refused, Rejected)
    assert (refused.status, refused.code) == (400, "request_exceeds_token_limit")
    assert refused.headers == {
        "x-ratelimit-limit-tokens": "500",
        "x-ratelimit-remaining-tokens": "200",
        "x-ratelimit-reset-tokens": "36s",  # 300 tokens at 500/60 per second
    }
    # Read by a charge of nothing that can take no slot: nothing changed.
    read = driver.effects[-1]
    assert isinstance(read, ChargeAndAcquire)
    assert (read.amount, read.limit) == (0, 0)
    assert driver.tokens_left("a", 500) == 200
    assert driver.slots("a") == 1


def test_a_failed_bucket_read_still_gives_the_400_with_the_limit() -> None:
    driver = Driver(Pool())
    steps = driver.control.admit(request("a", 600, tokens_per_minute=500), "r1", NOW)
    assert isinstance(next(steps), ChargeAndAcquire)
    read = steps.throw(ChargeTooLarge(600, 500))
    assert isinstance(read, ChargeAndAcquire) and read.amount == 0

    with pytest.raises(Rejected) as refused:
        steps.throw(ConnectionError("the store is down"))

    assert refused.value.status == 400
    assert refused.value.headers == {"x-ratelimit-limit-tokens": "500"}


def test_a_request_larger_than_the_pool_is_a_400() -> None:
    driver = Driver(Pool(capacity=500))

    _, refused = driver.start(request("a", 600), "r1")

    assert isinstance(refused, Rejected)
    assert (refused.status, refused.code) == (400, "request_exceeds_pool_capacity")
    assert driver.slots("a") == 0


def test_without_pool_state_every_request_goes_to_routing() -> None:
    driver = Driver(Pool(capacity=None))

    _, ticket = driver.start(request("a", 10**6), "r1")

    assert isinstance(ticket, Ticket)
    assert driver.pool.in_flight == 10**6


def test_a_queued_request_is_admitted_by_the_pump_and_counted_once() -> None:
    driver = Driver(Pool(capacity=1000))
    _, hog = driver.start(request("hog", 1000, share=1.0), "hog")
    steps, waiting = driver.start(request("a", 400, share=0.5), "r1")
    assert isinstance(waiting, WaitInQueue) and waiting.pool == POOL
    assert driver.control.queued(POOL) == 1

    assert isinstance(hog, Ticket)
    freed = driver.control.release(hog, used_tokens=0)
    assert freed is not None
    driver.refund(freed)
    pumped = driver.control.pump(POOL, NOW)

    assert pumped.admitted == ("r1",)
    assert driver.pool.in_flight == 400  # counted by the pump
    ticket = driver.resume(steps, Verdict(Outcome.ADMIT))
    assert isinstance(ticket, Ticket)
    assert driver.pool.in_flight == 400  # and not again on resuming
    assert driver.control.queued(POOL) == 0


def test_a_client_leaving_the_queue_is_forgotten_and_refunded() -> None:
    driver = Driver(Pool(capacity=1000))
    driver.start(request("hog", 1000, share=1.0), "hog")
    steps, _ = driver.start(request("a", 400, tokens_per_minute=1000, share=0.5), "r1")

    class ClientLeft(Exception):
        pass

    with pytest.raises(ClientLeft):
        driver.resume(steps, None, ClientLeft())

    assert driver.control.queued(POOL) == 0
    assert driver.tokens_left("a", 1000) == 1000
    assert driver.slots("a") == 0


def test_a_cancellation_after_the_pump_admitted_gives_the_pool_back() -> None:
    """GIVEN a queued request that a pump admitted (its tokens counted)
    WHEN its client's cancellation reaches the sequence before it resumed
    THEN its pool tokens come out again, and its charge and slot are given back.
    """
    driver = Driver(Pool(capacity=1000))
    _, hog = driver.start(request("hog", 1000, share=1.0), "hog")
    steps, _ = driver.start(request("a", 400, share=0.5), "r1")
    assert isinstance(hog, Ticket)
    freed = driver.control.release(hog, used_tokens=0)
    assert freed is not None
    driver.refund(freed)
    assert driver.control.pump(POOL, NOW).admitted == ("r1",)
    assert driver.pool.in_flight == 400

    with pytest.raises(KeyboardInterrupt):
        driver.resume(steps, None, KeyboardInterrupt())

    assert driver.pool.in_flight == 0
    assert driver.slots("a") == 0


def test_a_shed_newcomer_pushes_out_queued_batch_which_is_refunded() -> None:
    driver = Driver(Pool(capacity=1000), AdmissionOptions(max_queue=1))
    driver.start(request("hog", 1000, share=1.0), "hog")
    batch_steps, waiting = driver.start(request("b", 100, tier=Tier.BATCH), "batch")
    assert isinstance(waiting, WaitInQueue)

    _, waiting = driver.start(
        request("i", 100, tier=Tier.INTERACTIVE, share=0.5), "inter"
    )

    assert isinstance(waiting, WaitInQueue)
    shed = next(e for e in driver.effects if isinstance(e, ShedWaiting))
    assert [admission_id for admission_id, _ in shed.shed] == ["batch"]
    refused = driver.resume(batch_steps, Verdict(Outcome.SHED, 3))
    assert isinstance(refused, Rejected)
    assert (refused.status, refused.retry_after_s) == (503, 3)
    assert driver.slots("b") == 0
    assert [c.request_id for c in driver.control.waiting(POOL)] == ["inter"]


def test_a_dropped_sequence_leaves_the_queue_without_yielding_again() -> None:
    driver = Driver(Pool(capacity=1000))
    driver.start(request("hog", 1000, share=1.0), "hog")
    steps, _ = driver.start(request("a", 400, share=0.5), "r1")

    steps.close()  # as garbage collection would; must not raise RuntimeError

    assert driver.control.queued(POOL) == 0
