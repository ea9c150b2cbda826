"""Whether a replica's engine is making progress: the node agent's stall rule.

Public surface: ``Progress``, ``observe_progress``, ``is_stalled``.

An engine that holds requests changes something every step (tens of milliseconds):
it generates tokens (``vllm:generation_tokens_total``), and its gauges of running
and waiting requests and of KV-cache use move as prefill chunks, new requests and
finished ones come and go. vLLM publishes all of them from the engine with each
step, so a hung engine (a GPU stuck in a kernel, an engine core that stopped behind
a live API server) freezes them all, while ``/health`` still answers 200 and no
stream gets a byte.

The rule: a replica that holds requests (running or waiting) and whose figures
have all stayed the same for ``stall_after_s`` is stalled; it is serving again as
soon as one of them moves, or once it holds no requests (a hung engine can do
neither: it cannot even take the aborts of the clients that left). Counting the
gauges as well as the generated tokens keeps a long prompt's prefill, which
generates no token for seconds but takes KV blocks with every chunk, from looking
like a stall.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_nodes.domain.scrape import EngineStats

__all__ = ["Progress", "is_stalled", "observe_progress"]


@dataclass(frozen=True, slots=True)
class Progress:
    """A replica's figures at its last scrape, and since when they are unchanged.

    ``figures`` are (generated tokens, running, waiting, KV-cache use);
    ``unchanged_since`` is when they last moved while the replica held requests,
    on the caller's clock, or None when it held none.
    """

    figures: tuple[int, int, int, float]
    unchanged_since: float | None


def observe_progress(
    previous: Progress | None, stats: EngineStats, now: float
) -> Progress:
    """Return what a fresh scrape ``stats`` taken at ``now`` says after ``previous``.

    Only fresh scrapes may be observed: a reused one shows the same figures.
    """
    figures = (
        stats.generation_tokens,
        stats.num_requests_running,
        stats.num_requests_waiting,
        stats.kv_cache_usage_perc,
    )
    if stats.num_requests_running + stats.num_requests_waiting == 0:
        return Progress(figures, None)
    if (
        previous is not None
        and previous.figures == figures
        and previous.unchanged_since is not None
    ):
        return Progress(figures, previous.unchanged_since)
    return Progress(figures, now)


def is_stalled(progress: Progress | None, now: float, stall_after_s: float) -> bool:
    """Return True when the replica held requests and moved none for
    ``stall_after_s`` seconds up to ``now``."""
    return (
        progress is not None
        and progress.unchanged_since is not None
        and now - progress.unchanged_since >= stall_after_s
    )
