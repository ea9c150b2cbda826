"""The traffic twin checked against life: the live window's load and the comparison.

Public surface: ``TwinLoad``, ``PlannedTurn``, ``rate_at``, ``plan_turns``,
``system_text``, ``user_text``, ``Served``, ``ReplicaPoint``, ``TwinFigures``,
``probe_text``, ``figures_of``, ``first_turn_hit_share``, ``start_delay_s``, ``FigureRow``, ``TwinComparison``, ``compare``, ``GATED``,
``twin_fleet_config``, ``served_of_fleet``, ``replay``, ``decision_row``,
``decode_s_per_token``, ``followed_fleet``, ``PairedFigures``, ``paired_figures``.

``manage.py twin_check`` (``drills.twin_live``) runs a small live window
(gateway, node agent, simulated replicas, the autoscaler's tick), records it
with the traffic twin, replays the export in the fleet simulator configured as
the live pool was, and compares the two sides with the same arithmetic:
``figures_of`` turns each side's served requests and replica series into
``TwinFigures``, and ``compare`` gives the relative error of each figure. The
check passes when p95 TTFT and the prefix hit rate (``GATED``) are within the
tolerance (15%); a figure missing on either side fails it.

The load (``TwinLoad``, ``plan_turns``) is a compressed day: arrivals are a
Poisson process whose rate rises from ``trough_rps`` to ``peak_rps`` at mid-window
and falls back (``rate_at``); an arrival continues an open conversation (its
history grows by the last answer and a new question) or starts one, whose
system prompt is one of ``system_prompts`` shared ones (``shared_system_share``)
or its own.

The twin replays the trace twice. Once as the live pool ran, its own autoscaler
deciding (``twin_fleet_config``): that replay predicts the replicas the
autoscaler chose. Once on the fleet the live pool had (``followed_fleet``: the
live scale-ups, serving when the live replicas did): that one predicts the
request figures (TTFT, hits, tokens in flight, decode), so that a scale-up a
few seconds apart on the two sides (a 4 s panic window over a few hundred
requests) is not read as the engine or the router being wrong. The second
replay places each request on the replica that served it live, and
``paired_figures`` lines the two sides up request by request (through the
trace: a live request is its conversation's k-th line, a replayed one is the
line of its arrival time).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig, FleetEvent
from drills.domain.fleet_scaling import ColdStart, FleetAutoscaling
from drills.domain.replica import FleetRequest
from drills.domain.workload import Arrival, TeamSpec
from models_registry.domain.autoscaler import ScalingSettings
from simengine.domain.percentiles import percentile
from simengine.domain.perf import PROFILES

__all__ = [
    "GATED",
    "FigureRow",
    "PairedFigures",
    "PlannedTurn",
    "ReplicaPoint",
    "Served",
    "TwinComparison",
    "TwinFigures",
    "TwinLoad",
    "compare",
    "decision_row",
    "figures_of",
    "first_turn_hit_share",
    "paired_figures",
    "plan_turns",
    "rate_at",
    "replay",
    "served_of_fleet",
    "start_delay_s",
    "system_text",
    "twin_fleet_config",
    "user_text",
]

# The figures the check passes or fails on (the others are reported).
GATED = ("ttft_p95_s", "hit_rate")
TOLERANCE = 0.15

_WORDS = (
    "river",
    "stone",
    "garden",
    "window",
    "market",
    "signal",
    "harbor",
    "copper",
    "lantern",
    "meadow",
    "orbit",
    "pepper",
    "canvas",
    "ladder",
    "silver",
    "thunder",
    "velvet",
    "anchor",
    "beacon",
    "cobalt",
    "desert",
    "ember",
    "falcon",
    "glacier",
    "hollow",
    "island",
    "jasmine",
    "kettle",
    "lemon",
    "marble",
    "nectar",
    "oyster",
)


@dataclass(frozen=True, slots=True)
class TwinLoad:
    """The shape of the live window's traffic (see the module docstring)."""

    seed: int = 0
    duration_s: float = 120.0
    peak_rps: float = 3.0
    trough_rps: float = 0.5
    new_conversation_share: float = 0.3
    max_turns: int = 8
    min_gap_s: float = 1.5  # a conversation's turns are at least this far apart
    system_prompts: int = 3
    shared_system_share: float = 0.5
    system_words: tuple[int, int] = (30, 60)
    user_words: tuple[int, int] = (10, 30)
    max_tokens: tuple[int, int] = (24, 64)

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or not 0 < self.trough_rps <= self.peak_rps:
            raise ValueError("duration_s > 0 and 0 < trough_rps <= peak_rps")
        if not 0 < self.new_conversation_share <= 1:
            raise ValueError("new_conversation_share must be in (0, 1]")
        if not 0 <= self.shared_system_share <= 1 or self.system_prompts < 1:
            raise ValueError("shared_system_share in [0, 1], system_prompts >= 1")
        if self.max_turns < 1 or self.min_gap_s < 0:
            raise ValueError("max_turns >= 1 and min_gap_s >= 0")
        for low, high in (self.system_words, self.user_words, self.max_tokens):
            if not 1 <= low <= high:
                raise ValueError("word and token ranges are (low, high) >= 1")


