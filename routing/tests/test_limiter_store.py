"""Token buckets and concurrency slots, in memory and in Redis: the same answers.

The Redis stores run their arithmetic in Lua; the property tests replay random
histories through both stores side by side and require identical results, so the
Lua cannot drift from ``routing.domain.limiter``. Time is always injected.
"""

from __future__ import annotations

import asyncio
import math
import random
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import NotRequired, Protocol, TypedDict, TypeVar

import pytest
import redis
import redis.asyncio

from routing.domain.limiter import Bucket, Charge, ChargeTooLarge
from routing.limiter_redis import (
    BUCKET_TTL_MARGIN_S,
    RedisBucketStore,
    RedisConcurrency,
    RedisLimits,
)
from routing.limiter_store import (
    BucketStore,
    Claim,
    ConcurrencyStore,
    LimitStore,
    MemoryBucketStore,
    MemoryConcurrency,
    MemoryLimits,
)

T0 = 1_740_830_400.123456  # a unix time with a fraction, as time.time() gives

T = TypeVar("T")


class Buckets(BucketStore, Protocol):
    """A bucket store that can also be read without a write, as both stores can."""

    async def peek(
        self, key: str, *, capacity: int, refill_per_s: float, now: float
    ) -> Bucket:
        """Return the bucket refilled to ``now``, storing nothing."""
        ...


# A scenario runs on one side's stores, seen through the protocols the gateway uses.
Scenario = Callable[[Buckets, ConcurrencyStore], Awaitable[T]]


class Limits(TypedDict):
    """A bucket's limits, as the stores' keyword arguments."""

    capacity: int
    refill_per_s: float


class ChargeArgs(Limits):
    """The keyword arguments of a charge or a refund, but ``now``."""

    amount: int


class PeekArgs(Limits):
    """The keyword arguments of ``peek``."""

    now: float


class SlotArgs(TypedDict):
    """The keyword arguments of ``acquire``, but ``ttl_s``."""

    limit: int
    request_id: str
    now: float


class ClaimArgs(Limits):
    """The keyword arguments of ``charge_and_acquire``, but the charge and time."""

    limit: int
    request_id: str


class FullClaimArgs(ClaimArgs):
    """Every keyword argument of ``charge_and_acquire``."""

    amount: int
    now: float
    ttl_s: NotRequired[float]


