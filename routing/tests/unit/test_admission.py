"""Tests for tiered admission of one pool, on an explicit clock.

The pool holds 1,000 tokens in flight and, unless a test says otherwise, the queue
assumes it drains 100 tokens per second (capacity / 10), so Retry-After values
are hand-computed. Shares of 1.0 put a request inside its team's guarantee and
shares of 0.0 outside it; each request gets its own team unless a test is about
teams.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TypedDict

import pytest

from routing.domain.admission import (
    AdmissionQueue,
    Candidate,
    Outcome,
    PoolState,
    Pumped,
    Verdict,
)
from routing.domain.limiter import ChargeTooLarge
from routing.domain.tiers import Tier

CAP = 1000
INT, STD, BAT = Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH
IN, OUT = 1.0, 0.0  # guaranteed shares that put a lone request inside / outside


class TeamShare(TypedDict):
    """``cand`` keyword arguments naming a request's team and its share."""

    team: str
    share: float


class QueueSettings(TypedDict, total=False):
    """Keyword arguments of ``AdmissionQueue``."""

    max_queue: int
    max_wait_s: float
    batch_ceiling: float
    batch_lane: float
    drain_tokens_per_s: float | None


class CandidateValues(TypedDict, total=False):
    """The ``cand`` keyword arguments that ``Candidate`` validates."""

    tokens: int
    share: float


def cand(
    request_id: str,
    tier: Tier = STD,
    *,
    share: float = IN,
    tokens: int = 100,
    team: str | None = None,
    at: float = 0.0,
) -> Candidate:
    return Candidate(
        request_id=request_id,
        team=team or request_id,
        tier=tier,
        tokens=tokens,
        guaranteed_share=share,
        arrived_at=at,
    )


def pool(in_flight: int = 0, **team_in_flight: int) -> PoolState:
    return PoolState(capacity=CAP, in_flight=in_flight, team_in_flight=team_in_flight)


def batch_pool(in_flight: int, batch_in_flight: int) -> PoolState:
    return PoolState(
        capacity=CAP,
        in_flight=in_flight,
        team_in_flight={},
        batch_in_flight=batch_in_flight,
    )


IDLE = pool(0)
FULL = pool(CAP)  # not even one more token fits


def ids(queue: AdmissionQueue) -> list[str]:
    return [c.request_id for c in queue.waiting()]


def outcome(queue: AdmissionQueue, c: Candidate, state: PoolState) -> Outcome:
    verdict, shed = queue.offer(c, state, c.arrived_at)
    assert shed == ()
    return verdict.outcome


# Building queues: every class of rule 3, reached the way traffic reaches it.
# Inside-guarantee requests and batch queue because the pool is full; an
# interactive or standard request outside its guarantee only queues behind
# something (when full it gets a 429 instead), hence the interactive anchor.
CLASS_SPECS = {
    "i_in": (INT, IN),
    "i_out": (INT, OUT),
    "s_in": (STD, IN),
    "s_out": (STD, OUT),
    "b_in": (BAT, IN),
    "b_out": (BAT, OUT),
}
ADMISSION_ORDER = ["i_in", "i_out", "s_in", "s_out", "b_in", "b_out"]


def enqueue(queue: AdmissionQueue, c: Candidate) -> None:
    is_outside = c.tier is not BAT and c.guaranteed_share == OUT
    verdict, shed = queue.offer(c, IDLE if is_outside else FULL, c.arrived_at)
    assert verdict.outcome is Outcome.QUEUE, (c, verdict)
    assert shed == ()


def enqueue_class(queue: AdmissionQueue, name: str, request_id: str, at: float) -> None:
    tier, share = CLASS_SPECS[name]
    enqueue(queue, cand(request_id, tier, share=share, at=at))


# --- idle and busy-but-not-full -------------------------------------------------


@pytest.mark.parametrize("tier", list(Tier))
@pytest.mark.parametrize("share", [IN, OUT])
def test_admission_idle_pool_admits_every_tier(tier: Tier, share: float) -> None:
    queue = AdmissionQueue()
    verdict, shed = queue.offer(cand("r", tier, share=share), IDLE, 0.0)
    assert verdict == Verdict(Outcome.ADMIT)
    assert shed == ()
    assert len(queue) == 0


def test_admission_team_bursts_beyond_its_share_into_idle_capacity() -> None:
    queue = AdmissionQueue()
    c = cand("r", STD, share=0.1, team="a")
    assert outcome(queue, c, pool(800, a=800)) is Outcome.ADMIT  # 900 of its 100


