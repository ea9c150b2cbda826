"""Team limits and tiers at the admission seam, in process, on an injected clock."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any, TypedDict, TypeVar

import pytest
import redis
import redis.asyncio

from engine_nodes.domain.load_shares import (
    admitted_key,
    batch_key,
    queue_depth_key,
    queue_tokens_key,
)
from routing.admission import LiveAdmission, LivePoolView, pool_key
from routing.domain.admission_control import (
    AdmissionControl,
    AdmissionOptions,
    AdmissionRequest,
    Rejected,
)
from routing.domain.snapshot import LimitRecord
from routing.domain.tiers import Tier
from routing.limiter_redis import RedisBucketStore, RedisConcurrency
from routing.limiter_store import MemoryBucketStore, MemoryConcurrency
from routing.live import LiveLoad
from routing.region_limits import RegionLimits

T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FixedPool(LivePoolView):
    """A pool of a fixed capacity; its load is the real live load."""

    def __init__(self, live: LiveLoad, capacity: int) -> None:
        super().__init__(
            snapshot=lambda: None, live=live, default_replica_tokens_in_flight=1
        )
        self.fixed = capacity

    def capacity(self, model: str, version: str) -> int:
        return self.fixed


def build(
    capacity: int = 10_000,
    *,
    stores: tuple[Any, Any] | None = None,
    max_queue: int = 256,
    batch_ceiling: float = 1.0,
    batch_lane: float = 1.0,
) -> tuple[LiveAdmission, LiveLoad, Clock]:
    clock = Clock()
    live = LiveLoad(
        gateway_id="g", region="r", redis=None, prefix="p", beat_s=1.0, missed_beats=3
    )
    buckets, concurrency = stores or (MemoryBucketStore(), MemoryConcurrency())
    admission = LiveAdmission(
        control=AdmissionControl(
            FixedPool(live, capacity),
            AdmissionOptions(
                max_queue=max_queue,
                batch_ceiling=batch_ceiling,
                batch_lane=batch_lane,
            ),
        ),
        limits=buckets.pair(concurrency),
        clock=clock,
        pump_interval_s=3600.0,
        live=live,
    )
    return admission, live, clock


class Limits(TypedDict, total=False):
    tokens_per_minute: int
    max_concurrency: int


def request(
    team: str,
    tokens: int,
    *,
    tier: Tier = Tier.STANDARD,
    tokens_per_minute: int = 10**9,
    max_concurrency: int = 10**6,
    share: float = 0.0,
) -> AdmissionRequest:
    return AdmissionRequest(
        team=team,
        model="chat-7b",
        version="v1",
        tier=tier,
        prompt_tokens=tokens // 2,
        max_tokens=tokens - tokens // 2,
        limit=LimitRecord(
            team=team,
            model="chat-7b",
            tokens_per_minute=tokens_per_minute,
            max_concurrency=max_concurrency,
            guaranteed_share=share,
        ),
    )


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_bucket_charges_up_front_and_refunds_the_unused_part() -> None:
    async def scenario() -> None:
        admission, _, clock = build()
        first = await admission.admit(request("a", 600, tokens_per_minute=1000))
        assert first.headers["x-ratelimit-remaining-tokens"] == "400"
        with pytest.raises(Rejected) as refused:
            await admission.admit(request("a", 600, tokens_per_minute=1000))
        assert refused.value.status == 429
        # 200 tokens short at 1000/60 per second: 12 s.
        assert refused.value.retry_after_s == 12
        assert refused.value.headers["x-ratelimit-limit-tokens"] == "1000"
        await admission.release(first, used_tokens=100)  # 500 refunded
        second = await admission.admit(request("a", 600, tokens_per_minute=1000))
        assert second.headers["x-ratelimit-remaining-tokens"] == "300"
        await admission.release(second, used_tokens=600)
        clock.now += 42  # 700 tokens refill: the bucket is full again
        third = await admission.admit(request("a", 1000, tokens_per_minute=1000))
        assert third.headers["x-ratelimit-remaining-tokens"] == "0"

    run(scenario())


def test_region_share_sizes_the_bucket_and_demand_is_noted() -> None:
    """GIVEN this region holds a quarter of team a's limit, WHEN a asks for two
    requests of 1,000 tokens, THEN its bucket here holds 1,500 (one is refused)
    and both charges count as the region's demand, refused or not."""

    async def scenario() -> None:
        admission, _, clock = build()
        shares = RegionLimits(
            redis=None, prefix="p", slot_s=5.0, slot_ttl_s=40.0, clock=clock
        )
        shares.shares = {"a:chat-7b": 0.25, "*": 0.5}
        admission.region_limits = shares
        limits: Limits = {"tokens_per_minute": 6000, "max_concurrency": 4}
        first = await admission.admit(request("a", 1000, **limits))
        with pytest.raises(Rejected) as refused:
            await admission.admit(request("a", 1000, **limits))
        assert first.headers["x-ratelimit-limit-tokens"] == "1500"
        assert refused.value.status == 429
        assert "25% of it here" in refused.value.message
        assert shares._unsent == {"a:chat-7b": 2000}
        # A team without a share of its own takes the default one.
        other = await admission.admit(request("b", 100, **limits))
        assert other.headers["x-ratelimit-limit-tokens"] == "3000"

    run(scenario())


