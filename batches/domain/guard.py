"""The batch guard: how much of a replica batch lines may use, so that the batch tier
fills idle capacity without queuing in front of interactive prefill.

Public surface: ``BatchGuard``, ``batch_prefill_budget``, ``batch_fits_kv``,
``pick_preempted``, ``batch_window_share``, ``guarded_send``.

Three ceilings, each a pure decision the fleet simulator's replica
(``drills.domain.replica``) and the batch runner drive alike:

The ceilings bind the requests of engine priority ``guarded_rank`` and below
(by default standard and batch: a batch job the scheduler raised to the standard
tier for its deadline stays inside them); interactive requests are never held.

- **Prefill tokens per step** (``batch_prefill_budget``): a step spends at most
  ``prefill_tokens`` of its chunked-prefill budget on batch prompts, and at most
  ``prefill_beside_interactive`` when it also prefills an interactive prompt. An
  interactive first token comes at the end of the step that finishes its prompt,
  and every batch prefill token in that step (0.07 ms each on an A100) delays it;
  a short batch step also bounds how long a prompt arriving mid-step waits.
- **KV use** (``batch_fits_kv``): batch requests together hold at most
  ``kv_share`` of the replica's KV cache; a batch line that would pass it waits
  in the engine's queue behind every interactive one. Each running batch
  sequence also costs every step its KV read and its share of the batch, so the
  ceiling is also the most batch work an interactive step carries.
- **Preemption** (``pick_preempted``): vLLM's priority policy preempts the
  lowest-priority, latest-arrived running request when a higher one needs its
  blocks or its sequence slot: the batch request's KV is freed and it is
  recomputed later.

And one ahead of the engine: **the interactive forecast** (``batch_window_share``).
The autoscaler's Holt trend of the pool's interactive demand
(``models_registry.domain.warm_nodes.Trend``) is projected ``horizon_s`` ahead; the
share of its window a batch job may keep in flight falls from 1 at
``backoff_from`` of the pool's capacity to 0 at ``backoff_to``, so batch backs
off before the morning ramp arrives rather than when it is already queued behind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from models_registry.domain.warm_nodes import Trend

__all__ = [
    "BATCH_RANK",
    "BatchGuard",
    "batch_fits_kv",
    "batch_prefill_budget",
    "batch_window_share",
    "guarded_send",
    "pick_preempted",
]

# The batch tier's engine priority (``routing.domain.tiers``: interactive 0,
# standard 1, batch 2; lower first).
BATCH_RANK = 2


@dataclass(frozen=True, slots=True)
class BatchGuard:
    """The guard's knobs (``PLATFORM_BATCH_GUARD_*`` settings live)."""

    kv_share: float = 0.05
    prefill_tokens: int = 256
    prefill_beside_interactive: int = 0
    horizon_s: float = 360.0
    level_s: float = 60.0
    slope_s: float = 300.0
    # The plan's fleet is sized for a region's loss, so on a normal day its peak
    # holds about 0.3 of its capacity in flight (the batch drill: 14 replicas,
    # the seed's load): batch backs off from there (at 0.45-0.6 it ran through
    # the peak at interactive p95 x1.06-1.08 of the day without batch).
    backoff_from: float = 0.3
    backoff_to: float = 0.45
    # The share of its window a job raised to standard for its deadline keeps
    # however high the forecast: 0 holds raised jobs back as any other (deadlines
    # inside the peak miss), 1 exempts them (interactive p95 pays; see
    # docs/fleet-simulator.md for the measured trade-off).
    raised_share: float = 0.0
    # The engine priorities the ceilings bind: this rank and below (1: standard
    # and batch, so a batch job raised to standard for its deadline stays in the
    # lane; 2: batch only).
    guarded_rank: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_share <= 1.0:
            raise ValueError("kv_share must be in [0, 1]")
        # At least one: a replica holding only batch prompts must still prefill.
        if self.prefill_tokens < 1 or self.prefill_beside_interactive < 0:
            raise ValueError(
                "need prefill_tokens >= 1, prefill_beside_interactive >= 0"
            )
        if min(self.horizon_s, self.level_s, self.slope_s) <= 0:
            raise ValueError("horizon_s, level_s and slope_s must be positive")
        if not 0.0 <= self.backoff_from < self.backoff_to:
            raise ValueError("need 0 <= backoff_from < backoff_to")
        if not 0.0 <= self.raised_share <= 1.0:
            raise ValueError("raised_share must be in [0, 1]")
        if self.guarded_rank not in (1, BATCH_RANK):
            raise ValueError(f"guarded_rank is 1 or {BATCH_RANK}")

    def is_guarded(self, rank: int) -> bool:
        """Whether the ceilings bind a request of engine priority ``rank``."""
        return rank >= self.guarded_rank


def batch_prefill_budget(
    guard: BatchGuard, *, budget: int, has_interactive_prefill: bool
) -> int:
    """Return the prefill tokens batch prompts may take of a step's ``budget`` left
    (after the higher tiers' chunks)."""
    cap = (
        guard.prefill_beside_interactive
        if has_interactive_prefill
        else guard.prefill_tokens
    )
    return max(0, min(budget, cap))


def batch_fits_kv(
    guard: BatchGuard, *, batch_tokens: int, need_tokens: int, capacity_tokens: int
) -> bool:
    """Whether a batch request needing ``need_tokens`` of KV may start beside the
    ``batch_tokens`` batch already holds. One batch request may always run on a
    replica that holds no other (a ceiling never starves batch outright)."""
    if batch_tokens == 0:
        return guard.kv_share > 0
    return batch_tokens + need_tokens <= guard.kv_share * capacity_tokens


def pick_preempted(rank: int, running: Sequence[tuple[int, float]]) -> int | None:
    """Return the index in ``running`` ((rank, arrival) each) of the request a
    waiting request of ``rank`` preempts: the lowest priority (highest rank),
    latest arrival, strictly below ``rank``'s priority; None when there is none."""
    best: int | None = None
    for index, (other, arrived) in enumerate(running):
        if other <= rank:
            continue
        if best is None or (other, arrived) > running[best]:
            best = index
    return best


def batch_window_share(guard: BatchGuard, trend: Trend | None) -> float:
    """Return the share (0 to 1) of its window a batch job may keep in flight, from
    the interactive demand's trend (a share of the pool's capacity) projected
    ``horizon_s`` ahead; no trend yet: all of it."""
    if trend is None:
        return 1.0
    # The higher of now and the projection: a falling trend frees batch only
    # once the load has fallen, a rising one holds it back before.
    load = max(trend.level, trend.forecast(guard.horizon_s))
    span = guard.backoff_to - guard.backoff_from
    return min(1.0, max(0.0, (guard.backoff_to - load) / span))


def guarded_send(
    send: int, *, window: int, in_flight: int, share: float, floor: float = 0.0
) -> int:
    """Return how many of the ``send`` lines a job's plan wants to send now may go,
    with only ``share`` of its ``window`` allowed in flight (the forecast's
    back-off; the lines already in flight finish), but never less than ``floor``
    of it (``BatchGuard.raised_share`` for a job raised for its deadline: the
    engine's ceilings on batch KV and prefill still bound its lines)."""
    share = max(share, floor)
    if share >= 1.0:
        return send
    allowed = math.floor(share * window)
    return min(send, max(0, allowed - in_flight))