def test_admission_request_that_exactly_fills_the_pool_is_admitted() -> None:
    queue = AdmissionQueue()
    assert outcome(queue, cand("r", STD, tokens=100), pool(900)) is Outcome.ADMIT
    assert outcome(queue, cand("q", STD, tokens=101), pool(900)) is Outcome.QUEUE


QUEUED_TIER_COMBOS = [
    combo for n in range(4) for combo in itertools.combinations([INT, STD, BAT], n)
]


@pytest.mark.parametrize("queued", QUEUED_TIER_COMBOS)
@pytest.mark.parametrize("tier", list(Tier))
def test_admission_busy_pool_admits_only_when_nothing_is_queued_ahead(
    queued: tuple[Tier, ...], tier: Tier
) -> None:
    queue = AdmissionQueue()
    for i, queued_tier in enumerate(queued):
        enqueue(queue, cand(f"q{i}", queued_tier, at=float(i)))
    busy = pool(500)
    verdict, shed = queue.offer(cand("new", tier, at=10.0), busy, 10.0)
    is_blocked = any(t.rank <= tier.rank for t in queued)
    if is_blocked:
        assert verdict == Verdict(Outcome.QUEUE, reason="queued_behind")
    else:
        assert verdict == Verdict(Outcome.ADMIT)
    assert shed == ()


def test_admission_inside_request_is_admitted_past_queued_outside_ones() -> None:
    queue = AdmissionQueue()
    enqueue_class(queue, "i_in", "anchor", 0.0)
    enqueue_class(queue, "s_out", "late_payer", 1.0)
    queue.cancel("anchor")
    # Only an outside-guarantee standard request waits: an inside one is not behind it.
    assert (
        outcome(queue, cand("s_in", STD, share=IN, at=2.0), pool(500)) is Outcome.ADMIT
    )
    assert outcome(queue, cand("s_out2", STD, share=OUT, at=3.0), pool(500)) is (
        Outcome.QUEUE
    )
    assert ids(queue) == ["late_payer", "s_out2"]


# --- full pool --------------------------------------------------------------------

NEWCOMERS = [
    # (tier, share, expected outcome on a full pool)
    (INT, IN, Outcome.QUEUE),
    (STD, IN, Outcome.QUEUE),
    (BAT, IN, Outcome.QUEUE),
    (BAT, OUT, Outcome.QUEUE),  # batch waits; it is never rate limited
    (INT, OUT, Outcome.RATE_LIMITED),
    (STD, OUT, Outcome.RATE_LIMITED),
]


@pytest.mark.parametrize("queued", QUEUED_TIER_COMBOS)
@pytest.mark.parametrize(("tier", "share", "expected"), NEWCOMERS)
def test_admission_full_pool_outcome_and_place_with_any_queued_tiers(
    queued: tuple[Tier, ...], tier: Tier, share: float, expected: Outcome
) -> None:
    queue = AdmissionQueue()
    for i, queued_tier in enumerate(queued):
        enqueue(queue, cand(f"q_{queued_tier}", queued_tier, at=float(i)))
    verdict, shed = queue.offer(cand("new", tier, share=share, at=10.0), FULL, 10.0)
    assert verdict.outcome is expected
    assert shed == ()
    if expected is Outcome.RATE_LIMITED:
        assert verdict.reason == "over_share"
        assert verdict.retry_after_s >= 1
        assert "new" not in ids(queue)
        return
    assert verdict == Verdict(Outcome.QUEUE, reason="pool_full")
    # Interactive first, then standard, then batch; the newcomer behind its equals.
    expected_order = [
        request_id
        for t in (INT, STD, BAT)
        for request_id in [f"q_{t}" for q in queued if q is t]
        + (["new"] if t is tier else [])
    ]
    assert ids(queue) == expected_order
    assert queue.pump(IDLE, 10.0) == Pumped(tuple(expected_order), ())


def test_admission_over_share_team_gets_429_only_while_the_pool_is_full() -> None:
    queue = AdmissionQueue()
    over: TeamShare = {"team": "a", "share": 0.2}  # 200 of 1,000 guaranteed
    assert outcome(queue, cand("r1", STD, **over), pool(890, a=500)) is Outcome.ADMIT
    assert outcome(queue, cand("r2", INT, **over), pool(900, a=600)) is Outcome.ADMIT
    verdict, _ = queue.offer(cand("r3", STD, **over), pool(901, a=700), 0.0)
    assert verdict.outcome is Outcome.RATE_LIMITED


