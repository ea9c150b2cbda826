"""The gateway's own Prometheus metrics (default registry, served at /metrics).

Public surface: the collectors below, ``observe_request``, ``observe_team_tokens``,
``observe_shadow``, ``count_retry``, ``count_rejection``, ``count_rate_limited``,
``count_shed``, ``set_pool_load``, ``set_control_plane``, ``set_snapshot_from_disk``,
``count_snapshot_file_refused``, ``set_limits_degraded``,
``set_usage_buffered``, ``count_figures_dropped``, ``forget_pool``, ``OUTCOMES``,
and the autoscaler's figures read at scrape time: ``PoolScalingFigures``,
``PoolScalingCollector``, ``register_pool_scaling``.

Labels are bounded: model, version, region, team, tier, outcome; never request ids
or user text. Helpers cache ``.labels()`` children (a dict lookup instead of the
label validation and lock of ``.labels()`` on every request). ``forget_pool``
removes a pool's series when the pool goes away.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

__all__ = [
    "AUTOSCALER_DECISIONS",
    "CACHED_TOKENS",
    "CONTROL_PLANE_UP",
    "FIGURES_DROPPED",
    "LIMITS_DEGRADED",
    "OUTCOMES",
    "OUTPUT_TOKENS",
    "PROMPT_TOKENS",
    "QUEUE_DEPTH",
    "REQUESTS",
    "SHADOW_REQUESTS",
    "SHADOW_TTFT_SECONDS",
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
    "Outcome",
    "PoolScalingCollector",
    "PoolScalingFigures",
    "count_figures_dropped",
    "count_rate_limited",
    "count_rejection",
    "count_retry",
    "count_shed",
    "count_snapshot_file_refused",
    "forget_pool",
    "observe_request",
    "observe_shadow",
    "observe_team_tokens",
    "register_pool_scaling",
    "set_control_plane",
    "set_limits_degraded",
    "set_pool_load",
    "set_snapshot_from_disk",
    "set_usage_buffered",
]

Outcome = Literal["ok", "error", "client_closed", "retried"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "error", "client_closed", "retried")

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
TEAM_SHED = Counter(
    "platform_team_shed_total",
    "Requests shed with 503, per team, model and tier.",
    ("team", "model", "tier"),
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

_POOL_COLLECTORS: tuple[MetricWrapperBase, ...] = (
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    CACHED_TOKENS,
    TOKENS_IN_FLIGHT,
    QUEUE_DEPTH,
    TTFT_SECONDS,
    TIME_PER_OUTPUT_TOKEN_SECONDS,
    REQUESTS,
    UPSTREAM_RETRIES,
    SHADOW_REQUESTS,
    SHADOW_TTFT_SECONDS,
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


def count_rejection(*, team: str, model: str, tier: str, status: int) -> None:
    """Count one refused request: 429 is rate limited, any other status is shed."""
    if status == 429:
        count_rate_limited(team=team, model=model, tier=tier)
    else:
        count_shed(team=team, model=model, tier=tier)


def count_rate_limited(*, team: str, model: str, tier: str) -> None:
    """Count one request refused with 429."""
    _child(TEAM_RATE_LIMITED, team, model, tier).inc()


def count_shed(*, team: str, model: str, tier: str) -> None:
    """Count one request shed with 503."""
    _child(TEAM_SHED, team, model, tier).inc()


def set_pool_load(
    *, model: str, version: str, region: str, tokens_in_flight: int, queue_depth: int
) -> None:
    """Set a pool's in-flight tokens and queue depth gauges."""
    _child(TOKENS_IN_FLIGHT, model, version, region).set(tokens_in_flight)
    _child(QUEUE_DEPTH, model, version, region).set(queue_depth)


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


def forget_pool(model: str, version: str, region: str) -> None:
    """Remove every series of a pool (it was deleted or left this region)."""
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
    was created.
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
        "Tokens in flight and queued over the pool's capacity at the last tick.",
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
)
AUTOSCALER_DECISIONS = "platform_autoscaler_decisions"


class PoolScalingCollector(Collector):
    """Export the autoscaler's per-pool figures, read when Prometheus scrapes.

    The autoscaler runs in the Celery worker, which nobody scrapes; its figures
    live in the database, and ``read`` returns them (``engine_nodes.autoscaling.
    pool_figures``, two queries). Every scraped process of a region exports the
    same values: aggregate with ``max by (model, version, region)``. When the
    database does not answer, the scrape goes on without these series.
    """

    def __init__(self, read: Callable[[], Iterable[PoolScalingFigures]]) -> None:
        self.read = read

    def describe(self) -> Iterator[Metric]:
        # Without describe() the registry would call collect() (the database) at
        # registration, in every process that imports this module.
        yield from self._families([])

    def collect(self) -> Iterator[Metric]:
        try:
            figures = list(self.read())
        except Exception as exc:
            # The families stay described, with no sample: a scrape sees the
            # series go missing rather than the metric disappear.
            logger.warning("pool scaling figures unreadable: %s", type(exc).__name__)
            figures = []
        yield from self._families(figures)

    def _families(self, figures: list[PoolScalingFigures]) -> Iterator[Metric]:
        gauges = [
            GaugeMetricFamily(n, h, labels=POOL_LABELS) for n, h in _SCALING_GAUGES
        ]
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
            )
            for gauge, value in zip(gauges, values, strict=True):
                if value is not None:
                    gauge.add_metric(pool, value)
            for reason, count in sorted(f.decisions.items()):
                decisions.add_metric([*pool, reason], count)
        yield from gauges
        yield decisions


_scaling_collector: PoolScalingCollector | None = None


def register_pool_scaling(read: Callable[[], Iterable[PoolScalingFigures]]) -> None:
    """Export the autoscaler's figures from ``read`` in this process (once)."""
    global _scaling_collector
    if _scaling_collector is not None:
        return
    _scaling_collector = PoolScalingCollector(read)
    REGISTRY.register(_scaling_collector)
