"""The rollout drill's sequential check (issue 38): the guards at any traffic.

Public surface: ``Pool``, ``POOLS``, ``Version``, ``VERSIONS``,
``SequentialSettings``, ``Run``, ``Cell``, ``SequentialOutcome``, ``run_one``,
``run_sequential_check``, ``judge_sequential``.

Three versions (``VERSIONS``) through the default plan from its first canary
step, on three pools (``POOLS``): the 7B at 100 and at 1,000 streams and the 70B
at its peak (60 streams, the capacity plan's ``big``), each over ``seeds``
seeds. What decides is the platform's code: ``SimulatedRollout`` drives
``rollouts.domain.guard_tick`` (the live task's generator) on a ``FigureStore``,
told the pool's request rate as the live task reads it.

The traffic is drawn per ``slice_s`` (10 s), not replayed from the fleet
simulator (whose minute of CPU per replay would make 180 rollouts an hour): a
Poisson count of the pool's requests, of which a canary at ``p``% gets ``p``%
of *new* conversations only, so its share ramps over a conversation's length
(``conversation_s``, six turns 40 s apart) from each change of share; the
baseline band, as wide, ramps alike. Errors and refusals are binomial at the
version's rates; TTFT and output length are drawn from fixed histograms (the
same for both versions unless degraded). ``live_error_rate`` 0.4% is the issue's
"8 in 2,000"; ``worse`` adds 0.6 points (1.0%, "20 in 2,000").

Checks (``judge_sequential``), per pool: ``refuses`` is rolled back within
``DETECTION_PERIODS + 1`` (3) guard periods of the candidate's first request in
every seed; ``worse`` is never promoted within ``horizon_s``; ``good`` is promoted
in at least 19 of 20 seeds within ``horizon_s``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from drills.domain.capacity_plan import Scenario as CapacityScenario
from drills.domain.judge_rates import judge_rates
from drills.domain.overload import Check
from drills.domain.rollout_drill import (
    CANDIDATE_VERSION,
    LIVE_VERSION,
    REFUSAL_TOKENS,
    FigureBucket,
    FigureStore,
    SimulatedRollout,
)
from metering.domain.figures import (
    Role,
    VersionFigures,
    output_bucket,
    output_value,
    ttft_bucket,
)
from rollouts.domain.guards import JUDGE_GUARD
from rollouts.domain.plan import DEFAULT_PLAN, Decision, JudgeSpec, RolloutPlan, Stage

__all__ = [
    "POOLS",
    "VERSIONS",
    "Cell",
    "Pool",
    "Run",
    "SequentialOutcome",
    "SequentialSettings",
    "Version",
    "judge_sequential",
    "run_one",
    "run_sequential_check",
]


@dataclass(frozen=True, slots=True)
class Pool:
    """A model's pool at a load: ``streams`` at ``stream_tokens_per_s`` each."""

    name: str
    streams: float
    stream_tokens_per_s: float
    answer_tokens: float = 300.0

    @property
    def rps(self) -> float:
        """The pool's requests per second."""
        return self.streams * self.stream_tokens_per_s / self.answer_tokens


def _pools() -> tuple[Pool, ...]:
    seed = CapacityScenario()
    return (
        Pool("7b-100", 100, seed.stream_tokens_per_s, seed.answer_tokens),
        Pool("7b-1000", 1000, seed.stream_tokens_per_s, seed.answer_tokens),
        Pool(
            "70b-peak",
            seed.big.peak_streams,
            seed.big.stream_tokens_per_s,
            seed.answer_tokens,
        ),
    )


POOLS: tuple[Pool, ...] = _pools()


@dataclass(frozen=True, slots=True)
class Version:
    """A candidate: its error rate over live's, whether it refuses everything,
    and its quality (the share of gradable prompts it answers right; None: as
    live's)."""

    name: str
    description: str
    extra_error_points: float = 0.0
    refuses_all: bool = False
    quality: float | None = None


