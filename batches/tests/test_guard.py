"""The batch guard's pure decisions (``batches.domain.guard``): explicit inputs,
no database."""

from __future__ import annotations

import pytest

from batches.domain.guard import (
    BatchGuard,
    batch_fits_kv,
    batch_prefill_budget,
    batch_window_share,
    guarded_send,
    pick_preempted,
)
from models_registry.domain.warm_nodes import Trend

GUARD = BatchGuard(
    kv_share=0.1,
    prefill_tokens=256,
    prefill_beside_interactive=32,
    horizon_s=300.0,
    backoff_from=0.4,
    backoff_to=0.6,
)


def test_batch_prefill_budget_shrinks_beside_an_interactive_prompt() -> None:
    assert (
        batch_prefill_budget(GUARD, budget=2000, has_interactive_prefill=False) == 256
    )
    assert batch_prefill_budget(GUARD, budget=2000, has_interactive_prefill=True) == 32
    # Never more than the step has left.
    assert batch_prefill_budget(GUARD, budget=100, has_interactive_prefill=False) == 100
    assert batch_prefill_budget(GUARD, budget=-5, has_interactive_prefill=True) == 0


def test_batch_fits_kv_holds_batch_under_its_share() -> None:
    fits = [
        batch_fits_kv(GUARD, batch_tokens=held, need_tokens=500, capacity_tokens=10_000)
        for held in (0, 400, 500, 501, 900)
    ]
    assert fits == [True, True, True, False, False]
    # One request always runs on a replica where batch holds nothing...
    assert batch_fits_kv(GUARD, batch_tokens=0, need_tokens=5000, capacity_tokens=1000)
    # ...unless the share is zero: no batch at all.
    off = BatchGuard(kv_share=0.0)
    assert not batch_fits_kv(off, batch_tokens=0, need_tokens=1, capacity_tokens=1000)


def test_pick_preempted_takes_the_lowest_priority_latest_arrival() -> None:
    running = [(0, 1.0), (2, 3.0), (1, 9.0), (2, 5.0), (2, 4.0)]
    assert pick_preempted(0, running) == 3  # batch, arrived last
    assert pick_preempted(1, running) == 3
    # Nothing ranks below batch; nothing preempts its own rank.
    assert pick_preempted(2, running) is None
    assert pick_preempted(0, [(0, 1.0), (0, 2.0)]) is None
    assert pick_preempted(0, [(1, 1.0), (1, 2.0)]) == 1


def test_batch_window_share_backs_off_before_the_ramp() -> None:
    assert batch_window_share(GUARD, None) == 1.0
    flat = Trend(at=0.0, level=0.3, slope=0.0)
    assert batch_window_share(GUARD, flat) == 1.0
    # Level 0.3 now, rising 0.1 every 100 s: 0.6 expected 300 s ahead.
    rising = Trend(at=0.0, level=0.3, slope=0.001)
    assert batch_window_share(GUARD, rising) == pytest.approx(0.0)
    halfway = Trend(at=0.0, level=0.2, slope=0.001)  # 0.5 ahead
    assert batch_window_share(GUARD, halfway) == pytest.approx(0.5)
    # Falling: held back by the level now, not the projection.
    falling = Trend(at=0.0, level=0.55, slope=-0.001)
    assert batch_window_share(GUARD, falling) == pytest.approx(0.25)


def test_guarded_send_keeps_a_share_of_the_window_and_a_raised_jobs_floor() -> None:
    assert guarded_send(10, window=20, in_flight=0, share=1.0) == 10
    assert guarded_send(10, window=20, in_flight=3, share=0.25) == 2  # 5 - 3
    assert guarded_send(10, window=20, in_flight=6, share=0.25) == 0  # in flight go on
    assert guarded_send(10, window=20, in_flight=0, share=0.0) == 0
    # Raised to standard for its deadline: it keeps its floor of the window.
    assert guarded_send(10, window=20, in_flight=2, share=0.0, floor=0.25) == 3
    assert guarded_send(10, window=20, in_flight=0, share=0.0, floor=1.0) == 10


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_share": 1.5},
        {"prefill_tokens": 0},
        {"prefill_beside_interactive": -1},
        {"horizon_s": 0.0},
        {"backoff_from": 0.7, "backoff_to": 0.6},
        {"guarded_rank": 0},
    ],
)
def test_batch_guard_refuses_bad_knobs(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BatchGuard(**kwargs)  # type: ignore[arg-type]


def test_batch_guard_binds_standard_and_batch_by_default() -> None:
    assert [BatchGuard().is_guarded(rank) for rank in (0, 1, 2)] == [False, True, True]
    only_batch = BatchGuard(guarded_rank=2)
    assert [only_batch.is_guarded(rank) for rank in (0, 1, 2)] == [False, False, True]