def test_admission_inside_guarantee_counts_the_teams_queued_tokens() -> None:
    queue = AdmissionQueue()
    share: TeamShare = {"team": "a", "share": 0.3}  # 300 tokens guaranteed
    for i in range(3):
        assert outcome(queue, cand(f"r{i}", STD, **share), FULL) is Outcome.QUEUE
    verdict, _ = queue.offer(cand("r3", STD, **share), FULL, 0.0)
    assert verdict.outcome is Outcome.RATE_LIMITED  # 300 queued + 100 > 300
    assert queue.cancel("r0")
    assert outcome(queue, cand("r4", STD, **share), FULL) is Outcome.QUEUE


def test_admission_inside_guarantee_counts_the_teams_tokens_in_flight() -> None:
    queue = AdmissionQueue()
    share: TeamShare = {"team": "a", "share": 0.3}
    assert outcome(queue, cand("r1", STD, **share), pool(1000, a=200)) is Outcome.QUEUE
    verdict, _ = queue.offer(cand("r2", STD, **share), pool(1000, a=200), 0.0)
    assert verdict.outcome is Outcome.RATE_LIMITED  # 200 + 100 queued + 100 > 300


def test_admission_queued_batch_does_not_use_up_the_teams_guarantee() -> None:
    queue = AdmissionQueue()
    for i in range(9):
        enqueue(queue, cand(f"b{i}", BAT, team="a", share=0.3))
    assert outcome(queue, cand("i1", INT, team="a", share=0.3), FULL) is Outcome.QUEUE


def test_admission_share_boundary_is_inclusive() -> None:
    queue = AdmissionQueue()
    c = cand("r", INT, team="a", share=0.7, tokens=100)
    assert outcome(queue, c, pool(1000, a=600)) is Outcome.QUEUE  # 700 of 700
    verdict, _ = queue.offer(cand("r2", INT, team="b", share=0.7), pool(1000, b=601), 0)
    assert verdict.outcome is Outcome.RATE_LIMITED  # 701 of 700


def test_admission_share_boundary_survives_float_rounding() -> None:
    queue = AdmissionQueue()
    # 0.57 * 100 is 56.99999999999999 in floats; 57 of 57 tokens is inside.
    c = cand("r", INT, team="a", share=0.57, tokens=57)
    full = PoolState(capacity=100, in_flight=100, team_in_flight={})
    assert outcome(queue, c, full) is Outcome.QUEUE


# --- batch ------------------------------------------------------------------------


def test_admission_batch_is_paused_while_interactive_or_standard_wait() -> None:
    queue = AdmissionQueue()
    enqueue(queue, cand("s1", STD, at=0.0))
    verdict, _ = queue.offer(cand("b1", BAT, at=1.0), IDLE, 1.0)
    assert verdict == Verdict(Outcome.QUEUE, reason="queued_behind")
    assert queue.pump(IDLE, 2.0) == Pumped(("s1", "b1"), ())


def test_admission_batch_runs_only_on_idle_capacity() -> None:
    queue = AdmissionQueue(batch_ceiling=0.5)
    assert outcome(queue, cand("b1", BAT), pool(400)) is Outcome.ADMIT  # 500 <= 500
    verdict, _ = queue.offer(cand("b2", BAT), pool(401), 0.0)
    assert verdict == Verdict(Outcome.QUEUE, reason="batch_waits_for_idle_capacity")
    assert outcome(queue, cand("s1", STD), pool(401)) is Outcome.ADMIT


def test_admission_pump_admits_batch_only_under_the_ceiling() -> None:
    queue = AdmissionQueue(batch_ceiling=0.5)
    enqueue(queue, cand("b1", BAT, tokens=100))
    assert queue.pump(pool(450), 1.0) == Pumped((), ())
    assert queue.pump(pool(400), 2.0) == Pumped(("b1",), ())


def test_admission_pump_counts_admitted_interactive_toward_the_batch_ceiling() -> None:
    queue = AdmissionQueue(batch_ceiling=0.5)
    enqueue(queue, cand("i1", INT, tokens=300, at=0.0))
    enqueue(queue, cand("b1", BAT, tokens=100, at=0.0))
    # 100 + 300 = 400 leaves room under 500 for the batch request; 200 would not.
    assert queue.pump(pool(100), 1.0) == Pumped(("i1", "b1"), ())
    enqueue(queue, cand("i2", INT, tokens=300, at=2.0))
    enqueue(queue, cand("b2", BAT, tokens=100, at=2.0))
    assert queue.pump(pool(200), 3.0) == Pumped(("i2",), ())