def test_release_twice_refunds_once() -> None:
    async def scenario() -> None:
        admission, _, _ = build()
        ticket = await admission.admit(request("a", 600, tokens_per_minute=1000))
        await admission.release(ticket, used_tokens=0)
        await admission.release(ticket, used_tokens=0)
        again = await admission.admit(request("a", 1000, tokens_per_minute=1000))
        assert again.headers["x-ratelimit-remaining-tokens"] == "0"

    run(scenario())


def test_charge_above_the_whole_bucket_is_a_400() -> None:
    async def scenario() -> None:
        admission, _, _ = build()
        with pytest.raises(Rejected) as refused:
            await admission.admit(request("a", 1001, tokens_per_minute=1000))
        assert refused.value.status == 400
        assert refused.value.code == "request_exceeds_token_limit"

    run(scenario())


async def too_large_shows_the_bucket(stores: tuple[Any, Any]) -> dict[str, str]:
    """Charge 600 of a 1,000-token bucket, 9 s later ask for 1,001: return the
    400's headers, after checking that it took nothing."""
    admission, _, clock = build(stores=stores)
    limits = Limits(tokens_per_minute=1000, max_concurrency=1)
    held = await admission.admit(request("a", 600, **limits))
    clock.now += 9.0  # 150 tokens refill: 550 in the bucket
    with pytest.raises(Rejected) as refused:
        await admission.admit(request("a", 1001, **limits))
    assert (refused.value.status, refused.value.code) == (
        400,
        "request_exceeds_token_limit",
    )
    # Nothing taken: the one slot is still the first request's, the bucket as it was.
    bucket = await stores[0].peek(
        "a:chat-7b", capacity=1000, refill_per_s=1000 / 60, now=clock.now
    )
    assert round(bucket.tokens) == 550
    assert await stores[1].count("a:chat-7b", clock.now) == 1
    await admission.release(held, used_tokens=600)
    return refused.value.headers


def test_charge_above_the_whole_bucket_has_the_rate_limit_headers() -> None:
    headers = run(
        too_large_shows_the_bucket((MemoryBucketStore(), MemoryConcurrency()))
    )
    assert headers == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "550",
        "x-ratelimit-reset-tokens": "27s",  # 450 tokens at 1000/60 per second
    }


def test_charge_above_the_whole_bucket_has_the_headers_over_redis(
    redis_url: str, redis_prefix: str
) -> None:
    async def scenario() -> dict[str, str]:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await too_large_shows_the_bucket(
                (
                    RedisBucketStore(client, redis_prefix),
                    RedisConcurrency(client, redis_prefix),
                )
            )
        finally:
            await client.aclose()

    assert run(scenario()) == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "550",
        "x-ratelimit-reset-tokens": "27s",
    }


def test_concurrency_cap_refuses_then_frees_and_refunds() -> None:
    async def scenario() -> None:
        admission, _, _ = build()
        tickets = [
            await admission.admit(
                request("a", 100, max_concurrency=2, tokens_per_minute=1000)
            )
            for _ in range(2)
        ]
        with pytest.raises(Rejected) as refused:
            await admission.admit(
                request("a", 100, max_concurrency=2, tokens_per_minute=1000)
            )
        assert (refused.value.status, refused.value.code) == (
            429,
            "concurrency_limit_exceeded",
        )
        # The refused request was not charged: its headers show 800 left.
        assert refused.value.headers["x-ratelimit-remaining-tokens"] == "800"
        await admission.release(tickets[0], used_tokens=100)
        third = await admission.admit(
            request("a", 100, max_concurrency=2, tokens_per_minute=1000)
        )
        # 3 admitted x 100, 1 refused without a charge: 700 left.
        assert third.headers["x-ratelimit-remaining-tokens"] == "700"

    run(scenario())