def rate_at(load: TwinLoad, t: float) -> float:
    """Return the arrival rate (requests/s) at ``t`` seconds into the day: the
    trough at both ends, the peak at mid-window."""
    rise = math.sin(math.pi * min(max(t / load.duration_s, 0.0), 1.0)) ** 2
    return load.trough_rps + (load.peak_rps - load.trough_rps) * rise


@dataclass(frozen=True, slots=True)
class PlannedTurn:
    """One request of the plan: ``system`` is the shared prompt's number, or -1
    for the conversation's own."""

    at: float
    conversation: str
    turn: int
    system: int
    user_words: int
    max_tokens: int


def plan_turns(load: TwinLoad) -> list[PlannedTurn]:
    """Return the window's requests, in time order (deterministic per seed)."""
    rng = random.Random(f"twin:{load.seed}")
    turns: list[PlannedTurn] = []
    # conversation -> [turns sent, last planned at, system prompt]
    open_: dict[str, list[float]] = {}
    made = 0
    t = 0.0
    while True:
        # Thinning: candidate arrivals at the peak rate, kept at rate_at / peak.
        t += rng.expovariate(load.peak_rps)
        if t >= load.duration_s:
            return turns
        if rng.random() * load.peak_rps > rate_at(load, t):
            continue
        ready = [
            c
            for c, (n, last, _) in open_.items()
            if n < load.max_turns and t - last >= load.min_gap_s
        ]
        if ready and rng.random() >= load.new_conversation_share:
            conversation = rng.choice(sorted(ready))
        else:
            conversation = f"c{load.seed}-{made}"
            made += 1
            shared = rng.random() < load.shared_system_share
            system = rng.randrange(load.system_prompts) if shared else -1
            open_[conversation] = [0, t, system]
        state = open_[conversation]
        turns.append(
            PlannedTurn(
                at=round(t, 3),
                conversation=conversation,
                turn=int(state[0]),
                system=int(state[2]),
                user_words=rng.randint(*load.user_words),
                max_tokens=rng.randint(*load.max_tokens),
            )
        )
        state[0] += 1
        state[1] = t


def _words(key: str, n: int) -> str:
    rng = random.Random(key)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def probe_text(key: str, words: int) -> str:
    """Return ``words`` words of filler that start with ``key`` (distinct keys
    share no KV block: no probe hits another's prefix)."""
    return f"{key} " + _words(key, words)


def system_text(load: TwinLoad, turn: PlannedTurn) -> str:
    """Return the system prompt of ``turn``'s conversation (shared or its own)."""
    key = (
        f"system:{turn.system}"
        if turn.system >= 0
        else f"system:{load.seed}:{turn.conversation}"
    )
    n = random.Random(key).randint(*load.system_words)
    return "You are an assistant. " + _words(key, n)


def user_text(load: TwinLoad, turn: PlannedTurn) -> str:
    """Return ``turn``'s new question."""
    key = f"user:{load.seed}:{turn.conversation}:{turn.turn}"
    return f"Question {turn.turn}: " + _words(key, turn.user_words)


# -- the two sides, counted alike -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Served:
    """One answered request, live or simulated: times in seconds from the
    window's start; ``ttft_s`` from arrival to the first token."""

    at: float
    ended_at: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    max_tokens: int
    output_tokens: int = 0
    # The conversation as the trace names it (salted); live requests only.
    conversation: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaPoint:
    """The pool at ``at``: replicas serving, and the size the autoscaler asks."""

    at: float
    serving: int
    desired: int


@dataclass(frozen=True, slots=True)
class TwinFigures:
    """One side's headline figures (None: nothing to measure)."""

    requests: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    hit_rate: float | None
    tokens_in_flight_mean: float | None
    replicas_mean: float | None
    replicas_peak: int | None
    desired_changes: int
    decode_s_per_token: float | None = None
    request_s_mean: float | None = None


