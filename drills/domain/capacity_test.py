"""The seed's "capacity per version" procedure against one modelled replica.

Public surface: ``CapacityCriteria``, ``CapacityStep``, ``CapacityAnswer``,
``step_rates``, ``run_capacity_test``.

"Replay logged prompts at a fixed arrival rate and raise the rate step by step.
The highest output tokens per second at which p95 TTFT stays under 1 second and
streams keep 30 tokens per second replaces the assumed 2,500."

Each step is a fresh one-replica fleet (``FleetSim`` with ``replicas=1``; no
gateway admission, as when a version is load-tested on its own) fed Poisson
arrivals of the workload's shape at a fixed rate: warmed up, then measured for
``duration_s``. Per step: output tokens/s produced in the window, p95 TTFT of the
requests that arrived in it, and each stream's token rate (``1 / TPOT``: output
tokens after the first over the time they took). A step *holds* when p95 TTFT <
``ttft_p95_max_s``, the ``stream_quantile`` of stream rates is at least
``stream_min_tokens_per_s`` and every request got its first token before the
drain ran out. The answer is the highest output tokens/s of a step that holds.

``stream_quantile`` 0.5 (the default) asks the median stream to keep 30 tokens/s,
the reading under which the profiles were calibrated (83 streams at 33 ms TPOT);
0.05 asks it of 95% of streams, a stricter answer reported alongside.

Rates go up until ``stop_after_failures`` steps in a row fail (past the knee the
queue only grows) or the list ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig
from drills.domain.workload import ChatWorkload
from engine_nodes.domain.percentiles import percentile

__all__ = [
    "CapacityAnswer",
    "CapacityCriteria",
    "CapacityStep",
    "run_capacity_test",
    "step_rates",
]


@dataclass(frozen=True, slots=True)
class CapacityCriteria:
    """What a step must hold to count (the seed's: p95 TTFT < 1 s, 30 tokens/s)."""

    ttft_p95_max_s: float = 1.0
    stream_min_tokens_per_s: float = 30.0
    stream_quantile: float = 0.5

    def __post_init__(self) -> None:
        if self.ttft_p95_max_s <= 0 or self.stream_min_tokens_per_s <= 0:
            raise ValueError("the TTFT bound and the stream rate must be positive")
        if not 0.0 < self.stream_quantile <= 1.0:
            raise ValueError("stream_quantile must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class CapacityStep:
    """One arrival rate's measurements and whether they hold."""

    arrival_rate: float
    offered_tokens_per_s: float
    requests: int
    output_tokens_per_s: float
    ttft_p95_s: float | None
    stream_tokens_per_s_p50: float | None
    stream_tokens_per_s_p5: float | None
    stream_tokens_per_s: float | None  # at the criteria's quantile
    not_started: int
    holds: bool
    holds_strict: bool  # with 95% of streams at the minimum rate
    reasons: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        return {
            "arrival_rate": self.arrival_rate,
            "offered_tokens_per_s": self.offered_tokens_per_s,
            "requests": self.requests,
            "output_tokens_per_s": self.output_tokens_per_s,
            "ttft_p95_s": self.ttft_p95_s,
            "stream_tokens_per_s_p50": self.stream_tokens_per_s_p50,
            "stream_tokens_per_s_p5": self.stream_tokens_per_s_p5,
            "stream_tokens_per_s": self.stream_tokens_per_s,
            "not_started": self.not_started,
            "holds": self.holds,
            "holds_strict": self.holds_strict,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True, slots=True)
class CapacityAnswer:
    """Every step run, and the replica's capacity under the criteria."""

    steps: tuple[CapacityStep, ...]
    criteria: CapacityCriteria
    tokens_per_s: float | None
    arrival_rate: float | None
    strict_tokens_per_s: float | None  # 95% of streams at the minimum rate


def step_rates(
    *,
    start_tokens_per_s: float,
    step_tokens_per_s: float,
    max_tokens_per_s: float,
    answer_tokens: int,
) -> list[float]:
    """Return arrival rates (requests/s) offering ``start``, ``start + step``, ...
    up to ``max`` output tokens/s for answers of ``answer_tokens``."""
    if start_tokens_per_s <= 0 or step_tokens_per_s <= 0 or answer_tokens < 1:
        raise ValueError("start, step and answer tokens must be positive")
    rates = []
    offered = start_tokens_per_s
    while offered <= max_tokens_per_s + 1e-9:
        rates.append(offered / answer_tokens)
        offered += step_tokens_per_s
    return rates


def _measure(
    config: FleetConfig,
    workload: ChatWorkload,
    rate: float,
    criteria: CapacityCriteria,
    *,
    duration_s: float,
    warmup_s: float,
) -> CapacityStep:
    sim = FleetSim(config, replace(workload, arrival_rate=rate))
    result = sim.run(duration_s, warmup_s=warmup_s)
    requests = result.requests
    ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
    stream_rates = [1.0 / r.tpot_s for r in requests if r.tpot_s]
    not_started = sum(1 for r in requests if r.first_token_at is None)
    ttft_p95 = percentile(ttfts, 0.95)
    p50 = percentile(stream_rates, 0.5)
    p5 = percentile(stream_rates, 0.05)
    judged = percentile(stream_rates, criteria.stream_quantile)
    reasons = []
    if ttft_p95 is None or ttft_p95 >= criteria.ttft_p95_max_s:
        reasons.append("p95 TTFT")
    if not_started:
        reasons.append("requests never started")

    def slow(value: float | None) -> bool:
        return value is None or value < criteria.stream_min_tokens_per_s

    return CapacityStep(
        arrival_rate=rate,
        offered_tokens_per_s=rate * workload.answer_tokens,
        requests=len(requests),
        output_tokens_per_s=result.generated_tokens / result.duration_s,
        ttft_p95_s=ttft_p95,
        stream_tokens_per_s_p50=p50,
        stream_tokens_per_s_p5=p5,
        stream_tokens_per_s=judged,
        not_started=not_started,
        holds=not reasons and not slow(judged),
        holds_strict=not reasons and not slow(p5),
        reasons=(*reasons, *(["stream rate"] if slow(judged) else [])),
    )


def run_capacity_test(
    config: FleetConfig,
    workload: ChatWorkload,
    rates: Sequence[float],
    *,
    criteria: CapacityCriteria | None = None,
    duration_s: float = 120.0,
    warmup_s: float = 30.0,
    stop_after_failures: int = 2,
) -> CapacityAnswer:
    """Measure one replica at each arrival rate in turn; return the steps and the
    highest output tokens/s that held (None if none did)."""
    if not rates or any(rate <= 0 for rate in rates):
        raise ValueError("give at least one positive arrival rate")
    if duration_s <= 0 or warmup_s < 0 or stop_after_failures < 1:
        raise ValueError("duration_s and stop_after_failures must be positive")
    criteria = criteria or CapacityCriteria()
    config = replace(config, replicas=1, admission=False)
    steps: list[CapacityStep] = []
    failures = 0
    for rate in sorted(rates):
        step = _measure(
            config,
            workload,
            rate,
            criteria,
            duration_s=duration_s,
            warmup_s=warmup_s,
        )
        steps.append(step)
        failures = 0 if step.holds else failures + 1
        if failures >= stop_after_failures:
            break
    held = [s for s in steps if s.holds]
    best = max(held, key=lambda s: s.output_tokens_per_s, default=None)
    strict = [s.output_tokens_per_s for s in steps if s.holds_strict]
    return CapacityAnswer(
        steps=tuple(steps),
        criteria=criteria,
        tokens_per_s=best.output_tokens_per_s if best else None,
        arrival_rate=best.arrival_rate if best else None,
        strict_tokens_per_s=max(strict, default=None),
    )
