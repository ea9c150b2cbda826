"""The autoscaler's policy: how many replicas a pool wants, and why (seed step 11).

Public surface: ``ScheduleRule``, ``ScalingSettings``, ``PoolSignals``,
``ScalingDecision``, ``AutoscalerState``, ``decide``, ``Reason``, ``PoolKind``,
``admitted_rate``.

One pure function for the live Celery task and the fleet simulator alike: it takes a
pool's settings, what it remembers (``AutoscalerState``) and one observation
(``PoolSignals``), and returns the decision and the state to remember next time. It
never reads a clock: ``PoolSignals.at`` is the time (unix seconds in the platform,
virtual seconds in the simulator, both in UTC for the schedule).

The rules, in the order they apply:

1. **Demand** depends on the pool's kind (``PoolKind``). A chat pool's is the
   tokens its requests want in flight: tokens in flight (summed over every
   gateway) plus tokens waiting in the admission queues, against
   ``replica_tokens_in_flight`` a replica (the version's load test, or the
   platform's default, flagged ``capacity_is_assumed``). An embedding pool's is
   input tokens per second: the rate at which the gateways admitted tokens since
   the last tick (``admitted_rate`` over their cumulative counters, kept in the
   state), plus the queued tokens drained within a short window, against
   ``replica_tokens_per_s`` a replica (the version's measured input tokens/s at
   its latency target, or the default). A request of embeddings lasts a few
   milliseconds, so a snapshot of its tokens in flight says little; the count
   of tokens admitted does not miss one. Replicas *needed* at a demand are
   ``ceil(demand / (target_utilisation x per replica))``, either way; every
   rule below is the same for both kinds.
2. **Scale up** (``utilisation``): when the short window's average demand (the
   samples of the last ``panic_window_s``, Knative's 6 s, one on its start
   excluded) needs more replicas than the pool has
   (serving plus starting), the pool goes to that many at once, not one per tick.
   Starting replicas count, so a tick never adds again what is still starting.
3. **The queue is the fast trigger** (``queue``): a queue that persisted through the
   whole short window adds at least one replica even when the averages lag (none
   while a replica is starting, nor for a short window after the last one
   joined: that one is what the queue waited for, and its backlog needs a moment
   to drain), and while it persists nothing scales down. **Panic** (``panic``):
   when the short window asks for at least ``panic_factor`` times the serving
   replicas, the pool scales to it and holds (no scale-down) for a stable window
   after the last such tick, as Knative's KPA does.
4. **Scale down slowly** (``scale_down``): one replica at a time, at most once per
   ``scale_down_interval_s``, only when every observation in the stable window
   (``stable_window_s``, and the window must be full) kept utilisation under
   ``scale_down_utilisation`` at the smaller size, with no queue and no panic.
   Utilisation is demand over the capacity of the replicas that would remain, so
   removing one never pushes the rest past the scale-down threshold (hysteresis
   between the two thresholds).
5. **Floors and ceilings**: never below ``min_replicas``, the ``warm_floor`` or the
   floor of a schedule rule that applies now (``schedule``: a scheduled floor
   raises the pool before known peaks); never above ``max_replicas``, nor above
   the replicas the region's free GPUs can start (``capacity_exhausted``).
6. **Warm nodes** (``ScalingDecision.warm_nodes``): idle nodes with the weights
   on disk, so that a start costs load and warm-up only. Their number follows
   the demand's trend one cold start ahead (``warm_horizon_s``, the seed's 6
   minutes), between ``warm_nodes_min`` and ``warm_nodes_max``
   (``models_registry.domain.warm_nodes``). Off while ``warm_nodes_max`` is 0.

Every decision carries its reason and the signal values it was made on, so the
live task can write a row saying why and the console can show it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from models_registry.domain.scaling import (
    scaling_problems,
    schedule_rule_problems,
    windows_overlap,
)
from models_registry.domain.warm_nodes import Trend, follow, warm_nodes

__all__ = [
    "AutoscalerState",
    "PoolKind",
    "PoolSignals",
    "Reason",
    "ScalingDecision",
    "ScalingSettings",
    "ScheduleRule",
    "admitted_rate",
    "decide",
]

_TOLERANCE = 1e-9


class PoolKind(enum.StrEnum):
    """What a pool serves, and so what its demand is measured in."""

    CHAT = "chat"  # tokens in flight
    EMBEDDING = "embedding"  # input tokens per second


class Reason(enum.StrEnum):
    """Why the desired size is what it is."""

    HOLD = "hold"  # nothing to change
    UTILISATION = "utilisation"  # demand passed the target: scale up
    QUEUE = "queue"  # a queue persisted through the short window: scale up
    PANIC = "panic"  # the short window asks for panic_factor x serving
    SCALE_DOWN = "scale_down"  # the stable window stayed under the low threshold
    FLOOR = "floor"  # raised to min_replicas or the warm floor
    SCHEDULE = "schedule"  # raised to a schedule rule's floor
    CEILING = "ceiling"  # held at max_replicas
    CAPACITY_EXHAUSTED = "capacity_exhausted"  # the region has no GPUs for more


@dataclass(frozen=True, slots=True)
class ScheduleRule:
    """At least ``min_replicas`` on ``weekdays`` (0 Monday .. 6 Sunday), UTC minutes
    ``[start_minute, end_minute)`` of the day."""

    weekdays: frozenset[int]
    start_minute: int
    end_minute: int
    min_replicas: int

    def __post_init__(self) -> None:
        # The rules are the registry's, so that a Pool's stored rows agree.
        for message in schedule_rule_problems(
            weekdays=self.weekdays,
            start_minute=self.start_minute,
            end_minute=self.end_minute,
            min_replicas=self.min_replicas,
        ):
            raise ValueError(message)

    def applies(self, at: float) -> bool:
        """True when unix time ``at`` falls inside the rule (UTC)."""
        moment = datetime.fromtimestamp(at, tz=UTC)
        minute = moment.hour * 60 + moment.minute
        return (
            moment.weekday() in self.weekdays
            and self.start_minute <= minute < self.end_minute
        )

    def overlaps(self, other: ScheduleRule) -> bool:
        """True when the two rules share a minute of some weekday."""
        return windows_overlap(self, other)


@dataclass(frozen=True, slots=True)
class ScalingSettings:
    """A pool's autoscaling settings (``Pool`` fields), checked on construction.

    Raises ``ValueError`` naming the setting when they make no sense: min above
    max, thresholds outside (0, 1) or the scale-down threshold not below the
    scale-up one, windows that are not positive or a short window longer than the
    stable one, or overlapping schedule rules that ask for different floors.
    """

    min_replicas: int = 1
    max_replicas: int = 1
    warm_floor: int = 0
    target_utilisation: float = 0.7
    scale_down_utilisation: float = 0.5
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_factor: float = 2.0
    scale_down_interval_s: float = 600.0
    schedule: tuple[ScheduleRule, ...] = ()
    warm_nodes_min: int = 0
    warm_nodes_max: int = 0
    warm_horizon_s: float = 360.0

    def __post_init__(self) -> None:
        for message in self.problems():
            raise ValueError(message)

    def problems(self) -> list[str]:
        """Return what is wrong, as ``"field: why"`` lines (empty when valid).

        The rules are ``models_registry.domain.scaling``'s, which ``Pool.clean()``
        and the control-plane API apply to the stored settings too.
        """
        return scaling_problems(
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            warm_floor=self.warm_floor,
            target_utilisation=self.target_utilisation,
            scale_down_utilisation=self.scale_down_utilisation,
            stable_window_s=self.stable_window_s,
            panic_window_s=self.panic_window_s,
            panic_factor=self.panic_factor,
            scale_down_interval_s=self.scale_down_interval_s,
            schedule=self.schedule,
            warm_nodes_min=self.warm_nodes_min,
            warm_nodes_max=self.warm_nodes_max,
            warm_horizon_s=self.warm_horizon_s,
        )

    def floor(self, at: float) -> tuple[int, Reason]:
        """Return the lowest size allowed at ``at``, and which rule sets it."""
        floor, reason = max(self.min_replicas, self.warm_floor), Reason.FLOOR
        for rule in self.schedule:
            if rule.min_replicas > floor and rule.applies(at):
                floor, reason = rule.min_replicas, Reason.SCHEDULE
        return min(floor, self.max_replicas), reason


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One observation of a pool in one region.

    ``tokens_in_flight`` is summed over every gateway process; ``queued_tokens`` and
    ``queue_depth`` are what waits in the admission queues (tokens, requests);
    ``free_gpus`` is what the region's nodes have left beyond the pool's current
    replicas.

    An embedding pool (``kind``) adds ``admitted_tokens``, each gateway process's
    cumulative count of tokens admitted into the pool (its id to the count; None
    when the counts cannot be read: its input tokens/s are then estimated from
    tokens in flight at the measured ratio ``replica_tokens_per_s /
    replica_tokens_in_flight``), and ``replica_tokens_per_s``, a replica's input
    tokens per second at its latency target.
    """

    at: float
    serving: int
    starting: int
    tokens_in_flight: int
    queued_tokens: int
    queue_depth: int
    replica_tokens_in_flight: int
    capacity_is_assumed: bool = False
    gpus_per_replica: int = 1
    free_gpus: int = 10**6
    kind: PoolKind = PoolKind.CHAT
    admitted_tokens: Mapping[str, int] | None = None
    replica_tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind == PoolKind.EMBEDDING and not self.replica_tokens_per_s > 0:
            raise ValueError("an embedding replica carries some input tokens/s")
        if min(self.serving, self.starting, self.tokens_in_flight) < 0:
            raise ValueError("replicas and tokens in flight must be zero or more")
        if min(self.queued_tokens, self.queue_depth, self.free_gpus) < 0:
            raise ValueError("queue figures and free GPUs must be zero or more")
        if self.replica_tokens_in_flight < 1 or self.gpus_per_replica < 1:
            raise ValueError("a replica holds at least one token and one GPU")

    @property
    def current(self) -> int:
        """Replicas the pool has or is starting."""
        return self.serving + self.starting

    @property
    def per_replica(self) -> float:
        """What one replica carries, in the unit of the pool's demand."""
        if self.kind == PoolKind.EMBEDDING:
            return self.replica_tokens_per_s
        return float(self.replica_tokens_in_flight)


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    demand: float
    queue_depth: int


