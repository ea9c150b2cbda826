"""The gateway's own Prometheus metrics (default registry, served at /metrics).

Public surface: the collectors below, ``observe_request``, ``observe_team_tokens``,
``observe_shadow``, ``count_retry``, ``count_rejection``, ``count_rate_limited``,
``count_shed``, ``set_pool_load``, ``set_control_plane``, ``set_snapshot_from_disk``,
``count_snapshot_file_refused``, ``set_limits_degraded``,
``set_usage_buffered``, ``count_figures_dropped``, ``count_kv_batch``,
``pools_with_series``,
``forget_pool``, ``OUTCOMES``, ``SHED_CAUSES``,
and the figures read from the database at scrape time: the autoscaler's
(``PoolScalingFigures``, ``PoolScalingCollector``, ``register_pool_scaling``), the
pools' GPUs and their cost (``PoolCostFigures``, ``PoolCostCollector``,
``register_pool_costs``), the pools' live figures (``PoolLiveFigures``,
``PoolLiveCollector``, ``register_pool_live``), rollouts (``OpenRollout``, ``GuardTrips``,
``RolloutCollector``, ``register_rollouts``) and batches
(``BatchFigures``, ``BatchCollector``, ``register_batches``).

Labels are bounded: model, version, region, team, tier, outcome; never request ids
or user text. Helpers cache ``.labels()`` children (a dict lookup instead of the
label validation and lock of ``.labels()`` on every request). ``forget_pool``
removes a pool's series (every series labelled with its model, version and region)
when the pool is not this region's: the gateway calls it once a second for each
pool with a series (``pools_with_series``) that its snapshot does not hold
(``routing.gateway``), in the process that holds the series. The team series are
per team and model, not per pool, and stay for the process's life (counters of a
bounded label set; removing them would lose their increase).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

__all__ = [
    "AUTOSCALER_DECISIONS",
    "BUDGET_HARD_RATIO",
    "BUDGET_REFUSALS",
    "BUDGET_SOFT_RATIO",
    "BUDGET_SPEND_RATIO",
    "CACHED_TOKENS",
    "CONTROL_PLANE_UP",
    "FIGURES_DROPPED",
    "KV_EVENT_BATCHES",
    "LIMITS_DEGRADED",
    "LIVE_JUDGEMENTS",
    "OUTCOMES",
    "OUTPUT_TOKENS",
    "PREFIX_INDEX_BLOCKS",
    "PROMPT_TOKENS",
    "QUEUE_DEPTH",
    "REQUESTS",
    "SHADOW_REQUESTS",
    "SHADOW_TTFT_SECONDS",
    "SHED_CAUSES",
    "SNAPSHOT_AGE_SECONDS",
    "SNAPSHOT_FILE_REFUSED",
    "SNAPSHOT_FROM_DISK",
    "TEAM_RATE_LIMITED",
    "TEAM_SHED",
    "TEAM_TOKENS",
    "TIME_PER_OUTPUT_TOKEN_SECONDS",
    "TOKENS_IN_FLIGHT",
    "TTFT_SECONDS",
    "UPSTREAM_RETRIES",
    "USAGE_BUFFERED_ROWS",
    "BatchCollector",
    "BatchFigures",
    "GuardTrips",
    "OpenRollout",
    "Outcome",
    "PoolCostCollector",
    "PoolCostFigures",
    "PoolLiveCollector",
    "PoolLiveFigures",
    "PoolScalingCollector",
    "PoolScalingFigures",
    "RolloutCollector",
    "ShedCause",
    "count_budget_refusal",
    "count_figures_dropped",
    "count_kv_batch",
    "count_rate_limited",
    "count_rejection",
    "count_retry",
    "count_shed",
    "count_snapshot_file_refused",
    "forget_pool",
    "observe_request",
    "observe_shadow",
    "observe_team_tokens",
    "pools_with_series",
    "register_batches",
    "register_pool_costs",
    "register_pool_live",
    "register_pool_scaling",
    "register_rollouts",
    "set_budget_spend",
    "set_control_plane",
    "set_limits_degraded",
    "set_pool_load",
    "set_snapshot_from_disk",
    "set_usage_buffered",
]

Outcome = Literal["ok", "error", "client_closed", "retried"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "error", "client_closed", "retried")
# Why a request was shed with 503: admission shed its tier (the pool is
# overloaded), or no replica of the pool could start an answer (none serving, every
# one tried failed before its first token, or the retry budget was spent).
ShedCause = Literal["overload", "no_replica"]
SHED_CAUSES: tuple[ShedCause, ...] = ("overload", "no_replica")

POOL_LABELS = ("model", "version", "region")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5)

# Per pool.
OUTPUT_TOKENS = Counter(
    "platform_output_tokens_total", "Tokens generated, per pool.", POOL_LABELS
)
PROMPT_TOKENS = Counter(
    "platform_prompt_tokens_total", "Prompt tokens sent, per pool.", POOL_LABELS
)
CACHED_TOKENS = Counter(
    "platform_cached_tokens_total",
    "Prompt tokens served from the prefix cache, per pool.",
    POOL_LABELS,
)
TOKENS_IN_FLIGHT = Gauge(
    "platform_tokens_in_flight",
    "Tokens of the requests this gateway has in flight, per pool.",
    POOL_LABELS,
)
QUEUE_DEPTH = Gauge(
    "platform_queue_depth", "Requests waiting for admission, per pool.", POOL_LABELS
)
PREFIX_INDEX_BLOCKS = Gauge(
    "platform_prefix_index_blocks",
    "Prompt blocks (x media) this gateway process's prefix index says the pool's "
    "replicas hold, from their KV events (cache-aware routing); 0 without events.",
    POOL_LABELS,
)
TTFT_SECONDS = Histogram(
    "platform_ttft_seconds",
    "Time to first token seen by the client, per pool.",
    POOL_LABELS,
    buckets=TTFT_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN_SECONDS = Histogram(
    "platform_time_per_output_token_seconds",
    "Mean time between output tokens of a request, per pool.",
    POOL_LABELS,
    buckets=TPOT_BUCKETS,
)
REQUESTS = Counter(
    "platform_requests_total",
    "Requests finished, per pool and outcome (ok, error, client_closed, retried).",
    (*POOL_LABELS, "outcome"),
)
UPSTREAM_RETRIES = Counter(
    "platform_upstream_retries_total",
    "Requests sent again to another replica, per pool.",
    POOL_LABELS,
)
SHADOW_REQUESTS = Counter(
    "platform_shadow_requests_total",
    "Shadow copies sent to a version under test, per pool and outcome (ok, error).",
    (*POOL_LABELS, "outcome"),
)
LIVE_JUDGEMENTS = Counter(
    "platform_live_judgements_total",
    "Pairs the live-answer judge was asked about, per candidate pool and outcome "
    "(win, loss, tie, unreadable for the candidate; incomplete when an answer or "
    "the judge failed; skipped when the request cannot be shown to a judge).",
    (*POOL_LABELS, "outcome"),
)
SHADOW_TTFT_SECONDS = Histogram(
    "platform_shadow_ttft_seconds",
    "Time to first token of shadow copies, per pool.",
    POOL_LABELS,
    buckets=TTFT_BUCKETS,
)

# Per team.
TEAM_TOKENS = Counter(
    "platform_team_tokens_total",
    "Tokens per team and model; kind is prompt, cached or output.",
    ("team", "model", "kind"),
)
TEAM_RATE_LIMITED = Counter(
    "platform_team_rate_limited_total",
    "Requests refused with 429, per team, model and tier.",
    ("team", "model", "tier"),
)
BUDGET_SPEND_RATIO = Gauge(
    "platform_team_budget_spend_ratio",
    'A team\'s spend this month over its monthly USD budget (model "*": the '
    "budget on all its models), reservations of requests in flight included, as "
    "this gateway last saw it (docs/finance.md).",
    ("team", "model"),
)
BUDGET_SOFT_RATIO = Gauge(
    "platform_team_budget_soft_ratio",
    "The spend ratio at which a team's budget alerts (its soft threshold).",
    ("team", "model"),
)
BUDGET_HARD_RATIO = Gauge(
    "platform_team_budget_hard_ratio",
    "The spend ratio past which a team's new requests are refused (429).",
    ("team", "model"),
)
BUDGET_REFUSALS = Counter(
    "platform_team_budget_refused_total",
    "Requests refused with 429 budget_exceeded, per team and budget (model).",
    ("team", "model"),
)
TEAM_SHED = Counter(
    "platform_team_shed_total",
    "Requests refused with 503, per team, model, tier and cause: overload (admission "
    "shed the tier) or no_replica (no replica of the pool could start an answer).",
    ("team", "model", "tier", "cause"),
)

# The gateway itself.
SNAPSHOT_AGE_SECONDS = Gauge(
    "platform_snapshot_age_seconds",
    "Age of the routing snapshot this gateway serves from (NaN before the first).",
)
CONTROL_PLANE_UP = Gauge(
    "platform_control_plane_up",
    "1 while the last snapshot refresh reached the control plane, else 0.",
)
REGION_READY = Gauge(
    "platform_region_ready",
    "1 while this gateway judges its region able to serve (what /healthz tells "
    "the global load balancer: serving replicas, a fresh snapshot, Redis), else 0.",
)
SNAPSHOT_FROM_DISK = Gauge(
    "platform_snapshot_from_disk",
    "1 while this gateway serves the snapshot file it found on local disk at start "
    "(the database was down), 0 once a refresh reached the database.",
)
SNAPSHOT_FILE_REFUSED = Counter(
    "platform_snapshot_file_refused_total",
    "Snapshot files refused at start, per reason (digest, format, region, mode, "
    "malformed, unreadable).",
    ("reason",),
)
LIMITS_DEGRADED = Gauge(
    "platform_limits_degraded",
    "1 while this gateway process enforces team limits alone, at its share of each "
    "limit, because Redis is unreachable; 0 while Redis holds them (or without Redis).",
)
USAGE_BUFFERED_ROWS = Gauge(
    "platform_usage_buffered_rows",
    "Usage rows (team, model, version, minute) this gateway process holds in memory "
    "because Redis was unreachable, until it pushes them there.",
)
FIGURES_DROPPED = Counter(
    "platform_figures_dropped_total",
    "Requests whose rollout figures this gateway process dropped: reason redis "
    "(Redis failed; figures are not billing, so they are not kept) or invalid.",
    ("reason",),
)

TRAFFIC_RECORDS = Counter(
    "platform_traffic_records_total",
    "Requests of recording pools this gateway process kept for the traffic twin "
    "(routing.traffic): outcome written (to the region's Redis), or dropped (its "
    "buffer was full, or Redis refused the batch).",
    ("model", "outcome"),
)

KV_EVENT_BATCHES = Counter(
    "platform_kv_event_batches_total",
    "Replicas' KV-event batches this gateway process read: outcome applied (to "
    "its pool's prefix index), rejected (not a batch), or cleared (a lost batch "
    "or a restarted publisher dropped the replica's entries first).",
    ("outcome",),
)

F = TypeVar("F")

_POOL_COLLECTORS: tuple[MetricWrapperBase, ...] = (
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    CACHED_TOKENS,
    TOKENS_IN_FLIGHT,
    QUEUE_DEPTH,
    PREFIX_INDEX_BLOCKS,
    TTFT_SECONDS,
    TIME_PER_OUTPUT_TOKEN_SECONDS,
    REQUESTS,
    UPSTREAM_RETRIES,
    SHADOW_REQUESTS,
    SHADOW_TTFT_SECONDS,
    LIVE_JUDGEMENTS,
)

# (collector, label values) -> child. Bounded like the labels themselves.
_children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
_children_lock = threading.Lock()


def _child(metric: MetricWrapperBase, *values: str) -> Any:
    child = _children.get((metric, values))
    if child is None:
        child = metric.labels(*values)
        with _children_lock:
            _children[(metric, values)] = child
    return child


def observe_request(
    *,
    model: str,
    version: str,
    region: str,
    outcome: Outcome,
    team: str | None = None,
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    output_tokens: int = 0,
    ttft_s: float | None = None,
    duration_s: float | None = None,
    time_per_output_token_s: float | None = None,
) -> None:
    """Record one finished request of a pool (call once, at its end).

    With ``team``, its tokens are added to the team's counters too. The time per
    output token is ``time_per_output_token_s`` if given, else derived from
    ``duration_s`` and ``ttft_s`` when at least two tokens came out.
    """
    pool = (model, version, region)
    _child(REQUESTS, *pool, outcome).inc()
    if prompt_tokens:
        _child(PROMPT_TOKENS, *pool).inc(prompt_tokens)
    if cached_tokens:
        _child(CACHED_TOKENS, *pool).inc(cached_tokens)
    if output_tokens:
        _child(OUTPUT_TOKENS, *pool).inc(output_tokens)
    if ttft_s is not None:
        _child(TTFT_SECONDS, *pool).observe(ttft_s)
        if time_per_output_token_s is None and duration_s and output_tokens > 1:
            time_per_output_token_s = (duration_s - ttft_s) / (output_tokens - 1)
    if time_per_output_token_s is not None:
        _child(TIME_PER_OUTPUT_TOKEN_SECONDS, *pool).observe(time_per_output_token_s)
    if team is not None:
        observe_team_tokens(
            team=team,
            model=model,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            output_tokens=output_tokens,
        )


def observe_team_tokens(
    *,
    team: str,
    model: str,
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    output_tokens: int = 0,
) -> None:
    """Add a finished request's tokens to its team's counters."""
    for kind, tokens in (
        ("prompt", prompt_tokens),
        ("cached", cached_tokens),
        ("output", output_tokens),
    ):
        if tokens:
            _child(TEAM_TOKENS, team, model, kind).inc(tokens)


def count_retry(*, model: str, version: str, region: str) -> None:
    """Count one request sent again to another replica of the pool."""
    _child(UPSTREAM_RETRIES, model, version, region).inc()


def observe_shadow(
    *, model: str, version: str, region: str, outcome: str, ttft_s: float | None
) -> None:
    """Record one shadow copy sent to a version under test (outcome: ok, error)."""
    _child(SHADOW_REQUESTS, model, version, region, outcome).inc()
    if ttft_s is not None:
        _child(SHADOW_TTFT_SECONDS, model, version, region).observe(ttft_s)


def count_live_judgement(
    *, model: str, version: str, region: str, outcome: str
) -> None:
    """Count one pair the live-answer judge was asked about (``LIVE_JUDGEMENTS``)."""
    _child(LIVE_JUDGEMENTS, model, version, region, outcome).inc()


def count_rejection(*, team: str, model: str, tier: str, status: int) -> None:
    """Count one request admission refused: 429 is rate limited, any other status
    is shed for overload."""
    if status == 429:
        count_rate_limited(team=team, model=model, tier=tier)
    else:
        count_shed(team=team, model=model, tier=tier, cause="overload")


def set_budget_spend(
    *, team: str, model: str, spend_ratio: float, soft_ratio: float, hard_ratio: float
) -> None:
    """Set a budget's spend ratio and its thresholds (``model`` "" is "*")."""
    label = model or "*"
    _child(BUDGET_SPEND_RATIO, team, label).set(spend_ratio)
    _child(BUDGET_SOFT_RATIO, team, label).set(soft_ratio)
    _child(BUDGET_HARD_RATIO, team, label).set(hard_ratio)


