"""The admission sequence of one request, written once for the gateway and the simulator.

Public surface: ``AdmissionRequest``, ``AdmissionOptions``, ``Ticket``, ``Rejected``,
``PoolView``, ``AdmissionControl``, ``Steps``, and the effects ``ChargeAndAcquire``,
``RefundAndRelease``, ``WaitInQueue`` and ``ShedWaiting``.

For each request, in this order (seed steps 6 and 10):

1. the team's token bucket on the model is charged ``prompt_tokens + max_tokens``
   and one of the team's ``max_concurrency`` slots is taken, both or neither (a
   charge larger than the whole bucket is a 400, with the bucket's rate-limit
   headers read by a charge of nothing; an empty bucket or no free slot a 429,
   with nothing held);
2. the pool's tiered queue (``routing.domain.admission.AdmissionQueue``) decides:
   admit, queue (interactive ahead of standard; batch only on idle capacity), 429
   for a team above its guaranteed share while the pool is full, or 503 when the
   queue sheds the lowest tier; a queued request waits until a pump admits or
   sheds it, or its client leaves;
3. whatever a refused or abandoned request took in step 1 is given back;
4. when an admitted answer ends, ``release`` gives back the pool's tokens and
   returns the refund of the unused part and the freed slot.

The sequence does no I/O and reads no clock. ``admit`` is a generator that yields
*effects*, what it needs done by the outside world, and is resumed with the answer:
``ChargeAndAcquire`` (answered with a ``Claim``, or by throwing ``ChargeTooLarge``),
``RefundAndRelease`` (answered with None), ``ShedWaiting`` (queued requests shed to
make room: wake them with a SHED verdict; answered with None) and ``WaitInQueue``
(answered with the ``Verdict`` a later ``pump`` gave, or by throwing the
cancellation of a client that left). Its return value is the ``Ticket``; a refusal
is a ``Rejected`` raised out of it. The gateway (``routing.admission``) performs the
effects on Redis or in memory and awaits queue waits on futures; the fleet simulator
(``drills.domain.fleet``) performs them on a ``LimitTable`` in virtual time (the
effects' ``apply``) and keeps a waiting request's generator until its pump. So a drill measures this code, not a
copy of it.

Effects carry no time: the driver stamps the limit operations with its own clock
when it performs them (a refund after a long wait happens at the time of the
refund). ``now`` given to ``admit`` is the request's arrival, which orders the queue.

Pool load (tokens in flight per pool and per team, over every gateway) is the
``PoolView``'s, given at construction: the gateway's reads the snapshot and the
region's live load, the simulator's its own counters.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Protocol

from routing.domain.admission import (
    AdmissionQueue,
    Candidate,
    Outcome,
    PoolState,
    Pumped,
    Verdict,
)
from routing.domain.limit_table import Claim, LimitTable
from routing.domain.limiter import ChargeTooLarge, rate_limit_headers
from routing.domain.region_shares import RegionalLimits, regional_limits
from routing.domain.snapshot import LimitRecord
from routing.domain.tiers import Tier

__all__ = [
    "AdmissionControl",
    "AdmissionOptions",
    "AdmissionRequest",
    "ChargeAndAcquire",
    "PoolView",
    "RefundAndRelease",
    "Rejected",
    "ShedWaiting",
    "Steps",
    "Ticket",
    "WaitInQueue",
]

Pool = tuple[str, str]  # (model, version)
_NOTHING = Pumped(admitted=(), shed=())


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What admission knows of a request before it is routed."""

    team: str
    model: str
    version: str
    tier: Tier
    prompt_tokens: int
    max_tokens: int
    limit: LimitRecord
    # This region's share of the team's limits (``routing.domain.region_shares``).
    region_share: float = 1.0

    @property
    def charge_tokens(self) -> int:
        """The tokens charged up front: prompt plus the most the answer may use."""
        return self.prompt_tokens + self.max_tokens

    def regional(self, amount: int) -> RegionalLimits:
        """Return the limits this region enforces for a charge of ``amount``."""
        return regional_limits(
            tokens_per_minute=self.limit.tokens_per_minute,
            max_concurrency=self.limit.max_concurrency,
            share=self.region_share,
            amount=amount,
        )

    @property
    def limit_key(self) -> str:
        """The key of the team's bucket and slots on the model."""
        return f"{self.team}:{self.model}"