def figures_of(
    served: Sequence[Served],
    replicas: Sequence[ReplicaPoint],
    *,
    window_s: float,
) -> TwinFigures:
    """Return the figures of one side.

    Hit rate is cached over prompt tokens; tokens in flight are each request's
    ``prompt + max_tokens`` (what admission and the autoscaler count) over its
    life, averaged over ``window_s`` (Little's law); replicas serving are
    averaged over time between the points (each holds until the next).
    Decode is ``decode_s_per_token`` (a median); ``request_s_mean`` is the mean
    time from arrival to the answer's end, which tokens in flight weigh.
    """
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    ttfts = [s.ttft_s for s in served]
    prompt = sum(s.prompt_tokens for s in served)
    held = sum(
        (s.prompt_tokens + s.max_tokens) * max(0.0, s.ended_at - s.at) for s in served
    )
    points = sorted(replicas, key=lambda p: p.at)
    mean: float | None = None
    if points:
        weighted = span = 0.0
        for here, after in zip(points, [*points[1:], None], strict=True):
            until = after.at if after is not None else max(window_s, here.at)
            weighted += here.serving * (until - here.at)
            span += until - here.at
        mean = weighted / span if span > 0 else float(points[-1].serving)
    changes = sum(1 for a, b in pairwise(points) if a.desired != b.desired)
    return TwinFigures(
        requests=len(served),
        ttft_p50_s=percentile(ttfts, 0.50),
        ttft_p95_s=percentile(ttfts, 0.95),
        hit_rate=sum(s.cached_tokens for s in served) / prompt if prompt else None,
        tokens_in_flight_mean=held / window_s if served else None,
        replicas_mean=mean,
        replicas_peak=max(p.serving for p in points) if points else None,
        desired_changes=changes,
        decode_s_per_token=decode_s_per_token(served),
        request_s_mean=(
            sum(max(0.0, s.ended_at - s.at) for s in served) / len(served)
            if served
            else None
        ),
    )


def first_turn_hit_share(lines: Sequence[dict[str, object]]) -> float | None:
    """Return the cached tokens of conversations' first recorded turns over all
    prompt tokens of a trace's ``lines``: the hits that came from a prefix shared
    across conversations (a system prompt), which only a replay that keys the
    cache by the recorded block hashes can predict."""
    seen: set[object] = set()
    first = prompt = 0
    for line in lines:
        tokens = line.get("prompt_tokens")
        cached = line.get("cached_tokens")
        if not isinstance(tokens, int) or not isinstance(cached, int):
            continue
        prompt += tokens
        if line.get("conversation") not in seen:
            seen.add(line.get("conversation"))
            first += cached
    return first / prompt if prompt else None


@dataclass(frozen=True, slots=True)
class PairedFigures:
    """The two sides request by request: ``pairs`` lined up, of ``live`` and
    ``replayed``; those whose cached tokens differ; the replayed TTFT less the
    live one (median) and the 95th percentile of its size."""

    live: int
    replayed: int
    pairs: int
    hit_differs: int
    ttft_error_p50_s: float | None
    ttft_abs_error_p95_s: float | None


def paired_figures(
    live: Sequence[Served],
    lines: Sequence[Mapping[str, object]],
    replayed: Sequence[Served],
) -> PairedFigures:
    """Line up live requests with the replayed ones through the trace ``lines``.

    A live request (``Served.conversation`` set) is the k-th line of its
    conversation when it is that conversation's k-th answered request; a replayed
    one is the line whose ``t`` is its arrival. A pair counts only when both
    sides have the line's prompt tokens, so a line missing from the recording
    (or a request missing from the replay) leaves its neighbours unpaired
    rather than paired wrongly.
    """
    by_turn: dict[tuple[str, int], Mapping[str, object]] = {}
    turns: dict[str, int] = {}
    for line in sorted(lines, key=lambda line: _number(line.get("t"))):
        conversation = str(line.get("conversation", ""))
        k = turns.get(conversation, 0)
        turns[conversation] = k + 1
        by_turn[(conversation, k)] = line
    twins: dict[tuple[float, int], list[Served]] = {}
    for served in replayed:
        twins.setdefault((round(served.at, 6), served.prompt_tokens), []).append(served)
    asked: dict[str, int] = {}
    pairs: list[tuple[Served, Served]] = []
    for served in sorted(live, key=lambda s: s.at):
        k = asked.get(served.conversation, 0)
        asked[served.conversation] = k + 1
        recorded = by_turn.get((served.conversation, k))
        if recorded is None or recorded.get("prompt_tokens") != served.prompt_tokens:
            continue
        key = (round(_number(recorded.get("t")), 6), served.prompt_tokens)
        candidates = twins.get(key)
        if candidates:
            pairs.append((served, candidates.pop(0)))
    errors = [twin.ttft_s - real.ttft_s for real, twin in pairs]
    return PairedFigures(
        live=len(live),
        replayed=len(replayed),
        pairs=len(pairs),
        hit_differs=sum(
            1 for real, twin in pairs if real.cached_tokens != twin.cached_tokens
        ),
        ttft_error_p50_s=percentile(errors, 0.5),
        ttft_abs_error_p95_s=percentile((abs(e) for e in errors), 0.95),
    )


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def start_delay_s(points: Sequence[ReplicaPoint]) -> float | None:
    """Return the median time from a scale-up (the size asked for rising) to
    that many replicas serving, over ``points``; None when none completed."""
    ordered = sorted(points, key=lambda p: p.at)
    delays = []
    for i in range(1, len(ordered)):
        before, here = ordered[i - 1], ordered[i]
        if here.desired <= before.desired or here.serving >= here.desired:
            continue
        for later in ordered[i + 1 :]:
            if later.serving >= here.desired:
                delays.append(later.at - here.at)
                break
    return percentile(delays, 0.50) if delays else None