def count_budget_refusal(*, team: str, model: str) -> None:
    """Count one request refused for its budget (``model`` "" is "*")."""
    _child(BUDGET_REFUSALS, team, model or "*").inc()


def count_rate_limited(*, team: str, model: str, tier: str) -> None:
    """Count one request refused with 429."""
    _child(TEAM_RATE_LIMITED, team, model, tier).inc()


def count_shed(*, team: str, model: str, tier: str, cause: ShedCause) -> None:
    """Count one request refused with 503, and why (``ShedCause``)."""
    _child(TEAM_SHED, team, model, tier, cause).inc()


def set_pool_load(
    *,
    model: str,
    version: str,
    region: str,
    tokens_in_flight: int,
    queue_depth: int,
    index_blocks: int = 0,
) -> None:
    """Set a pool's in-flight tokens, queue depth and prefix-index gauges."""
    _child(TOKENS_IN_FLIGHT, model, version, region).set(tokens_in_flight)
    _child(QUEUE_DEPTH, model, version, region).set(queue_depth)
    _child(PREFIX_INDEX_BLOCKS, model, version, region).set(index_blocks)


def set_control_plane(*, up: bool, snapshot_age_s: float | None) -> None:
    """Set whether the last refresh reached the control plane, and the snapshot age.

    ``snapshot_age_s`` is None while the gateway has never loaded a snapshot (it
    started with the database down): the age is then unknown and the gauge reads
    NaN, Prometheus' "no value", rather than a made-up number.
    """
    CONTROL_PLANE_UP.set(1 if up else 0)
    SNAPSHOT_AGE_SECONDS.set(math.nan if snapshot_age_s is None else snapshot_age_s)