@dataclass(frozen=True, slots=True)
class AdmissionOptions:
    """The admission queue's bounds, with the platform's defaults.

    ``max_queue`` requests may wait per pool and none longer than ``max_wait_s``;
    batch is admitted only below ``batch_ceiling`` of the pool's capacity, and
    holds at most ``batch_lane`` of it itself (1: no lane).
    ``PLATFORM_ADMISSION_MAX_QUEUE``, ``PLATFORM_ADMISSION_MAX_WAIT_S``,
    ``PLATFORM_BATCH_CEILING`` and ``PLATFORM_BATCH_LANE`` default to these
    values, and so does the simulator.
    """

    max_queue: int = 256
    max_wait_s: float = 10.0
    batch_ceiling: float = 0.9
    batch_lane: float = 1.0

    def __post_init__(self) -> None:
        # The queue checks them too; failing here names the setting at start-up.
        AdmissionQueue(
            max_queue=self.max_queue,
            max_wait_s=self.max_wait_s,
            batch_ceiling=self.batch_ceiling,
            batch_lane=self.batch_lane,
        )


class Rejected(Exception):
    """Admission refused the request: 400 (never admissible), 429 or 503."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after_s: float,
        code: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.code = code
        self.headers = headers or {}


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request's claim: what it took, given back once by ``release``.

    ``headers`` are the rate-limit headers of its charge, for the answer.
    """

    request: AdmissionRequest
    admission_id: str
    charged: int
    headers: dict[str, str] = field(default_factory=dict)


# -- effects --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChargeAndAcquire:
    """Charge ``amount`` to ``key``'s bucket and take a slot for ``request_id``."""

    key: str
    capacity: int
    refill_per_s: float
    amount: int
    limit: int
    request_id: str

    def apply(self, table: LimitTable, now: float) -> Claim:
        """Perform the charge on an in-memory ``LimitTable`` at ``now``.

        Raises:
            ChargeTooLarge: ``amount`` is more than the whole bucket.
        """
        return table.charge_and_acquire(
            self.key,
            capacity=self.capacity,
            refill_per_s=self.refill_per_s,
            amount=self.amount,
            limit=self.limit,
            request_id=self.request_id,
            now=now,
        )


@dataclass(frozen=True, slots=True)
class RefundAndRelease:
    """Give ``amount`` tokens back to ``key``'s bucket and free ``request_id``'s slot."""

    key: str
    capacity: int
    refill_per_s: float
    amount: int
    request_id: str

    def apply(self, table: LimitTable, now: float) -> None:
        """Perform the refund on an in-memory ``LimitTable`` at ``now``."""
        table.refund_and_release(
            self.key,
            capacity=self.capacity,
            refill_per_s=self.refill_per_s,
            amount=self.amount,
            request_id=self.request_id,
            now=now,
        )


@dataclass(frozen=True, slots=True)
class WaitInQueue:
    """Wait until a ``pump`` of ``pool`` admits or sheds ``admission_id``."""

    pool: Pool
    admission_id: str


@dataclass(frozen=True, slots=True)
class ShedWaiting:
    """Wake these queued requests with a SHED verdict: ``(admission_id, retry_after_s)``."""

    shed: tuple[tuple[str, int], ...]


Effect = ChargeAndAcquire | RefundAndRelease | WaitInQueue | ShedWaiting
# What a driver sends back: a Claim, a Verdict, or None.
Steps = Generator[Effect, Claim | Verdict | None, Ticket]


class PoolView(Protocol):
    """A pool's load as admission judges it, and the tokens admission counts into it."""

    def state(self, model: str, version: str) -> PoolState | None:
        """Return the pool's capacity and tokens in flight; None while it has none."""
        ...

    def take(
        self, model: str, version: str, team: str, tokens: int, tier: Tier
    ) -> None:
        """Count an admitted request's tokens into the pool and its team's share
        (and the batch lane's, for the batch tier)."""
        ...

    def give_back(
        self, model: str, version: str, team: str, tokens: int, tier: Tier
    ) -> None:
        """Take an ended request's tokens out of the pool and its team's share
        (and the batch lane's, for the batch tier)."""
        ...


# -- the sequence ---------------------------------------------------------------------


