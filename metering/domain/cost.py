"""The cost model: what a pool's GPUs cost, what each team's tokens owe, and what sat idle.

Public surface: ``TokenWeights``, ``PoolTime``, ``TeamTokens``, ``PoolCost``,
``TeamCost``, ``VersionCost``, ``allocate``, ``usd_per_million_at_full``,
``usd_per_million``, ``gpu_usd_per_hour``, ``gpu_hour_usd_for``, ``Span``,
``pool_times``, ``replica_tokens_per_s``.

A pool's cost is its GPU-hours times the GPU-hour price of its region: every second
a replica holds its GPUs counts (starting, loading, serving, stalled, draining),
because the GPUs are paid for whether or not they make tokens. A pool's capacity is
the time its replicas were serving times the version's measured output tokens per
second (the load test's, as the autoscaler uses it). Uncached prompt tokens,
cached prompt tokens and output tokens each weigh what they cost the GPU
(``TokenWeights``; an output token is 1), and utilisation is the weighted tokens
made over that capacity, at most 1: a pool kept busy with long prompts and short
answers is busy, not idle.

The used part of the cost (cost x utilisation) is split between the teams by their
share of weighted tokens, so each team pays for its tokens what they cost in a full
pool, ``usd / capacity`` per weighted token, whether the pool was full or half empty.
The rest is idle cost and is reported on its own line, never spread over the teams'
bills (seed: 0.28 USD per million output tokens when full, 0.56 when half busy).
Capacity is measured in output tokens at the load test's mix of prompts, so a pool
full at a prompt-heavy mix reads 1 (capped) a little before it is.

**An embedding model is priced per input token.** Its replicas make no output
tokens: the load test measures their capacity in input tokens per second, so
its pools' capacity is serving time x input tokens/s, each input token weighs 1
in the split (its requests are never cached: every token is embedded), and its
cost per million is per million input tokens: GPU cost per hour / (input tokens/s
x 3600 x utilisation). ``allocate`` prices the models named in
``input_priced`` so (``VersionCost.priced_by``); every other model per output
token as above.

Usage is metered per team, model, version, region and minute, so the split is per
version and region: each region's tokens pay for that region's pools, at that
region's GPU-hour price, and each region's idle part is its own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

__all__ = [
    "INPUT",
    "OUTPUT",
    "PoolCost",
    "PoolTime",
    "Span",
    "TeamCost",
    "TeamTokens",
    "TokenWeights",
    "VersionCost",
    "allocate",
    "gpu_hour_usd_for",
    "gpu_usd_per_hour",
    "pool_times",
    "replica_tokens_per_s",
    "usd_per_million",
    "usd_per_million_at_full",
]

_MILLION = 1_000_000.0

# The replica states in which a replica holds its GPUs, and the one in which it makes
# tokens. ``gone`` holds nothing.
HOLDING_STATES = frozenset({"starting", "loading", "serving", "stalled", "draining"})
SERVING_STATE = "serving"

# What a model's tokens are priced by: output tokens (chat), or input tokens
# (embeddings, which make none).
OUTPUT = "output"
INPUT = "input"

# A pool: model, version and region.
_PoolKey = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class TokenWeights:
    """What a token weighs in the split, in output tokens.

    Defaults: an output token is 1 (one decode step of one row); an uncached prompt
    token 0.25 (prefill runs many tokens per step, so it costs a fraction of a decode
    step; the 1:4 ratio of OpenAI's list prices for input and output); a cached
    prompt token a tenth of an uncached one (it is read from the prefix cache, not
    computed). Settable with ``PLATFORM_COST_WEIGHTS``.
    """

    prompt: float = 0.25
    cached: float = 0.025
    output: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prompt", "cached", "output"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"token weight {name} must be >= 0, not {value}")
        if self.output <= 0.0:
            raise ValueError("the output token weight must be > 0")

    def of(
        self, *, prompt_tokens: int, cached_tokens: int, output_tokens: int
    ) -> float:
        """Return the weighted tokens of a usage (``cached_tokens`` within prompt)."""
        uncached = max(0, prompt_tokens - cached_tokens)
        return (
            self.prompt * uncached
            + self.cached * min(cached_tokens, prompt_tokens)
            + self.output * output_tokens
        )


def gpu_hour_usd_for(
    region: str, *, default: float, by_region: Mapping[str, float]
) -> float:
    """Return the GPU-hour price in ``region``: its own if set, else ``default``."""
    return by_region.get(region, default)


def gpu_usd_per_hour(*, gpus: int, gpu_hour_usd: float) -> float:
    """Return what ``gpus`` GPUs cost per hour."""
    return gpus * gpu_hour_usd


def replica_tokens_per_s(
    measured: float | None, *, assumed: float
) -> tuple[float, bool]:
    """Return one replica's output tokens per second, and whether it is ``assumed``
    (no load test measured the version; a measured 0 is no measurement, as the
    autoscaler reads it)."""
    return (measured, False) if measured else (assumed, True)


def usd_per_million_at_full(
    *, gpus_per_replica: int, gpu_hour_usd: float, tokens_per_s: float
) -> float:
    """Return USD per million tokens of a replica kept full, in the unit of
    ``tokens_per_s`` (output tokens for chat, input tokens for embeddings).

    Seed: 1 GPU at 2.50 USD making 2,500 tokens a second, 9 million an hour: 0.28.
    """
    if tokens_per_s <= 0:
        raise ValueError("tokens_per_s must be > 0")
    return gpus_per_replica * gpu_hour_usd / (tokens_per_s * 3600.0 / _MILLION)


def usd_per_million(*, usd: float, tokens: int) -> float | None:
    """Return USD per million tokens actually made (output, or input for an
    embedding model); None without tokens."""
    if tokens <= 0:
        return None
    return usd / (tokens / _MILLION)


# -- GPU time from the replicas' state history -----------------------------------------


@dataclass(frozen=True, slots=True)
class Span:
    """A replica in one state from ``start`` until ``end`` (None: still in it)."""

    model: str
    version: str
    region: str
    gpus: int
    state: str
    start: datetime
    end: datetime | None


@dataclass(frozen=True, slots=True)
class PoolTime:
    """What one pool's replicas held and served over a period.

    ``held_s`` and ``serving_s`` are replica-seconds (not GPU-seconds);
    ``gpu_s`` is held time times GPUs per replica.
    """

    model: str
    version: str
    region: str
    held_s: float
    serving_s: float
    gpu_s: float

    @property
    def gpu_hours(self) -> float:
        return self.gpu_s / 3600.0


def pool_times(
    spans: Iterable[Span], *, start: datetime, end: datetime
) -> list[PoolTime]:
    """Add up each pool's replica time inside ``[start, end)``.

    An open span counts until ``end``: pass ``min(period end, now)``. Spans of
    states that hold no GPU add nothing.
    """
    held: dict[tuple[str, str, str], float] = defaultdict(float)
    serving: dict[tuple[str, str, str], float] = defaultdict(float)
    gpu: dict[tuple[str, str, str], float] = defaultdict(float)
    for span in spans:
        if span.state not in HOLDING_STATES:
            continue
        lo = max(span.start, start)
        hi = min(span.end or end, end)
        seconds = (hi - lo).total_seconds()
        if seconds <= 0:
            continue
        key = (span.model, span.version, span.region)
        held[key] += seconds
        gpu[key] += seconds * span.gpus
        if span.state == SERVING_STATE:
            serving[key] += seconds
    return [
        PoolTime(
            model=model,
            version=version,
            region=region,
            held_s=held[(model, version, region)],
            serving_s=serving[(model, version, region)],
            gpu_s=gpu[(model, version, region)],
        )
        for model, version, region in sorted(held)
    ]


# -- the split ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolCost:
    """One pool's GPU time with what it costs and what it could have made.

    ``tokens_per_s`` is one serving replica's capacity in output tokens per
    second (input tokens for an embedding model); ``gpu_hour_usd`` the price in
    the pool's region.
    """

    time: PoolTime
    gpus_per_replica: int
    gpu_hour_usd: float
    tokens_per_s: float

    @property
    def usd(self) -> float:
        return self.time.gpu_hours * self.gpu_hour_usd

    @property
    def capacity_tokens(self) -> float:
        return self.time.serving_s * self.tokens_per_s

    @property
    def usd_per_million_at_full(self) -> float:
        return usd_per_million_at_full(
            gpus_per_replica=self.gpus_per_replica,
            gpu_hour_usd=self.gpu_hour_usd,
            tokens_per_s=self.tokens_per_s,
        )


@dataclass(frozen=True, slots=True)
class TeamTokens:
    """What one team used of one version in one region over the period."""

    team: str
    model: str
    version: str
    region: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class TeamCost:
    """A team's tokens of one version, weighted, and its part of the used cost."""

    tokens: TeamTokens
    weighted_tokens: float
    usd: float


@dataclass(frozen=True, slots=True)
class VersionCost:
    """One version's cost in one region over the period.

    ``usd`` = ``teams_usd`` + ``idle_usd``. ``utilisation`` is the weighted tokens
    over the capacity, None when no replica served (nothing to measure against).
    ``priced_by`` is ``OUTPUT`` or ``INPUT`` (an embedding model), and
    ``priced_tokens`` the tokens of that kind made. ``usd_per_million_tokens`` is
    the cost over the priced tokens (None without tokens);
    ``usd_per_million_tokens_at_full`` what it would have been with every serving
    second used (None without serving time).
    """

    model: str
    version: str
    region: str
    pools: tuple[PoolCost, ...]
    usd: float
    gpu_hours: float
    output_tokens: int
    capacity_tokens: float
    utilisation: float | None
    teams: tuple[TeamCost, ...]
    teams_usd: float
    idle_usd: float
    usd_per_million_tokens: float | None
    usd_per_million_tokens_at_full: float | None
    priced_by: str = OUTPUT
    priced_tokens: int = 0


def allocate(
    pools: Sequence[PoolCost],
    usage: Sequence[TeamTokens],
    *,
    weights: TokenWeights,
    input_priced: Collection[str] = frozenset(),
) -> list[VersionCost]:
    """Split each version's GPU cost in each region between the teams that used it
    there, the rest on an idle line.

    A region's tokens pay for that region's pools only (at its GPU-hour price), so
    a region that costs more bills more per token. Tokens of a version with no GPU
    time in their region in the period (its replicas were started before and
    their history is missing, or the usage is late) cost nothing here and still
    appear, with ``usd`` 0, so the token totals stay whole. The models in
    ``input_priced`` (embedding models) are priced per input token: each of
    their prompt tokens weighs 1 against a capacity in input tokens.
    """
    by_pool: dict[_PoolKey, list[PoolCost]] = defaultdict(list)
    for pool in pools:
        by_pool[(pool.time.model, pool.time.version, pool.time.region)].append(pool)
    used: dict[_PoolKey, list[TeamTokens]] = defaultdict(list)
    for row in usage:
        used[(row.model, row.version, row.region)].append(row)

    costs = []
    for model, version, region in sorted(set(by_pool) | set(used)):
        its_pools = tuple(by_pool.get((model, version, region), ()))
        its_usage = used.get((model, version, region), [])
        usd = sum(p.usd for p in its_pools)
        capacity = sum(p.capacity_tokens for p in its_pools)
        output = sum(r.output_tokens for r in its_usage)
        if model in input_priced:
            priced_by, priced = INPUT, sum(r.prompt_tokens for r in its_usage)
            weighted = [float(r.prompt_tokens) for r in its_usage]
        else:
            priced_by, priced = OUTPUT, output
            weighted = [
                weights.of(
                    prompt_tokens=r.prompt_tokens,
                    cached_tokens=r.cached_tokens,
                    output_tokens=r.output_tokens,
                )
                for r in its_usage
            ]
        total_weight = sum(weighted)
        utilisation = None if capacity <= 0 else min(1.0, total_weight / capacity)
        # Tokens with GPU time but no serving time to compare with (history that
        # began mid-way): the teams carry all of it rather than none.
        busy_fraction = (
            utilisation if utilisation is not None else (1.0 if total_weight else 0.0)
        )
        busy_usd = usd * busy_fraction
        teams = tuple(
            TeamCost(
                tokens=row,
                weighted_tokens=w,
                usd=busy_usd * w / total_weight if total_weight > 0 else 0.0,
            )
            for row, w in zip(its_usage, weighted, strict=True)
        )
        teams_usd = sum(t.usd for t in teams)
        serving = [p for p in its_pools if p.time.serving_s > 0]
        at_full = (
            sum(p.usd_per_million_at_full * p.time.serving_s for p in serving)
            / sum(p.time.serving_s for p in serving)
            if serving
            else None
        )
        costs.append(
            VersionCost(
                model=model,
                version=version,
                region=region,
                pools=its_pools,
                usd=usd,
                gpu_hours=sum(p.time.gpu_hours for p in its_pools),
                output_tokens=output,
                capacity_tokens=capacity,
                utilisation=utilisation,
                teams=teams,
                teams_usd=teams_usd,
                idle_usd=max(0.0, usd - teams_usd),
                usd_per_million_tokens=usd_per_million(usd=usd, tokens=priced),
                usd_per_million_tokens_at_full=at_full,
                priced_by=priced_by,
                priced_tokens=priced,
            )
        )
    return costs