def set_region_ready(*, ready: bool) -> None:
    """Set whether this gateway judges its region able to serve (``/healthz``)."""
    REGION_READY.set(1 if ready else 0)


def set_snapshot_from_disk(*, from_disk: bool) -> None:
    """Set whether this gateway serves the snapshot file rather than the database's."""
    SNAPSHOT_FROM_DISK.set(1 if from_disk else 0)


def count_snapshot_file_refused(reason: str) -> None:
    """Count a snapshot file refused at start (``reason`` is a bounded word)."""
    SNAPSHOT_FILE_REFUSED.labels(reason).inc()


def set_limits_degraded(*, is_degraded: bool) -> None:
    """Set whether this process enforces team limits alone (Redis unreachable)."""
    LIMITS_DEGRADED.set(1 if is_degraded else 0)


def set_usage_buffered(*, rows: int) -> None:
    """Set how many usage rows wait in memory for Redis."""
    USAGE_BUFFERED_ROWS.set(rows)


def count_figures_dropped(*, reason: Literal["redis", "invalid"]) -> None:
    """Count one request whose rollout figures were dropped."""
    _child(FIGURES_DROPPED, reason).inc()


def count_kv_batch(outcome: Literal["applied", "rejected", "cleared"]) -> None:
    """Count one KV-event batch read from a replica."""
    _child(KV_EVENT_BATCHES, outcome).inc()


