"""The stall rule: a replica holding requests whose engine stopped moving."""

from __future__ import annotations

from engine_nodes.domain.progress import Progress, is_stalled, observe_progress
from engine_nodes.domain.scrape import EngineStats

STALL_AFTER_S = 5.0


def stats(
    *, generated: int, running: int = 1, waiting: int = 0, kv: float = 0.1
) -> EngineStats:
    return EngineStats(
        num_requests_running=running,
        num_requests_waiting=waiting,
        kv_cache_usage_perc=kv,
        num_gpu_blocks=1000,
        block_size=16,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        generation_tokens=generated,
    )


def watch(scrapes: list[tuple[float, EngineStats]]) -> list[bool]:
    """Observe each (time, scrape) in turn; return whether it is stalled after each."""
    progress: Progress | None = None
    verdicts = []
    for now, scrape in scrapes:
        progress = observe_progress(progress, scrape, now)
        verdicts.append(is_stalled(progress, now, STALL_AFTER_S))
    return verdicts


def test_a_flat_counter_with_a_running_request_is_a_stall_after_the_window() -> None:
    flat = stats(generated=40)
    assert watch([(0.0, flat), (4.9, flat), (5.0, flat), (9.0, flat)]) == [
        False,
        False,
        True,
        True,
    ]


def test_the_window_starts_at_the_last_move() -> None:
    assert watch(
        [
            (0.0, stats(generated=10)),
            (3.0, stats(generated=12)),  # moved at 3 s
            (7.9, stats(generated=12)),
            (8.0, stats(generated=12)),
        ]
    ) == [False, False, False, True]


def test_a_stalled_replica_serves_again_once_its_counter_moves() -> None:
    flat = stats(generated=40)
    assert watch([(0.0, flat), (6.0, flat), (7.0, stats(generated=41))]) == [
        False,
        True,
        False,
    ]


def test_an_idle_replica_is_never_stalled_however_long_it_stays_flat() -> None:
    idle = stats(generated=40, running=0, kv=0.0)
    assert watch([(0.0, idle), (60.0, idle), (600.0, idle)]) == [False] * 3


def test_a_stalled_replica_that_drains_its_requests_serves_again() -> None:
    """A hung engine cannot take the aborts of the clients that left: one whose
    requests are gone is alive, even though it generated nothing meanwhile."""
    flat = stats(generated=40)
    assert watch([(0.0, flat), (6.0, flat), (7.0, stats(generated=40, running=0))]) == [
        False,
        True,
        False,
    ]


def test_waiting_requests_with_a_flat_engine_are_a_stall() -> None:
    queued = stats(generated=0, running=0, waiting=3, kv=0.0)
    assert watch([(0.0, queued), (5.0, queued)]) == [False, True]


def test_a_long_prefill_that_takes_kv_blocks_is_not_a_stall() -> None:
    """GIVEN one long prompt prefilling in chunks (no token generated for 12 s)
    THEN its KV use grows with every chunk, so the replica is not stalled."""
    scrapes = [
        (float(t), stats(generated=100, kv=0.01 * (t + 1))) for t in range(0, 13, 2)
    ]
    assert watch(scrapes) == [False] * len(scrapes)


def test_new_requests_on_a_flat_engine_count_as_movement() -> None:
    # The gauges are the engine's: a count that changed was changed by a step.
    assert watch(
        [
            (0.0, stats(generated=5, running=1)),
            (4.0, stats(generated=5, running=2)),
            (8.0, stats(generated=5, running=2)),
            (9.0, stats(generated=5, running=2)),
        ]
    ) == [False, False, False, True]