def test_overload_order_batch_pauses_over_share_refused_standard_queues() -> None:
    """GIVEN a pool of 10,000 tokens shared by gold (0.5, interactive), silver (0.3,
    standard), greedy (0.1, standard) and bronze (batch)
    WHEN the pool fills
    THEN batch pauses first, greedy (over share) gets 429, silver and gold queue and
    are admitted in tier order as capacity frees; nobody inside a guarantee is shed.
    """

    async def scenario() -> None:
        admission, live, _ = build(batch_ceiling=0.9)
        bronze = await admission.admit(request("bronze", 2000, tier=Tier.BATCH))
        gold = await admission.admit(
            request("gold", 4000, tier=Tier.INTERACTIVE, share=0.5)
        )
        silver = await admission.admit(request("silver", 2000, share=0.3))
        # 8,000 in flight: a second batch request would pass the idle ceiling.
        batch_wait = asyncio.ensure_future(
            admission.admit(request("bronze", 1000, tier=Tier.BATCH))
        )
        greedy = await admission.admit(request("greedy", 2000, share=0.1))  # bursts
        with pytest.raises(Rejected) as refused:
            await admission.admit(request("greedy", 1000, share=0.1))
        assert (refused.value.status, refused.value.code) == (
            429,
            "over_guaranteed_share",
        )
        silver_wait = asyncio.ensure_future(
            admission.admit(request("silver", 1000, share=0.3))
        )
        gold_wait = asyncio.ensure_future(
            admission.admit(request("gold", 1000, tier=Tier.INTERACTIVE, share=0.5))
        )
        await asyncio.sleep(0)
        assert [c.team for c in admission.control.waiting(("chat-7b", "v1"))] == [
            "gold",
            "silver",
            "bronze",
        ]
        # Freeing 2,000 lets gold (interactive) in first, then silver.
        await admission.release(greedy, used_tokens=2000)
        gold_more = await asyncio.wait_for(gold_wait, 1)
        silver_more = await asyncio.wait_for(silver_wait, 1)
        assert not batch_wait.done()  # batch still paused: the pool is full
        for ticket in (gold, silver, bronze, gold_more, silver_more):
            await admission.release(ticket, used_tokens=0)
        batch_more = await asyncio.wait_for(batch_wait, 1)
        assert live.tokens_in_flight(pool_key("chat-7b", "v1")) == 1000
        await admission.release(batch_more, used_tokens=0)

    run(scenario())


def test_queue_limit_sheds_batch_before_interactive_in_guarantee() -> None:
    async def scenario() -> None:
        admission, _, _ = build(max_queue=2)
        hog = await admission.admit(request("hog", 10_000, share=1.0))
        batch = asyncio.ensure_future(
            admission.admit(request("b", 500, tier=Tier.BATCH))
        )
        standard = asyncio.ensure_future(admission.admit(request("s", 500, share=0.0)))
        with pytest.raises(Rejected) as refused:  # the pool is full, s has no share
            await asyncio.wait_for(standard, 1)
        assert refused.value.status == 429
        inter = [
            asyncio.ensure_future(
                admission.admit(request(f"i{n}", 500, tier=Tier.INTERACTIVE, share=0.2))
            )
            for n in range(3)
        ]
        with pytest.raises(Rejected) as shed:
            await asyncio.wait_for(batch, 1)
        assert (shed.value.status, shed.value.code) == (503, "pool_overloaded")
        assert not any(task.done() for task in inter)  # never shed, even past the limit
        await admission.release(hog, used_tokens=0)
        for task in inter:
            await admission.release(await asyncio.wait_for(task, 1), used_tokens=0)

    run(scenario())


def test_queue_figures_follow_the_queue_in_the_live_share() -> None:
    """GIVEN a full pool
    WHEN requests wait in its queue, one leaves, the pool frees
    THEN this process's live-load share holds the queued tokens and requests (the
    exchange publishes them to the autoscaler), exact at each step, and none at the
    end.
    """
    queued_tokens = queue_tokens_key("chat-7b", "v1")
    queued_requests = queue_depth_key("chat-7b", "v1")

    async def scenario() -> None:
        admission, live, _ = build(capacity=1000)
        hog = await admission.admit(request("hog", 1000, share=0.2))
        first = asyncio.ensure_future(admission.admit(request("a", 300, share=0.4)))
        second = asyncio.ensure_future(admission.admit(request("b", 200, share=0.4)))
        await asyncio.sleep(0)
        assert (live.own[queued_tokens], live.own[queued_requests]) == (500, 2)

        second.cancel()  # its client left
        with pytest.raises(asyncio.CancelledError):
            await second
        assert (live.own[queued_tokens], live.own[queued_requests]) == (300, 1)

        await admission.release(hog, used_tokens=0)
        ticket = await asyncio.wait_for(first, 1)
        assert queued_tokens not in live.own
        assert queued_requests not in live.own
        await admission.release(ticket, used_tokens=0)

    run(scenario())


def test_refused_admission_gives_the_bucket_back() -> None:
    async def scenario() -> None:
        admission, _, _ = build(capacity=1000)
        hog = await admission.admit(request("hog", 1000, share=1.0))
        with pytest.raises(Rejected):
            await admission.admit(request("a", 600, tokens_per_minute=1000, share=0.0))
        await admission.release(hog, used_tokens=0)
        again = await admission.admit(request("a", 1000, tokens_per_minute=1000))
        assert again.headers["x-ratelimit-remaining-tokens"] == "0"

    run(scenario())