VERSIONS: tuple[Version, ...] = (
    Version(
        "refuses",
        "every answer a refusal (a broken chat template)",
        refuses_all=True,
        quality=0.0,
    ),
    Version("worse", "0.6 points more errors (just past the 0.5 threshold)", 0.6),
    Version("good", "as live", 0.0),
    Version(
        "subtle",
        "subtly worse: right on 75% of gradable prompts where live is on 95%, "
        "with live's errors, refusals, latency and lengths",
        quality=0.75,
    ),
)


def _judged_plan() -> RolloutPlan:
    return replace(DEFAULT_PLAN, judge=JudgeSpec(model="judge"))


@dataclass(frozen=True, slots=True)
class SequentialSettings:
    """The check's knobs (see the module docstring)."""

    seeds: int = 20
    seed: int = 0
    guard_period_s: float = 60.0
    slice_s: float = 10.0
    conversation_s: float = 240.0
    conversation_turns: int = 6
    live_error_rate: float = 0.004
    live_refusal_rate: float = 0.01
    horizon_s: float = 8 * 3600.0
    # The live version's and the judge's quality (``drills.domain.judge_rates``).
    live_quality: float = 0.95
    judge_quality: float = 0.9
    plan: RolloutPlan = field(default_factory=_judged_plan)


@dataclass(frozen=True, slots=True)
class Run:
    """One rollout: how it ended, when (seconds from its start), and its first
    candidate request's time; ``raised``: the shares it was raised to."""

    decision: str
    decided_s: float | None
    first_exposure_s: float | None
    periods_to_decision: float | None
    raised: tuple[float, ...]
    expected_first_s: float | None
    # The guards that said worse, for a rollback.
    tripped: tuple[str, ...] = ()
    # Pairs the judge compared in the rollout's last step.
    judged_pairs: int = 0


