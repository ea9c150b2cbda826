"""Token buckets and concurrency slots in Redis, shared by a region's gateways.

Public surface: ``RedisBucketStore``, ``RedisConcurrency``, ``RedisLimits``,
``BUCKET_TTL_MARGIN_S``.

One Lua script per operation makes each charge, refund and acquire atomic. The Lua
repeats the pure arithmetic of ``routing.domain.limiter`` step for step, in IEEE
doubles like Python's floats, so these stores give the same ``Charge`` as the
memory stores (``routing.limiter_store``) for the same history
(``routing/tests/test_limiter_store.py`` checks this on random histories).

Every gateway writes its own ``now`` into shared buckets, so gateway hosts need
synchronised clocks (NTP), as every multi-host limiter does; a bucket last written
by a host whose clock is ahead refills nothing until the others' clocks pass that
time.

A bucket is the hash ``{prefix}:bucket:{key}`` (``tokens``, ``updated_at``) that
expires once it would have refilled from empty (plus ``BUCKET_TTL_MARGIN_S``): an
absent bucket is a full one, so idle buckets cost no memory. Concurrency slots are
the sorted set ``{prefix}:conc:{key}`` of request ids scored by their expiry time,
so slots that a crashed gateway never released expire after ``ttl_s``.

The gateway's claims and give-backs (``RedisLimits``) that one turn of the event
loop starts go to Redis together, as one pipeline (``_TickBatch``): a command
through redis-py costs the gateway well over 100 us of CPU (the pool, its timeouts,
the reply's parse), a pipeline of several little more than one. Each script is
still its own atomic step; only the trip is shared.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import redis.asyncio
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from routing.domain import limiter
from routing.domain.limit_table import Claim, check_now, check_ttl
from routing.domain.limiter import Bucket, Charge
from routing.limiter_store import ConcurrencyStore

__all__ = [
    "BUCKET_TTL_MARGIN_S",
    "RedisBucketStore",
    "RedisConcurrency",
    "RedisLimits",
]

# A Redis bucket outlives its time to refill from empty by this much, so that it
# never vanishes (reads as full) while a gateway whose clock is behind would
# still see it partly empty. Covers clock skew between hosts; costs idle memory.
BUCKET_TTL_MARGIN_S = 10.0

# The scripts repeat ``limiter.refill``, ``charge`` and ``refund`` operation for
# operation (same order, same tolerance, same min/max), so that Lua's doubles round
# exactly as Python's floats do; keep them in step with that module. Floats travel
# as text both ways: into Lua as repr() read by tonumber() (exact), out as %.17g
# (exact), because Redis truncates Lua numbers in replies to integers and
# tostring() keeps only 14 digits.
_REFILL_LUA = """
local function num(x) return string.format('%.17g', x) end
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local now = tonumber(ARGV[4])
local tokens = capacity
local updated_at = now
local state = redis.call('HMGET', KEYS[1], 'tokens', 'updated_at')
if state[1] and state[2] then
  tokens = tonumber(state[1])
  updated_at = tonumber(state[2])
  local elapsed = now - updated_at
  if elapsed <= 0 then
    -- A clock going backwards refills nothing and keeps the later time.
    if tokens > capacity then tokens = capacity end
  else
    tokens = math.min(capacity, tokens + elapsed * rate)
    updated_at = now
  end
end
"""

_CHARGE_LUA = (
    _REFILL_LUA
    + """
local slack = TOLERANCE * capacity
local allowed = 0
local retry_after = 0
if tokens + slack >= amount then
  allowed = 1
  tokens = math.max(0.0, tokens - amount)
else
  local wait_s = (amount - tokens) / rate
  retry_after = math.max(1, math.ceil(wait_s - TOLERANCE * math.max(1.0, wait_s)))
end
redis.call('HSET', KEYS[1], 'tokens', num(tokens), 'updated_at', num(updated_at))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {allowed, num(tokens), num(updated_at), num(math.floor(tokens + slack)),
        num(retry_after), num((capacity - tokens) / rate)}
""".replace("TOLERANCE", repr(limiter._TOLERANCE))
)

_REFUND_LUA = (
    _REFILL_LUA
    + """
tokens = math.min(capacity, tokens + amount)
redis.call('HSET', KEYS[1], 'tokens', num(tokens), 'updated_at', num(updated_at))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {num(tokens), num(updated_at)}
"""
)


# The same steps as ``limiter.debit``: refill, then take the amount down to empty.
_DEBIT_LUA = (
    _REFILL_LUA
    + """
tokens = math.max(0.0, tokens - amount)
redis.call('HSET', KEYS[1], 'tokens', num(tokens), 'updated_at', num(updated_at))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""
)