def pools_with_series(region: str) -> set[tuple[str, str]]:
    """Return the (model, version) of every pool of ``region`` with a series here.

    Whatever made the series (the load gauges, a request, a retry, a shadow
    copy), so that the gateway can forget a pool its snapshot never held.
    """
    with _children_lock:
        return {
            (values[0], values[1])
            for metric, values in _children
            if metric in _POOL_COLLECTORS and values[2] == region
        }


def forget_pool(model: str, version: str, region: str) -> None:
    """Remove every series of a pool (it was deleted or left this region).

    Called by the gateway for every pool with a series here that its snapshot
    does not hold (``pools_with_series``); a later request of the pool starts its
    counters from zero. The team series (team, model, ...) are not a pool's:
    bounded by teams x models, they live as long as the process.
    """
    labels = {"model": model, "version": version, "region": region}
    for metric in _POOL_COLLECTORS:
        metric.remove_by_labels(labels)
    pool = (model, version, region)
    with _children_lock:
        stale = [
            key
            for key in _children
            if key[0] in _POOL_COLLECTORS and key[1][:3] == pool
        ]
        for key in stale:
            del _children[key]


# -- the autoscaler's figures, read at scrape time ------------------------------------


@dataclass(frozen=True, slots=True)
class PoolScalingFigures:
    """One pool's autoscaling figures as the control plane holds them.

    ``utilisation`` is the last tick's (None before one, or without replicas);
    ``decisions`` counts the autoscaler's size changes per reason since the pool
    was created. ``kind`` is what the pool serves (``chat``, ``embedding``); an
    embedding pool's ``capacity_input_tokens_per_s`` is its serving replicas x
    the input tokens/s one sustains (measured, else the default), what the
    autoscaler sizes it on (None for a chat pool).
    """

    model: str
    version: str
    region: str
    desired_replicas: int
    serving_replicas: int
    starting_replicas: int
    utilisation: float | None
    is_capacity_exhausted: bool
    capacity_is_assumed: bool
    is_panicking: bool
    decisions: Mapping[str, int] = field(default_factory=dict)
    kind: str = "chat"
    capacity_input_tokens_per_s: float | None = None


