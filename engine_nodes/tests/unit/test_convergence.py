"""Convergence to a pool's target: start, cancel unready, drain one at a time."""

from __future__ import annotations

import pytest

from engine_nodes.domain.convergence import (
    CancelReplica,
    Convergence,
    DrainReplica,
    Effect,
    ReplicaView,
    StartReplica,
    Step,
    Steps,
    converge,
    converge_steps,
)


def view(
    replica_id: str,
    state: str = "serving",
    tokens: int = 0,
    created_at: float = 0.0,
    *,
    is_silent: bool = False,
) -> ReplicaView:
    return ReplicaView(replica_id, state, tokens, created_at, is_silent=is_silent)


def test_converge_starts_what_the_pool_lacks_counting_unready_replicas() -> None:
    pool = [view("a"), view("b", "starting"), view("c", "loading")]
    assert converge(3, pool) == Convergence(Step.CONVERGED)
    assert converge(5, pool) == Convergence(Step.START, start=2)


def test_converge_does_not_count_draining_or_gone_replicas() -> None:
    pool = [view("a"), view("b", "draining"), view("c", "gone")]
    assert converge(2, pool) == Convergence(Step.START, start=1)


def test_converge_drains_only_the_least_loaded_serving_replica() -> None:
    pool = [view("a", tokens=900), view("b", tokens=100), view("c", tokens=500)]
    assert converge(1, pool) == Convergence(Step.DRAIN, drain=("b",))


def test_converge_breaks_load_ties_toward_the_newest() -> None:
    pool = [view("old", created_at=1.0), view("new", created_at=2.0)]
    assert converge(1, pool).drain == ("new",)


def test_converge_waits_while_one_replica_of_the_pool_drains() -> None:
    pool = [view("a"), view("b"), view("c", "draining")]
    assert converge(1, pool) == Convergence(Step.WAIT_DRAINING)


def test_converge_shrinks_three_to_one_one_drain_at_a_time() -> None:
    """GIVEN three serving replicas and a target of one
    WHEN each drained replica is removed before the next reconcile
    THEN exactly one replica drains at a time, and two drains bring the pool to one.
    """
    pool = {r: view(r, tokens=t) for r, t in (("a", 30), ("b", 10), ("c", 20))}
    drained = []
    for _ in range(4):
        plan = converge(1, list(pool.values()))
        if plan.step == Step.CONVERGED:
            break
        assert plan.step == Step.DRAIN
        assert len(plan.drain) == 1
        (replica_id,) = plan.drain
        pool[replica_id] = view(replica_id, "draining")
        # Nothing else drains meanwhile (the pool waits, or is at target already).
        assert converge(1, list(pool.values())).drain == ()
        del pool[replica_id]  # its streams finished; it stopped
        drained.append(replica_id)
    assert drained == ["b", "c"]
    assert list(pool) == ["a"]


def test_converge_cancels_unready_replicas_first_all_at_once() -> None:
    pool = [
        view("s1"),
        view("s2"),
        view("load-old", "loading", created_at=1.0),
        view("load-new", "loading", created_at=2.0),
        view("start", "starting", created_at=0.5),
    ]
    assert converge(3, pool) == Convergence(Step.CANCEL, drain=("start", "load-new"))
    assert converge(1, pool) == Convergence(
        Step.CANCEL, drain=("start", "load-new", "load-old")
    )


def test_converge_drains_no_serving_replica_unless_others_make_the_target() -> None:
    # One serving replica is silent (dead, not yet reaped): the healthy one stays.
    pool = [view("healthy"), view("dead", is_silent=True)]
    assert converge(1, pool) == Convergence(Step.WAIT_SERVING)


def test_converge_drains_a_stalled_replica_before_a_serving_one() -> None:
    pool = [view("a"), view("stuck", "stalled", tokens=5000)]
    assert converge(1, pool) == Convergence(Step.DRAIN, drain=("stuck",))


def test_converge_refuses_a_negative_target() -> None:
    with pytest.raises(ValueError, match="target"):
        converge(-1, [])


def drive(steps: Steps, answers: list[bool]) -> tuple[list[Effect], Convergence]:
    """Answer each effect in turn (True once ``answers`` run out)."""
    effects: list[Effect] = []
    answer: bool | None = None
    while True:
        try:
            effect = next(steps) if answer is None else steps.send(answer)
        except StopIteration as done:
            return effects, done.value
        effects.append(effect)
        answer = answers.pop(0) if answers else True


def test_converge_steps_start_until_the_driver_has_no_room() -> None:
    effects, plan = drive(converge_steps(5, [view("a")]), [True, False])
    assert plan == Convergence(Step.START, start=4)
    assert effects == [StartReplica(), StartReplica()]  # stopped at the refusal


def test_converge_steps_cancel_every_unready_surplus_then_drain_one() -> None:
    pool = [view("a"), view("b", "starting", created_at=2), view("c", "loading")]
    effects, _ = drive(converge_steps(1, pool), [])
    assert effects == [CancelReplica("b"), CancelReplica("c")]
    effects, plan = drive(converge_steps(1, [view("a"), view("b", tokens=5)]), [])
    assert effects == [DrainReplica("a")]
    assert plan.step == Step.DRAIN


def test_converge_steps_yield_nothing_while_one_drains() -> None:
    pool = [view("a"), view("b"), view("c", "draining")]
    effects, plan = drive(converge_steps(1, pool), [])
    assert (effects, plan.step) == ([], Step.WAIT_DRAINING)
