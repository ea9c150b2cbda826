"""Admission in the gateway: the pure sequence driven over the live stores.

Public surface: ``Admission`` (the seam the gateway calls), ``LiveAdmission``,
``LivePoolView``, ``pool_key``, ``team_key``.

The sequence itself (charge and slot, tiered queue, give back) is
``routing.domain.admission_control.AdmissionControl``, shared with the fleet
simulator. This module performs its effects: bucket charges and slots on a
``LimitStore`` (Redis, shared by a region's gateways, falling back to this
process's share in memory while Redis is away: ``routing.failover``; or memory),
queue waits on futures resolved by a pump that runs while anything waits (every
``pump_interval_s``, and whenever an answer ends here).

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
from dataclasses import replace
from typing import Protocol

from engine_nodes.domain.load_shares import (
    admitted_key,
    batch_key,
    pool_key,
    queue_depth_key,
    queue_tokens_key,
    team_key,
)
from models_registry.domain.capacity import CapacityRecord, pool_capacity_tokens
from routing.domain.admission import Outcome, PoolState, Verdict
from routing.domain.admission_control import (
    AdmissionControl,
    AdmissionRequest,
    ChargeAndAcquire,
    Effect,
    RefundAndRelease,
    ShedWaiting,
    Ticket,
    WaitInQueue,
)
from routing.domain.limit_table import Claim
from routing.domain.snapshot import ConfigSnapshot
from routing.domain.tiers import Tier
from routing.limiter_store import LimitStore
from routing.live import LiveLoad
from routing.region_limits import RegionLimits

logger = logging.getLogger(__name__)

__all__ = ["Admission", "LiveAdmission", "LivePoolView", "pool_key", "team_key"]


class Admission(Protocol):
    """Decides whether (and when) a request may go to a replica."""

    async def admit(self, request: AdmissionRequest) -> Ticket:
        """Admit ``request`` or raise ``Rejected``; may wait in the pool's queue."""
        ...

    async def release(self, ticket: Ticket, *, used_tokens: int) -> None:
        """Give back what ``ticket`` took, refunding all but ``used_tokens``; once."""
        ...


class LivePoolView:
    """Pools as this region's gateways see them: the snapshot plus live load.

    A pool's capacity is its serving replicas (heard from recently, not ejected
    here) times the version's load-tested tokens in flight, or
    ``default_replica_tokens_in_flight`` where no load test has run. While Redis is
    unreachable this process cannot see the others' load, and judges its pools at
    its part of that capacity (``LiveLoad.pool_divisor``).
    """

    def __init__(
        self,
        *,
        snapshot: Callable[[], ConfigSnapshot | None],
        live: LiveLoad,
        default_replica_tokens_in_flight: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.snapshot = snapshot
        self.live = live
        self.default_replica_tokens_in_flight = default_replica_tokens_in_flight
        self.clock = clock

    def capacity(self, model: str, version: str) -> int:
        """Return the tokens in flight the pool can hold now (0 without replicas)."""
        snapshot = self.snapshot()
        if snapshot is None:
            return 0
        record = snapshot.versions.get((model, version))
        measured = record.load_test_tokens_in_flight if record is not None else None
        serving = len(self.live.nodes(snapshot, model, version, self.clock()))
        # A figure of 0 is no measurement: keep the pool usable on the default.
        capacity = CapacityRecord(tokens_per_s=None, tokens_in_flight=measured or None)
        total = pool_capacity_tokens(
            serving, capacity, self.default_replica_tokens_in_flight
        )
        return total // self.live.pool_divisor

    def state(self, model: str, version: str) -> PoolState | None:
        """Return the pool's load over all gateways; None while it has no capacity."""
        capacity = self.capacity(model, version)
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
            batch_in_flight=live.tokens_in_flight(batch_key(model, version)),
        )

    def take(
        self, model: str, version: str, team: str, tokens: int, tier: Tier
    ) -> None:
        """Count admitted tokens into the pool and the team's share (this process),
        the batch tier's into the batch lane's, and all into the pool's cumulative
        count (an embedding pool's autoscaler measures its input tokens/s by it)."""
        self.live.add(pool_key(model, version), tokens)
        self.live.add(team_key(model, version, team), tokens)
        self.live.add(admitted_key(model, version), tokens)
        if tier == Tier.BATCH:
            self.live.add(batch_key(model, version), tokens)

    def give_back(
        self, model: str, version: str, team: str, tokens: int, tier: Tier
    ) -> None:
        """Take an ended request's tokens out of the pool, the team's share and,
        for the batch tier, the batch lane's."""
        self.live.remove(pool_key(model, version), tokens)
        self.live.remove(team_key(model, version, team), tokens)
        if tier == Tier.BATCH:
            self.live.remove(batch_key(model, version), tokens)


