"""Tiered admission for one pool: who runs now, who waits, and who is told to retry.

Public surface: ``Outcome``, ``Candidate``, ``Verdict``, ``PoolState``, ``Pumped``,
``AdmissionQueue``.

The gateway keeps one ``AdmissionQueue`` per pool. It calls ``offer`` for every
request that passed its team's token bucket, ``pump`` whenever tokens in flight go
down (an answer ended) or on a short tick, and ``cancel`` when a queued client
disconnects. ``PoolState`` is the pool as the gateway sees it now (tokens in
flight on every gateway); after an ``ADMIT`` the caller adds the request's tokens
to it. The queue never reads a clock; ``now`` comes in.

Rules, in the order the seed gives them (batch pauses first, then teams above
their guaranteed share get a 429, then standard requests queue; interactive
traffic inside a guarantee is never shed):

1. The pool is *full* for a request when ``in_flight + tokens > capacity``.
2. A team is *inside its guarantee* when
   ``team_in_flight[team] + queued + tokens <= guaranteed_share * capacity``,
   where ``queued`` is the team's interactive and standard tokens already waiting
   in this queue. Counting them stops a team inside its share from queueing
   without bound (its interactive requests are never shed); batch tokens are not
   counted, so a team's batch backlog never costs its interactive traffic the
   guarantee. The class is fixed when the request is queued.
3. Queue order: tier (interactive, standard, batch), then inside-guarantee before
   outside, then FIFO by ``arrived_at`` (ties in offer order). That is six
   classes, each a deque.
4. ``offer``: a request that is not full and has nothing queued ahead of it
   (nothing in its own class or a class before it in rule 3) is ``ADMIT``-ted,
   even beyond its team's share: a team may burst into idle capacity.
5. Batch runs only on idle capacity: it is admitted only when
   ``in_flight + tokens <= batch_ceiling * capacity`` and no interactive or
   standard request is queued (rule 4 implies the second part); otherwise it waits
   (``QUEUE``). Batch is never rate limited here; it waits or is shed.
   The *batch lane* bounds batch on its own, whatever the interactive load:
   ``batch_in_flight + tokens <= batch_lane * capacity``, where
   ``batch_in_flight`` is the batch tier's tokens in flight in the pool. It stands
   in for the per-priority KV ceiling that real engines lack (vLLM orders by
   priority but lets a running batch sequence share every step): fewer batch
   sequences per replica. It cannot reach the batch prefill inside an engine
   step, which is what holds interactive latency (``docs/fleet-simulator.md``,
   the batch drill on real vLLM). A batch request may always run while no batch
   is in flight, so a lane narrower than one request never starves the tier.
6. When the pool is full, an interactive or standard request from a team outside
   its guarantee gets ``RATE_LIMITED`` (429) with a Retry-After and is not
   queued; one inside its guarantee is queued (interactive ahead of standard).
   A request that is not full but has something queued ahead of it is queued,
   whatever its share: 429s happen only while the pool is full.
7. Queue bound: while more than ``max_queue`` requests wait, the one that would be
   admitted last among the sheddable is ``SHED`` (503) with a Retry-After: the
   lowest tier present (batch, then standard, then interactive outside its
   guarantee), outside-guarantee before inside within a tier, newest first within
   a class. That may be the newcomer itself (its verdict is then ``SHED``); the
   others come back from ``offer`` as ``(request_id, retry_after_s)``. Interactive
   requests inside their guarantee are never shed: if only they wait, the queue
   may grow past ``max_queue`` (rule 2 bounds each team's part of it).
8. ``pump`` first sheds every request that has waited longer than ``max_wait_s``
   (``now - arrived_at > max_wait_s``), except interactive inside its guarantee,
   then admits from the head of the queue while the head fits: under
   ``capacity`` for interactive and standard, under ``batch_ceiling * capacity``
   and inside the batch lane for batch. It stops at the first head that does not
   fit (strict order, no overtaking), and counts the tokens it admits toward
   ``in_flight`` (and batch's toward ``batch_in_flight``) for the heads after
   them. Team shares are not rechecked in ``pump``.
9. Retry-After, for 429 and 503 alike, is whole seconds, at least 1:
   ``ceil((in_flight + queued_tokens + tokens - capacity) / drain_tokens_per_s)``,
   the time for the pool to drain enough to fit this request behind everything
   still queued (``queued_tokens`` excludes the request itself). The drain rate
   is an assumption passed to the constructor; by default ``capacity / 10`` per
   second (a full pool turns over in ten seconds). The gateway adds client jitter.
10. A request larger than the whole pool (``tokens > capacity``) could never be
    admitted, so ``offer`` raises ``ChargeTooLarge`` (a 400) instead.

Cost: ``offer``, ``cancel`` and each request admitted or shed by ``pump`` are O(1)
amortised (six deques; cancel marks the entry dead and the deques are compacted
when dead entries outnumber live ones). Only a request offered with an
``arrived_at`` older than its class's newest pays a scan to keep FIFO order. Not
thread-safe: one queue per pool per event loop.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from routing.domain.limiter import ChargeTooLarge
from routing.domain.tiers import Tier

__all__ = [
    "AdmissionQueue",
    "Candidate",
    "Outcome",
    "PoolState",
    "Pumped",
    "Verdict",
]

_CLASSES = 6  # (tier rank) x (inside, outside its guarantee); see rule 3
_FIRST_BATCH_CLASS = 2 * Tier.BATCH.rank
_FIRST_SHEDDABLE_CLASS = 1  # class 0, interactive inside its guarantee, is never shed
_TOLERANCE = 1e-9  # float slack: 0.57 * 100 is 56.99999999999999
_COMPACT_MIN_DEAD = 64


class Outcome(enum.StrEnum):
    """What happens to a request now."""

    ADMIT = "admit"
    QUEUE = "queue"
    RATE_LIMITED = "rate_limited"  # 429: the team is above its guaranteed share
    SHED = "shed"  # 503: the queue is over its bound or the wait was too long


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request asking for room in the pool; ``tokens`` is prompt plus max_tokens."""

    request_id: str
    team: str
    tier: Tier
    tokens: int
    guaranteed_share: float
    arrived_at: float

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError("tokens must be zero or more")
        if not 0.0 <= self.guaranteed_share <= 1.0:
            raise ValueError("guaranteed_share must be between 0 and 1")


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome for one request; ``retry_after_s`` is set for 429 and 503."""

    outcome: Outcome
    retry_after_s: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PoolState:
    """Tokens in flight in this pool now (all gateways): in total, per team, and
    the batch tier's part of the total (the batch lane's, rule 5)."""

    capacity: int
    in_flight: int
    team_in_flight: Mapping[str, int]
    batch_in_flight: int = 0

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError("capacity must be a positive number of tokens")
        if self.in_flight < 0 or self.batch_in_flight < 0:
            raise ValueError("in_flight and batch_in_flight must be zero or more")


@dataclass(frozen=True, slots=True)
class Pumped:
    """What one ``pump`` did: ids admitted in order, and (id, retry_after_s) shed."""

    admitted: tuple[str, ...]
    shed: tuple[tuple[str, int], ...]


class _Entry:
    __slots__ = ("candidate", "is_live", "key")

    def __init__(self, candidate: Candidate, key: int) -> None:
        self.candidate = candidate
        self.key = key
        self.is_live = True


class AdmissionQueue:
    """Admit, queue, rate-limit or shed requests for one pool (see the module rules).

    Invariants: every live entry is in exactly one class deque and in ``_by_id``;
    ``len(self)``, ``_live``, ``_queued_tokens`` and ``_team_queued`` count live
    entries only; dead (cancelled) entries stay in the deques until popped or
    compacted.
    """

    __slots__ = (
        "_by_id",
        "_classes",
        "_count",
        "_dead",
        "_live",
        "_queued_tokens",
        "_team_queued",
        "batch_ceiling",
        "batch_lane",
        "drain_tokens_per_s",
        "max_queue",
        "max_wait_s",
    )

    def __init__(
        self,
        *,
        max_queue: int = 256,
        max_wait_s: float = 10.0,
        batch_ceiling: float = 1.0,
        batch_lane: float = 1.0,
        drain_tokens_per_s: float | None = None,
    ) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be zero or more")
        if not max_wait_s >= 0:
            raise ValueError("max_wait_s must be zero or more")
        if not 0.0 < batch_ceiling <= 1.0:
            raise ValueError("batch_ceiling must be in (0, 1]")
        if not 0.0 < batch_lane <= 1.0:
            raise ValueError("batch_lane must be in (0, 1]")
        if drain_tokens_per_s is not None and not (
            drain_tokens_per_s > 0 and math.isfinite(drain_tokens_per_s)
        ):
            raise ValueError("drain_tokens_per_s must be a positive number")
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.batch_ceiling = batch_ceiling
        self.batch_lane = batch_lane
        self.drain_tokens_per_s = drain_tokens_per_s
        self._classes: tuple[deque[_Entry], ...] = tuple(
            deque() for _ in range(_CLASSES)
        )
        self._live = [0] * _CLASSES
        self._count = 0
        self._dead = 0
        self._by_id: dict[str, _Entry] = {}
        self._queued_tokens = 0
        # Interactive and standard tokens queued per team (rule 2); no zero entries.
        self._team_queued: dict[str, int] = {}

    def __len__(self) -> int:
        return self._count

    @property
    def queued_tokens(self) -> int:
        """Return the tokens of the live entries (what waits, in tokens)."""
        return self._queued_tokens

    def offer(
        self, c: Candidate, pool: PoolState, now: float
    ) -> tuple[Verdict, tuple[tuple[str, int], ...]]:
        """Return the verdict for ``c`` and the queued requests shed to make room.

        ``now`` is the time of the offer; waits are measured from
        ``c.arrived_at`` and expire only in ``pump``.

        Raises:
            ChargeTooLarge: ``c.tokens > pool.capacity`` (rule 10).
            ValueError: ``c.request_id`` is already queued.
        """
        if c.request_id in self._by_id:
            raise ValueError(f"request {c.request_id!r} is already queued")
        capacity = pool.capacity
        tokens = c.tokens
        if tokens > capacity:
            raise ChargeTooLarge(tokens, capacity, unit="tokens in flight in the pool")
        share_used = (
            pool.team_in_flight.get(c.team, 0)
            + self._team_queued.get(c.team, 0)
            + tokens
        )
        is_inside = share_used <= c.guaranteed_share * capacity + (
            _TOLERANCE * capacity
        )
        key = 2 * c.tier.rank + (0 if is_inside else 1)
        is_batch = key >= _FIRST_BATCH_CLASS
        is_full = pool.in_flight + tokens > capacity
        has_ahead = any(self._live[: key + 1])
        if not is_full and not has_ahead:
            if not is_batch or self._batch_fits(
                pool.in_flight, pool.batch_in_flight, tokens, capacity
            ):
                return Verdict(Outcome.ADMIT), ()
            reason = "batch_waits_for_idle_capacity"
        elif is_full and not is_batch and not is_inside:
            retry_after_s = self._retry_after(pool.in_flight, tokens, capacity)
            return Verdict(Outcome.RATE_LIMITED, retry_after_s, "over_share"), ()
        else:
            reason = "pool_full" if is_full else "queued_behind"
        entry = _Entry(c, key)
        self._push(entry)
        verdict = Verdict(Outcome.QUEUE, reason=reason)
        shed: list[tuple[str, int]] = []
        while self._count > self.max_queue:
            victim = self._pop_victim()
            if victim is None:
                break  # only interactive requests inside their guarantee wait
            retry_after_s = self._retry_after(
                pool.in_flight, victim.candidate.tokens, capacity
            )
            if victim is entry:
                verdict = Verdict(Outcome.SHED, retry_after_s, "queue_full")
            else:
                shed.append((victim.candidate.request_id, retry_after_s))
        return verdict, tuple(shed)

    def pump(self, pool: PoolState, now: float) -> Pumped:
        """Shed requests that waited too long, then admit queued heads that fit."""
        capacity = pool.capacity
        in_flight = pool.in_flight
        classes = self._classes
        live = self._live
        shed: list[tuple[str, int]] = []
        for key in range(_FIRST_SHEDDABLE_CLASS, _CLASSES):
            queue = classes[key]
            while live[key]:
                entry = queue[0]
                if not entry.is_live:
                    queue.popleft()
                    self._dead -= 1
                    continue
                if now - entry.candidate.arrived_at <= self.max_wait_s:
                    break  # FIFO by arrived_at: the rest of this class waited less
                queue.popleft()
                self._forget(entry)
                shed.append(
                    (
                        entry.candidate.request_id,
                        self._retry_after(in_flight, entry.candidate.tokens, capacity),
                    )
                )
        admitted: list[str] = []
        batch_in_flight = pool.batch_in_flight
        for key in range(_CLASSES):
            queue = classes[key]
            is_batch = key >= _FIRST_BATCH_CLASS
            while live[key]:
                entry = queue[0]
                if not entry.is_live:
                    queue.popleft()
                    self._dead -= 1
                    continue
                tokens = entry.candidate.tokens
                if not (
                    self._batch_fits(in_flight, batch_in_flight, tokens, capacity)
                    if is_batch
                    else in_flight + tokens <= capacity
                ):
                    # Strict order: a head that does not fit blocks everything
                    # behind it, so small requests cannot starve a large one.
                    return Pumped(tuple(admitted), tuple(shed))
                queue.popleft()
                self._forget(entry)
                in_flight += tokens
                if is_batch:
                    batch_in_flight += tokens
                admitted.append(entry.candidate.request_id)
        return Pumped(tuple(admitted), tuple(shed))

    def cancel(self, request_id: str) -> bool:
        """Drop a queued request (its client gave up); False if it was not queued."""
        entry = self._by_id.get(request_id)
        if entry is None:
            return False
        self._forget(entry)
        self._dead += 1
        if self._dead >= _COMPACT_MIN_DEAD and self._dead > self._count:
            self._compact()
        return True

    def waiting(self) -> list[Candidate]:
        """Return the queued requests in admission order."""
        return [
            entry.candidate
            for queue in self._classes
            for entry in queue
            if entry.is_live
        ]

    def _push(self, entry: _Entry) -> None:
        queue = self._classes[entry.key]
        arrived_at = entry.candidate.arrived_at
        if not queue or queue[-1].candidate.arrived_at <= arrived_at:
            queue.append(entry)
        else:
            # Rare: an older arrival offered late. Keep FIFO by arrived_at.
            index = len(queue)
            while index > 0 and queue[index - 1].candidate.arrived_at > arrived_at:
                index -= 1
            queue.insert(index, entry)
        c = entry.candidate
        self._live[entry.key] += 1
        self._count += 1
        self._by_id[c.request_id] = entry
        self._queued_tokens += c.tokens
        if entry.key < _FIRST_BATCH_CLASS:
            self._team_queued[c.team] = self._team_queued.get(c.team, 0) + c.tokens

    def _forget(self, entry: _Entry) -> None:
        """Mark a live entry gone and uncount it; the caller handles its deque slot."""
        c = entry.candidate
        entry.is_live = False
        self._live[entry.key] -= 1
        self._count -= 1
        del self._by_id[c.request_id]
        self._queued_tokens -= c.tokens
        if entry.key < _FIRST_BATCH_CLASS:
            left = self._team_queued[c.team] - c.tokens
            if left:
                self._team_queued[c.team] = left
            else:
                del self._team_queued[c.team]

    def _pop_victim(self) -> _Entry | None:
        """Remove and return the sheddable entry that would be admitted last."""
        for key in range(_CLASSES - 1, _FIRST_SHEDDABLE_CLASS - 1, -1):
            if not self._live[key]:
                continue
            queue = self._classes[key]
            entry = queue.pop()
            while not entry.is_live:
                self._dead -= 1
                entry = queue.pop()
            self._forget(entry)
            return entry
        return None

    def _compact(self) -> None:
        for queue in self._classes:
            kept = [entry for entry in queue if entry.is_live]
            queue.clear()
            queue.extend(kept)
        self._dead = 0

    def _batch_fits(
        self, in_flight: int, batch_in_flight: int, tokens: int, capacity: int
    ) -> bool:
        """Whether a batch request of ``tokens`` fits under the ceiling and in the
        lane (rule 5); the lane always lets one in while no batch is in flight."""
        if in_flight + tokens > self.batch_ceiling * capacity:
            return False
        return (
            batch_in_flight == 0
            or batch_in_flight + tokens <= self.batch_lane * capacity
        )

    def _retry_after(self, in_flight: int, tokens: int, capacity: int) -> int:
        """Whole seconds until the pool could fit ``tokens`` behind the queue (rule 9)."""
        drain = self.drain_tokens_per_s or capacity / 10
        excess = in_flight + self._queued_tokens + tokens - capacity
        return max(1, math.ceil(excess / drain - _TOLERANCE))
