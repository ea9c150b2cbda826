"""How much chat one replica carries once its prompts are counted, and what its
prefix cache can hit: the capacity plan's model of the fleet simulator's replica.

Public surface: ``StepCosts``, ``ChatLoad``, ``ReplicaLoad``, ``replica_load``,
``CacheHits``, ``cache_hit_estimate``, ``FleetEstimate``, ``estimate_fleet``,
``smallest_fleet``.

**Mean step time.** A replica receiving ``rate`` requests/s of ``prompt`` tokens
(``uncached`` of them computed, ``loaded`` of them read back from host memory) and
``answer`` output tokens runs steps of the ``PerfProfile`` formula
(``simengine.domain.perf``): every step gives each of its ``c`` decoding
streams one token, so a stream's answer takes ``answer`` steps and, by Little's
law, ``c = rate * answer * T`` for a mean step of ``T`` seconds. A prompt is
prefilled in ``ceil(uncached / (max_num_batched_tokens - c))`` steps; the other
steps decode only. The replica's busy time per second is then::

    steps/s * (a + b c + k_kv c ctx)                  every step
    + decode steps/s * max(W, c_tok c)                decode-only steps
    + prefill steps/s * max(W, c_tok (c + chunk))     steps that prefill
    + rate * (k_att A + p chunks + host_load loaded)  per request

with ``ctx = prompt + answer / 2`` (the KV a stream reads, on average) and
``A = uncached * (prompt - uncached) + uncached^2 / 2`` (the prefill attention
work, the same however the prompt is chunked). The busy time falls as ``T`` grows
(fewer steps, the same tokens), and the replica settles at the smallest ``T``
whose busy time fits in a second: that is its mean time per output token. None
when no ``T`` fits before ``max_num_seqs`` streams (the queue grows without end).
The host's per-sequence time (``h_ms``, CPU profiles only) is left out.

**Cache hits** (``cache_hit_estimate``), under prefix affinity: a user's next
message comes an exponential time (mean ``message_interval_s``) after the last, to
the same replica. An LRU cache keeps a block for its characteristic time ``tau``:
the time the replica takes to allocate as many new blocks as its free queue holds
(KV blocks less what running streams reserve; Che's approximation). The host tier
keeps a block for ``host tokens / tokens stored per second`` (every block computed
is stored). A history is found when the gap is under the longer of the two, a
chance of ``1 - exp(-tau / interval)``; the load bound sends ``off_owner`` of the
requests elsewhere, where they miss.

**Carried** (``FleetEstimate.is_carried``): the mean step is at most ``1 / stream_tokens_per_s``
(streams at their speed); the prefill chunks then fit with room and p95 TTFT stays
far under a second (the fleet simulator: 0.12-0.41 s wherever this holds at the
seed's peak). ``smallest_fleet`` is the least number of replicas that carries a
region's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "CacheHits",
    "ChatLoad",
    "FleetEstimate",
    "ReplicaLoad",
    "StepCosts",
    "cache_hit_estimate",
    "estimate_fleet",
    "replica_load",
    "smallest_fleet",
]

_MAX_FLEET = 10_000
_HIT_ITERATIONS = 60


@dataclass(frozen=True, slots=True)
class StepCosts:
    """The step-time constants of one replica (``PerfProfile``'s, same units) and
    its KV capacity in tokens."""

    a_ms: float
    w_ms: float
    ctok_ms: float
    b_ms: float
    kkv_us: float
    katt: float
    p_ms: float
    kv_cache_tokens: float
    max_num_seqs: int
    max_num_batched_tokens: int
    host_load_us_per_token: float


@dataclass(frozen=True, slots=True)
class ChatLoad:
    """One region's chat peak and the shape of its requests."""

    requests_per_s: float
    prompt_tokens: float
    cached_prefix_tokens: float
    answer_tokens: float
    stream_tokens_per_s: float
    message_interval_s: float
    host_cache_tokens: float = 0.0
    off_owner: float = 0.0


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's steady state: mean step (time per output token), streams."""

    step_ms: float
    streams: float
    busy_fraction: float


def replica_load(
    costs: StepCosts,
    rate: float,
    *,
    prompt: float,
    uncached: float,
    loaded: float,
    answer: float,
) -> ReplicaLoad | None:
    """Return the steady state of a replica at ``rate`` requests/s, or None when
    it cannot keep up (see the module docstring)."""
    if rate <= 0:
        return ReplicaLoad(step_ms=costs.a_ms + costs.w_ms, streams=0, busy_fraction=0)
    ctx = prompt + answer / 2
    work = uncached * (prompt - uncached) + uncached * uncached / 2

    def busy_ms(step_ms: float) -> float:
        steps = 1000.0 / step_ms
        streams = rate * answer * step_ms / 1000.0
        budget = max(costs.max_num_batched_tokens - streams, 1.0)
        chunks = max(1.0, math.ceil(uncached / budget)) if uncached > 0 else 0.0
        prefill_steps = min(rate * chunks, steps)
        chunk = uncached / chunks if chunks else 0.0
        every = costs.a_ms + costs.b_ms * streams + costs.kkv_us * streams * ctx / 1000
        decode_linear = max(costs.w_ms, costs.ctok_ms * streams)
        prefill_linear = max(costs.w_ms, costs.ctok_ms * (streams + chunk))
        per_request = (
            costs.katt * work
            + costs.p_ms * chunks
            + costs.host_load_us_per_token * loaded / 1000
        )
        return (
            steps * every
            + (steps - prefill_steps) * decode_linear
            + prefill_steps * prefill_linear
            + rate * per_request
        )

    # The most streams the replica runs at once bounds the step it may settle at.
    longest = costs.max_num_seqs * 1000.0 / (rate * answer)
    if busy_ms(longest) > 1000.0:
        return None
    low, high = 1e-3, longest
    for _ in range(80):
        mid = (low + high) / 2
        if busy_ms(mid) > 1000.0:
            low = mid
        else:
            high = mid
    return ReplicaLoad(
        step_ms=high,
        streams=rate * answer * high / 1000.0,
        busy_fraction=min(busy_ms(high) / 1000.0, 1.0),
    )


def cache_hit_estimate(costs: StepCosts, load: ChatLoad, replicas: int) -> CacheHits:
    """Return the share of cacheable history a fleet of ``replicas`` finds in its
    caches, in all and in the GPU pool alone (see the module docstring)."""
    rate = load.requests_per_s / replicas
    prompt, prefix = load.prompt_tokens, load.cached_prefix_tokens
    held = prompt + load.answer_tokens
    hit = gpu_hit = 0.5
    for _ in range(_HIT_ITERATIONS):
        found = hit * prefix
        state = replica_load(
            costs,
            rate,
            prompt=prompt,
            uncached=prompt - found,
            loaded=max(hit - gpu_hit, 0.0) * prefix,
            answer=load.answer_tokens,
        )
        streams = costs.max_num_seqs if state is None else state.streams
        # Tokens allocated (GPU) and stored (host) per second: all but the hit.
        written = max(rate * (held - found), 1e-9)
        gpu_tau = max(costs.kv_cache_tokens - streams * held, 0.0) / written
        tau = max(gpu_tau, load.host_cache_tokens / written)
        kept = 1.0 - load.off_owner
        new_gpu = (1.0 - math.exp(-gpu_tau / load.message_interval_s)) * kept
        new_hit = (1.0 - math.exp(-tau / load.message_interval_s)) * kept
        if abs(new_hit - hit) < 1e-7 and abs(new_gpu - gpu_hit) < 1e-7:
            return CacheHits(new_hit, new_gpu)
        hit, gpu_hit = (hit + new_hit) / 2, (gpu_hit + new_gpu) / 2
    return CacheHits(hit, gpu_hit)


@dataclass(frozen=True, slots=True)
class CacheHits:
    """Shares of the cacheable history found: in either tier, and on the GPU."""

    hit_rate: float
    gpu_hit_rate: float


@dataclass(frozen=True, slots=True)
class FleetEstimate:
    """What a fleet of ``replicas`` does with a region's peak."""

    replicas: int
    hit_rate: float
    host_hit_rate: float
    step_ms: float | None
    streams_per_replica: float | None
    uncached_prefill_tokens_per_s: float

    def is_carried(self, stream_tokens_per_s: float) -> bool:
        """Whether streams keep their speed: a mean step of at most
        ``1 / stream_tokens_per_s``."""
        return self.step_ms is not None and self.step_ms <= 1000.0 / stream_tokens_per_s


def estimate_fleet(
    costs: StepCosts, load: ChatLoad, replicas: int, hit_rate: float | None = None
) -> FleetEstimate:
    """Return what ``replicas`` do with ``load``: at ``hit_rate`` when given (an
    assumed hit rate, all from the GPU), else at the cache model's."""
    if hit_rate is None:
        hits = cache_hit_estimate(costs, load, replicas)
        hit_rate, host_hit = hits.hit_rate, max(hits.hit_rate - hits.gpu_hit_rate, 0.0)
    else:
        host_hit = 0.0
    prefix = load.cached_prefix_tokens
    uncached = load.prompt_tokens - hit_rate * prefix
    state = replica_load(
        costs,
        load.requests_per_s / replicas,
        prompt=load.prompt_tokens,
        uncached=uncached,
        loaded=host_hit * prefix,
        answer=load.answer_tokens,
    )
    return FleetEstimate(
        replicas=replicas,
        hit_rate=hit_rate,
        host_hit_rate=host_hit,
        step_ms=None if state is None else state.step_ms,
        streams_per_replica=None if state is None else state.streams,
        uncached_prefill_tokens_per_s=load.requests_per_s * uncached,
    )


def smallest_fleet(
    costs: StepCosts, load: ChatLoad, hit_rate: float | None = None
) -> FleetEstimate | None:
    """Return the estimate of the least number of replicas that carries ``load``,
    or None when no fleet up to 10,000 does."""
    for replicas in range(1, _MAX_FLEET + 1):
        estimate = estimate_fleet(costs, load, replicas, hit_rate)
        if estimate.is_carried(load.stream_tokens_per_s):
            return estimate
    return None