@dataclass(frozen=True, slots=True)
class FigureRow:
    """One figure, predicted against measured; ``relative_error`` is
    (predicted - measured) / measured (None when either is missing or measured
    is 0)."""

    name: str
    predicted: float | None
    measured: float | None
    relative_error: float | None
    is_gated: bool
    is_within: bool


@dataclass(frozen=True, slots=True)
class TwinComparison:
    """Every figure side by side, and whether the gated ones are within."""

    rows: tuple[FigureRow, ...]
    tolerance: float
    passed: bool = field(default=False)


def _relative(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / abs(measured)


def compare(
    predicted: TwinFigures,
    measured: TwinFigures,
    *,
    tolerance: float = TOLERANCE,
    gated: Iterable[str] = GATED,
) -> TwinComparison:
    """Return the comparison of the simulator's figures with the live ones.

    A gated figure passes when both sides have it and its relative error is
    within ``tolerance``; the comparison passes when every gated figure does
    and both sides served requests.
    """
    if tolerance <= 0:
        raise ValueError("tolerance must be positive")
    gates = set(gated)
    names = (
        "requests",
        "ttft_p50_s",
        "ttft_p95_s",
        "hit_rate",
        "tokens_in_flight_mean",
        "replicas_mean",
        "replicas_peak",
        "desired_changes",
        "decode_s_per_token",
        "request_s_mean",
    )
    unknown = gates - set(names)
    if unknown:
        raise ValueError(f"no such figure: {', '.join(sorted(unknown))}")
    rows = []
    for name in names:
        p, m = getattr(predicted, name), getattr(measured, name)
        error = _relative(p, m)
        within = error is not None and abs(error) <= tolerance
        rows.append(FigureRow(name, p, m, error, name in gates, within))
    passed = (
        predicted.requests > 0
        and measured.requests > 0
        and all(row.is_within for row in rows if row.is_gated)
    )
    return TwinComparison(rows=tuple(rows), tolerance=tolerance, passed=passed)


# -- the simulator's side -------------------------------------------------------------


def twin_fleet_config(
    base: FleetConfig,
    *,
    settings: ScalingSettings,
    replica_tokens_in_flight: int,
    profile: str,
    interval_s: float,
    start_s: float,
    seed: int,
    tick_times: Sequence[float] = (),
    route_delay_s: float = 0.0,
) -> FleetConfig:
    """Return ``base`` (the platform's routing and admission settings) set up as
    the live pool runs: the same profile and its KV block, admission on, the same
    autoscaling settings and tick, from ``min_replicas``, and replicas that serve
    ``start_s`` after the decision (the live agent's start of a simulated
    replica: no node to boot, no weights to pull). ``tick_times`` are the live
    autoscaler's ticks on the trace's clock (those before it starts dropped): the
    twin's policy samples the pool when live did, so its decisions differ only
    by what it sees. On a light pool a scale-up is a 6-s window's mean crossing
    the target, and moving the ticks by half a second moves it by tens of
    seconds. ``route_delay_s`` is the live time between admission and the
    replica that the step model does not count (``FleetConfig.route_delay_s``)."""
    return replace(
        base,
        replicas=settings.min_replicas,
        profile=profile,
        block_size=PROFILES[profile].block_size,
        admission=True,
        replica_tokens_in_flight=replica_tokens_in_flight,
        seed=seed,
        route_delay_s=route_delay_s,
        autoscaling=FleetAutoscaling(
            settings=settings,
            interval_s=interval_s,
            cold_start=ColdStart(node_start_s=start_s, weights_gb=0.0, warmup_s=0.0),
            gpu_budget=settings.max_replicas,
            tick_times=tuple(t for t in tick_times if t >= 0),
        ),
    )


def served_of_fleet(requests: Iterable[FleetRequest]) -> list[Served]:
    """Return the simulated requests that were answered, as ``Served``."""
    served = []
    for r in requests:
        if r.outcome != "ok" or r.first_token_at is None or r.finished_at is None:
            continue
        served.append(
            Served(
                at=r.arrived_at,
                ended_at=r.finished_at,
                ttft_s=r.first_token_at - r.arrived_at,
                prompt_tokens=r.prompt_tokens,
                cached_tokens=r.cached_tokens,
                max_tokens=r.max_tokens,
                output_tokens=r.output_tokens,
            )
        )
    return served


def followed_fleet(
    config: FleetConfig,
    live: Sequence[ReplicaPoint],
    *,
    start_s: float,
    shift_s: float,
) -> tuple[FleetConfig, list[FleetEvent]]:
    """Return ``config`` without its autoscaler, from the live pool's first size,
    and the events that add a replica where the live one did: each rise in the
    replicas serving at ``at`` (live clock; the trace's is ``shift_s`` later)
    becomes an ``add_replica`` that serves then (``start_s`` after it is asked
    for, as ``config``'s cold start says). A fall is not followed: the live
    replica drains its streams, and the twin keeps it to the end."""
    points = sorted(live, key=lambda p: p.at)
    first = points[0].serving if points else config.replicas
    events, most = [], first
    for point in points:
        if point.serving > most:
            at = max(0.0, point.at - shift_s - start_s)
            events.append(FleetEvent(at, "add_replica", count=point.serving - most))
            most = point.serving
    followed = replace(
        config, replicas=max(1, first), autoscaling=None, cold_start_s=start_s
    )
    return followed, events


def decode_s_per_token(served: Iterable[Served]) -> float | None:
    """Return the median time per output token after the first (each answer of
    two tokens or more); None without one."""
    per_token = [
        (s.ended_at - s.at - s.ttft_s) / (s.output_tokens - 1)
        for s in served
        if s.output_tokens > 1
    ]
    return percentile(per_token, 0.50) if per_token else None


def replay(
    arrivals: Iterable[Arrival],
    config: FleetConfig,
    *,
    window_s: float,
    teams: Iterable[TeamSpec] = (),
    events: Iterable[FleetEvent] = (),
) -> tuple[list[Served], list[ReplicaPoint], list[dict[str, Any]]]:
    """Replay a trace's arrivals in the fleet simulator (``teams``: the trace's
    teams with their limits; ``events``: ``followed_fleet``'s); return the
    answered requests, the pool's replicas each second (serving, and the size
    the autoscaler's last tick asked for), and the autoscaler's changes of size
    (``decision_row``; none without an autoscaler)."""
    result = FleetSim(config, arrivals=arrivals, teams=teams, events=events).run(
        window_s, drain_s=120.0
    )
    ticks = list(result.scaling.ticks) if result.scaling is not None else []
    changes = [
        decision_row(
            at_s=tick.decision.at,
            current=tick.decision.current,
            desired=tick.decision.desired,
            reason=tick.decision.reason.value,
            utilisation=tick.decision.utilisation,
            signals=tick.decision.signals,
        )
        for tick in ticks
        if tick.decision.changed
    ]
    points = []
    desired, i = config.replicas, 0
    for sample in result.samples:
        while i < len(ticks) and ticks[i].decision.at <= sample.at:
            desired = ticks[i].decision.desired
            i += 1
        points.append(ReplicaPoint(sample.at, sample.replicas, desired))
    return served_of_fleet(result.requests), points, changes


def decision_row(
    *,
    at_s: float,
    current: int,
    desired: int,
    reason: str,
    utilisation: float | None,
    signals: Mapping[str, float],
) -> dict[str, Any]:
    """One change of the pool's size, as both sides report it: when, from and to,
    the policy's reason, and the signals it decided on (utilisation of the short
    window, the admission and engine queues' requests, tokens in flight)."""
    return {
        "at_s": at_s,
        "from": current,
        "to": desired,
        "reason": reason,
        "utilisation": utilisation,
        "queue_depth": signals.get("queue_depth"),
        "tokens_in_flight": signals.get("tokens_in_flight"),
    }