# (name, help) of each per-pool gauge, in the order they are exported.
_SCALING_GAUGES = (
    ("platform_pool_desired_replicas", "Replicas the autoscaler wants, per pool."),
    (
        "platform_pool_serving_replicas",
        "Replicas serving and heard from, per pool (as the autoscaler counts them).",
    ),
    (
        "platform_pool_starting_replicas",
        "Replicas starting, loading, stalled or silent: counted, not serving.",
    ),
    (
        "platform_pool_utilisation",
        "Demand over the pool's capacity at the last tick: tokens in flight and "
        "queued (chat), input tokens/s (embedding).",
    ),
    (
        "platform_pool_capacity_exhausted",
        "1 while the pool needs replicas the region's GPUs cannot start.",
    ),
    (
        "platform_pool_capacity_assumed",
        "1 while the version has no load test: its capacity is the default.",
    ),
    ("platform_pool_panicking", "1 while the autoscaler is in panic mode."),
    (
        "platform_pool_capacity_input_tokens_per_s",
        "An embedding pool's capacity: serving replicas x the input tokens/s one "
        "sustains at its latency target (no sample for a chat pool).",
    ),
)
POOL_INFO = "platform_pool_info"
AUTOSCALER_DECISIONS = "platform_autoscaler_decisions"