class GiveBackArgs(Limits):
    """The keyword arguments of ``refund_and_release``."""

    amount: int
    request_id: str
    now: float


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    prefix = f"test-limiter-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def run_redis(redis_url: str, work: Callable[[redis.asyncio.Redis], Awaitable[T]]) -> T:
    """Run ``work(client)`` on a fresh event loop with its own async client."""

    async def main() -> T:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await work(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


@dataclass
class Backend:
    """Runs a scenario against the memory stores or the Redis stores."""

    kind: str
    redis_url: str = ""
    prefix: str = ""

    def __call__(self, scenario: Scenario[T]) -> T:
        if self.kind == "memory":

            async def alone() -> T:
                return await scenario(MemoryBucketStore(), MemoryConcurrency())

            return asyncio.run(alone())

        async def work(client: redis.asyncio.Redis) -> T:
            return await scenario(
                RedisBucketStore(client, self.prefix),
                RedisConcurrency(client, self.prefix),
            )

        return run_redis(self.redis_url, work)


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "memory":
        return Backend("memory")
    return Backend(
        "redis",
        redis_url=request.getfixturevalue("redis_url"),
        prefix=request.getfixturevalue("prefix"),
    )


# -- token buckets: memory and Redis agree ---------------------------------------------

CAPACITIES = [1, 2, 3, 10, 60, 100, 1000, 120_000]
# Dyadic rates make exact knife edges (a bucket refilled to exactly the amount);
# capacity / 60 (what the gateway uses) and 0.1 make rounding the tolerance absorbs.
RATES = [0.25, 0.5, 1.0, 2.0, 0.1, 7.3, 1e-3, 1000.0]
# Steps of 0, below the clock's resolution at T0 (~2.4e-7 s), tiny and huge.
STEPS = [0.0, 0.0, 1e-9, 1e-6, 1e-3, 0.25, 0.5, 1.0, 1.0, 2.0, 60.0, 3600.0, 1e7]


def random_limit(rng: random.Random) -> tuple[int, float]:
    capacity = rng.choice(CAPACITIES)
    return capacity, rng.choice([*RATES, capacity / 60])


def random_step(rng: random.Random, capacity: int, rate: float) -> float:
    if rng.random() < 0.7:
        return rng.choice(STEPS)
    return rng.uniform(0, 1.2 * capacity / rate)


def random_amount(rng: random.Random, capacity: int) -> int:
    roll = rng.random()
    if roll < 0.08:
        return capacity + rng.randint(1, 3)  # ChargeTooLarge
    if roll < 0.15:
        return capacity
    if roll < 0.2:
        return 0
    return rng.randint(1, max(1, capacity // rng.choice([1, 2, 4, 10])))


@dataclass
class Tally:
    allowed: int = 0
    refused: int = 0
    too_large: int = 0
    emptied: int = 0
    full: int = 0
    swept: int = 0


async def replay_bucket_history(
    rng: random.Random,
    memory: MemoryBucketStore,
    shared: RedisBucketStore,
    run_id: str,
    tally: Tally,
) -> None:
    """Replay one random history on both stores; assert every answer is equal."""
    limits = {f"{run_id}:k{i}": random_limit(rng) for i in range(rng.randint(1, 3))}
    now = T0 + rng.uniform(0, 1e6)
    for step in range(rng.randint(40, 60)):
        key = rng.choice(list(limits))
        if rng.random() < 0.03:
            # The limits changed: a bucket may now hold more than its capacity.
            # Only a lower capacity and a faster refill: a bucket dropped as full
            # (as a Redis key expires) was judged by its old limits, and is full at
            # the next call only if these did not grow the capacity or slow the
            # refill (the lazy refill applies the new rate to the whole gap).
            capacity, rate = random_limit(rng)
            old_capacity, old_rate = limits[key]
            limits[key] = (min(capacity, old_capacity), max(rate, old_rate))
        capacity, rate = limits[key]
        now += random_step(rng, capacity, rate)
        where = f"{run_id} step {step} {key} at {now!r} ({capacity}, {rate!r})"
        roll = rng.random()
        if roll < 0.65:
            amount = random_amount(rng, capacity)
            args: ChargeArgs = {
                "capacity": capacity,
                "refill_per_s": rate,
                "amount": amount,
            }
            if amount > capacity:
                with pytest.raises(ChargeTooLarge):
                    await memory.charge(key, now=now, **args)
                with pytest.raises(ChargeTooLarge):
                    await shared.charge(key, now=now, **args)
                tally.too_large += 1
                continue
            before = len(memory)
            expected = await memory.charge(key, now=now, **args)
            got = await shared.charge(key, now=now, **args)
            # Exact, floats included: both sides round the same IEEE operations.
            assert got == expected, f"charge {amount}: {where}"
            tally.swept += len(memory) < before
            if expected.allowed:
                tally.allowed += 1
                tally.emptied += expected.bucket.tokens == 0.0
            else:
                tally.refused += 1
            continue
        if roll < 0.8:
            # Mostly small refunds; some larger than anything charged.
            top = 2 * capacity if rng.random() < 0.2 else max(1, capacity // 4)
            amount = rng.randint(0, top)
            args = {"capacity": capacity, "refill_per_s": rate, "amount": amount}
            await memory.refund(key, now=now, **args)
            await shared.refund(key, now=now, **args)
        peek_args: PeekArgs = {"capacity": capacity, "refill_per_s": rate, "now": now}
        level = await memory.peek(key, **peek_args)
        assert await shared.peek(key, **peek_args) == level, f"level: {where}"
        tally.full += level.tokens == capacity
    for key, (capacity, rate) in limits.items():
        for at in (now, now + 0.5, now + 2 * capacity / rate):
            peek_args = {"capacity": capacity, "refill_per_s": rate, "now": at}
            assert await shared.peek(key, **peek_args) == await memory.peek(
                key, **peek_args
            ), f"final level of {key} at {at!r}"


def test_bucket_stores_agree_on_random_histories(redis_url: str, prefix: str) -> None:
    tally = Tally()

    async def work(client: redis.asyncio.Redis) -> None:
        shared = RedisBucketStore(client, prefix)
        for run in range(300):
            # Seeded per history, so a failing one replays alone by its number.
            rng = random.Random(f"buckets-{run}")
            # Sweeping often proves that dropping full buckets changes no answer.
            memory = MemoryBucketStore(sweep_every=3)
            await replay_bucket_history(rng, memory, shared, f"run{run}", tally)

    run_redis(redis_url, work)
    # The histories reached every branch (so the equalities above were tested).
    assert tally.allowed > 3000
    assert tally.refused > 500
    assert tally.too_large > 300
    assert tally.emptied > 100
    assert tally.full > 300
    assert tally.swept > 100


def test_bucket_stores_agree_at_knife_edges(redis_url: str, prefix: str) -> None:
    """GIVEN buckets refilled to exactly, or within rounding of, the amount
    WHEN they are charged that amount on both stores
    THEN both allow it, with the same remaining tokens and reset time.
    """
    cases = [
        # (capacity, rate, first charge, wait_s, second charge)
        (2, 0.5, 2, 2.0, 1),  # exactly 1.0 token after 2 s
        (100, 100 / 60, 100, 6.0, 10),  # 10 tokens within rounding of 100/60 * 6
        (1000, 1000 / 60, 1000, 0.06, 1),  # 0.99999999 tokens: the tolerance allows
        (3, 0.1, 3, 10.0, 1),  # 0.1 * 10 rounds
    ]

    async def work(client: redis.asyncio.Redis) -> list[tuple[bool, int]]:
        shared = RedisBucketStore(client, prefix)
        memory = MemoryBucketStore()
        seen = []
        for i, (capacity, rate, first, wait_s, second) in enumerate(cases):
            key = f"edge{i}"
            args: Limits = {"capacity": capacity, "refill_per_s": rate}
            stores: tuple[Buckets, ...] = (memory, shared)
            for store in stores:
                await store.charge(key, amount=first, now=T0, **args)
            expected = await memory.charge(key, amount=second, now=T0 + wait_s, **args)
            got = await shared.charge(key, amount=second, now=T0 + wait_s, **args)
            assert got == expected, f"case {i}"
            seen.append((got.allowed, got.retry_after_s))
        return seen

    assert run_redis(redis_url, work) == [(True, 0)] * len(cases)


# -- token buckets: behaviour of each store --------------------------------------------


def test_redis_charge_admits_exactly_capacity_under_concurrency(
    redis_url: str, prefix: str, sync_redis: redis.Redis
) -> None:
    """200 concurrent charges of 1 from two gateways on a bucket of 100."""

    async def work(client: redis.asyncio.Redis) -> list[Charge]:
        other = redis.asyncio.Redis.from_url(redis_url)
        try:
            gateways = [
                RedisBucketStore(client, prefix),
                RedisBucketStore(other, prefix),
            ]
            return await asyncio.gather(
                *(
                    gateways[i % 2].charge(
                        "team:chat-7b",
                        capacity=100,
                        refill_per_s=100 / 60,
                        amount=1,
                        now=T0,
                    )
                    for i in range(200)
                )
            )
        finally:
            await other.aclose()

    charges = run_redis(redis_url, work)
    allowed = [c for c in charges if c.allowed]
    assert len(allowed) == 100
    # Each allowed charge saw a different level: none were lost to a race.
    assert sorted(c.remaining for c in allowed) == list(range(100))
    assert {c.retry_after_s for c in charges if not c.allowed} == {1}
    stored = sync_redis.hgetall(f"{prefix}:bucket:team:chat-7b")
    assert stored == {b"tokens": b"0", b"updated_at": repr(T0).encode()}


def test_bucket_refund_never_exceeds_capacity(backend: Backend) -> None:
    async def scenario(buckets: Buckets, _: ConcurrencyStore) -> list[Bucket]:
        args: Limits = {"capacity": 100, "refill_per_s": 100 / 60}
        await buckets.charge("a", amount=30, now=T0, **args)
        await buckets.refund("a", amount=500, now=T0, **args)
        # Charged 100, half refilled by T0 + 30; refunding all 100 still caps.
        await buckets.charge("b", amount=100, now=T0, **args)
        await buckets.refund("b", amount=100, now=T0 + 30, **args)
        # A refund on a bucket never charged.
        await buckets.refund("c", amount=7, now=T0, **args)
        # Peeking at each bucket's last time shows it as stored.
        return [
            await buckets.peek("a", now=T0, **args),
            await buckets.peek("b", now=T0 + 30, **args),
            await buckets.peek("c", now=T0, **args),
        ]

    assert backend(scenario) == [
        Bucket(100.0, T0),
        Bucket(100.0, T0 + 30),
        Bucket(100.0, T0),
    ]


def test_redis_bucket_hash_holds_exact_floats_never_above_capacity(
    redis_url: str, prefix: str, sync_redis: redis.Redis
) -> None:
    args: Limits = {"capacity": 100, "refill_per_s": 100 / 60}

    async def work(
        client: redis.asyncio.Redis,
    ) -> tuple[Charge, dict[bytes | str, bytes | str]]:
        buckets = RedisBucketStore(client, prefix)
        await buckets.charge("a", amount=2, now=T0, **args)
        charged = await buckets.charge("a", amount=1, now=T0 + 0.1, **args)
        stored = await client.hgetall(f"{prefix}:bucket:a")
        await buckets.refund("a", amount=500, now=T0 + 0.1, **args)
        return charged, stored

    charged, stored = run_redis(redis_url, work)
    assert charged.bucket == Bucket(98 + (T0 + 0.1 - T0) * (100 / 60) - 1, T0 + 0.1)
    # %.17g text, which reads back as the very same double.
    assert {field: float(text) for field, text in stored.items()} == {
        b"tokens": charged.bucket.tokens,
        b"updated_at": T0 + 0.1,
    }
    refunded = sync_redis.hgetall(f"{prefix}:bucket:a")
    assert float(refunded[b"tokens"]) == 100.0


def test_bucket_charge_too_large_leaves_state_untouched(backend: Backend) -> None:
    async def scenario(
        buckets: Buckets, _: ConcurrencyStore
    ) -> tuple[Bucket, Bucket, int]:
        args: Limits = {"capacity": 100, "refill_per_s": 2.0}
        await buckets.charge("a", amount=40, now=T0, **args)
        with pytest.raises(ChargeTooLarge) as raised:
            await buckets.charge("a", amount=101, now=T0 + 5, **args)
        bads: list[ChargeArgs] = [
            {**args, "amount": -1},
            {**args, "amount": 1, "capacity": 0},
        ]
        for bad in bads:
            with pytest.raises(ValueError):
                await buckets.charge("a", now=T0 + 5, **bad)
        with pytest.raises(ChargeTooLarge):
            await buckets.charge("fresh", amount=101, now=T0, **args)
        # Peeking at T0 shows the stored bucket as is (a clock going backwards
        # refills nothing); a refused charge at T0 + 5 would have moved it.
        return (
            await buckets.peek("a", now=T0, **args),
            await buckets.peek("fresh", now=T0 - 1, **args),
            raised.value.capacity,
        )

    assert backend(scenario) == (Bucket(60.0, T0), Bucket(100.0, T0 - 1), 100)


def test_bucket_clock_going_backwards_refills_nothing(backend: Backend) -> None:
    async def scenario(
        buckets: Buckets, _: ConcurrencyStore
    ) -> list[tuple[bool, Bucket]]:
        args: ChargeArgs = {"capacity": 10, "refill_per_s": 1.0, "amount": 1}
        emptying: ChargeArgs = {**args, "amount": 10}
        await buckets.charge("a", now=T0 + 10, **emptying)
        seen = []
        # Another gateway's clock is 10 s behind, then 0.5 s and 0 s ahead.
        for now in (T0, T0 + 10.5, T0 + 11):
            charge = await buckets.charge("a", now=now, **args)
            seen.append((charge.allowed, charge.bucket))
        return seen

    assert backend(scenario) == [
        (False, Bucket(0.0, T0 + 10)),
        (False, Bucket(0.5, T0 + 10.5)),
        (True, Bucket(0.0, T0 + 11)),
    ]


def test_bucket_rejects_a_clock_that_is_not_finite(backend: Backend) -> None:
    async def scenario(buckets: Buckets, _: ConcurrencyStore) -> Bucket:
        args: ChargeArgs = {"capacity": 10, "refill_per_s": 1.0, "amount": 1}
        for now in (float("nan"), float("inf")):
            with pytest.raises(ValueError):
                await buckets.charge("a", now=now, **args)
            with pytest.raises(ValueError):
                await buckets.refund("a", now=now, **args)
        return await buckets.peek("a", capacity=10, refill_per_s=1.0, now=T0)

    assert backend(scenario) == Bucket(10.0, T0)


def test_redis_bucket_ttl_is_time_to_refill_from_empty_plus_margin(
    redis_url: str, prefix: str, sync_redis: redis.Redis
) -> None:
    key = f"{prefix}:bucket:team:chat-7b"
    args: Limits = {"capacity": 120, "refill_per_s": 2.0}

    async def charge(client: redis.asyncio.Redis) -> None:
        await RedisBucketStore(client, prefix).charge(
            "team:chat-7b", amount=1, now=T0, **args
        )

    async def refund(client: redis.asyncio.Redis) -> None:
        await RedisBucketStore(client, prefix).refund(
            "team:chat-7b", amount=1, now=T0, **args
        )

    ttl_ms = (60 + BUCKET_TTL_MARGIN_S) * 1000
    run_redis(redis_url, charge)
    assert ttl_ms - 2000 < sync_redis.pttl(key) <= ttl_ms
    sync_redis.persist(key)
    run_redis(redis_url, refund)
    assert ttl_ms - 2000 < sync_redis.pttl(key) <= ttl_ms


def test_redis_bucket_that_expired_is_full(
    redis_url: str, prefix: str, sync_redis: redis.Redis
) -> None:
    async def charge(client: redis.asyncio.Redis) -> Charge:
        return await RedisBucketStore(client, prefix).charge(
            "a", capacity=10, refill_per_s=1.0, amount=10, now=T0
        )

    assert run_redis(redis_url, charge).remaining == 0
    assert run_redis(redis_url, charge).allowed is False
    sync_redis.delete(f"{prefix}:bucket:a")  # what PEXPIRE does when idle
    assert run_redis(redis_url, charge).allowed is True


def test_memory_bucket_store_sweeps_full_buckets_only() -> None:
    args: Limits = {"capacity": 10, "refill_per_s": 1.0}

    async def scenario() -> list[int]:
        store = MemoryBucketStore(sweep_every=4)
        sizes = []
        for key in ("a", "b", "c"):
            await store.charge(key, amount=1, now=T0, **args)
        sizes.append(len(store))
        # 4th charge: a, b and c hold 9.5 tokens, not full, so all are kept.
        await store.charge("hot", amount=5, now=T0 + 0.5, **args)
        sizes.append(len(store))
        for step in (0.6, 0.7, 0.8):
            await store.charge("hot", amount=0, now=T0 + step, **args)
        sizes.append(len(store))
        # 8th charge: a, b and c are full at T0 + 1; hot (5.5 tokens) is not.
        await store.charge("hot", amount=0, now=T0 + 1, **args)
        sizes.append(len(store))
        assert await store.peek("a", now=T0 + 1, **args) == Bucket(10.0, T0 + 1)
        assert await store.peek("hot", now=T0 + 1, **args) == Bucket(5.5, T0 + 1)
        return sizes

    assert asyncio.run(scenario()) == [3, 4, 4, 1]
    with pytest.raises(ValueError):
        MemoryBucketStore(sweep_every=0)


# -- concurrency slots -----------------------------------------------------------------


def test_concurrency_caps_at_limit_and_release_frees_a_slot(backend: Backend) -> None:
    async def scenario(_: Buckets, slots: ConcurrencyStore) -> list[bool | int]:
        seen: list[bool | int] = []
        for request_id in ("r1", "r2", "r3"):
            seen.append(
                await slots.acquire("t:m", limit=2, request_id=request_id, now=T0)
            )
        seen.append(await slots.count("t:m", T0))
        seen.append(await slots.acquire("t:other", limit=2, request_id="r3", now=T0))
        await slots.release("t:m", request_id="r1")
        await slots.release("t:m", request_id="unknown")
        await slots.release("never", request_id="r1")
        seen.append(await slots.count("t:m", T0))
        seen.append(await slots.acquire("t:m", limit=2, request_id="r3", now=T0))
        seen.append(await slots.count("t:m", T0))
        for request_id in ("r2", "r3"):
            await slots.release("t:m", request_id=request_id)
        seen.append(await slots.count("t:m", T0))
        seen.append(await slots.acquire("t:m", limit=0, request_id="r4", now=T0))
        return seen

    assert backend(scenario) == [True, True, False, 2, True, 1, True, 2, 0, False]


def test_concurrency_slots_expire_after_ttl(backend: Backend) -> None:
    async def scenario(_: Buckets, slots: ConcurrencyStore) -> list[bool | int]:
        return [
            await slots.acquire("k", limit=1, request_id="r1", now=T0, ttl_s=30.0),
            await slots.count("k", T0 + 29.5),
            await slots.acquire("k", limit=1, request_id="r2", now=T0 + 29.5),
            await slots.count("k", T0 + 30),
            # Expired at exactly now + ttl_s, as ZREMRANGEBYSCORE -inf now.
            await slots.acquire("k", limit=1, request_id="r2", now=T0 + 30, ttl_s=5.0),
            await slots.count("k", T0 + 30),
        ]

    assert backend(scenario) == [True, 1, False, 0, True, 1]


def test_concurrency_reacquire_by_holder_extends_its_slot(backend: Backend) -> None:
    async def scenario(_: Buckets, slots: ConcurrencyStore) -> list[bool]:
        return [
            await slots.acquire("k", limit=1, request_id="r1", now=T0, ttl_s=10.0),
            await slots.acquire("k", limit=1, request_id="r1", now=T0 + 5, ttl_s=10.0),
            await slots.acquire("k", limit=1, request_id="r2", now=T0 + 12),
            await slots.acquire("k", limit=1, request_id="r2", now=T0 + 15),
        ]

    assert backend(scenario) == [True, True, False, True]


def test_concurrency_rejects_a_bad_ttl_or_clock(backend: Backend) -> None:
    async def scenario(_: Buckets, slots: ConcurrencyStore) -> int:
        for ttl_s in (0.0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError):
                await slots.acquire("k", limit=1, request_id="r", now=T0, ttl_s=ttl_s)
        with pytest.raises(ValueError):
            await slots.acquire("k", limit=1, request_id="r", now=float("nan"))
        return await slots.count("k", T0)

    assert backend(scenario) == 0


def test_memory_concurrency_forgets_released_and_expired_keys() -> None:
    async def scenario() -> list[int]:
        slots = MemoryConcurrency(sweep_every=3)
        sizes = []
        await slots.acquire("a", limit=1, request_id="r", now=T0, ttl_s=10.0)
        await slots.acquire("b", limit=1, request_id="r", now=T0, ttl_s=10.0)
        sizes.append(len(slots))
        await slots.release("a", request_id="r")
        sizes.append(len(slots))
        # The 3rd acquire sweeps at T0 + 10: b's slot expired, b goes.
        await slots.acquire("c", limit=0, request_id="r", now=T0 + 10)
        sizes.append(len(slots))
        return sizes

    assert asyncio.run(scenario()) == [2, 1, 0]


def test_redis_concurrency_key_expires_with_its_longest_slot(
    redis_url: str, prefix: str, sync_redis: redis.Redis
) -> None:
    async def work(client: redis.asyncio.Redis) -> None:
        slots = RedisConcurrency(client, prefix)
        await slots.acquire("k", limit=5, request_id="long", now=T0, ttl_s=900.0)
        await slots.acquire("k", limit=5, request_id="short", now=T0, ttl_s=5.0)

    run_redis(redis_url, work)
    key = f"{prefix}:conc:k"
    assert 898_000 < sync_redis.pttl(key) <= 900_000
    assert sync_redis.zrange(key, 0, -1, withscores=True) == [
        (b"short", T0 + 5.0),
        (b"long", T0 + 900.0),
    ]


def test_redis_concurrency_admits_exactly_the_limit_under_concurrency(
    redis_url: str, prefix: str, sync_redis: redis.Redis
) -> None:
    async def work(client: redis.asyncio.Redis) -> list[bool]:
        slots = RedisConcurrency(client, prefix)
        return await asyncio.gather(
            *(
                slots.acquire("k", limit=10, request_id=f"r{i}", now=T0)
                for i in range(60)
            )
        )

    assert sum(run_redis(redis_url, work)) == 10
    assert sync_redis.zcard(f"{prefix}:conc:k") == 10


def test_concurrency_stores_agree_on_random_histories(
    redis_url: str, prefix: str
) -> None:
    outcomes: dict[str, set[bool | int]] = {"acquire": set(), "count": set()}

    async def work(client: redis.asyncio.Redis) -> None:
        shared = RedisConcurrency(client, prefix)
        memory = MemoryConcurrency(sweep_every=5)
        for run in range(150):
            rng = random.Random(f"slots-{run}")
            key = f"run{run}"
            limit = rng.randint(0, 4)
            now = T0 + rng.uniform(0, 1e6)
            for step in range(40):
                now += rng.choice([0.0, 0.0, 1e-9, 0.5, 1.0, 5.0, 30.0, 1000.0])
                request_id = f"r{rng.randint(0, 6)}"
                where = f"{key} step {step} at {now!r}"
                roll = rng.random()
                if roll < 0.5:
                    ttl_s = rng.choice([0.5, 1.0, 5.0, 30.0, 900.0])
                    args: SlotArgs = {
                        "limit": limit,
                        "request_id": request_id,
                        "now": now,
                    }
                    got = await shared.acquire(key, ttl_s=ttl_s, **args)
                    expected = await memory.acquire(key, ttl_s=ttl_s, **args)
                    assert got == expected, f"acquire: {where}"
                    outcomes["acquire"].add(got)
                elif roll < 0.8:
                    await shared.release(key, request_id=request_id)
                    await memory.release(key, request_id=request_id)
                counted = await memory.count(key, now)
                assert await shared.count(key, now) == counted, f"count: {where}"
                outcomes["count"].add(counted)

    run_redis(redis_url, work)
    assert outcomes == {"acquire": {True, False}, "count": {0, 1, 2, 3, 4}}


# -- a charge and a slot together (one round trip each way) ----------------------------

LIMITS: Limits = {"capacity": 100, "refill_per_s": 100 / 60}


def test_claim_charges_the_bucket_and_takes_a_slot(backend: Backend) -> None:
    async def scenario(
        buckets: Buckets, slots: ConcurrencyStore
    ) -> tuple[Claim, int, Bucket]:
        limits = buckets.pair(slots)
        claim = await limits.charge_and_acquire(
            "t:m", amount=30, limit=2, request_id="r1", now=T0, **LIMITS
        )
        return (
            claim,
            await slots.count("t:m", T0),
            await buckets.peek("t:m", now=T0, **LIMITS),
        )

    claim, held, level = backend(scenario)
    assert claim.has_slot is True
    assert (claim.charge.allowed, claim.charge.bucket) == (True, Bucket(70.0, T0))
    assert (claim.charge.remaining, claim.charge.retry_after_s) == (70, 0)
    assert (held, level) == (1, Bucket(70.0, T0))


def test_claim_refused_by_the_cap_leaves_the_bucket_untouched(
    backend: Backend,
) -> None:
    """GIVEN a bucket charged 30 at T0 and the team's only slot held
    WHEN another request that the bucket could pay for claims at T0 + 6
    THEN it gets no slot, nothing is charged or stored, and the claim reports the
    bucket as refilled to T0 + 6 with nothing taken.
    """

    async def scenario(
        buckets: Buckets, slots: ConcurrencyStore
    ) -> tuple[Claim, int, Bucket, int]:
        limits = buckets.pair(slots)
        await limits.charge_and_acquire(
            "t:m", amount=30, limit=1, request_id="r1", now=T0, **LIMITS
        )
        refused = await limits.charge_and_acquire(
            "t:m", amount=20, limit=1, request_id="r2", now=T0 + 6, **LIMITS
        )
        held = await slots.count("t:m", T0 + 6)
        # Peeking at T0 shows the stored bucket as is: a write at T0 + 6 would
        # have moved its time (a clock going backwards refills nothing).
        stored = await buckets.peek("t:m", now=T0, **LIMITS)
        # r2 holds nothing: once r1 is freed, no slot is left.
        await slots.release("t:m", request_id="r1")
        return refused, held, stored, await slots.count("t:m", T0 + 6)

    refused, held, stored, left = backend(scenario)
    assert refused.has_slot is False
    refilled = 70.0 + 6 * (100 / 60)
    assert refused.charge.allowed is True
    assert refused.charge.bucket == Bucket(refilled, T0 + 6)
    assert refused.charge.remaining == 80  # 80 tokens, not 60: nothing was taken
    assert refused.charge.reset_s == (100 - refilled) / (100 / 60)
    assert (held, stored, left) == (1, Bucket(70.0, T0), 0)


def test_claim_refused_by_the_bucket_takes_no_slot(backend: Backend) -> None:
    async def scenario(
        buckets: Buckets, slots: ConcurrencyStore
    ) -> tuple[Claim, Claim, int, Bucket]:
        limits = buckets.pair(slots)
        await buckets.charge("t:m", amount=95, now=T0, **LIMITS)
        refused = await limits.charge_and_acquire(
            "t:m", amount=20, limit=5, request_id="r1", now=T0 + 3, **LIMITS
        )
        # The bucket's refusal comes first, even when the cap is full too.
        also_capped = await limits.charge_and_acquire(
            "t:m", amount=20, limit=0, request_id="r2", now=T0 + 3, **LIMITS
        )
        return (
            refused,
            also_capped,
            await slots.count("t:m", T0 + 3),
            await buckets.peek("t:m", now=T0, **LIMITS),
        )

    refused, also_capped, held, stored = backend(scenario)
    assert (refused.has_slot, refused.charge.allowed) == (False, False)
    # 10 tokens at T0 + 3, 10 short at 100/60 per second: 6 s.
    assert refused.charge.retry_after_s == 6
    assert also_capped == refused
    assert held == 0
    # A refused charge stores its refill, as ``charge`` does.
    assert stored == Bucket(5.0 + 3 * (100 / 60), T0 + 3)


def test_claim_that_cannot_be_made_touches_nothing(backend: Backend) -> None:
    async def scenario(buckets: Buckets, slots: ConcurrencyStore) -> tuple[int, Bucket]:
        limits = buckets.pair(slots)
        args: ClaimArgs = {"limit": 5, "request_id": "r1", **LIMITS}
        with pytest.raises(ChargeTooLarge):
            await limits.charge_and_acquire("t:m", amount=101, now=T0, **args)
        bads: list[FullClaimArgs] = [
            {"amount": 1, "now": T0, **args, "ttl_s": 0.0},
            {"amount": 1, **args, "now": math.nan},
            {"now": T0, **args, "amount": -1},
        ]
        for bad in bads:
            with pytest.raises(ValueError):
                await limits.charge_and_acquire("t:m", **bad)
        with pytest.raises(ValueError):
            await limits.refund_and_release(
                "t:m", amount=-1, request_id="r1", now=T0, **LIMITS
            )
        return (
            await slots.count("t:m", T0),
            await buckets.peek("t:m", now=T0 - 1, **LIMITS),
        )

    assert backend(scenario) == (0, Bucket(100.0, T0 - 1))


def test_give_back_refunds_at_most_capacity_and_frees_the_slot(
    backend: Backend,
) -> None:
    async def scenario(
        buckets: Buckets, slots: ConcurrencyStore
    ) -> list[int | Bucket | bool]:
        limits = buckets.pair(slots)
        claim: ClaimArgs = {"limit": 1, "request_id": "r1", **LIMITS}
        await limits.charge_and_acquire("t:m", amount=40, now=T0, **claim)
        seen: list[int | Bucket | bool] = [await slots.count("t:m", T0)]
        await limits.refund_and_release(
            "t:m", amount=500, request_id="r1", now=T0 + 3, **LIMITS
        )
        seen += [
            await slots.count("t:m", T0 + 3),
            await buckets.peek("t:m", now=T0 + 3, **LIMITS),
        ]
        # A refund of 0 frees the slot and leaves the bucket as stored (its time
        # too); freeing a slot nobody holds is a no-op.
        await limits.charge_and_acquire("t:m", amount=40, now=T0 + 4, **claim)
        await limits.refund_and_release(
            "t:m", amount=0, request_id="r1", now=T0 + 5, **LIMITS
        )
        await limits.refund_and_release(
            "t:m", amount=0, request_id="never", now=T0 + 5, **LIMITS
        )
        seen += [
            await slots.count("t:m", T0 + 5),
            await buckets.peek("t:m", now=T0, **LIMITS),
        ]
        # The slot is free again: a new request gets it.
        again = await limits.charge_and_acquire("t:m", amount=1, now=T0 + 5, **claim)
        seen.append(again.has_slot)
        return seen

    assert backend(scenario) == [
        1,
        0,
        Bucket(100.0, T0 + 3),
        0,
        Bucket(60.0, T0 + 4),
        True,
    ]


def test_redis_claim_refused_by_the_cap_writes_nothing(
    redis_url: str, prefix: str, sync_redis: redis.Redis
) -> None:
    bucket_key = f"{prefix}:bucket:t:m"

    async def first(client: redis.asyncio.Redis) -> None:
        limits = RedisBucketStore(client, prefix).pair(RedisConcurrency(client, prefix))
        await limits.charge_and_acquire(
            "t:m", amount=30, limit=1, request_id="r1", now=T0, **LIMITS
        )

    async def refused(client: redis.asyncio.Redis) -> Claim:
        limits = RedisBucketStore(client, prefix).pair(RedisConcurrency(client, prefix))
        return await limits.charge_and_acquire(
            "t:m", amount=30, limit=1, request_id="r2", now=T0 + 1, **LIMITS
        )

    run_redis(redis_url, first)
    stored = sync_redis.hgetall(bucket_key)
    sync_redis.persist(bucket_key)  # a write would set a TTL again
    assert run_redis(redis_url, refused).has_slot is False
    assert sync_redis.hgetall(bucket_key) == stored
    assert sync_redis.pttl(bucket_key) == -1
    assert sync_redis.zrange(f"{prefix}:conc:t:m", 0, -1) == [b"r1"]


def test_redis_claims_take_exactly_the_cap_and_charge_only_those(
    redis_url: str, prefix: str, sync_redis: redis.Redis
) -> None:
    """60 concurrent claims of 10 tokens from two gateways, 10 slots, 1000 tokens."""

    async def work(client: redis.asyncio.Redis) -> list[Claim]:
        other = redis.asyncio.Redis.from_url(redis_url)
        try:
            gateways = [
                RedisBucketStore(c, prefix).pair(RedisConcurrency(c, prefix))
                for c in (client, other)
            ]
            return await asyncio.gather(
                *(
                    gateways[i % 2].charge_and_acquire(
                        "t:m",
                        capacity=1000,
                        refill_per_s=1000 / 60,
                        amount=10,
                        limit=10,
                        request_id=f"r{i}",
                        now=T0,
                    )
                    for i in range(60)
                )
            )
        finally:
            await other.aclose()

    claims = run_redis(redis_url, work)
    taken = [c for c in claims if c.has_slot]
    assert len(taken) == 10
    assert sorted(c.charge.remaining for c in taken) == list(range(900, 1000, 10))
    # Every refused claim saw the bucket allowed and untouched by the others.
    assert {c.charge.allowed for c in claims} == {True}
    assert {c.charge.remaining for c in claims if not c.has_slot} == {900}
    assert sync_redis.hget(f"{prefix}:bucket:t:m", "tokens") == b"900"
    assert sync_redis.zcard(f"{prefix}:conc:t:m") == 10


def test_limit_stores_agree_on_random_histories(redis_url: str, prefix: str) -> None:
    """Claims, give-backs, debits and the single operations, mixed, on both stores."""
    seen: dict[str, set[tuple[bool, bool] | int]] = {"claim": set(), "count": set()}

    async def work(client: redis.asyncio.Redis) -> None:
        redis_buckets = RedisBucketStore(client, prefix)
        redis_slots = RedisConcurrency(client, prefix)
        shared = redis_buckets.pair(redis_slots)
        for run in range(150):
            rng = random.Random(f"claims-{run}")
            memory_buckets = MemoryBucketStore(sweep_every=3)
            memory_slots = MemoryConcurrency(sweep_every=5)
            memory = memory_buckets.pair(memory_slots)
            key = f"run{run}"
            capacity, rate = random_limit(rng)
            limit = rng.randint(0, 3)
            now = T0 + rng.uniform(0, 1e6)
            for step in range(50):
                now += random_step(rng, capacity, rate)
                request_id = f"r{rng.randint(0, 5)}"
                where = f"{key} step {step} at {now!r} ({capacity}, {rate!r})"
                limits: Limits = {"capacity": capacity, "refill_per_s": rate}
                roll = rng.random()
                if roll < 0.5:
                    amount = random_amount(rng, capacity)
                    args: FullClaimArgs = {
                        "amount": amount,
                        "limit": limit,
                        "request_id": request_id,
                        "now": now,
                        "ttl_s": rng.choice([1.0, 30.0, 900.0]),
                        **limits,
                    }
                    if amount > capacity:
                        stores: tuple[LimitStore, ...] = (memory, shared)
                        for store in stores:
                            with pytest.raises(ChargeTooLarge):
                                await store.charge_and_acquire(key, **args)
                        continue
                    expected = await memory.charge_and_acquire(key, **args)
                    got = await shared.charge_and_acquire(key, **args)
                    assert got == expected, f"claim {amount}: {where}"
                    seen["claim"].add((expected.charge.allowed, expected.has_slot))
                elif roll < 0.8:
                    top = 2 * capacity if rng.random() < 0.2 else max(1, capacity // 4)
                    give_back: GiveBackArgs = {
                        "amount": rng.choice([0, rng.randint(0, top)]),
                        "request_id": request_id,
                        "now": now,
                        **limits,
                    }
                    await memory.refund_and_release(key, **give_back)
                    await shared.refund_and_release(key, **give_back)
                elif roll < 0.9:
                    amount = rng.randint(0, capacity)
                    charge_args: ChargeArgs = {"amount": amount, **limits}
                    expected_charge = await memory_buckets.charge(
                        key, now=now, **charge_args
                    )
                    got_charge = await redis_buckets.charge(key, now=now, **charge_args)
                    assert got_charge == expected_charge, f"charge: {where}"
                elif roll < 0.95:
                    await memory_slots.release(key, request_id=request_id)
                    await redis_slots.release(key, request_id=request_id)
                else:
                    # A debit (tokens spent while Redis was away), past empty too.
                    owed = rng.randint(0, 2 * capacity)
                    await memory.debit(key, amount=owed, now=now, **limits)
                    await shared.debit(key, amount=owed, now=now, **limits)
                level = await memory_buckets.peek(key, now=now, **limits)
                assert await redis_buckets.peek(key, now=now, **limits) == level, (
                    f"level: {where}"
                )
                counted = await memory_slots.count(key, now)
                assert await redis_slots.count(key, now) == counted, f"count: {where}"
                seen["count"].add(counted)

    run_redis(redis_url, work)
    # Every outcome of a claim happened: taken, refused by the cap, by the bucket.
    assert seen["claim"] == {(True, True), (True, False), (False, False)}
    assert seen["count"] == {0, 1, 2, 3}


def test_pair_needs_slots_kept_in_the_same_place() -> None:
    client = redis.asyncio.Redis()  # never connects: pairing makes no call
    other = redis.asyncio.Redis()
    with pytest.raises(TypeError):
        MemoryBucketStore().pair(RedisConcurrency(client, "p"))
    with pytest.raises(TypeError):
        RedisBucketStore(client, "p").pair(MemoryConcurrency())
    with pytest.raises(TypeError):
        RedisBucketStore(client, "p").pair(RedisConcurrency(other, "p"))
    assert isinstance(MemoryBucketStore().pair(MemoryConcurrency()), MemoryLimits)
    assert isinstance(
        RedisBucketStore(client, "p").pair(RedisConcurrency(client, "p")), RedisLimits
    )


# -- the claims and give-backs of one turn of the event loop share a round trip --------


def test_redis_claims_of_one_loop_turn_go_in_one_pipeline(
    redis_url: str,
    prefix: str,
    sync_redis: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipelines: list[int] = []

    async def work(client: redis.asyncio.Redis) -> list[Claim]:
        open_pipeline = client.pipeline

        def counted(transaction: bool = True) -> object:
            pipeline = open_pipeline(transaction=transaction)
            pipelines.append(id(pipeline))
            return pipeline

        monkeypatch.setattr(client, "pipeline", counted)
        limits = RedisBucketStore(client, prefix).pair(RedisConcurrency(client, prefix))
        claims = await asyncio.gather(
            *(
                limits.charge_and_acquire(
                    "t:m", amount=10, limit=3, request_id=f"r{i}", now=T0, **LIMITS
                )
                for i in range(5)
            )
        )
        await asyncio.gather(
            *(
                limits.refund_and_release(
                    "t:m", amount=5, request_id=f"r{i}", now=T0, **LIMITS
                )
                for i in range(2)
            )
        )
        return claims

    claims = run_redis(redis_url, work)
    assert len(pipelines) == 2  # five claims, then two give-backs
    assert [c.has_slot for c in claims] == [True, True, True, False, False]
    assert [c.charge.remaining for c in claims] == [90, 80, 70, 70, 70]
    assert sync_redis.zrange(f"{prefix}:conc:t:m", 0, -1) == [b"r2"]
    assert float(sync_redis.hget(f"{prefix}:bucket:t:m", "tokens") or 0) == 80.0


def test_redis_claim_cancelled_before_its_batch_is_sent_takes_nothing(
    redis_url: str, prefix: str, sync_redis: redis.Redis
) -> None:
    async def work(client: redis.asyncio.Redis) -> Claim:
        limits = RedisBucketStore(client, prefix).pair(RedisConcurrency(client, prefix))
        gone = asyncio.ensure_future(
            limits.charge_and_acquire(
                "t:m", amount=10, limit=3, request_id="gone", now=T0, **LIMITS
            )
        )
        await asyncio.sleep(0)  # the claim waits for its batch to be sent
        gone.cancel()
        kept = await limits.charge_and_acquire(
            "t:m", amount=10, limit=3, request_id="kept", now=T0, **LIMITS
        )
        assert gone.cancelled()
        return kept

    assert run_redis(redis_url, work).charge.remaining == 90
    assert sync_redis.zrange(f"{prefix}:conc:t:m", 0, -1) == [b"kept"]


def test_redis_batch_loads_a_script_redis_does_not_hold(redis_url: str) -> None:
    from routing.limiter_redis import _TickBatch

    async def work(client: redis.asyncio.Redis) -> list[object]:
        # A script of its own text, never loaded: the pipeline's EVALSHA fails.
        script = client.register_script(f"return ARGV[1] .. '{uuid.uuid4().hex}'")
        batch = _TickBatch(client)
        replies = await asyncio.gather(
            batch.call(script, [], ["a"]), batch.call(script, [], ["b"])
        )
        return [reply[:1] for reply in replies]

    assert run_redis(redis_url, work) == [b"a", b"b"]