@dataclass(frozen=True, slots=True)
class AutoscalerState:
    """What the autoscaler remembers of a pool between ticks.

    ``samples`` cover the last stable window (oldest first); ``panic_until`` is when
    a panic ends unless renewed; ``last_scale_down_at`` paces scale-downs;
    ``last_starting_at`` is the last tick that saw a replica starting;
    ``admitted`` and ``admitted_at`` are an embedding pool's counts of admitted
    tokens at the last tick (``PoolSignals.admitted_tokens``) and its time;
    ``trend`` is the demand's level and slope and the warm-node target
    (``models_registry.domain.warm_nodes``).
    """

    samples: tuple[_Sample, ...] = ()
    panic_until: float | None = None
    last_scale_down_at: float | None = None
    last_starting_at: float | None = None
    admitted: tuple[tuple[str, int], ...] = ()
    admitted_at: float | None = None
    trend: Trend | None = None

    def as_dict(self) -> dict[str, Any]:
        """Return the state as JSON-ready primitives (``from_dict`` reads them back)."""
        return {
            "samples": [[s.at, s.demand, s.queue_depth] for s in self.samples],
            "panic_until": self.panic_until,
            "last_scale_down_at": self.last_scale_down_at,
            "last_starting_at": self.last_starting_at,
            "admitted": dict(self.admitted),
            "admitted_at": self.admitted_at,
            "trend": None if self.trend is None else self.trend.as_list(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AutoscalerState:
        """Return the state ``as_dict`` wrote; an empty or foreign dict is a fresh state.

        A stored state that does not parse is dropped rather than trusted: the
        autoscaler then starts its windows again, as after a first tick.
        """
        try:
            samples = tuple(
                _Sample(float(at), float(demand), int(depth))
                for at, demand, depth in data.get("samples", ())
            )
            panic_until = data.get("panic_until")
            last_down = data.get("last_scale_down_at")
            last_starting = data.get("last_starting_at")
            admitted_at = data.get("admitted_at")
            admitted = tuple(
                sorted((str(k), int(v)) for k, v in data.get("admitted", {}).items())
            )
            return cls(
                samples=tuple(sorted(samples, key=lambda s: s.at)),
                panic_until=None if panic_until is None else float(panic_until),
                last_scale_down_at=None if last_down is None else float(last_down),
                last_starting_at=(
                    None if last_starting is None else float(last_starting)
                ),
                admitted=admitted,
                admitted_at=None if admitted_at is None else float(admitted_at),
                trend=Trend.from_list(data.get("trend")),
            )
        except (TypeError, ValueError, AttributeError):
            return cls()


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """The desired size of a pool at one tick, and what it was decided on.

    ``utilisation`` is the short window's demand over the capacity of the replicas
    the pool has (serving plus starting; None without any); ``changed`` says
    whether ``desired`` differs from ``current``; ``warm_nodes`` is how many idle
    nodes with the weights on disk the pool should keep ready beside them.
    """

    at: float
    current: int
    desired: int
    reason: Reason
    utilisation: float | None
    stable_utilisation: float | None
    is_panicking: bool
    is_capacity_exhausted: bool
    capacity_is_assumed: bool
    signals: dict[str, float] = field(default_factory=dict)
    warm_nodes: int = 0

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def decide(
    settings: ScalingSettings, state: AutoscalerState, signals: PoolSignals
) -> tuple[ScalingDecision, AutoscalerState]:
    """Return the pool's desired size at ``signals.at`` and the state to keep."""
    now = signals.at
    per_replica = signals.per_replica
    demand, admitted_per_s = _demand(settings, state, signals)
    samples = _window(
        state.samples,
        _Sample(now, demand, signals.queue_depth),
        now - settings.stable_window_s,
    )
    # The short window is (now - panic_window_s, now]: a sample on its start is
    # older, for the panic as for the queue rule below. Live ticks land a few ms
    # late each, so a 6-s window of 2-s ticks holds three samples; counting the
    # one on its start would give the simulator's exact ticks a fourth.
    short_start = now - settings.panic_window_s + _TOLERANCE
    short = [s for s in samples if s.at > short_start]
    short_demand = sum(s.demand for s in short) / len(short)
    stable_demand = sum(s.demand for s in samples) / len(samples)
    needed_short = _needed(short_demand, per_replica, settings.target_utilisation)
    current = signals.current

    # Panic: the short window asks for panic_factor x what serves now (KPA).
    serving = max(signals.serving, 1)
    is_panic_tick = needed_short >= settings.panic_factor * serving and (
        needed_short > current
    )
    panic_until = state.panic_until
    if is_panic_tick:
        panic_until = now + settings.stable_window_s
    is_panicking = panic_until is not None and now < panic_until
    if not is_panicking:
        panic_until = None
    # The queue persisted through the short window: queued at the last sample at
    # least a short window old, and at every sample since.
    older = [s for s in samples if s.at <= short_start]
    has_queue = bool(older) and all(s.queue_depth > 0 for s in (older[-1], *short))

    desired, reason = current, Reason.HOLD
    if needed_short > current:
        desired = needed_short
        reason = Reason.PANIC if is_panic_tick else Reason.UTILISATION
    last_starting = now if signals.starting else state.last_starting_at
    is_settled = last_starting is None or (
        now - last_starting >= settings.panic_window_s - _TOLERANCE
    )
    if has_queue and desired <= current and is_settled:
        # Not while a start is pending: it is what the queue waits for, and adding
        # one per tick would grow the pool by a replica every tick of a cold start.
        # Nor for a short window after it joined: the queue's samples were taken
        # while it started, the gateways count it a beat late and its backlog
        # drains over the next moments, so the tick it joins would add another.
        desired, reason = current + 1, Reason.QUEUE
    last_down = state.last_scale_down_at
    if desired == current and not is_panicking and not has_queue and current > 0:
        smaller = current - 1
        window_full = samples[0].at <= now - settings.stable_window_s + _TOLERANCE
        paced = last_down is None or now - last_down >= settings.scale_down_interval_s
        quiet = smaller > 0 and all(
            s.demand < settings.scale_down_utilisation * smaller * per_replica
            and s.queue_depth == 0
            for s in samples
        )
        if window_full and paced and (quiet or _idle(samples)):
            desired, reason = smaller, Reason.SCALE_DOWN

    floor, floor_reason = settings.floor(now)
    if desired < floor:
        desired, reason = floor, floor_reason
    is_exhausted = False
    if desired > settings.max_replicas:
        desired, reason = settings.max_replicas, Reason.CEILING
    startable = current + signals.free_gpus // signals.gpus_per_replica
    if desired > current and desired > startable:
        desired = max(current, startable)
        is_exhausted = True
        reason = Reason.CAPACITY_EXHAUSTED
    if desired < current:
        # A scale-down, or max_replicas lowered: the next one waits its interval.
        last_down = now

    trend = warm_nodes(
        follow(
            state.trend,
            now,
            demand,
            level_s=settings.stable_window_s,
            slope_s=settings.warm_horizon_s / 2,
        ),
        horizon_s=settings.warm_horizon_s,
        per_replica=per_replica,
        target_utilisation=settings.target_utilisation,
        desired=desired,
        current=current,
        max_replicas=settings.max_replicas,
        startable=startable - max(desired, current),
        minimum=settings.warm_nodes_min,
        maximum=settings.warm_nodes_max,
    )
    capacity = current * per_replica
    extra: dict[str, float] = {}
    if signals.kind == PoolKind.EMBEDDING:
        extra = {
            "admitted_tokens_per_s": admitted_per_s,
            "replica_tokens_per_s": per_replica,
        }
    decision = ScalingDecision(
        at=now,
        current=current,
        desired=desired,
        reason=reason,
        utilisation=short_demand / capacity if capacity else None,
        stable_utilisation=stable_demand / capacity if capacity else None,
        is_panicking=is_panicking,
        is_capacity_exhausted=is_exhausted,
        capacity_is_assumed=signals.capacity_is_assumed,
        signals={
            "serving": float(signals.serving),
            "starting": float(signals.starting),
            "tokens_in_flight": float(signals.tokens_in_flight),
            "queued_tokens": float(signals.queued_tokens),
            "queue_depth": float(signals.queue_depth),
            "replica_tokens_in_flight": float(signals.replica_tokens_in_flight),
            "short_demand": short_demand,
            "stable_demand": stable_demand,
            "needed": float(needed_short),
            "forecast_demand": trend.forecast(settings.warm_horizon_s),
            "growth_per_s": trend.slope,
            **extra,
        },
        warm_nodes=trend.warm,
    )
    admitted = signals.admitted_tokens
    return decision, AutoscalerState(
        samples=samples,
        panic_until=panic_until,
        last_scale_down_at=last_down,
        last_starting_at=last_starting,
        admitted=() if admitted is None else tuple(sorted(admitted.items())),
        admitted_at=None if admitted is None else now,
        trend=trend,
    )


def _demand(
    settings: ScalingSettings, state: AutoscalerState, signals: PoolSignals
) -> tuple[float, float]:
    """Return the pool's demand in its kind's unit, and (embedding) the input
    tokens/s admitted since the last tick that went into it."""
    if signals.kind == PoolKind.CHAT:
        return float(signals.tokens_in_flight + signals.queued_tokens), 0.0
    admitted_per_s = None
    if signals.admitted_tokens is not None:
        admitted_per_s = admitted_rate(
            dict(state.admitted),
            state.admitted_at,
            signals.admitted_tokens,
            signals.at,
        )
    if admitted_per_s is None:
        # No counts (Redis away), or no earlier reading to measure against (the
        # first tick): tokens in flight stand in at the load test's ratio.
        ratio = signals.replica_tokens_per_s / signals.replica_tokens_in_flight
        admitted_per_s = signals.tokens_in_flight * ratio
    # What waits must go within a short window, on top of what keeps coming.
    return admitted_per_s + signals.queued_tokens / settings.panic_window_s, (
        admitted_per_s
    )


def admitted_rate(
    before: Mapping[str, int],
    before_at: float | None,
    now: Mapping[str, int],
    at: float,
) -> float | None:
    """Return tokens admitted per second between two readings of the gateways'
    cumulative counts (gateway process id to tokens admitted since it started).

    A process whose count fell restarted: all of its count is new. A process not
    in ``before`` gives its baseline only (its count may span more than the
    interval), and one gone since gives nothing. Without an earlier reading, or
    with no time between the two, it is None: there is nothing to measure over.
    """
    if before_at is None or at <= before_at:
        return None
    added = 0
    for gateway_id, count in now.items():
        if gateway_id not in before:
            continue
        earlier = before[gateway_id]
        added += count - earlier if count >= earlier else max(0, count)
    return added / (at - before_at)


def _window(
    samples: tuple[_Sample, ...], latest: _Sample, since: float
) -> tuple[_Sample, ...]:
    """Return ``samples`` plus ``latest`` from ``since`` on, keeping one older sample
    so that a window is known to be covered (its start lies inside the record)."""
    kept = [s for s in samples if s.at < latest.at]
    kept.append(latest)
    start = 0
    while start + 1 < len(kept) and kept[start + 1].at <= since + _TOLERANCE:
        start += 1
    return tuple(kept[start:])


def _needed(demand: float, per_replica: float, target: float) -> int:
    """Replicas that carry ``demand`` at ``target`` utilisation."""
    return math.ceil(demand / (target * per_replica) - _TOLERANCE)


def _idle(samples: tuple[_Sample, ...]) -> bool:
    return all(s.demand == 0 and s.queue_depth == 0 for s in samples)