class _ScrapeTimeCollector(Collector, Generic[F]):
    """Export figures that ``read`` fetches from the database when Prometheus scrapes.

    The figures' owners (the autoscaler and the reaper in the Celery worker, the
    rollout guards, the batch runners) are not scraped; their results live in the
    database. When it does not answer, the scrape goes on without these series:
    the families stay described, with no sample, so a scrape sees the series go
    missing rather than the metric disappear. Subclasses build the families.
    """

    # What the figures are, for the log line when they cannot be read.
    what = "figures"

    def __init__(self, read: Callable[[], Iterable[F]]) -> None:
        self.read = read

    def describe(self) -> Iterator[Metric]:
        # Without describe() the registry would call collect() (the database) at
        # registration, in every process that imports this module.
        yield from self._families([])

    def collect(self) -> Iterator[Metric]:
        try:
            figures = list(self.read())
        except Exception as exc:
            # The type name only: a database error's text may carry its DSN.
            logger.warning("%s unreadable: %s", self.what, type(exc).__name__)
            figures = []
        yield from self._families(figures)

    def _families(self, figures: list[F]) -> Iterator[Metric]:
        raise NotImplementedError


class PoolScalingCollector(_ScrapeTimeCollector[PoolScalingFigures]):
    """Export the autoscaler's per-pool figures, read when Prometheus scrapes.

    ``read`` returns them (``control.autoscaling.pool_figures``, two
    queries). Every scraped process of a region exports the same values:
    aggregate with ``max by (model, version, region)``.
    """

    what = "pool scaling figures"

    def _families(self, figures: list[PoolScalingFigures]) -> Iterator[Metric]:
        gauges = [
            GaugeMetricFamily(n, h, labels=POOL_LABELS) for n, h in _SCALING_GAUGES
        ]
        info = GaugeMetricFamily(
            POOL_INFO,
            "1 per pool, labelled with its kind (chat or embedding).",
            labels=(*POOL_LABELS, "kind"),
        )
        decisions = CounterMetricFamily(
            AUTOSCALER_DECISIONS,
            "Size changes the autoscaler made, per pool and reason.",
            labels=(*POOL_LABELS, "reason"),
        )
        for f in figures:
            pool = [f.model, f.version, f.region]
            values: tuple[float | None, ...] = (
                f.desired_replicas,
                f.serving_replicas,
                f.starting_replicas,
                f.utilisation,
                float(f.is_capacity_exhausted),
                float(f.capacity_is_assumed),
                float(f.is_panicking),
                f.capacity_input_tokens_per_s,
            )
            for gauge, value in zip(gauges, values, strict=True):
                if value is not None:
                    gauge.add_metric(pool, value)
            info.add_metric([*pool, f.kind], 1.0)
            for reason, count in sorted(f.decisions.items()):
                decisions.add_metric([*pool, reason], count)
        yield from gauges
        yield info
        yield decisions


_scaling_collector: PoolScalingCollector | None = None


def register_pool_scaling(read: Callable[[], Iterable[PoolScalingFigures]]) -> None:
    """Export the autoscaler's figures from ``read`` in this process (once)."""
    global _scaling_collector
    if _scaling_collector is not None:
        return
    _scaling_collector = PoolScalingCollector(read)
    REGISTRY.register(_scaling_collector)


# -- the pools' GPUs and their cost, read at scrape time -------------------------------


@dataclass(frozen=True, slots=True)
class PoolCostFigures:
    """One pool's GPUs now, what they cost an hour, and its silent replicas.

    ``gpus`` counts the GPUs of every replica not gone (starting, loading,
    serving, stalled, draining all hold theirs). ``usd_per_million_tokens_at_full``
    is at the version's load-tested tokens per second, or the cost model's assumed
    rate before a load test (``platform_pool_capacity_assumed`` is 1 then).
    ``silent_replicas``: replicas not gone whose last heartbeat is older than the
    missed-beat window (the reaper has not marked them gone yet).
    """

    model: str
    version: str
    region: str
    gpus: int
    gpu_usd_per_hour: float
    usd_per_million_tokens_at_full: float
    silent_replicas: int