def test_admission_batch_lane_bounds_batch_whatever_the_interactive_load() -> None:
    queue = AdmissionQueue(batch_ceiling=1.0, batch_lane=0.2)
    # 100 batch + 100 fits the lane of 200; 101 more does not, on an idle pool.
    assert outcome(queue, cand("b1", BAT), batch_pool(100, 100)) is Outcome.ADMIT
    verdict, _ = queue.offer(cand("b2", BAT, tokens=101), batch_pool(100, 100), 0.0)
    assert verdict == Verdict(Outcome.QUEUE, reason="batch_waits_for_idle_capacity")
    # Interactive and standard are not in the lane.
    assert outcome(queue, cand("s1", STD), batch_pool(900, 200)) is Outcome.ADMIT


def test_admission_batch_lane_lets_one_request_in_while_no_batch_runs() -> None:
    queue = AdmissionQueue(batch_ceiling=0.5, batch_lane=0.05)
    # 300 tokens is wider than the lane's 50, but no batch is in flight.
    assert (
        outcome(queue, cand("b1", BAT, tokens=300), batch_pool(0, 0)) is Outcome.ADMIT
    )
    # The ceiling still holds it back on a busy pool.
    verdict, _ = queue.offer(cand("b2", BAT, tokens=300), batch_pool(300, 0), 0.0)
    assert verdict.outcome is Outcome.QUEUE


def test_admission_pump_counts_its_batch_admissions_toward_the_lane() -> None:
    queue = AdmissionQueue(batch_lane=0.25)
    for i in range(4):
        enqueue(queue, cand(f"b{i}", BAT, tokens=100, at=float(i)))
    # 50 batch in flight: two more fit under 250, the third would make 350.
    assert queue.pump(batch_pool(300, 50), 5.0) == Pumped(("b0", "b1"), ())
    assert ids(queue) == ["b2", "b3"]
    assert queue.pump(batch_pool(300, 0), 6.0) == Pumped(("b2", "b3"), ())


# --- pump -------------------------------------------------------------------------


def test_admission_pump_tracks_in_flight_across_its_own_admissions() -> None:
    queue = AdmissionQueue()
    for i in range(3):
        enqueue(queue, cand(f"r{i}", INT, tokens=400, at=float(i)))
    assert queue.pump(pool(100), 5.0) == Pumped(("r0", "r1"), ())
    assert ids(queue) == ["r2"]


def test_admission_pump_head_that_does_not_fit_blocks_smaller_ones_behind() -> None:
    queue = AdmissionQueue()
    enqueue(queue, cand("big", INT, tokens=500, at=0.0))
    enqueue(queue, cand("small", INT, tokens=100, at=1.0))
    enqueue(queue, cand("std", STD, tokens=10, at=2.0))
    assert queue.pump(pool(600), 3.0) == Pumped((), ())
    assert queue.pump(pool(400), 4.0) == Pumped(("big", "small"), ())
    assert queue.pump(pool(990), 5.0) == Pumped(("std",), ())


def test_admission_pump_on_a_full_pool_admits_nothing() -> None:
    queue = AdmissionQueue()
    enqueue(queue, cand("r", INT, tokens=1))
    assert queue.pump(FULL, 1.0) == Pumped((), ())
    assert len(queue) == 1


# --- fairness within a tier -------------------------------------------------------


def test_admission_fifo_among_equals_across_teams() -> None:
    queue = AdmissionQueue()
    for i, team in enumerate(["c", "a", "b", "a"]):
        enqueue(queue, cand(f"r{i}", STD, team=team, at=float(i)))
    admitted: list[str] = []
    for step in range(4):
        admitted += queue.pump(pool(900), 10.0 + step).admitted  # room for one
    assert admitted == ["r0", "r1", "r2", "r3"]


def test_admission_late_offer_of_an_earlier_arrival_keeps_fifo_by_arrived_at() -> None:
    queue = AdmissionQueue()
    enqueue(queue, cand("t3", STD, at=3.0))
    enqueue(queue, cand("t1", STD, at=1.0))
    enqueue(queue, cand("t2", STD, at=2.0))
    enqueue(queue, cand("t3b", STD, at=3.0))  # ties keep offer order
    assert ids(queue) == ["t1", "t2", "t3", "t3b"]


def test_admission_inside_guarantee_goes_before_outside_in_the_same_tier() -> None:
    queue = AdmissionQueue()
    enqueue_class(queue, "s_in", "early_in", 1.0)
    enqueue_class(queue, "s_out", "early_out", 2.0)
    enqueue_class(queue, "s_in", "late_in", 3.0)
    assert ids(queue) == ["early_in", "late_in", "early_out"]
    assert queue.pump(IDLE, 4.0).admitted == ("early_in", "late_in", "early_out")


