"""The seed's routing A/B: one replay, run once per routing policy.

Public surface: ``POLICY_ORDER``, ``generate_arrivals``, ``PolicyOutcome``,
``run_routing_ab``, ``run_engine_ab``, ``history_hit_rate``.

The arrivals are drawn once (``generate_arrivals``, deterministic for a seed) and
replayed unchanged through a fresh fleet per policy, so the policies differ in
nothing but their routing. Per policy it reports the prefix hit rate (cached
tokens over the history tokens a warm replica could have served), p95 TTFT,
imbalance (highest tokens in flight over the pool average, time-averaged and peak,
sampled every second) and uncached prefill tokens per second.

``run_engine_ab`` replays the same arrivals once per engine too
(``FleetConfig.engine``: vLLM's block pool, SGLang's radix cache), so the two
prefix caches differ in nothing else. Each engine's ``prefix_hit_rate`` counts
hits in its own granularity (whole blocks for vLLM, tokens for SGLang);
``history_hit_rate`` counts both against the same denominator, the history to the
token, so the rows compare directly.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig, FleetEvent
from drills.domain.fleet_result import FleetResult
from drills.domain.workload import Arrival, ChatWorkload, Conversations

__all__ = [
    "POLICY_ORDER",
    "PolicyOutcome",
    "generate_arrivals",
    "history_hit_rate",
    "run_engine_ab",
    "run_routing_ab",
]

POLICY_ORDER = ("round_robin", "least_tokens", "prefix_affinity", "cache_aware")


def generate_arrivals(
    workload: ChatWorkload, duration_s: float, *, seed: int = 0
) -> list[Arrival]:
    """Return ``duration_s`` seconds of the workload's arrivals, in time order.

    Every team is its own Poisson stream at its share of ``arrival_rate``; each
    arrival comes from one of the team's users, drawn uniformly, whose conversation
    state moves on by one turn.
    """
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    rng = random.Random(seed)
    conversations = Conversations(workload, rng)
    users = workload.team_users()
    times: list[tuple[float, int]] = []
    for index, team in enumerate(workload.teams):
        rate = workload.team_rate(team)
        at = rng.expovariate(rate)
        while at < duration_s:
            times.append((at, index))
            at += rng.expovariate(rate)
    times.sort()
    arrivals = []
    for at, index in times:
        team = workload.teams[index]
        team_users = users[team.name]
        user = team_users.start + rng.randrange(len(team_users))
        arrivals.append(conversations.next_request(user, team, at))
    return arrivals


@dataclass(frozen=True, slots=True)
class PolicyOutcome:
    """One policy's row of the A/B, plus the run behind it."""

    policy: str
    prefix_hit_rate: float | None
    ttft_p95_s: float | None
    imbalance_mean: float | None
    imbalance_peak: float | None
    uncached_prefill_tokens_per_s: float
    ttft_p50_s: float | None
    tpot_p50_s: float | None
    output_tokens_per_s: float
    requests: int
    unfinished: int
    result: FleetResult
    engine: str = "vllm"
    history_hit_rate: float | None = None

    def row(self) -> dict[str, object]:
        """Return the JSON row (the issue's keys first)."""
        return {
            "policy": self.policy,
            "engine": self.engine,
            "history_hit_rate": self.history_hit_rate,
            "prefix_hit_rate": self.prefix_hit_rate,
            "ttft_p95_s": self.ttft_p95_s,
            "imbalance_mean": self.imbalance_mean,
            "imbalance_peak": self.imbalance_peak,
            "uncached_prefill_tokens_per_s": self.uncached_prefill_tokens_per_s,
            "ttft_p50_s": self.ttft_p50_s,
            "tpot_p50_s": self.tpot_p50_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "requests": self.requests,
            "unfinished": self.unfinished,
        }


def history_hit_rate(result: FleetResult) -> float | None:
    """Return cached tokens over the history a warm cache could serve *to the
    token* (``min(history, prompt - 1)`` per answered request): the same
    denominator for every engine, so a block pool's rounding shows as a loss."""
    cacheable = cached = 0
    for request in result.requests:
        if request.outcome != "ok":
            continue
        limit = request.cacheable_tokens(1)
        cacheable += limit
        cached += min(request.cached_tokens, limit)
    return cached / cacheable if cacheable else None


def run_routing_ab(
    config: FleetConfig,
    arrivals: Sequence[Arrival],
    *,
    duration_s: float,
    warmup_s: float = 0.0,
    policies: Iterable[str] = POLICY_ORDER,
    events: Iterable[FleetEvent] = (),
) -> list[PolicyOutcome]:
    """Replay ``arrivals`` through one fresh fleet per policy; measure after warm-up."""
    events = tuple(events)
    outcomes = []
    for policy in policies:
        sim = FleetSim(replace(config, policy=policy), arrivals=arrivals, events=events)
        result = sim.run(duration_s, warmup_s=warmup_s)
        summary = result.summary()
        outcomes.append(
            PolicyOutcome(
                policy=policy,
                prefix_hit_rate=summary["prefix_hit_rate"],
                ttft_p95_s=summary["ttft_p95_s"],
                imbalance_mean=summary["imbalance_mean"],
                imbalance_peak=summary["imbalance_peak"],
                uncached_prefill_tokens_per_s=summary["uncached_prefill_tokens_per_s"],
                ttft_p50_s=summary["ttft_p50_s"],
                tpot_p50_s=summary["tpot_p50_s"],
                output_tokens_per_s=summary["output_tokens_per_s"],
                requests=summary["requests"],
                unfinished=summary["outcomes"]["unfinished"],
                result=result,
                engine=config.engine,
                history_hit_rate=history_hit_rate(result),
            )
        )
    return outcomes


def run_engine_ab(
    config: FleetConfig,
    arrivals: Sequence[Arrival],
    *,
    engines: Iterable[str],
    duration_s: float,
    warmup_s: float = 0.0,
    policies: Iterable[str] = POLICY_ORDER,
    events: Iterable[FleetEvent] = (),
) -> list[PolicyOutcome]:
    """Run ``run_routing_ab`` once per engine on the same arrivals; return the
    rows engine by engine, each in ``policies``' order."""
    policies = tuple(policies)
    events = tuple(events)
    outcomes: list[PolicyOutcome] = []
    for engine in engines:
        outcomes.extend(
            run_routing_ab(
                replace(config, engine=engine),
                arrivals,
                duration_s=duration_s,
                warmup_s=warmup_s,
                policies=policies,
                events=events,
            )
        )
    return outcomes