class PoolCostCollector(_ScrapeTimeCollector[PoolCostFigures]):
    """Export each pool's GPUs, their cost per hour and its silent replicas.

    ``read`` is ``control.pool_costs.pool_cost_figures``. Like the scaling
    figures, every scraped process exports the same values: aggregate with ``max``.
    """

    what = "pool cost figures"

    def _families(self, figures: list[PoolCostFigures]) -> Iterator[Metric]:
        gpus = GaugeMetricFamily(
            "platform_pool_gpus",
            "GPUs held by the pool's replicas that are not gone, per pool.",
            labels=POOL_LABELS,
        )
        usd_per_hour = GaugeMetricFamily(
            "platform_pool_gpu_usd_per_hour",
            "What the pool's GPUs cost an hour at its region's GPU-hour price.",
            labels=POOL_LABELS,
        )
        at_full = GaugeMetricFamily(
            "platform_pool_usd_per_million_tokens_at_full",
            "USD per million output tokens (input tokens for an embedding pool) "
            "with every replica kept full (at the version's load-tested tokens "
            "per second, else the assumed rate).",
            labels=POOL_LABELS,
        )
        silent = GaugeMetricFamily(
            "platform_pool_silent_replicas",
            "Replicas not marked gone whose last heartbeat is older than the "
            "missed-beat window, per pool.",
            labels=POOL_LABELS,
        )
        for f in figures:
            pool = [f.model, f.version, f.region]
            gpus.add_metric(pool, f.gpus)
            usd_per_hour.add_metric(pool, f.gpu_usd_per_hour)
            at_full.add_metric(pool, f.usd_per_million_tokens_at_full)
            silent.add_metric(pool, f.silent_replicas)
        yield from (gpus, usd_per_hour, at_full, silent)


@dataclass(frozen=True, slots=True)
class PoolLiveFigures:
    """One pool's live figures as ``GET /admin/pools/{model}/state`` shows them.

    Latencies in seconds; None (no sample in the window, or no router figure for
    another region's pool) exports no sample.
    """

    model: str
    version: str
    region: str
    requests: int
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p95_s: float | None
    prefix_hit_rate: float | None
    usd_per_million_tokens: float | None
    router_utilisation: float | None


class PoolLiveCollector(_ScrapeTimeCollector[PoolLiveFigures]):
    """Export each pool's live figures (the gateways' role ``pool`` figures over
    five minutes, and the routers' utilisation), read from the pool state.

    ``read`` is ``control.autoscaling.pool_live_figures``: the same entries the
    admin API and the console show. The routers' tokens in flight and queue depth
    are the gateways' own ``platform_tokens_in_flight`` and
    ``platform_queue_depth``. Every scraped process exports the same values:
    aggregate with ``max``.
    """

    what = "pool live figures"

    def _families(self, figures: list[PoolLiveFigures]) -> Iterator[Metric]:
        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=POOL_LABELS)

        requests = gauge(
            "platform_pool_live_requests",
            "Requests the pool served in the last five minutes (answered or failed).",
        )
        values: dict[str, tuple[GaugeMetricFamily, Callable[[PoolLiveFigures], Any]]]
        values = {
            "ttft_p95": (
                gauge(
                    "platform_pool_ttft_p95_seconds",
                    "p95 time to first token over the last five minutes, per pool.",
                ),
                lambda f: f.ttft_p95_s,
            ),
            "ttft_p99": (
                gauge(
                    "platform_pool_ttft_p99_seconds",
                    "p99 time to first token over the last five minutes, per pool.",
                ),
                lambda f: f.ttft_p99_s,
            ),
            "tpot_p50": (
                gauge(
                    "platform_pool_tpot_p50_seconds",
                    "Median time per output token after the first, last five "
                    "minutes, per pool.",
                ),
                lambda f: f.tpot_p50_s,
            ),
            "tpot_p95": (
                gauge(
                    "platform_pool_tpot_p95_seconds",
                    "p95 time per output token after the first, last five "
                    "minutes, per pool.",
                ),
                lambda f: f.tpot_p95_s,
            ),
            "hit": (
                gauge(
                    "platform_pool_prefix_hit_rate",
                    "Cached over prompt tokens of the pool's answers, last five "
                    "minutes.",
                ),
                lambda f: f.prefix_hit_rate,
            ),
            "usd": (
                gauge(
                    "platform_pool_usd_per_million_tokens",
                    "What the pool's GPUs cost over the last five minutes per "
                    "million prompt and output tokens it served.",
                ),
                lambda f: f.usd_per_million_tokens,
            ),
            "router_utilisation": (
                gauge(
                    "platform_pool_router_utilisation",
                    "The routers' tokens in flight on the pool over its capacity "
                    "(this region's pools).",
                ),
                lambda f: f.router_utilisation,
            ),
        }
        for f in figures:
            pool = [f.model, f.version, f.region]
            requests.add_metric(pool, f.requests)
            for family, value_of in values.values():
                value = value_of(f)
                if value is not None:
                    family.add_metric(pool, value)
        yield requests
        for family, _ in values.values():
            yield family


