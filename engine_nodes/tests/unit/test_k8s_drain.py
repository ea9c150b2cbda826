"""The pure scale-down policy of a pool's Deployment and its in-memory interpreter."""

from __future__ import annotations

from engine_nodes.domain.k8s_drain import (
    DRAINED_COST,
    AnnotatePod,
    InMemoryPool,
    MarkDraining,
    MarkServing,
    PodView,
    PoolFacts,
    Scale,
    Step,
    decide,
    drain_steps,
)
from engine_nodes.domain.liveness import ReplicaState


def facts(replicas: int, target: int, *pods: PodView, now: float = 100.0) -> PoolFacts:
    return PoolFacts(
        replicas=replicas, target=target, pods=pods, now=now, drain_timeout_s=60
    )


def pod(
    name: str,
    *,
    streams: int | None = 0,
    created_at: float = 0.0,
    is_ready: bool = True,
    draining_since: float | None = None,
) -> PodView:
    return PodView(
        pod=name,
        replica_id=name,
        state=ReplicaState.SERVING if draining_since is None else ReplicaState.DRAINING,
        streams=streams,
        created_at=created_at,
        is_ready=is_ready,
        draining_since=draining_since,
    )


def effects(pool: PoolFacts) -> list[object]:
    steps = drain_steps(pool)
    done: list[object] = [next(steps, None)]
    while done[-1] is not None:
        try:
            done.append(steps.send(True))
        except StopIteration:
            break
    return [e for e in done if e is not None]


def test_drain_scales_up_directly() -> None:
    assert effects(facts(1, 3, pod("a"))) == [Scale(3)]


def test_drain_chooses_the_fewest_streams_then_the_chosen() -> None:
    pool = facts(
        3,
        2,
        pod("a", streams=2, created_at=1),
        pod("b", streams=1, created_at=2),
        pod("c", streams=1, created_at=3),
    )
    assert effects(pool) == [MarkDraining("c", "c", at=100.0)]


def test_drain_unknown_streams_count_as_many() -> None:
    pool = facts(2, 1, pod("a", streams=None, created_at=9), pod("b", streams=5))
    assert decide(pool).pod == "b"


def test_drain_waits_for_streams_then_annotates_before_scaling() -> None:
    busy = facts(2, 1, pod("a"), pod("b", streams=1, draining_since=90.0))
    assert decide(busy).step == Step.WAIT_DRAINING
    assert effects(busy) == []
    idle = facts(2, 1, pod("a"), pod("b", streams=0, draining_since=90.0))
    assert effects(idle) == [AnnotatePod("b", DRAINED_COST), Scale(1)]


def test_drain_deadline_removes_a_replica_that_still_streams() -> None:
    late = facts(2, 1, pod("a"), pod("b", streams=3, draining_since=40.0))
    assert decide(late).step == Step.REMOVE_DRAINED


def test_drain_unready_pod_goes_without_a_drain() -> None:
    pool = facts(3, 2, pod("a"), pod("b"), pod("c", is_ready=False))
    assert effects(pool) == [Scale(2)]


def test_drain_waits_while_the_controller_has_a_pod_to_remove() -> None:
    pool = facts(1, 1, pod("a"), pod("b", draining_since=10.0))
    assert decide(pool).step == Step.WAIT_TERMINATING


def test_drain_target_risen_again_undrains() -> None:
    pool = facts(2, 2, pod("a"), pod("b", draining_since=90.0))
    assert effects(pool) == [AnnotatePod("b", 0), MarkServing("b", "b")]


def test_drain_replica_marked_but_not_stamped_is_stamped_first() -> None:
    marked = PodView(pod="b", replica_id="b", state=ReplicaState.DRAINING, streams=9)
    assert effects(facts(2, 1, pod("a"), marked)) == [MarkDraining("b", "b", at=100.0)]
    assert decide(facts(2, 2, pod("a"), marked)).step == Step.UNDRAIN


def test_drain_never_leaves_the_pool_short_of_serving_replicas() -> None:
    stalled_free = facts(2, 2, pod("a"), pod("b"))
    assert decide(stalled_free).step == Step.CONVERGED
    assert decide(facts(1, 0, pod("a"))).step == Step.MARK_DRAINING


def test_in_memory_pool_removes_the_drained_pod_and_cuts_no_stream() -> None:
    """GIVEN three pods, the oldest with the fewest streams (one, which finishes
    before the deadline)
    WHEN the target falls to two
    THEN that pod drains, and it alone is removed once its stream ended, though
    the controller alone would have removed the chosen."""
    pool = InMemoryPool(replicas=3)
    chosen = pool.add_pod(now=1.0, streams=1)
    pool.add_pod(now=2.0, streams=4)
    pool.add_pod(now=3.0, streams=2)

    def tick(now: float) -> Step:
        steps = drain_steps(pool.facts(target=2, now=now, drain_timeout_s=60))
        return pool.run(steps, now=now).step

    assert tick(10) == Step.MARK_DRAINING
    assert pool.pods[chosen].state == ReplicaState.DRAINING
    assert tick(11) == Step.WAIT_DRAINING
    assert pool.replicas == 3
    pool.set_streams(chosen, 0)
    assert tick(12) == Step.REMOVE_DRAINED
    assert pool.removed == [chosen]
    assert pool.cut == {}
    assert tick(13) == Step.CONVERGED