class AdmissionControl:
    """Each pool's tiered queue, and the admission sequence over them.

    Invariants: a queued request's candidate is in ``_waiting`` until a pump admits
    it (its tokens are then counted into the pool and it moves to ``_woken`` until
    its sequence resumes), a pump or an offer sheds it, or it is cancelled. Every
    admitted ticket is in ``_held`` until released, so a ticket is given back once.
    Not thread-safe: one per event loop, or per simulation.
    """

    def __init__(self, view: PoolView, options: AdmissionOptions | None = None) -> None:
        self.view = view
        self.options = options or AdmissionOptions()
        self._queues: dict[Pool, AdmissionQueue] = {}
        self._waiting: dict[str, Candidate] = {}
        self._woken: set[str] = set()
        self._held: set[str] = set()

    def admit(self, request: AdmissionRequest, admission_id: str, now: float) -> Steps:
        """Run the admission sequence for ``request`` (see the module docstring).

        ``admission_id`` names the request's slot and queue entry (unique among
        requests in flight); ``now`` is its arrival on the queue's clock.

        Raises (out of the generator):
            Rejected: refused; whatever step 1 took has been given back.
        """
        limit = request.limit
        amount = request.charge_tokens
        regional = request.regional(amount)
        capacity = regional.capacity
        refill_per_s = regional.refill_per_s
        try:
            claim = yield ChargeAndAcquire(
                key=request.limit_key,
                capacity=capacity,
                refill_per_s=refill_per_s,
                amount=amount,
                limit=regional.max_concurrency,
                request_id=admission_id,
            )
        except ChargeTooLarge:
            raise Rejected(
                400,
                f"this request needs {amount} tokens (prompt + max_tokens) but the "
                f"team's limit is {limit.tokens_per_minute} tokens per minute; "
                "lower max_tokens",
                retry_after_s=0,
                code="request_exceeds_token_limit",
                headers=(yield from self._read_bucket(request, admission_id)),
            ) from None
        assert isinstance(claim, Claim)
        charge = claim.charge
        headers = rate_limit_headers(charge)
        if not charge.allowed:
            raise Rejected(
                429,
                f"team {request.team!r} is over its token limit on {request.model} "
                f"({_limit_text(limit.tokens_per_minute, request.region_share)})",
                retry_after_s=charge.retry_after_s,
                code="rate_limit_exceeded",
                headers=headers,
            )
        if not claim.has_slot:
            # Nothing was charged: the headers show the bucket as it stands.
            raise Rejected(
                429,
                f"team {request.team!r} already has {regional.max_concurrency} "
                f"streams in flight on {request.model}"
                + _region_text(limit.max_concurrency, request.region_share),
                retry_after_s=1,
                code="concurrency_limit_exceeded",
                headers=headers,
            )
        try:
            yield from self._enter_pool(request, admission_id, now)
        except GeneratorExit:
            raise  # the driver dropped the sequence: nothing more may be yielded
        except BaseException:
            # Refused by the pool, or the client left while queued.
            yield RefundAndRelease(
                key=request.limit_key,
                capacity=capacity,
                refill_per_s=refill_per_s,
                amount=amount,
                request_id=admission_id,
            )
            raise
        self._held.add(admission_id)
        return Ticket(
            request=request, admission_id=admission_id, charged=amount, headers=headers
        )

    def release(self, ticket: Ticket, *, used_tokens: int) -> RefundAndRelease | None:
        """Give back the pool's tokens of an ended answer; return what the store owes.

        The refund is the unused part of the charge (``charged - used_tokens``).
        None when the ticket was already released. The caller performs the refund
        and then pumps the pool, so a waiting request can take the room.
        """
        if ticket.admission_id not in self._held:
            return None
        self._held.discard(ticket.admission_id)
        request = ticket.request
        self.view.give_back(
            request.model, request.version, request.team, ticket.charged, request.tier
        )
        regional = request.regional(ticket.charged)
        return RefundAndRelease(
            key=request.limit_key,
            capacity=regional.capacity,
            refill_per_s=regional.refill_per_s,
            amount=max(0, ticket.charged - max(0, used_tokens)),
            request_id=ticket.admission_id,
        )

    def pump(self, pool: Pool, now: float) -> Pumped:
        """Run the pool's queue once: admit what fits, shed what waited too long.

        Admitted requests' tokens are counted into the pool here; the caller wakes
        them with an ADMIT verdict and the shed ones with a SHED verdict.
        """
        queue = self._queues.get(pool)
        if queue is None or not len(queue):
            return _NOTHING
        state = self.view.state(*pool)
        if state is None:
            return _NOTHING
        pumped = queue.pump(state, now)
        for admission_id in pumped.admitted:
            candidate = self._waiting.pop(admission_id)
            self.view.take(*pool, candidate.team, candidate.tokens, candidate.tier)
            self._woken.add(admission_id)
        for admission_id, _retry_after_s in pumped.shed:
            del self._waiting[admission_id]
        return pumped

    def queued(self, pool: Pool) -> int:
        """Return how many requests wait in ``pool``'s queue."""
        queue = self._queues.get(pool)
        return len(queue) if queue is not None else 0

    def queued_tokens(self, pool: Pool) -> int:
        """Return the tokens of the requests waiting in ``pool``'s queue."""
        queue = self._queues.get(pool)
        return queue.queued_tokens if queue is not None else 0

    def waiting(self, pool: Pool) -> list[Candidate]:
        """Return the requests waiting in ``pool``'s queue, in admission order."""
        queue = self._queues.get(pool)
        return queue.waiting() if queue is not None else []

    def _read_bucket(
        self, request: AdmissionRequest, admission_id: str
    ) -> Generator[Effect, Claim | Verdict | None, dict[str, str]]:
        """Return the rate-limit headers of the team's bucket as it stands.

        For the 400 of a request that no bucket could ever hold: a charge of 0
        tokens with a cap of 0 slots, which every store answers with the bucket
        refilled to now and stores nothing (``Claim``: a refused slot leaves the
        bucket untouched). A store that fails here does not turn the 400 into a
        503: the headers then carry only the limit.
        """
        capacity = request.limit.tokens_per_minute
        try:
            # The whole limit: a charge above it is why this request is a 400.
            claim = yield ChargeAndAcquire(
                key=request.limit_key,
                capacity=capacity,
                refill_per_s=request.regional(capacity).refill_per_s,
                amount=0,
                limit=0,
                request_id=admission_id,
            )
        except Exception:
            return {"x-ratelimit-limit-tokens": str(capacity)}
        assert isinstance(claim, Claim)
        return rate_limit_headers(claim.charge)

    def _enter_pool(
        self, request: AdmissionRequest, admission_id: str, now: float
    ) -> Generator[Effect, Claim | Verdict | None, None]:
        pool = (request.model, request.version)
        tokens = request.charge_tokens
        state = self.view.state(*pool)
        if state is None:
            # No serving replica: routing answers 503 with Retry-After.
            self.view.take(*pool, request.team, tokens, request.tier)
            return
        queue = self._queue(pool)
        candidate = Candidate(
            request_id=admission_id,
            team=request.team,
            tier=request.tier,
            tokens=tokens,
            guaranteed_share=request.limit.guaranteed_share,
            arrived_at=now,
        )
        try:
            verdict, shed = queue.offer(candidate, state, now)
        except ChargeTooLarge:
            raise Rejected(
                400,
                f"this request needs {tokens} tokens in flight, more than the whole "
                f"{request.model} pool holds ({state.capacity}); lower max_tokens",
                retry_after_s=0,
                code="request_exceeds_pool_capacity",
            ) from None
        if shed:
            for shed_id, _retry_after_s in shed:
                del self._waiting[shed_id]
            yield ShedWaiting(shed)
        if verdict.outcome == Outcome.ADMIT:
            self.view.take(*pool, request.team, tokens, request.tier)
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
        self._waiting[admission_id] = candidate
        try:
            woken = yield WaitInQueue(pool=pool, admission_id=admission_id)
        except BaseException:
            self._abandon(pool, candidate)
            raise
        self._woken.discard(admission_id)
        assert isinstance(woken, Verdict)
        if woken.outcome == Outcome.ADMIT:
            return  # the pump already counted its tokens into the pool
        raise Rejected(
            503,
            f"the {request.model} pool is overloaded; the request waited and was shed",
            retry_after_s=woken.retry_after_s,
            code="pool_overloaded",
        )

    def _abandon(self, pool: Pool, candidate: Candidate) -> None:
        """Forget a queued request whose client left (or whose driver dropped it)."""
        admission_id = candidate.request_id
        if self._waiting.pop(admission_id, None) is not None:
            self._queues[pool].cancel(admission_id)
        elif admission_id in self._woken:
            # Admitted by a pump before the cancellation reached it: its tokens
            # were counted into the pool and must come out again.
            self._woken.discard(admission_id)
            self.view.give_back(*pool, candidate.team, candidate.tokens, candidate.tier)

    def _queue(self, pool: Pool) -> AdmissionQueue:
        queue = self._queues.get(pool)
        if queue is None:
            queue = self._queues[pool] = AdmissionQueue(
                max_queue=self.options.max_queue,
                max_wait_s=self.options.max_wait_s,
                batch_ceiling=self.options.batch_ceiling,
                batch_lane=self.options.batch_lane,
            )
        return queue


def _limit_text(tokens_per_minute: int, share: float) -> str:
    text = f"{tokens_per_minute} tokens per minute"
    if share < 1.0:
        text += f" over all regions, {share:.0%} of it here"
    return text


def _region_text(max_concurrency: int, share: float) -> str:
    if share < 1.0:
        return f" ({share:.0%} here of {max_concurrency} over all regions)"
    return ""