def test_admission_waiting_lists_all_six_classes_in_admission_order() -> None:
    queue = AdmissionQueue()
    for i, name in enumerate(reversed(ADMISSION_ORDER)):
        if name in ("i_out", "s_out"):
            continue
        enqueue_class(queue, name, name, float(i))
    enqueue_class(queue, "s_out", "s_out", 10.0)
    enqueue_class(queue, "i_out", "i_out", 11.0)
    assert ids(queue) == ADMISSION_ORDER
    assert len(queue) == 6


# --- queue bound and shedding order ----------------------------------------------

SHEDDABLE = ADMISSION_ORDER[1:]
SHEDDABLE_COMBOS = [
    combo for n in range(1, 6) for combo in itertools.combinations(SHEDDABLE, n)
]


@pytest.mark.parametrize("present", SHEDDABLE_COMBOS)
def test_admission_queue_at_limit_sheds_the_lowest_class_present(
    present: tuple[str, ...],
) -> None:
    """GIVEN a queue at its limit holding an interactive-inside anchor and one
    request of each class in ``present`` WHEN an interactive request inside its
    guarantee arrives THEN the request that would be admitted last is shed."""
    queue = AdmissionQueue(max_queue=len(present) + 1)
    enqueue_class(queue, "i_in", "anchor", 0.0)
    for i, name in enumerate(present):
        enqueue_class(queue, name, name, float(i + 1))
    verdict, shed = queue.offer(cand("new", INT, at=10.0), FULL, 10.0)
    assert verdict == Verdict(Outcome.QUEUE, reason="pool_full")
    victim = max(present, key=ADMISSION_ORDER.index)
    assert [request_id for request_id, _ in shed] == [victim]
    assert victim not in ids(queue)
    assert len(queue) == len(present) + 1


def test_admission_queue_at_limit_sheds_in_exact_order_and_never_interactive_inside() -> (
    None
):
    queue = AdmissionQueue(max_queue=12)
    enqueue_class(queue, "i_in", "i_in_0", 0.0)
    for name in ADMISSION_ORDER[::-1]:
        for k in (1, 2):
            if (name, k) == ("i_in", 2):
                continue
            enqueue_class(queue, name, f"{name}_{k}", float(k))
    assert len(queue) == 12
    shed_order: list[str] = []
    for n in range(14):
        verdict, shed = queue.offer(cand(f"vip{n}", INT, at=20.0 + n), FULL, 20.0 + n)
        assert verdict.outcome is Outcome.QUEUE
        shed_order += [request_id for request_id, _ in shed]
    assert shed_order == [
        "b_out_2",
        "b_out_1",
        "b_in_2",
        "b_in_1",
        "s_out_2",
        "s_out_1",
        "s_in_2",
        "s_in_1",
        "i_out_2",
        "i_out_1",
    ]
    # Only interactive-inside requests are left, and the queue grew past its limit.
    assert ids(queue) == ["i_in_0", "i_in_1"] + [f"vip{n}" for n in range(14)]
    assert len(queue) == 16


@pytest.mark.parametrize(
    ("queued", "newcomer"),
    [
        (["s_in", "s_in"], cand("new", BAT, at=9.0)),  # lower tier than anything queued
        (["s_in", "s_in"], cand("new", STD, at=9.0)),  # same class, and the newest
        (["s_in", "s_in"], cand("new", BAT, share=OUT, at=9.0)),
        (["i_in", "i_in"], cand("new", STD, at=9.0)),
        (["i_in", "i_in"], cand("new", INT, share=OUT, at=9.0)),
        (["i_in", "b_in"], cand("new", BAT, share=OUT, at=9.0)),
    ],
)
def test_admission_queue_at_limit_sheds_the_newcomer_when_it_ranks_last(
    queued: list[str], newcomer: Candidate
) -> None:
    queue = AdmissionQueue(max_queue=2)
    for i, name in enumerate(queued):
        enqueue_class(queue, name, f"q{i}", float(i))
    is_outside = newcomer.tier is not BAT and newcomer.guaranteed_share == OUT
    state = pool(500) if is_outside else FULL
    verdict, shed = queue.offer(newcomer, state, 9.0)
    assert verdict.outcome is Outcome.SHED
    assert verdict.reason == "queue_full"
    assert verdict.retry_after_s >= 1
    assert shed == ()
    assert ids(queue) == ["q0", "q1"]


def test_admission_queue_at_limit_sheds_newest_first_within_a_class() -> None:
    queue = AdmissionQueue(max_queue=3)
    for i in range(3):
        enqueue(queue, cand(f"b{i}", BAT, at=float(i)))
    _, shed1 = queue.offer(cand("s1", STD, at=5.0), FULL, 5.0)
    _, shed2 = queue.offer(cand("s2", STD, at=6.0), FULL, 6.0)
    assert [shed1[0][0], shed2[0][0]] == ["b2", "b1"]
    assert ids(queue) == ["s1", "s2", "b0"]