class CountingRedis(redis.asyncio.Redis):
    """A Redis client that records the commands it sends (one per round trip)."""

    sent: list[str]

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.sent.append(str(args[0]))
        return await super().execute_command(*args, **options)


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"test-limits-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


def test_admit_and_release_are_one_redis_round_trip_each(
    redis_url: str, redis_prefix: str
) -> None:
    """GIVEN admission over Redis stores (scripts already loaded)
    WHEN a request is admitted and released, and others are refused
    THEN each admit, refusal and release sends one command to Redis.
    """

    async def scenario() -> dict[str, list[str]]:
        client = CountingRedis.from_url(redis_url)
        assert isinstance(client, CountingRedis)
        client.sent = []
        stores = (
            RedisBucketStore(client, redis_prefix),
            RedisConcurrency(client, redis_prefix),
        )
        admission, _, _ = build(stores=stores)
        limits = Limits(tokens_per_minute=1000, max_concurrency=1)
        try:
            warm = await admission.admit(request("a", 10, **limits))
            await admission.release(warm, used_tokens=10)
            sent: dict[str, list[str]] = {}
            client.sent = []
            ticket = await admission.admit(request("a", 100, **limits))
            sent["admit"], client.sent = client.sent, []
            with pytest.raises(Rejected) as capped:
                await admission.admit(request("a", 100, **limits))
            assert capped.value.code == "concurrency_limit_exceeded"
            sent["capped"], client.sent = client.sent, []
            await admission.release(ticket, used_tokens=40)
            sent["release"], client.sent = client.sent, []
            with pytest.raises(Rejected) as limited:
                await admission.admit(request("a", 1000, **limits))
            assert limited.value.code == "rate_limit_exceeded"
            sent["limited"], client.sent = client.sent, []
            bucket = await stores[0].peek(
                "a:chat-7b", capacity=1000, refill_per_s=1000 / 60, now=1000.0
            )
            # 10 + 100 charged, 60 refunded; the capped request charged nothing.
            assert bucket.tokens == 1000 - 10 - 40
            assert await stores[1].count("a:chat-7b", 1000.0) == 0
            return sent
        finally:
            await client.aclose()

    assert run(scenario()) == {
        "admit": ["EVALSHA"],
        "capped": ["EVALSHA"],
        "release": ["EVALSHA"],
        "limited": ["EVALSHA"],
    }


def test_admitted_tokens_count_up_and_never_down_for_the_autoscaler() -> None:
    """The share's ``a|model|version`` is every token admitted into the pool since
    the process started (an embedding pool's autoscaler takes its rate): a release
    takes tokens out of flight, never out of the count; a queued request counts
    when the pump admits it."""

    async def scenario() -> None:
        admission, live, _ = build(capacity=1_000)
        counted = admitted_key("chat-7b", "v1")
        first = await admission.admit(request("a", 600))
        assert live.own[counted] == 600
        waiting = asyncio.ensure_future(
            admission.admit(request("b", 600, tier=Tier.BATCH))
        )
        await asyncio.sleep(0)
        assert live.own[counted] == 600  # queued, not admitted
        await admission.release(first, used_tokens=600)
        second = await asyncio.wait_for(waiting, 1)
        await admission.release(second, used_tokens=0)
        assert live.tokens_in_flight(pool_key("chat-7b", "v1")) == 0
        assert live.own[counted] == 1_200

    run(scenario())


def test_batch_lane_counts_every_gateways_batch_tokens() -> None:
    """The share's ``b|model|version`` is the batch tier's tokens in flight; the
    lane (here 200 of 1,000) is judged over this process's and the others'."""

    async def scenario() -> None:
        admission, live, _ = build(capacity=1_000, batch_lane=0.2)
        lane = batch_key("chat-7b", "v1")
        first = await admission.admit(request("a", 100, tier=Tier.BATCH))
        chat = await admission.admit(request("c", 300, tier=Tier.INTERACTIVE))
        assert live.own[lane] == 100  # the interactive request is not in the lane
        live.others[lane] = 60  # another gateway's batch
        waiting = asyncio.ensure_future(
            admission.admit(request("b", 100, tier=Tier.BATCH))
        )
        await asyncio.sleep(0)
        assert not waiting.done()  # 100 + 60 + 100 > 200
        await admission.release(chat, used_tokens=300)
        assert not waiting.done()  # interactive leaving frees nothing in the lane
        await admission.release(first, used_tokens=100)
        second = await asyncio.wait_for(waiting, 1)
        assert live.own[lane] == 100
        await admission.release(second, used_tokens=100)
        assert lane not in live.own

    run(scenario())
