"""The regions' shares of one team's limit (routing.domain.region_shares)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.domain.region_shares import (
    BEAT_KEY,
    DemandRow,
    PublishDemand,
    ReadDemand,
    ShareOptions,
    WriteShares,
    demand_slot,
    demand_slot_key,
    region_shares,
    regional_limits,
    share_tick,
    shares_key,
)

NOW = 1_000_000.0
STALE_S = 6.0
FLOOR = 0.05


def shares(
    heard_at: dict[str, float],
    demand: dict[str, float],
    own: str = "east",
    floor: float = FLOOR,
) -> dict[str, float]:
    return region_shares(
        own_region=own,
        heard_at=heard_at,
        demand=demand,
        now=NOW,
        floor=floor,
        stale_after_s=STALE_S,
    )


def test_region_shares_alone_takes_whole_limit() -> None:
    assert shares({}, {"east": 10}) == {"east": 1.0}
    assert shares({"east": NOW}, {}) == {"east": 1.0}


def test_region_shares_follow_demand_above_floor() -> None:
    got = shares({"east": NOW, "west": NOW}, {"east": 300, "west": 100})
    assert got["east"] == pytest.approx(0.05 + 0.9 * 0.75)
    assert got["west"] == pytest.approx(0.05 + 0.9 * 0.25)
    assert sum(got.values()) == pytest.approx(1.0)


def test_region_shares_one_region_team_gets_95_percent() -> None:
    got = shares({"east": NOW, "west": NOW}, {"east": 5_000})
    assert got == {"east": pytest.approx(0.95), "west": pytest.approx(0.05)}
    # From the quiet region's side: the same vector.
    assert shares({"east": NOW, "west": NOW}, {"east": 5_000}, own="west") == got


def test_region_shares_split_equally_without_demand() -> None:
    assert shares({"east": NOW, "west": NOW}, {}) == {"east": 0.5, "west": 0.5}


def test_region_shares_stale_region_goes_to_survivor() -> None:
    heard = {"east": NOW - 1, "west": NOW - STALE_S - 0.001}
    assert shares(heard, {"east": 1, "west": 1_000_000}) == {"east": 1.0}


def test_region_shares_own_region_live_even_if_its_row_is_old() -> None:
    heard = {"east": NOW - 100, "west": NOW}
    got = shares(heard, {"west": 10})
    assert set(got) == {"east", "west"}


def test_region_shares_stale_bound_is_inclusive() -> None:
    heard = {"east": NOW, "west": NOW - STALE_S}
    assert set(shares(heard, {})) == {"east", "west"}


def test_region_shares_floor_never_above_equal_split() -> None:
    heard = {r: NOW for r in ("a", "b", "c")}
    got = shares(heard, {"a": 5}, own="a", floor=0.9)
    assert got == {"a": pytest.approx(1 / 3), "b": 1 / 3, "c": 1 / 3}


def test_region_shares_ignore_bad_demand() -> None:
    got = shares({"east": NOW, "west": NOW}, {"east": -5, "west": math.nan})
    assert got == {"east": 0.5, "west": 0.5}


@pytest.mark.parametrize(
    ("floor", "stale"), [(-0.1, 1.0), (1.1, 1.0), (0.1, 0.0), (0.1, -1.0)]
)
def test_region_shares_refuse_bad_settings(floor: float, stale: float) -> None:
    with pytest.raises(ValueError):
        region_shares(
            own_region="a",
            heard_at={},
            demand={},
            now=NOW,
            floor=floor,
            stale_after_s=stale,
        )


regions = st.sampled_from(["r0", "r1", "r2", "r3"])


@given(
    heard=st.dictionaries(regions, st.floats(NOW - 20, NOW + 1)),
    demand=st.dictionaries(regions, st.floats(0, 1e12)),
    own=regions,
    floor=st.floats(0, 0.5),
)
def test_region_shares_properties(
    heard: dict[str, float], demand: dict[str, float], own: str, floor: float
) -> None:
    got = shares(heard, demand, own=own, floor=floor)
    live = {own} | {r for r, at in heard.items() if NOW - at <= STALE_S}
    # Only live regions, the own one always; the whole limit and no more.
    assert set(got) == live
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-9)
    assert sum(got.values()) <= 1.0 + 1e-9
    # Each live region keeps its floor (at most an equal split).
    for share in got.values():
        assert share >= min(floor, 1 / len(live)) - 1e-12
    # A region without demand gets its floor, no more, when others ask.
    if any(demand.get(r, 0) > 0 for r in live):
        for region in live:
            if demand.get(region, 0) == 0:
                assert got[region] == pytest.approx(min(floor, 1 / len(live)))


@given(
    heard=st.dictionaries(regions, st.floats(NOW - 20, NOW + 1)),
    tokens=st.floats(1, 1e12),
    own=regions,
)
def test_region_shares_one_region_team_keeps_all_but_the_floors(
    heard: dict[str, float], tokens: float, own: str
) -> None:
    got = shares(heard, {own: tokens}, own=own)
    assert got[own] >= 1 - FLOOR * (len(got) - 1) - 1e-12
    if len(got) <= 2:
        assert got[own] >= 0.95 - 1e-12


def test_regional_limits_whole_share_unchanged() -> None:
    got = regional_limits(
        tokens_per_minute=6_000, max_concurrency=4, share=1.0, amount=100
    )
    assert (got.capacity, got.refill_per_s, got.max_concurrency) == (6_000, 100.0, 4)


def test_regional_limits_scale_bucket_rate_and_cap() -> None:
    got = regional_limits(
        tokens_per_minute=6_000, max_concurrency=10, share=0.25, amount=100
    )
    assert got.capacity == 1_500
    assert got.refill_per_s == pytest.approx(25.0)
    assert got.max_concurrency == 2


def test_regional_limits_hold_one_whole_request_and_one_slot() -> None:
    got = regional_limits(
        tokens_per_minute=6_000, max_concurrency=3, share=0.05, amount=4_000
    )
    assert got.capacity == 4_000
    assert got.max_concurrency == 1
    # Never more than the team's limit: a bigger charge stays a 400.
    big = regional_limits(
        tokens_per_minute=6_000, max_concurrency=3, share=0.05, amount=9_000
    )
    assert big.capacity == 6_000


@given(
    tpm=st.integers(1, 10**9),
    conc=st.integers(1, 10_000),
    share=st.floats(0, 1),
    amount=st.integers(0, 10**9),
)
def test_regional_limits_properties(
    tpm: int, conc: int, share: float, amount: int
) -> None:
    got = regional_limits(
        tokens_per_minute=tpm, max_concurrency=conc, share=share, amount=amount
    )
    assert 1 <= got.capacity <= tpm
    assert got.capacity >= min(amount, tpm)
    assert got.refill_per_s > 0
    assert got.refill_per_s <= tpm / 60.0 + 1e-9
    assert 1 <= got.max_concurrency <= conc


def test_demand_slots_and_keys() -> None:
    assert demand_slot(19.9, 5.0) == 3
    assert demand_slot(20.0, 5.0) == 4
    assert demand_slot_key("p", 4) == "p:limit-demand:4"
    assert shares_key("p") == "p:limit-shares"


def test_share_tick_reads_publishes_then_writes_the_shares() -> None:
    options = ShareOptions(window_s=30.0, slot_s=5.0, floor=0.05, stale_after_s=6.0)
    tick = share_tick(region="east", now=NOW, options=options)

    read = next(tick)
    assert read == ReadDemand(first_slot=199_994, last_slot=200_000)
    publish = tick.send({"a:m": 300})
    assert publish == PublishDemand(region="east", demand={"a:m": 300}, heard_at=NOW)
    write = tick.send(
        [
            DemandRow("east", BEAT_KEY, 0, NOW),
            DemandRow("east", "a:m", 300, NOW),
            DemandRow("west", BEAT_KEY, 0, NOW - 1),
            DemandRow("west", "a:m", 100, NOW - 1),
            DemandRow("west", "b:m", 50, NOW - 1),
            # A key whose row went stale in a live region counts as no demand.
            DemandRow("west", "c:m", 50, NOW - 7),
        ]
    )
    assert isinstance(write, WriteShares)
    with pytest.raises(StopIteration) as done:
        tick.send(None)
    assert done.value.value == write.shares
    assert write.shares == {
        "a:m": pytest.approx(0.05 + 0.9 * 0.75),
        "b:m": pytest.approx(0.05),
        "*": 0.5,
    }


def test_share_tick_without_a_live_peer_takes_everything() -> None:
    tick = share_tick(region="east", now=NOW, options=ShareOptions())
    next(tick)
    tick.send({})
    write = tick.send([DemandRow("west", BEAT_KEY, 0, NOW - 60)])
    assert isinstance(write, WriteShares)
    assert write.shares == {"*": 1.0}