class LiveAdmission:
    """Token buckets, concurrency caps and per-pool tiered queues, live."""

    def __init__(
        self,
        *,
        control: AdmissionControl,
        limits: LimitStore,
        pump_interval_s: float = 0.05,
        clock: Callable[[], float] = time.time,
        live: LiveLoad | None = None,
        region_limits: RegionLimits | None = None,
    ) -> None:
        self.control = control
        # This region's shares of teams' limits, and the demand noted for them.
        self.region_limits = region_limits
        # Charge and slot are taken (and given back) together: one round trip each.
        self.limits = limits
        self.pump_interval_s = pump_interval_s
        self.clock = clock
        # Where each pool's queue is published (this process's live-load share),
        # so the autoscaler sees queued tokens and requests over every gateway.
        self.live = live
        self._waiters: dict[str, asyncio.Future[Verdict]] = {}
        self._pumps: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def admit(self, request: AdmissionRequest) -> Ticket:
        """Admit ``request`` or raise ``Rejected``; may wait in the pool's queue."""
        if self.region_limits is not None:
            key = request.limit_key
            self.region_limits.note(key, request.charge_tokens)
            request = replace(request, region_share=self.region_limits.share(key))
        steps = self.control.admit(request, secrets.token_hex(8), self.clock())
        reply: Claim | Verdict | None = None
        error: BaseException | None = None
        queued: tuple[str, str] | None = None  # the pool whose queue it waited in
        try:
            while True:
                try:
                    effect = steps.send(reply) if error is None else steps.throw(error)
                except StopIteration as done:
                    return done.value
                reply, error = None, None
                if isinstance(effect, WaitInQueue):
                    queued = effect.pool
                    self._publish_queue(queued)
                try:
                    reply = await self._perform(effect)
                except BaseException as exc:
                    # Handed to the sequence (a cancelled wait, a refused charge),
                    # which gives back what it took and raises it again.
                    error = exc
        finally:
            if queued is not None:
                self._publish_queue(queued)

    async def release(self, ticket: Ticket, *, used_tokens: int) -> None:
        """Give back what ``ticket`` took, refunding all but ``used_tokens``; once."""
        refund = self.control.release(ticket, used_tokens=used_tokens)
        if refund is None:
            return
        try:
            await self._perform(refund)
        finally:
            request = ticket.request
            self.pump((request.model, request.version))

    def pump(self, pool: tuple[str, str]) -> None:
        """Run the pool's queue once and wake whom it admitted or shed."""
        pumped = self.control.pump(pool, self.clock())
        for admission_id in pumped.admitted:
            self._wake(admission_id, Verdict(Outcome.ADMIT))
        for admission_id, retry_after_s in pumped.shed:
            self._wake(admission_id, Verdict(Outcome.SHED, retry_after_s))

    async def _perform(self, effect: Effect) -> Claim | Verdict | None:
        if isinstance(effect, ChargeAndAcquire):
            return await self.limits.charge_and_acquire(
                effect.key,
                capacity=effect.capacity,
                refill_per_s=effect.refill_per_s,
                amount=effect.amount,
                limit=effect.limit,
                request_id=effect.request_id,
                now=self.clock(),
            )
        if isinstance(effect, RefundAndRelease):
            await self.limits.refund_and_release(
                effect.key,
                capacity=effect.capacity,
                refill_per_s=effect.refill_per_s,
                amount=effect.amount,
                request_id=effect.request_id,
                now=self.clock(),
            )
            return None
        if isinstance(effect, ShedWaiting):
            for admission_id, retry_after_s in effect.shed:
                self._wake(admission_id, Verdict(Outcome.SHED, retry_after_s))
            return None
        return await self._wait(effect)

    async def _wait(self, effect: WaitInQueue) -> Verdict:
        future: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._waiters[effect.admission_id] = future
        self._ensure_pump(effect.pool)
        try:
            return await future
        finally:
            self._waiters.pop(effect.admission_id, None)

    def _wake(self, admission_id: str, verdict: Verdict) -> None:
        future = self._waiters.pop(admission_id, None)
        if future is not None and not future.done():
            future.set_result(verdict)

    def _ensure_pump(self, pool: tuple[str, str]) -> None:
        task = self._pumps.get(pool)
        if task is None or task.done():
            self._pumps[pool] = asyncio.get_running_loop().create_task(
                self._pump_loop(pool)
            )

    async def _pump_loop(self, pool: tuple[str, str]) -> None:
        """Admit queued requests as capacity frees (here or in other gateways)."""
        while self.control.queued(pool):
            self.pump(pool)
            if not self.control.queued(pool):
                return
            await asyncio.sleep(self.pump_interval_s)

    def _publish_queue(self, pool: tuple[str, str]) -> None:
        """Set the pool's waiting tokens and requests in this process's share.

        Called when a request enters the queue and when its admission ends
        (admitted, shed, refused or abandoned), so the figures stay exact; the
        once-a-second exchange carries them to the other processes and the
        autoscaler.
        """
        if self.live is None:
            return
        model, version = pool
        control = self.control
        self.live.put(queue_tokens_key(model, version), control.queued_tokens(pool))
        self.live.put(queue_depth_key(model, version), control.queued(pool))