def test_admission_interactive_inside_exceeds_the_limit_rather_than_being_shed() -> (
    None
):
    queue = AdmissionQueue(max_queue=2)
    for i in range(5):
        assert outcome(queue, cand(f"i{i}", INT, at=float(i)), FULL) is Outcome.QUEUE
    assert len(queue) == 5
    verdict, _ = queue.offer(cand("s", STD, at=9.0), FULL, 9.0)
    assert verdict.outcome is Outcome.SHED


def test_admission_zero_max_queue_sheds_everything_but_interactive_inside() -> None:
    queue = AdmissionQueue(max_queue=0)
    assert outcome(queue, cand("i", INT), FULL) is Outcome.QUEUE
    for request_id, tier in [("s", STD), ("b", BAT)]:
        verdict, _ = queue.offer(cand(request_id, tier), FULL, 0.0)
        assert verdict.outcome is Outcome.SHED
    assert ids(queue) == ["i"]


# --- Retry-After ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("queued_tokens", "in_flight", "tokens", "drain", "retry_after_s"),
    [
        (0, 1000, 100, None, 1),  # 100 over / 100 per s
        (0, 950, 100, None, 1),  # 50 over is half a second: at least 1
        (200, 1000, 100, None, 3),  # the queue drains first: 300 / 100
        (200, 1000, 300, None, 5),
        (0, 1000, 300, 25.0, 12),  # explicit drain rate
        (0, 1000, 250, 100.0, 3),  # 2.5 s rounds up
    ],
)
def test_admission_rate_limited_retry_after_is_drain_time_in_whole_seconds(
    queued_tokens: int,
    in_flight: int,
    tokens: int,
    drain: float | None,
    retry_after_s: int,
) -> None:
    queue = AdmissionQueue(drain_tokens_per_s=drain)
    if queued_tokens:
        enqueue(queue, cand("ahead", INT, tokens=queued_tokens))
    c = cand("r", STD, share=OUT, tokens=tokens)
    verdict, shed = queue.offer(c, pool(in_flight), 0.0)
    assert verdict == Verdict(Outcome.RATE_LIMITED, retry_after_s, "over_share")
    assert shed == ()


def test_admission_shed_retry_after_counts_what_is_still_queued() -> None:
    queue = AdmissionQueue(max_queue=2)
    enqueue(queue, cand("b", BAT, tokens=300, at=0.0))
    enqueue(queue, cand("s1", STD, tokens=100, at=1.0))
    verdict, shed = queue.offer(cand("s2", STD, tokens=100, at=2.0), FULL, 2.0)
    assert verdict.outcome is Outcome.QUEUE
    assert shed == (("b", 5),)  # (1000 + 200 queued + 300 - 1000) / 100
    verdict, shed = queue.offer(cand("b2", BAT, tokens=300, at=3.0), FULL, 3.0)
    assert verdict == Verdict(Outcome.SHED, 5, "queue_full")
    assert shed == ()


# --- waits bounded by max_wait_s ------------------------------------------------


def test_admission_pump_sheds_requests_that_waited_longer_than_max_wait() -> None:
    queue = AdmissionQueue(max_wait_s=10.0)
    enqueue_class(queue, "i_in", "i_in", 0.0)
    enqueue_class(queue, "i_out", "i_out", 0.0)
    enqueue_class(queue, "s_in", "s_in", 0.0)
    enqueue_class(queue, "b_out", "b_out", 0.0)
    enqueue_class(queue, "s_in", "s_late", 5.0)
    assert queue.pump(FULL, 10.0) == Pumped((), ())  # exactly max_wait_s is fine
    pumped = queue.pump(FULL, 10.5)
    assert pumped.admitted == ()
    # Queued tokens after each removal: 400, 300, 200; (1000 + q + 100 - 1000) / 100.
    assert pumped.shed == (("i_out", 5), ("s_in", 4), ("b_out", 3))
    assert ids(queue) == ["i_in", "s_late"]
    assert queue.pump(FULL, 15.5).shed == (("s_late", 2),)


def test_admission_interactive_inside_guarantee_never_expires() -> None:
    queue = AdmissionQueue(max_wait_s=1.0)
    enqueue(queue, cand("vip", INT, at=0.0))
    assert queue.pump(FULL, 1_000.0) == Pumped((), ())
    assert queue.pump(IDLE, 1_001.0) == Pumped(("vip",), ())