@dataclass(frozen=True, slots=True)
class Cell:
    """One version on one pool over every seed."""

    pool: Pool
    version: Version
    runs: tuple[Run, ...]

    def count(self, decision: str) -> int:
        """How many runs ended in ``decision``."""
        return sum(1 for r in self.runs if r.decision == decision)

    def median_decision_s(self) -> float | None:
        """The median time to a decision over the runs that decided."""
        times = sorted(r.decided_s for r in self.runs if r.decided_s is not None)
        return times[len(times) // 2] if times else None

    def caught_by_judge(self) -> int:
        """How many runs were rolled back with the judge guard among the reasons."""
        return sum(
            1
            for r in self.runs
            if r.decision == Decision.ROLLED_BACK.value and JUDGE_GUARD in r.tripped
        )

    def max_periods(self) -> float | None:
        """The most guard periods from first exposure to a decision."""
        periods = [
            r.periods_to_decision
            for r in self.runs
            if r.periods_to_decision is not None
        ]
        return max(periods) if periods else None

    def as_dict(self) -> dict[str, object]:
        """The cell as JSON."""
        return {
            "pool": self.pool.name,
            "streams": self.pool.streams,
            "rps": self.pool.rps,
            "version": self.version.name,
            "seeds": len(self.runs),
            "promoted": self.count(Decision.PROMOTED.value),
            "rolled_back": self.count(Decision.ROLLED_BACK.value),
            "undecided": self.count(Decision.PENDING.value),
            "caught_by_judge": self.caught_by_judge(),
            "median_decision_s": self.median_decision_s(),
            "max_periods_from_exposure": self.max_periods(),
            "runs": [
                {
                    "decision": r.decision,
                    "decided_s": r.decided_s,
                    "first_exposure_s": r.first_exposure_s,
                    "periods_to_decision": r.periods_to_decision,
                    "raised_to": list(r.raised),
                    "expected_decision_s_at_first_tick": r.expected_first_s,
                    "tripped": list(r.tripped),
                    "judged_pairs": r.judged_pairs,
                }
                for r in self.runs
            ],
        }


@dataclass(frozen=True, slots=True)
class SequentialOutcome:
    """Every cell of the check, and its settings."""

    settings: SequentialSettings
    cells: tuple[Cell, ...]

    def cell(self, pool: str, version: str) -> Cell:
        """The cell of ``version`` on ``pool``; KeyError if there is none."""
        for c in self.cells:
            if c.pool.name == pool and c.version.name == version:
                return c
        raise KeyError((pool, version))


class _RunningStore(FigureStore):
    """A ``FigureStore`` that keeps the sum of its closed buckets, so a long
    rollout's reads stay linear (the figures are the same sums)."""

    def __init__(self, bucket_s: float) -> None:
        super().__init__(bucket_s)
        self._sums: dict[tuple[str, str, int], tuple[int, VersionFigures]] = {}

    def figures(self, role: str, version: str, since: float) -> VersionFigures:
        first = math.floor(since / self.bucket_s)
        last = max(
            (i for (r, v, i) in self.buckets if r == role and v == version),
            default=first - 1,
        )
        done, total = self._sums.get((role, version, first), (first, VersionFigures()))
        # Buckets before the last one are closed: nothing lands in them any more.
        for index in range(done, last):
            bucket = self.buckets.get((role, version, index))
            if bucket is not None:
                total = total + bucket.figures()
        self._sums[(role, version, first)] = (max(done, last), total)
        bucket = self.buckets.get((role, version, last))
        return total + bucket.figures() if bucket is not None else total


class _Shapes:
    """TTFT and output-length bucket distributions, drawn once per run."""

    def __init__(self, rng: np.random.Generator) -> None:
        ttft = rng.lognormal(mean=math.log(0.35), sigma=0.5, size=20_000)
        output = np.clip(rng.gamma(2.0, 150.0, size=20_000), 1, 4000)
        self.ttft = _pmf([ttft_bucket(float(v)) for v in ttft])
        self.output = _pmf([output_bucket(int(v)) for v in output])
        self.refusal_bucket = output_bucket(REFUSAL_TOKENS)


def _pmf(indices: Sequence[int]) -> tuple[list[int], np.ndarray]:
    keys = sorted(set(indices))
    counts = np.array([indices.count(k) for k in keys], dtype=np.float64)
    return keys, counts / counts.sum()


def _add(
    bucket: FigureBucket,
    n: int,
    *,
    error_rate: float,
    refusal_rate: float,
    refuses_all: bool,
    shapes: _Shapes,
    rng: np.random.Generator,
    conversation_ids: range,
) -> None:
    """Add ``n`` requests' figures in bulk (as ``FigureBucket.add`` would, one by
    one)."""
    if n <= 0:
        return
    errors = int(rng.binomial(n, error_rate))
    answered = n - errors
    bucket.requests += n
    if errors:
        bucket.errors["upstream_5xx"] = bucket.errors.get("upstream_5xx", 0) + errors
    bucket.conversations.update(f"c{i}" for i in conversation_ids)
    keys, pmf = shapes.ttft
    for key, count in zip(keys, rng.multinomial(answered, pmf), strict=True):
        if count:
            bucket.ttft[key] = bucket.ttft.get(key, 0) + int(count)
    bucket.answered += answered
    if refuses_all:
        bucket.refusals += answered
        bucket.output_tokens += answered * REFUSAL_TOKENS
        index = shapes.refusal_bucket
        bucket.output[index] = bucket.output.get(index, 0) + answered
        return
    bucket.refusals += int(rng.binomial(answered, refusal_rate))
    keys, pmf = shapes.output
    for key, count in zip(keys, rng.multinomial(answered, pmf), strict=True):
        if count:
            bucket.output[key] = bucket.output.get(key, 0) + int(count)
            bucket.output_tokens += int(count) * _bucket_tokens(key)


@dataclass(frozen=True, slots=True)
class _JudgeDraws:
    """The judge's verdicts on a slice's canary requests: a share of them, at
    most the plan's ``per_minute`` (one gateway process), drawn at the rates the
    platform's judge code gives for the version's quality (``judge_rates``)."""

    share: float
    per_slice: int
    outcomes: tuple[str, ...]
    rates: np.ndarray

    @classmethod
    def of(
        cls, plan: RolloutPlan, version: Version, settings: SequentialSettings
    ) -> _JudgeDraws | None:
        judge = plan.judge
        if judge is None:
            return None
        quality = settings.live_quality if version.quality is None else version.quality
        pairs = judge_rates(quality, settings.live_quality, settings.judge_quality)
        rates = np.array([share for _, share in pairs])
        return cls(
            share=judge.share,
            per_slice=int(judge.per_minute * settings.slice_s / 60.0),
            outcomes=tuple(name for name, _ in pairs),
            rates=rates / rates.sum(),
        )

    def add(self, bucket: FigureBucket, n_c: int, rng: np.random.Generator) -> None:
        """Add the verdicts on ``n_c`` canary requests to ``bucket``."""
        n_j = min(int(rng.binomial(n_c, self.share)), self.per_slice)
        for name, count in zip(
            self.outcomes, rng.multinomial(n_j, self.rates), strict=True
        ):
            if count:
                bucket.judged[name] = bucket.judged.get(name, 0) + int(count)


def _bucket_tokens(index: int) -> int:
    return round(output_value(index))


def run_one(
    pool: Pool, version: Version, settings: SequentialSettings, seed: int
) -> Run:
    """Run one rollout of ``version`` on ``pool`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    shapes = _Shapes(rng)
    plan = settings.plan
    plan = replace(
        plan, steps=tuple(s for s in plan.steps if s.stage is not Stage.SHADOW)
    )
    period, slice_s = settings.guard_period_s, settings.slice_s
    store = _RunningStore(bucket_s=period)
    rollout = SimulatedRollout(plan, store, pool_rps=pool.rps, guard_period_s=period)
    # Half a slice off the period boundaries, as a beat's phase is arbitrary.
    start = slice_s / 2
    rollout.begin(start)
    segments: list[tuple[float, float]] = [(start, rollout.percent)]
    step, percent = rollout.step, rollout.percent
    first_exposure: float | None = None
    raised: list[float] = []
    expected_first: float | None = None
    conv = 0
    t = start
    next_tick = start + period
    error_c = settings.live_error_rate + version.extra_error_points / 100.0
    judging = _JudgeDraws.of(plan, version, settings)
    while t < start + settings.horizon_s:
        t_end = t + slice_s
        n = int(rng.poisson(pool.rps * slice_s))
        mid = t + slice_s / 2
        share = sum(
            p * min(1.0, max(0.0, mid - since) / settings.conversation_s)
            for since, p in segments
        )
        share = min(share, 50.0) / 100.0
        n_c = int(rng.binomial(n, share))
        n_b = int(rng.binomial(n - n_c, share / (1.0 - share))) if share < 1 else 0
        new_c = max(1, n_c // settings.conversation_turns) if n_c else 0
        new_b = max(1, n_b // settings.conversation_turns) if n_b else 0
        if n_c and first_exposure is None:
            first_exposure = t + float(rng.uniform(0, slice_s))
        _add(
            store.bucket(Role.CANARY.value, CANDIDATE_VERSION, t_end),
            n_c,
            error_rate=error_c,
            refuses_all=version.refuses_all,
            conversation_ids=range(conv, conv + new_c),
            refusal_rate=settings.live_refusal_rate,
            shapes=shapes,
            rng=rng,
        )
        conv += new_c
        if judging is not None and n_c:
            judging.add(
                store.bucket(Role.CANARY.value, CANDIDATE_VERSION, t_end), n_c, rng
            )
        _add(
            store.bucket(Role.BASELINE.value, LIVE_VERSION, t_end),
            n_b,
            error_rate=settings.live_error_rate,
            refuses_all=False,
            conversation_ids=range(conv, conv + new_b),
            refusal_rate=settings.live_refusal_rate,
            shapes=shapes,
            rng=rng,
        )
        conv += new_b
        t = t_end
        if t >= next_tick:
            evaluation = rollout.tick(next_tick)
            if expected_first is None and evaluation is not None:
                expected_first = evaluation.decision.expected_decision_s
            next_tick += period
            if rollout.decision != Decision.PENDING.value:
                break
            # Conversations already on the candidate stay there; only the added
            # share ramps in, with new conversations.
            if rollout.step == step and rollout.percent != percent:
                raised.append(rollout.percent)
            if rollout.percent != percent:
                segments.append((t, rollout.percent - percent))
            step, percent = rollout.step, rollout.percent
    decided = rollout.decided_at
    periods = (
        (decided - first_exposure) / period
        if decided is not None and first_exposure is not None
        else None
    )
    return Run(
        decision=rollout.decision,
        decided_s=None if decided is None else decided - start,
        first_exposure_s=None if first_exposure is None else first_exposure - start,
        periods_to_decision=periods,
        raised=tuple(raised),
        expected_first_s=expected_first,
        tripped=tuple(r.name for r in rollout.tripped),
        judged_pairs=sum(
            rollout.store.figures(
                Role.CANARY.value, CANDIDATE_VERSION, rollout.step_started_at
            ).judged.values()
        ),
    )


def run_sequential_check(
    settings: SequentialSettings,
    *,
    pools: Sequence[Pool] = POOLS,
    versions: Sequence[Version] = VERSIONS,
) -> SequentialOutcome:
    """Run every version on every pool over ``settings.seeds`` seeds."""
    cells = []
    for p_index, pool in enumerate(pools):
        for v_index, version in enumerate(versions):
            runs = tuple(
                run_one(
                    pool,
                    version,
                    settings,
                    seed=settings.seed * 1_000_003
                    + p_index * 10_007
                    + v_index * 101
                    + i,
                )
                for i in range(settings.seeds)
            )
            cells.append(Cell(pool, version, runs))
    return SequentialOutcome(settings, tuple(cells))


def judge_sequential(outcome: SequentialOutcome) -> tuple[Check, ...]:
    """The issue's targets, per pool."""
    checks: list[Check] = []
    within = 3.0
    for cell in outcome.cells:
        name, n = cell.pool.name, len(cell.runs)
        if cell.version.name == "refuses":
            late = [
                r
                for r in cell.runs
                if r.decision != Decision.ROLLED_BACK.value
                or r.periods_to_decision is None
                or r.periods_to_decision > within
            ]
            worst = cell.max_periods()
            checks.append(
                Check(
                    f"{name}_refuses_rolled_back_within_3_periods",
                    not late,
                    f"{n - len(late)} of {n} rolled back within {within:g} guard "
                    f"periods of first exposure (worst "
                    f"{'-' if worst is None else f'{worst:.2f}'})",
                )
            )
        elif cell.version.name == "worse":
            promoted = cell.count(Decision.PROMOTED.value)
            checks.append(
                Check(
                    f"{name}_worse_never_promoted",
                    promoted == 0,
                    f"{promoted} of {n} promoted within "
                    f"{outcome.settings.horizon_s:g} s",
                )
            )
        elif cell.version.name == "subtle":
            caught = cell.caught_by_judge()
            promoted = cell.count(Decision.PROMOTED.value)
            need = math.ceil(0.9 * n)
            checks.append(
                Check(
                    f"{name}_subtle_caught_by_judge_18_of_20",
                    caught >= need and promoted == 0,
                    f"{caught} of {n} rolled back by the judge guard, {promoted} "
                    f"promoted (needs {need} caught, none promoted)",
                )
            )
        elif cell.version.name == "good":
            promoted = cell.count(Decision.PROMOTED.value)
            need = math.ceil(0.95 * n)
            checks.append(
                Check(
                    f"{name}_good_promoted_19_of_20",
                    promoted >= need,
                    f"{promoted} of {n} promoted (needs {need})",
                )
            )
    return tuple(checks)