# -- rollouts, read at scrape time ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenRollout:
    """A rollout still pending: its candidate version, stage and share."""

    model: str
    version: str
    stage: str
    percent: float
    is_paused: bool


@dataclass(frozen=True, slots=True)
class GuardTrips:
    """How often the guards rolled back a version, and when they last did.

    ``last_trip_at`` is a Unix time, None before the first trip (the series is
    exported at 0 from the rollout's start, so that ``increase`` sees the first).
    """

    model: str
    version: str
    trips: int
    last_trip_at: float | None


class RolloutCollector(_ScrapeTimeCollector[OpenRollout | GuardTrips]):
    """Export open rollouts and the guards' trips (``rollouts.figures``)."""

    what = "rollout figures"

    def _families(self, figures: list[OpenRollout | GuardTrips]) -> Iterator[Metric]:
        is_open = GaugeMetricFamily(
            "platform_rollout_open",
            "1 per pending rollout, labelled with its candidate version and stage.",
            labels=("model", "version", "stage"),
        )
        percent = GaugeMetricFamily(
            "platform_rollout_percent",
            "The share of traffic (percent) a pending rollout's candidate sees.",
            labels=("model", "version", "stage"),
        )
        paused = GaugeMetricFamily(
            "platform_rollout_paused",
            "1 while a pending rollout is paused by an admin, else 0.",
            labels=("model", "version", "stage"),
        )
        trips = CounterMetricFamily(
            "platform_rollout_guard_trips",
            "Guard evaluations that rolled a version back, per model and version.",
            labels=("model", "version"),
        )
        last_trip = GaugeMetricFamily(
            "platform_rollout_guard_last_trip_timestamp_seconds",
            "Unix time of the last guard evaluation that rolled the version back.",
            labels=("model", "version"),
        )
        for f in figures:
            if isinstance(f, OpenRollout):
                labels = [f.model, f.version, f.stage]
                is_open.add_metric(labels, 1)
                percent.add_metric(labels, f.percent)
                paused.add_metric(labels, float(f.is_paused))
            else:
                trips.add_metric([f.model, f.version], f.trips)
                if f.last_trip_at is not None:
                    last_trip.add_metric([f.model, f.version], f.last_trip_at)
        yield from (is_open, percent, paused, trips, last_trip)


# -- batches, read at scrape time ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchFigures:
    """One model's batches that have not ended, and how many the scheduler judges
    at risk of missing their deadline."""

    model: str
    active: int
    at_risk: int


class BatchCollector(_ScrapeTimeCollector[BatchFigures]):
    """Export batches running and at risk per model (``batches.figures``)."""

    what = "batch figures"

    def _families(self, figures: list[BatchFigures]) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            "platform_batches_active",
            "Batches validating, in progress or finalizing, per model.",
            labels=("model",),
        )
        at_risk = GaugeMetricFamily(
            "platform_batches_at_risk",
            "Batches not ended that the scheduler judges at risk of missing their "
            "deadline, per model.",
            labels=("model",),
        )
        for f in figures:
            active.add_metric([f.model], f.active)
            at_risk.add_metric([f.model], f.at_risk)
        yield from (active, at_risk)


_registered: dict[str, Collector] = {}


def _register_once(name: str, collector: Collector) -> None:
    # ready() runs once per process, but tests and the test runner may set up
    # Django again: a second registration would raise (duplicate names).
    if name in _registered:
        return
    _registered[name] = collector
    REGISTRY.register(collector)


def register_pool_costs(read: Callable[[], Iterable[PoolCostFigures]]) -> None:
    """Export the pools' GPUs, cost and silent replicas from ``read`` (once)."""
    _register_once("pool_costs", PoolCostCollector(read))


def register_pool_live(read: Callable[[], Iterable[PoolLiveFigures]]) -> None:
    """Export the pools' live figures from ``read`` (once)."""
    _register_once("pool_live", PoolLiveCollector(read))


def register_rollouts(
    read: Callable[[], Iterable[OpenRollout | GuardTrips]],
) -> None:
    """Export open rollouts and guard trips from ``read`` in this process (once)."""
    _register_once("rollouts", RolloutCollector(read))


def register_batches(read: Callable[[], Iterable[BatchFigures]]) -> None:
    """Export batches running and at risk from ``read`` in this process (once)."""
    _register_once("batches", BatchCollector(read))