def test_admission_pump_sheds_expired_before_admitting() -> None:
    queue = AdmissionQueue(max_wait_s=10.0)
    enqueue(queue, cand("old", STD, at=0.0))
    enqueue(queue, cand("new", STD, at=5.0))
    assert queue.pump(IDLE, 11.0) == Pumped(("new",), (("old", 1),))


# --- cancel -----------------------------------------------------------------------


def test_admission_cancel_removes_a_queued_request() -> None:
    queue = AdmissionQueue()
    enqueue(queue, cand("a", STD, at=0.0))
    enqueue(queue, cand("b", STD, at=1.0))
    assert queue.cancel("a") is True
    assert queue.cancel("a") is False
    assert queue.cancel("never-queued") is False
    assert ids(queue) == ["b"]
    assert len(queue) == 1
    assert queue.pump(IDLE, 2.0) == Pumped(("b",), ())


def test_admission_cancel_frees_room_under_the_limit() -> None:
    queue = AdmissionQueue(max_queue=1)
    enqueue(queue, cand("b1", BAT))
    queue.cancel("b1")
    enqueue(queue, cand("b2", BAT))
    assert ids(queue) == ["b2"]


def test_admission_cancelled_request_is_neither_shed_nor_expired() -> None:
    queue = AdmissionQueue(max_queue=2, max_wait_s=5.0)
    enqueue(queue, cand("s", STD, at=0.0))
    enqueue(queue, cand("b_cancelled", BAT, at=1.0))
    queue.cancel("b_cancelled")
    enqueue(queue, cand("b", BAT, at=2.0))
    verdict, shed = queue.offer(cand("s2", STD, at=3.0), FULL, 3.0)
    assert verdict.outcome is Outcome.QUEUE
    assert [request_id for request_id, _ in shed] == ["b"]
    assert queue.pump(FULL, 100.0).shed == (("s", 2), ("s2", 1))
    assert len(queue) == 0


def test_admission_request_id_can_be_offered_again_after_cancel() -> None:
    queue = AdmissionQueue()
    enqueue(queue, cand("r", STD))
    with pytest.raises(ValueError, match="already queued"):
        queue.offer(cand("r", STD), FULL, 0.0)
    queue.cancel("r")
    enqueue(queue, cand("r", INT))
    assert ids(queue) == ["r"]


def test_admission_many_cancels_keep_order_and_counts() -> None:
    queue = AdmissionQueue(max_queue=1_000, max_wait_s=10_000.0)
    for i in range(300):
        enqueue(queue, cand(f"r{i:03}", [INT, STD, BAT][i % 3], at=float(i)))
    for i in range(0, 300, 3):
        queue.cancel(f"r{i:03}")
    for i in range(1, 300, 3):
        queue.cancel(f"r{i:03}")
    kept = [f"r{i:03}" for i in range(2, 300, 3)]  # all batch
    assert ids(queue) == kept
    assert len(queue) == 100
    assert queue.pump(IDLE, 1_000.0).admitted == tuple(kept[:10])


# --- guaranteed shares under contention -----------------------------------------


def test_admission_guarantee_is_recovered_from_a_team_that_burst_first() -> None:
    """GIVEN team b (40%) filled the idle pool WHEN team a (60%) floods THEN a's
    requests up to its share queue and take each freed slot before b's, b gets 429s
    only while the pool is full, and both end at their shares."""
    queue = AdmissionQueue()
    shares = {"a": 0.6, "b": 0.4}
    flight: deque[tuple[str, str]] = deque()
    in_flight = {"a": 0, "b": 0}
    n = 0

    def state() -> PoolState:
        return PoolState(CAP, sum(in_flight.values()), dict(in_flight))

    def offer(team: str, now: float) -> Outcome:
        nonlocal n
        n += 1
        c = cand(f"{team}{n}", STD, team=team, share=shares[team], at=now)
        before = state()
        verdict, shed = queue.offer(c, before, now)
        assert shed == ()
        if verdict.outcome is Outcome.ADMIT:
            flight.append((c.request_id, team))
            in_flight[team] += c.tokens
        if verdict.outcome is Outcome.RATE_LIMITED:
            assert before.in_flight + c.tokens > CAP
        return verdict.outcome

    for _ in range(10):
        assert offer("b", 0.0) is Outcome.ADMIT  # 1,000 of its 400
    a_outcomes = [offer("a", 1.0) for _ in range(8)]
    assert a_outcomes == [Outcome.QUEUE] * 6 + [Outcome.RATE_LIMITED] * 2
    for step in range(6):
        _, team = flight.popleft()
        in_flight[team] -= 100
        for request_id in queue.pump(state(), 2.0 + step).admitted:
            flight.append((request_id, request_id[0]))
            in_flight[request_id[0]] += 100
        assert offer("b", 2.5 + step) is Outcome.RATE_LIMITED
    assert in_flight == {"a": 600, "b": 400}
    assert len(queue) == 0


