"""Team limits and priority tiers at the gateway's admission seam (seed steps 6 and 10).

Public surface: ``TieredAdmission``.

For each request, in this order:
1. the team's token bucket on the model is charged ``prompt_tokens + max_tokens``
   (a charge larger than the whole bucket is a 400; an empty bucket a 429 with the
   seconds until it could hold the request);
2. the team's streams in flight on the model are capped by ``max_concurrency`` (429);
3. the pool's tiered admission decides: admit, queue (interactive ahead of standard;
   batch only on idle capacity), 429 for a team above its guaranteed share while the
   pool is full, or 503 when the queue sheds the lowest tier.
Whatever was taken is given back when the answer ends: the unused part of the
charge is refunded, the concurrency slot freed, the pool's tokens released.

Steps 1 and 2 are one call to the limit store (one Redis round trip), and so is
giving both back: a request refused by its concurrency cap leaves the bucket as it
was, and one refused by its bucket never holds a slot.

Pool and team tokens in flight are shared by the gateway processes of a region
through ``LiveLoad`` (this process exact, the others as of the last second), so a
pool's fullness is judged over all gateways within a second.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from routing.admission import AdmissionRequest, Rejected, Ticket
from routing.domain.admission import AdmissionQueue, Candidate, Outcome, PoolState
from routing.domain.limiter import ChargeTooLarge, rate_limit_headers
from routing.domain.snapshot import LimitRecord
from routing.domain.tiers import Tier
from routing.limiter_store import BucketStore, ConcurrencyStore
from routing.live import LiveLoad

logger = logging.getLogger(__name__)


def pool_key(model: str, version: str) -> str:
    """Return the live-load key of a pool's admitted tokens."""
    return f"p|{model}|{version}"


def team_key(model: str, version: str, team: str) -> str:
    """Return the live-load key of a team's admitted tokens in a pool."""
    return f"t|{model}|{version}|{team}"


@dataclass(slots=True)
class _Ticket:
    """An admitted request: what it took, to give back exactly once."""

    owner: TieredAdmission
    request: AdmissionRequest
    limit: LimitRecord
    request_id: str
    charged: int
    headers: dict[str, str] = field(default_factory=dict)
    released: bool = False

    async def release(self, *, used_tokens: int) -> None:
        if self.released:
            return
        self.released = True
        await self.owner._give_back(self, used_tokens=used_tokens)


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[tuple[Outcome, int]]
    candidate: Candidate