def _float_arg(value: float) -> str:
    return repr(float(value))


def _int_reply(value: bytes | str) -> int:
    # An integral double as %.17g text ("12", "1e+20") is parsed exactly by float().
    return int(float(value))


class RedisBucketStore:
    """Keep buckets in Redis, shared by every gateway of a region.

    Each charge and each refund is one Lua script (one round trip, atomic), so
    concurrent gateways never both spend the same tokens. Arguments are checked
    in Python first, so a ``ChargeTooLarge`` never reaches Redis.
    """

    def __init__(self, client: redis.asyncio.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._charge = client.register_script(_CHARGE_LUA)
        self._refund = client.register_script(_REFUND_LUA)

    def bucket_key(self, key: str) -> str:
        """Return the Redis key of ``key``'s bucket hash."""
        return f"{self.prefix}:bucket:{key}"

    @staticmethod
    def ttl_ms(*, capacity: int, refill_per_s: float) -> int:
        """Return how long an untouched bucket is kept: refill from empty + margin."""
        return math.ceil((capacity / refill_per_s + BUCKET_TTL_MARGIN_S) * 1000)

    def _args(
        self, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> list[str]:
        return [
            str(capacity),
            _float_arg(refill_per_s),
            str(amount),
            _float_arg(now),
            str(self.ttl_ms(capacity=capacity, refill_per_s=refill_per_s)),
        ]

    async def charge(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> Charge:
        """Refill the bucket to ``now`` and take ``amount`` if it holds that much.

        Raises:
            ChargeTooLarge: ``amount > capacity``; Redis is not called.
            redis.RedisError: Redis is unreachable; the caller decides.
        """
        # Reject what the pure math rejects (same exceptions) before Redis is
        # called: running it on a fresh bucket costs a few microseconds and keeps
        # no second copy of its rules here.
        check_now(now)
        limiter.charge(
            None, now, capacity=capacity, refill_per_s=refill_per_s, amount=amount
        )
        allowed, tokens, updated_at, remaining, retry_after, reset = await self._charge(
            keys=[self.bucket_key(key)],
            args=self._args(
                capacity=capacity, refill_per_s=refill_per_s, amount=amount, now=now
            ),
        )
        return Charge(
            allowed=allowed == 1,
            bucket=Bucket(tokens=float(tokens), updated_at=float(updated_at)),
            limit=capacity,
            remaining=_int_reply(remaining),
            retry_after_s=_int_reply(retry_after),
            reset_s=float(reset),
        )

    async def refund(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> None:
        """Give back ``amount`` tokens (never above ``capacity``)."""
        check_now(now)
        limiter.refund(
            None, now, capacity=capacity, refill_per_s=refill_per_s, amount=amount
        )
        await self._refund(
            keys=[self.bucket_key(key)],
            args=self._args(
                capacity=capacity, refill_per_s=refill_per_s, amount=amount, now=now
            ),
        )

    def pair(self, slots: ConcurrencyStore) -> RedisLimits:
        """Return the store that charges here and takes ``slots`` in one step.

        Raises:
            TypeError: ``slots`` is not a ``RedisConcurrency`` on this client.
        """
        if not isinstance(slots, RedisConcurrency) or slots.client is not self.client:
            raise TypeError(
                "Redis buckets pair with a RedisConcurrency on the same client, not "
                f"{type(slots).__name__}"
            )
        return RedisLimits(self, slots)

    async def peek(
        self, key: str, *, capacity: int, refill_per_s: float, now: float
    ) -> Bucket:
        """Return the bucket as refilled to ``now``, without storing it."""
        tokens, updated_at = await self.client.hmget(
            self.bucket_key(key), ["tokens", "updated_at"]
        )
        stored = (
            Bucket(tokens=float(tokens), updated_at=float(updated_at))
            if tokens is not None and updated_at is not None
            else None
        )
        return limiter.refill(stored, now, capacity=capacity, refill_per_s=refill_per_s)


# The key expires with its longest-lived slot (only ever extended), so an
# abandoned set goes away; slots themselves expire by score, on the caller's clock.
_ACQUIRE_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZSCORE', KEYS[1], ARGV[3])
    or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[5]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[5])
  end
  return 1
end
return 0
"""


class RedisConcurrency:
    """Keep concurrency slots in Redis, shared by every gateway of a region.

    Acquire is one Lua script (expire, count, add: atomic), release one ZREM.
    """

    def __init__(self, client: redis.asyncio.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._acquire = client.register_script(_ACQUIRE_LUA)

    def slots_key(self, key: str) -> str:
        """Return the Redis key of ``key``'s sorted set of slots."""
        return f"{self.prefix}:conc:{key}"

    async def acquire(
        self,
        key: str,
        *,
        limit: int,
        request_id: str,
        now: float,
        ttl_s: float = 900.0,
    ) -> bool:
        """Take a slot for ``request_id`` unless ``limit`` unexpired slots are held.

        Raises:
            ValueError: ``now`` is not finite or ``ttl_s`` not a positive number.
            redis.RedisError: Redis is unreachable; the caller decides.
        """
        check_now(now)
        check_ttl(ttl_s)
        # The expiry is computed here, as in MemoryConcurrency, not in Lua.
        expires_at = now + ttl_s
        acquired = await self._acquire(
            keys=[self.slots_key(key)],
            args=[
                _float_arg(now),
                str(limit),
                request_id,
                _float_arg(expires_at),
                str(math.ceil(ttl_s * 1000)),
            ],
        )
        return acquired == 1

    async def release(self, key: str, *, request_id: str) -> None:
        """Free the slot of ``request_id`` (a no-op if it holds none)."""
        await self.client.zrem(self.slots_key(key), request_id)

    async def count(self, key: str, now: float) -> int:
        """Return the number of slots held at ``now`` (unexpired)."""
        return int(
            await self.client.zcount(self.slots_key(key), f"({_float_arg(now)}", "+inf")
        )


# KEYS: the bucket, the slots. ARGV 1-5 as for _CHARGE_LUA, then the slot cap, the
# request id, its expiry time and the slot key's TTL in ms (as _ACQUIRE_LUA).
# The same steps as _CHARGE_LUA then _ACQUIRE_LUA, except that the charge is
# stored only once the slot is taken: a refused slot leaves the bucket as it was.
_CLAIM_LUA = (
    _REFILL_LUA
    + """
local slack = TOLERANCE * capacity
if tokens + slack < amount then
  -- Refused by the bucket: store the refill, as a refused charge does; no slot.
  local wait_s = (amount - tokens) / rate
  local retry_after = math.max(1, math.ceil(wait_s - TOLERANCE * math.max(1.0, wait_s)))
  redis.call('HSET', KEYS[1], 'tokens', num(tokens), 'updated_at', num(updated_at))
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return {0, 0, num(tokens), num(updated_at), num(math.floor(tokens + slack)),
          num(retry_after), num((capacity - tokens) / rate)}
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
local has_slot = 0
if redis.call('ZSCORE', KEYS[2], ARGV[7])
    or redis.call('ZCARD', KEYS[2]) < tonumber(ARGV[6]) then
  has_slot = 1
  redis.call('ZADD', KEYS[2], ARGV[8], ARGV[7])
  if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[9]) then
    redis.call('PEXPIRE', KEYS[2], ARGV[9])
  end
  tokens = math.max(0.0, tokens - amount)
  redis.call('HSET', KEYS[1], 'tokens', num(tokens), 'updated_at', num(updated_at))
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
-- Without a slot nothing was stored: the reply is the charge of 0 tokens.
return {1, has_slot, num(tokens), num(updated_at), num(math.floor(tokens + slack)),
        num(0), num((capacity - tokens) / rate)}
""".replace("TOLERANCE", repr(limiter._TOLERANCE))
)

# KEYS: the bucket, the slots. ARGV 1-5 as for _REFUND_LUA, then the request id.
# A refund of 0 leaves the bucket alone (not even refilled), as memory does.
_GIVE_BACK_LUA = (
    "if tonumber(ARGV[3]) > 0 then\n"
    + _REFILL_LUA
    + """
tokens = math.min(capacity, tokens + amount)
redis.call('HSET', KEYS[1], 'tokens', num(tokens), 'updated_at', num(updated_at))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
redis.call('ZREM', KEYS[2], ARGV[6])
return 1
"""
)


_Call = tuple[AsyncScript, list[str], list[str], "asyncio.Future[Any]"]


class _TickBatch:
    """Send the script calls made in one turn of the event loop as one pipeline.

    A call waits at most until the loop's next turn. A call cancelled before its
    batch is sent is left out of it, so a request that went away takes no slot;
    once sent, a cancelled call's script runs, as a cancelled command would. A
    pipeline is no transaction: each script runs atomically on its own, in order.
    """

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self._calls: list[_Call] = []
        self._sending: set[asyncio.Task[None]] = set()  # referenced until done

    async def call(self, script: AsyncScript, keys: list[str], args: list[str]) -> Any:
        """Run ``script`` with ``keys`` and ``args``; return its reply."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._calls:
            loop.call_soon(self._flush)
        self._calls.append((script, keys, args, future))
        return await future

    def _flush(self) -> None:
        calls = [call for call in self._calls if not call[3].done()]
        self._calls = []
        if calls:
            task = asyncio.get_running_loop().create_task(self._send(calls))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, calls: list[_Call]) -> None:
        replies: list[Any]
        try:
            if len(calls) == 1:
                script, keys, args, _ = calls[0]
                replies = [await script(keys=keys, args=args)]
            else:
                pipe = self.client.pipeline(transaction=False)
                for script, keys, args, _ in calls:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                replies = await pipe.execute(raise_on_error=False)
                for i, (script, keys, args, _) in enumerate(calls):
                    if isinstance(replies[i], NoScriptError):
                        # Redis lost its scripts (a restart): nothing ran; the
                        # script's own call loads it and runs it.
                        try:
                            replies[i] = await script(keys=keys, args=args)
                        except Exception as exc:
                            replies[i] = exc
        except Exception as exc:
            # Redis unreachable (or the reply lost): every call of the batch failed.
            for *_, future in calls:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:
            for *_, future in calls:
                future.cancel()
            raise
        for (*_, future), reply in zip(calls, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)


class RedisLimits:
    """Charge and take a slot (refund and free it) in one Lua script each, in Redis.

    One script per call instead of two, atomic across both keys, and the calls of
    one turn of the event loop share a round trip (``_TickBatch``). Both keys live
    on one Redis server (a Redis Cluster would need them in one hash slot).
    """

    def __init__(self, buckets: RedisBucketStore, slots: RedisConcurrency) -> None:
        self.buckets = buckets
        self.slots = slots
        self._claim = buckets.client.register_script(_CLAIM_LUA)
        self._give_back = buckets.client.register_script(_GIVE_BACK_LUA)
        self._debit = buckets.client.register_script(_DEBIT_LUA)
        self._batch = _TickBatch(buckets.client)

    async def charge_and_acquire(
        self,
        key: str,
        *,
        capacity: int,
        refill_per_s: float,
        amount: int,
        limit: int,
        request_id: str,
        now: float,
        ttl_s: float = 900.0,
    ) -> Claim:
        """Charge ``amount`` to ``key``'s bucket and take a slot for ``request_id``.

        Raises:
            ChargeTooLarge: ``amount > capacity``; Redis is not called.
            redis.RedisError: Redis is unreachable; the caller decides.
        """
        check_now(now)
        check_ttl(ttl_s)
        limiter.charge(
            None, now, capacity=capacity, refill_per_s=refill_per_s, amount=amount
        )
        (
            allowed,
            has_slot,
            tokens,
            updated_at,
            remaining,
            retry_after,
            reset,
        ) = await self._batch.call(
            self._claim,
            [self.buckets.bucket_key(key), self.slots.slots_key(key)],
            [
                *self.buckets._args(
                    capacity=capacity,
                    refill_per_s=refill_per_s,
                    amount=amount,
                    now=now,
                ),
                str(limit),
                request_id,
                _float_arg(now + ttl_s),
                str(math.ceil(ttl_s * 1000)),
            ],
        )
        charge = Charge(
            allowed=allowed == 1,
            bucket=Bucket(tokens=float(tokens), updated_at=float(updated_at)),
            limit=capacity,
            remaining=_int_reply(remaining),
            retry_after_s=_int_reply(retry_after),
            reset_s=float(reset),
        )
        return Claim(charge, has_slot=has_slot == 1)

    async def refund_and_release(
        self,
        key: str,
        *,
        capacity: int,
        refill_per_s: float,
        amount: int,
        request_id: str,
        now: float,
    ) -> None:
        """Give ``amount`` tokens back (never above ``capacity``) and free the slot."""
        check_now(now)
        limiter.refund(
            None, now, capacity=capacity, refill_per_s=refill_per_s, amount=amount
        )
        await self._batch.call(
            self._give_back,
            [self.buckets.bucket_key(key), self.slots.slots_key(key)],
            [
                *self.buckets._args(
                    capacity=capacity, refill_per_s=refill_per_s, amount=amount, now=now
                ),
                request_id,
            ],
        )

    async def debit(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> None:
        """Take ``amount`` tokens from ``key``'s bucket whatever its level.

        Raises:
            redis.RedisError: Redis is unreachable; the caller decides.
        """
        check_now(now)
        limiter.debit(
            None, now, capacity=capacity, refill_per_s=refill_per_s, amount=amount
        )
        await self._batch.call(
            self._debit,
            [self.buckets.bucket_key(key)],
            self.buckets._args(
                capacity=capacity, refill_per_s=refill_per_s, amount=amount, now=now
            ),
        )