@pytest.mark.parametrize("first", ["a", "b", "alternate"])
def test_admission_two_flooding_teams_each_hold_their_guaranteed_share(
    first: str,
) -> None:
    """GIVEN teams a (60%) and b (40%) each offering 3 requests per step, forever,
    WHEN one request completes per step and the queue is pumped THEN, once the
    pool has turned over, each team always holds its share in flight or queued at
    the front, its queued requests run at the next pump, and 429s only happen on a
    full pool to a team at or above its share."""
    queue = AdmissionQueue(max_queue=16)
    shares = {"a": 0.6, "b": 0.4}
    flight: deque[str] = deque()
    in_flight = {"a": 0, "b": 0}
    queued_at: dict[str, int] = {}
    rate_limited = {"a": 0, "b": 0}
    n = 0

    def state() -> PoolState:
        return PoolState(CAP, sum(in_flight.values()), dict(in_flight))

    def start(request_id: str) -> None:
        flight.append(request_id)
        in_flight[request_id[0]] += 100

    for step in range(120):
        if flight:
            in_flight[flight.popleft()[0]] -= 100
        pumped = queue.pump(state(), float(step))
        assert pumped.shed == ()
        for request_id in pumped.admitted:
            if step >= 10:
                assert step - queued_at[request_id] == 1
            start(request_id)
        if first == "alternate":
            order = ["a", "b"] if step % 2 else ["b", "a"]
        else:
            order = [first, "b" if first == "a" else "a"]
        for team in order:
            for _ in range(3):
                n += 1
                c = cand(f"{team}{n}", STD, team=team, share=shares[team], at=step)
                before = state()
                verdict, shed = queue.offer(c, before, float(step))
                assert shed == ()
                if verdict.outcome is Outcome.ADMIT:
                    start(c.request_id)
                elif verdict.outcome is Outcome.QUEUE:
                    queued_at[c.request_id] = step
                else:
                    assert verdict.outcome is Outcome.RATE_LIMITED
                    queued = sum(w.tokens for w in queue.waiting() if w.team == team)
                    assert before.in_flight + c.tokens > CAP
                    assert before.team_in_flight[team] + queued + c.tokens > (
                        shares[team] * CAP
                    )
                    rate_limited[team] += 1
        if step >= 10:
            for team, share in shares.items():
                queued = sum(w.tokens for w in queue.waiting() if w.team == team)
                assert in_flight[team] + queued >= share * CAP
                assert in_flight[team] <= share * CAP + 100  # one request of burst
    assert rate_limited["a"] > 0
    assert rate_limited["b"] > 0


# --- validation ---------------------------------------------------------------------


def test_admission_request_larger_than_the_pool_is_a_clear_400() -> None:
    queue = AdmissionQueue()
    assert outcome(queue, cand("fits", STD, tokens=CAP), IDLE) is Outcome.ADMIT
    with pytest.raises(ChargeTooLarge, match="1001 tokens"):
        queue.offer(cand("huge", STD, tokens=CAP + 1), IDLE, 0.0)
    assert len(queue) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_queue": -1},
        {"max_wait_s": -0.1},
        {"batch_ceiling": 0.0},
        {"batch_ceiling": 1.5},
        {"batch_lane": 0.0},
        {"batch_lane": 1.01},
        {"drain_tokens_per_s": 0.0},
        {"drain_tokens_per_s": float("inf")},
    ],
)
def test_admission_queue_rejects_invalid_settings(kwargs: QueueSettings) -> None:
    with pytest.raises(ValueError):
        AdmissionQueue(**kwargs)


@pytest.mark.parametrize("kwargs", [{"tokens": -1}, {"share": -0.1}, {"share": 1.1}])
def test_admission_candidate_rejects_invalid_values(kwargs: CandidateValues) -> None:
    with pytest.raises(ValueError):
        cand("r", STD, **kwargs)


@pytest.mark.parametrize(
    ("capacity", "in_flight", "batch_in_flight"),
    [(0, 0, 0), (-5, 0, 0), (100, -1, 0), (100, 0, -1)],
)
def test_admission_pool_state_rejects_invalid_values(
    capacity: int, in_flight: int, batch_in_flight: int
) -> None:
    with pytest.raises(ValueError):
        PoolState(
            capacity=capacity,
            in_flight=in_flight,
            team_in_flight={},
            batch_in_flight=batch_in_flight,
        )