class TieredAdmission:
    """Token buckets, concurrency caps and per-pool tiered queues."""

    def __init__(
        self,
        *,
        live: LiveLoad,
        buckets: BucketStore,
        concurrency: ConcurrencyStore,
        capacity_of: Callable[[str, str], int],
        max_queue: int = 256,
        max_wait_s: float = 10.0,
        batch_ceiling: float = 1.0,
        pump_interval_s: float = 0.05,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.live = live
        self.buckets = buckets
        self.concurrency = concurrency
        # Charge and slot are taken (and given back) together: one round trip each.
        self.limits = buckets.pair(concurrency)
        self.capacity_of = capacity_of
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.batch_ceiling = batch_ceiling
        self.pump_interval_s = pump_interval_s
        self.clock = clock
        self._queues: dict[tuple[str, str], AdmissionQueue] = {}
        self._waiters: dict[str, _Waiter] = {}
        self._pumps: dict[tuple[str, str], asyncio.Task[None]] = {}

    # -- admission ------------------------------------------------------------------------

    async def admit(self, request: AdmissionRequest) -> Ticket:
        """Admit ``request`` or raise ``Rejected``; may wait in the pool's queue."""
        limit = request.limit
        if limit is None:
            raise Rejected(
                403,
                "no limits for this team and model",
                retry_after_s=0,
                code="model_not_allowed",
            )
        now = self.clock()
        amount = request.charge_tokens
        key = f"{request.team}:{request.model}"
        rate = limit.tokens_per_minute / 60.0
        request_id = secrets.token_hex(8)
        try:
            claim = await self.limits.charge_and_acquire(
                key,
                capacity=limit.tokens_per_minute,
                refill_per_s=rate,
                amount=amount,
                limit=limit.max_concurrency,
                request_id=request_id,
                now=now,
            )
        except ChargeTooLarge:
            raise Rejected(
                400,
                f"this request needs {amount} tokens (prompt + max_tokens) but the "
                f"team's limit is {limit.tokens_per_minute} tokens per minute; lower "
                "max_tokens",
                retry_after_s=0,
                code="request_exceeds_token_limit",
            ) from None
        charge = claim.charge
        headers = rate_limit_headers(charge)
        if not charge.allowed:
            raise Rejected(
                429,
                f"team {request.team!r} is over its token limit on {request.model} "
                f"({limit.tokens_per_minute} tokens per minute)",
                retry_after_s=charge.retry_after_s,
                code="rate_limit_exceeded",
                headers=headers,
            )
        if not claim.has_slot:
            # Nothing was charged: the headers show the bucket as it stands.
            raise Rejected(
                429,
                f"team {request.team!r} already has {limit.max_concurrency} streams "
                f"in flight on {request.model}",
                retry_after_s=1,
                code="concurrency_limit_exceeded",
                headers=headers,
            )
        try:
            await self._enter_pool(request, request_id, limit.guaranteed_share, now)
        except BaseException:
            # Refused by the pool, or the client left while queued.
            await self.limits.refund_and_release(
                key,
                capacity=limit.tokens_per_minute,
                refill_per_s=rate,
                amount=amount,
                request_id=request_id,
                now=self.clock(),
            )
            raise
        return _Ticket(
            owner=self,
            request=request,
            limit=limit,
            request_id=request_id,
            charged=amount,
            headers=headers,
        )

    async def _enter_pool(
        self, request: AdmissionRequest, request_id: str, share: float, now: float
    ) -> None:
        pool = (request.model, request.version)
        queue = self._queue(pool)
        candidate = Candidate(
            request_id=request_id,
            team=request.team,
            tier=request.tier,
            tokens=request.charge_tokens,
            guaranteed_share=share,
            arrived_at=now,
        )
        state = self._pool_state(pool)
        if state is None:
            # No serving replica: routing answers 503 with Retry-After.
            self._take(request, request.charge_tokens)
            return
        try:
            verdict, shed = queue.offer(candidate, state, now)
        except ChargeTooLarge:
            raise Rejected(
                400,
                f"this request needs {candidate.tokens} tokens in flight, more than the "
                f"whole {request.model} pool holds ({state.capacity}); lower max_tokens",
                retry_after_s=0,
                code="request_exceeds_pool_capacity",
            ) from None
        self._shed(shed)
        if verdict.outcome == Outcome.ADMIT:
            self._take(request, request.charge_tokens)
            return
        if verdict.outcome == Outcome.RATE_LIMITED:
            raise Rejected(
                429,
                f"the {request.model} pool is full and team {request.team!r} is above "
                "its guaranteed share",
                retry_after_s=verdict.retry_after_s,
                code="over_guaranteed_share",
            )
        if verdict.outcome == Outcome.SHED:
            raise Rejected(
                503,
                f"the {request.model} pool is overloaded; {request.tier} requests are "
                "being shed",
                retry_after_s=verdict.retry_after_s,
                code="pool_overloaded",
            )
        # QUEUE: wait until a pump admits or sheds it (or the client goes away).
        waiter = _Waiter(
            future=asyncio.get_running_loop().create_future(), candidate=candidate
        )
        self._waiters[request_id] = waiter
        self._ensure_pump(pool)
        try:
            outcome, retry_after = await waiter.future
        except asyncio.CancelledError:
            queue.cancel(request_id)
            self._waiters.pop(request_id, None)
            raise
        if outcome == Outcome.ADMIT:
            # The pump already counted its tokens into the pool.
            return
        raise Rejected(
            503,
            f"the {request.model} pool is overloaded; the request waited and was shed",
            retry_after_s=retry_after,
            code="pool_overloaded",
        )

    def _queue(self, pool: tuple[str, str]) -> AdmissionQueue:
        queue = self._queues.get(pool)
        if queue is None:
            queue = self._queues[pool] = AdmissionQueue(
                max_queue=self.max_queue,
                max_wait_s=self.max_wait_s,
                batch_ceiling=self.batch_ceiling,
            )
        return queue

    def _pool_state(self, pool: tuple[str, str]) -> PoolState | None:
        """Return the pool's load over all gateways; None while it has no capacity."""
        model, version = pool
        capacity = self.capacity_of(model, version)
        if capacity <= 0:
            return None
        live = self.live
        prefix = f"t|{model}|{version}|"
        teams: dict[str, int] = {}
        for source in (live.own, live.others):
            for key, tokens in source.items():
                if key.startswith(prefix):
                    team = key[len(prefix) :]
                    teams[team] = teams.get(team, 0) + tokens
        return PoolState(
            capacity=capacity,
            in_flight=live.tokens_in_flight(pool_key(model, version)),
            team_in_flight=teams,
        )

    def _take(self, request: AdmissionRequest, tokens: int) -> None:
        self.live.add(pool_key(request.model, request.version), tokens)
        self.live.add(team_key(request.model, request.version, request.team), tokens)

    def _shed(self, shed: Any) -> None:
        for request_id, retry_after in shed:
            waiter = self._waiters.pop(request_id, None)
            if waiter is not None and not waiter.future.done():
                waiter.future.set_result((Outcome.SHED, retry_after))

    def _ensure_pump(self, pool: tuple[str, str]) -> None:
        task = self._pumps.get(pool)
        if task is None or task.done():
            self._pumps[pool] = asyncio.get_running_loop().create_task(
                self._pump_loop(pool)
            )

    async def _pump_loop(self, pool: tuple[str, str]) -> None:
        """Admit queued requests as capacity frees (here or in other gateways)."""
        queue = self._queues[pool]
        while len(queue):
            self.pump(pool)
            if not len(queue):
                return
            await asyncio.sleep(self.pump_interval_s)

    def pump(self, pool: tuple[str, str]) -> None:
        """Run the pool's queue once: admit what fits, shed what waited too long."""
        queue = self._queues.get(pool)
        if queue is None or not len(queue):
            return
        state = self._pool_state(pool)
        if state is None:
            return
        pumped = queue.pump(state, self.clock())
        for request_id in pumped.admitted:
            waiter = self._waiters.pop(request_id, None)
            if waiter is None or waiter.future.done():
                continue
            candidate = waiter.candidate
            self.live.add(pool_key(*pool), candidate.tokens)
            self.live.add(team_key(*pool, candidate.team), candidate.tokens)
            waiter.future.set_result((Outcome.ADMIT, 0))
        self._shed(pumped.shed)

    # -- giving back -------------------------------------------------------------------------

    async def _give_back(self, ticket: _Ticket, *, used_tokens: int) -> None:
        request = ticket.request
        limit = ticket.limit
        pool = (request.model, request.version)
        self.live.remove(pool_key(*pool), ticket.charged)
        self.live.remove(team_key(*pool, request.team), ticket.charged)
        try:
            await self.limits.refund_and_release(
                f"{request.team}:{request.model}",
                capacity=limit.tokens_per_minute,
                refill_per_s=limit.tokens_per_minute / 60.0,
                amount=max(0, ticket.charged - max(0, used_tokens)),
                request_id=ticket.request_id,
                now=self.clock(),
            )
        finally:
            self.pump(pool)


__all__ = ["Tier", "TieredAdmission", "pool_key", "team_key"]
