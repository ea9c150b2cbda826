"""The rollout drill: a broken, a good and a slow version through the rollout plan,
over the seed's traffic from the fleet simulator.

Public surface: ``MODEL``, ``LIVE_VERSION``, ``CANDIDATE_VERSION``,
``REFUSAL_TEXT``, ``REFUSAL_TOKENS``, ``SLOW_TTFT_FACTOR``, ``SEED_STREAMS``,
``Candidate``, ``SCENARIOS``, ``SCENARIO_NAMES``,
``RolloutDrillSettings``, ``Turn``, ``Traffic``, ``simulate_traffic``,
``FigureBucket``, ``FigureStore``, ``SimulatedRollout``, ``Tick``,
``MidChatMoves``, ``ScenarioOutcome``, ``Check`` (from ``drills.domain.overload``),
``DrillOutcome``, ``replay_rollout``, ``judge``, ``run_drill``.

Issue 16's drill: (a) a version with a broken chat template (every answer the
simulated replica's degraded refusal) is caught at canary 1% and rolled back; (b) a
good version goes from shadow to live with no trip; (c) a version with a 30%
slower TTFT trips the TTFT guard. What decides is the platform's own code, not a
copy of it:

- the version of every request: ``routing.domain.resolve.resolve`` (the canary by
  a stable hash of the conversation's routing key ``conv:<id>``, the shadow copy
  by a uniform draw) and ``routing.domain.sticky`` with a dict as the gateways'
  conversation memory (from the rollout's start: ``first_choice`` for a
  conversation not seen yet, which goes to the canary only on its first turn,
  ``stick`` after), consulted and written while ``sticky.needs_memory`` says so,
  as ``routing.chat`` does with ``routing.sticky``;
- the figures: per role, version and bucket of ``bucket_s`` (60 s, the live
  ``PLATFORM_FIGURES_BUCKET_S``), filled when a request ends, with the buckets of
  ``metering.domain.figures`` (``ttft_bucket``, ``output_bucket``; ``FigureBucket``
  is held equal to summed ``one_request`` figures by a test). Conversations are
  counted exactly per bucket (live uses a HyperLogLog per bucket). Each request
  counts in the role ``sticky.figure_role`` gives it (``canary``, ``baseline``:
  the live version's band beside the canary, ``live``), as the gateway's;
- every ``guard_period_s`` (60 s, ``PLATFORM_ROLLOUT_GUARD_INTERVAL_S``), the
  figures ended so far are flushed to their buckets (``FigureStore``) and the
  guard tick runs: ``rollouts.domain.guard_tick``, the generator the live task
  drives too (``control.rollout_guard``), here driven by ``SimulatedRollout`` in
  virtual time (advance: the next step's traffic from now; promote: the alias
  moves, the old version is retained; roll back: the canary and the shadow go).
  A test feeds the same figures to both drivers and gets the same decisions.

The traffic (``simulate_traffic``): the seed's 7B chat workload at ``streams``
concurrent streams (1,000: 100 requests/s, ``streams x 30 tokens/s / 300
tokens``) through ``FleetSim`` on ``replicas`` replicas (default: the capacity
plan's for one region carrying that rate, prefill counted, ``drills.domain.
planned_fleet``: 14 at the seed's 100 requests/s; the seed's 12 count decode only and
run past their knee with its 1,200-token prompts). Each request
keeps its arrival, conversation, TTFT, decode time and output length as the
modelled replicas produced them. Chats last ``conversation_turns`` turns (6, about
four minutes at the seed's 40 s between messages): a chat that never ended would
never let a canary step's new share in, since only new conversations go to it. A
request's first turn is one with no earlier turn's tokens in its prompt. By default the simulator runs the whole replay of a rollout that
advances as soon as each step allows (``lead_s`` + the plan's minimum durations +
``after_s``: 2,970 s with the default plan, about a minute of CPU at the seed's
scale). A replay longer than the window (a rollout that holds, or a shorter
``window_s``) repeats the window in cycles, each shifted by the window and with
its conversation ids offset (so a cycle's conversations are new ones; a
conversation under way at the window's end ends there).
``Traffic.cycles_used`` says how many were replayed.

The candidate's answers are the live replica's for the same request, changed by
the scenario (``Candidate``): degraded, every answer is ``REFUSAL_TEXT`` (10
tokens, judged a refusal by the gateway's ``RefusalDetector``), with the same TTFT
and the same time per output token; slow, the TTFT times ``SLOW_TTFT_FACTOR``
(1.3); good, as the replica produced it. The candidate runs on its own pool (a
canary is extra capacity), modelled as serving like the live one, so the
candidate's traffic does not change the live version's figures. A shadow copy's
answer is recorded in full (``routing.shadow`` reads it whole and runs the
detector), and no caller sees it.

Scenarios (``SCENARIOS``): ``bad`` runs the plan from its first canary step (the
issue's "caught at canary 1%": a plan without its shadow steps); ``bad_shadow``
runs the same version through the whole plan, where the shadow copies catch it
before any user sees it; ``good`` and ``slow`` run the whole plan. The rollout
starts ``lead_s`` into the traffic (conversations under way, and half a bucket off
the minute boundaries, as a beat's phase is arbitrary: each step's window then
also holds the half bucket before it, as live). The replay goes on ``after_s``
past the decision, to see where the conversations go next.

Mid-chat moves (``MidChatMoves``): a conversation whose turn went to another
version than its previous turn's. ``rollback``: a rollback came between the two
(a rollback moves canary conversations back to live: that is what it is for);
``before_memory``: the previous turn came before the gateways began remembering
versions (the rollout's start); ``other``: any other. Both are zero at the seed's
scale: a conversation under way stays on the live version.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import NamedTuple

from drills.domain.capacity_plan import Scenario as CapacityScenario
from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig
from drills.domain.overload import Check
from drills.domain.planned_fleet import at_region_peak, fleet_size
from drills.domain.workload import ChatWorkload
from metering.domain.figures import Role, VersionFigures, output_bucket, ttft_bucket
from rollouts.domain.guard_tick import (
    AdvanceStep,
    Effect,
    Evaluation,
    GuardedRollout,
    LockRollout,
    Promote,
    RaiseShare,
    ReadFigures,
    ReadGates,
    RecordEvaluation,
    Reply,
    RollBack,
    drive,
    guard_tick,
)
from rollouts.domain.guards import GuardReport, GuardResult
from rollouts.domain.plan import (
    DEFAULT_PLAN,
    Decision,
    RolloutPlan,
    Stage,
    StepSpec,
    step_share,
)
from routing.domain.refusals import RefusalDetector
from routing.domain.resolve import resolve
from routing.domain.snapshot import ModelRecord
from routing.domain.sticky import (
    Remembered,
    figure_role,
    first_choice,
    needs_memory,
    routable_versions,
    stick,
)

__all__ = [
    "CANDIDATE_VERSION",
    "LIVE_VERSION",
    "MODEL",
    "REFUSAL_TEXT",
    "REFUSAL_TOKENS",
    "SCENARIOS",
    "SCENARIO_NAMES",
    "SEED_STREAMS",
    "SLOW_TTFT_FACTOR",
    "Candidate",
    "Check",
    "DrillOutcome",
    "FigureBucket",
    "FigureStore",
    "MidChatMoves",
    "RolloutDrillSettings",
    "ScenarioOutcome",
    "SimulatedRollout",
    "Tick",
    "Traffic",
    "Turn",
    "judge",
    "replay_rollout",
    "run_drill",
    "simulate_traffic",
]

MODEL, LIVE_VERSION, CANDIDATE_VERSION = "chat-7b", "v1", "v2"
# The simulated replica's degraded answer (simengine.replica.DEGRADED_PIECES).
REFUSAL_TEXT = "I am sorry, I cannot help with that."
REFUSAL_TOKENS = 10
SLOW_TTFT_FACTOR = 1.3
SEED_STREAMS = 1000
# Outcomes of the simulator that are no error of the version: refused by limits
# or by the pool's admission (the gateway records no figures for them), or still
# running when the simulation's drain ended (no end to record).
_NOT_RECORDED = frozenset({"rate_limited", "shed", "too_large", "unfinished"})


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the version under rollout does to an answer, and where its plan starts.

    ``is_degraded``: every answer is the refusal; ``ttft_factor`` scales the TTFT;
    ``skips_shadow``: the plan runs from its first canary step.
    """

    name: str
    description: str
    is_degraded: bool = False
    ttft_factor: float = 1.0
    skips_shadow: bool = False


SCENARIOS: Mapping[str, Candidate] = {
    "bad": Candidate(
        "bad",
        "broken chat template (every answer a refusal), plan from canary",
        is_degraded=True,
        skips_shadow=True,
    ),
    "bad_shadow": Candidate(
        "bad_shadow",
        "broken chat template, the whole plan (shadow first)",
        is_degraded=True,
    ),
    "good": Candidate("good", "a good version, the whole plan"),
    "slow": Candidate(
        "slow",
        f"TTFT x{SLOW_TTFT_FACTOR:g}, the whole plan",
        ttft_factor=SLOW_TTFT_FACTOR,
    ),
}
SCENARIO_NAMES: tuple[str, ...] = tuple(SCENARIOS)


@dataclass(frozen=True, slots=True)
class RolloutDrillSettings:
    """The drill's traffic and clocks (defaults: the seed's scale, live's periods).

    ``replicas`` None: the capacity plan's for one region at ``arrival_rate``.
    ``window_s``: how long the fleet simulator runs (the replay cycles it); None:
    ``lead_s`` + the plan's minimum durations + ``after_s``, the whole replay of a
    rollout that advances as soon as each step allows (no cycle).
    ``hold_allowance_s``: past the plan's minimum durations, how long a rollout may
    wait for a decision before the drill reports it still pending.
    """

    streams: int = SEED_STREAMS
    replicas: int | None = None
    window_s: float | None = None
    warmup_s: float = 120.0
    conversation_turns: int = 6
    plan: RolloutPlan = DEFAULT_PLAN
    guard_period_s: float = 60.0
    bucket_s: float = 60.0
    lead_s: float = 270.0
    after_s: float = 300.0
    hold_allowance_s: float = 1200.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.streams < 1 or (self.replicas is not None and self.replicas < 1):
            raise ValueError("streams and replicas must be positive")
        if min(self.traffic_window_s, self.guard_period_s, self.bucket_s) <= 0:
            raise ValueError("window_s, guard_period_s and bucket_s must be positive")
        if min(self.warmup_s, self.lead_s, self.after_s, self.hold_allowance_s) < 0:
            raise ValueError("warm-up, lead, after and hold times must be >= 0")
        if self.conversation_turns < 1:
            raise ValueError("conversation_turns must be at least 1")

    @property
    def arrival_rate(self) -> float:
        """Requests/s of ``streams`` streams: streams x tokens/s / answer tokens."""
        seed = CapacityScenario()
        return self.streams * seed.stream_tokens_per_s / seed.answer_tokens

    @property
    def fleet_replicas(self) -> int:
        if self.replicas is not None:
            return self.replicas
        planned = fleet_size(at_region_peak(CapacityScenario(), self.arrival_rate))
        return planned.replicas

    @property
    def plan_s(self) -> float:
        """The plan's minimum durations, summed."""
        return sum(step.min_duration_s for step in self.plan.steps)

    @property
    def traffic_window_s(self) -> float:
        """The simulator's window (``window_s``, or the whole replay)."""
        if self.window_s is not None:
            return self.window_s
        return self.lead_s + self.plan_s + self.after_s


class Turn(NamedTuple):
    """One request as the modelled replicas served it (seconds from the window's
    start). ``first_token_at`` None: no first token; ``finished_at`` None: no end."""

    at: float
    first_token_at: float | None
    finished_at: float | None
    conversation: int
    output_tokens: int
    outcome: str
    first_turn: bool = True


@dataclass(frozen=True, slots=True)
class Traffic:
    """The simulator's requests of one window, replayed in cycles.

    ``stride``: the conversation-id offset between cycles (above every id).
    """

    turns: tuple[Turn, ...]
    window_s: float
    stride: int
    arrival_rate: float
    replicas: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None

    def replay(self, until_s: float) -> Iterator[Turn]:
        """Yield the turns arriving before ``until_s``, cycling the window."""
        cycle = 0
        while cycle * self.window_s < until_s:
            shift = cycle * self.window_s
            offset = cycle * self.stride
            for turn in self.turns:
                at = turn.at + shift
                if at >= until_s:
                    return
                yield Turn(
                    at,
                    None
                    if turn.first_token_at is None
                    else turn.first_token_at + shift,
                    None if turn.finished_at is None else turn.finished_at + shift,
                    turn.conversation + offset,
                    turn.output_tokens,
                    turn.outcome,
                    turn.first_turn,
                )
            cycle += 1

    def cycles_used(self, until_s: float) -> int:
        """How many windows a replay to ``until_s`` uses."""
        return max(1, math.ceil(until_s / self.window_s))


def simulate_traffic(config: FleetConfig, settings: RolloutDrillSettings) -> Traffic:
    """Run the seed's chat workload through the fleet simulator for one window.

    ``config``'s replicas are replaced by ``settings.fleet_replicas``.
    """
    workload = ChatWorkload(
        arrival_rate=settings.arrival_rate,
        conversation_turns=settings.conversation_turns,
    )
    sim = FleetSim(replace(config, replicas=settings.fleet_replicas), workload)
    result = sim.run(settings.traffic_window_s, warmup_s=settings.warmup_s)
    start = settings.warmup_s
    turns = tuple(
        Turn(
            r.arrived_at - start,
            None if r.first_token_at is None else r.first_token_at - start,
            None if r.finished_at is None else r.finished_at - start,
            r.conversation,
            r.output_tokens,
            r.outcome,
            # No earlier turn's tokens in its prompt: the conversation's first.
            r.history_tokens == 0,
        )
        for r in sorted(result.requests, key=lambda r: (r.arrived_at, r.request_id))
    )
    summary = result.summary()
    return Traffic(
        turns=turns,
        window_s=settings.traffic_window_s,
        stride=max((t.conversation for t in turns), default=0) + 1,
        arrival_rate=settings.arrival_rate,
        replicas=settings.fleet_replicas,
        ttft_p50_s=summary["ttft_p50_s"],
        ttft_p95_s=summary["ttft_p95_s"],
    )


class FigureBucket:
    """One bucket of one version's figures in one role, added to request by request.

    The gateway adds ``one_request`` figures per request; summing thousands of
    ``VersionFigures`` that way copies every histogram each time, so the drill
    counts in place with the same bucket functions and builds the figures once.
    ``conversations``: the distinct conversations seen.
    """

    __slots__ = (
        "answered",
        "conversations",
        "errors",
        "judged",
        "output",
        "output_tokens",
        "refusals",
        "requests",
        "ttft",
    )

    def __init__(self) -> None:
        self.judged: dict[str, int] = {}
        self.requests = 0
        self.answered = 0
        self.refusals = 0
        self.output_tokens = 0
        self.conversations: set[str] = set()
        self.errors: dict[str, int] = {}
        self.ttft: dict[int, int] = {}
        self.output: dict[int, int] = {}

    def add(
        self,
        *,
        ttft_s: float | None,
        output_tokens: int | None,
        error_kind: str | None = None,
        refused: bool = False,
        conversation: str | None = None,
    ) -> None:
        """Add one request (``one_request``'s arguments) and its conversation."""
        self.requests += 1
        if conversation:
            self.conversations.add(conversation)
        if error_kind is not None:
            self.errors[error_kind] = self.errors.get(error_kind, 0) + 1
        if ttft_s is not None:
            index = ttft_bucket(ttft_s)
            self.ttft[index] = self.ttft.get(index, 0) + 1
        if output_tokens is not None:
            self.answered += 1
            self.refusals += int(refused)
            self.output_tokens += output_tokens
            index = output_bucket(output_tokens)
            self.output[index] = self.output.get(index, 0) + 1

    def figures(self) -> VersionFigures:
        return VersionFigures(
            requests=self.requests,
            answered=self.answered,
            refusals=self.refusals,
            output_tokens=self.output_tokens,
            conversations=len(self.conversations),
            errors=dict(self.errors),
            ttft=dict(self.ttft),
            output=dict(self.output),
            judged=dict(self.judged),
        )


@dataclass(frozen=True, slots=True)
class Tick:
    """One guard evaluation: when (seconds from the rollout's start), the step it
    judged, the decision and the report, with the candidate's counts in the step."""

    at_s: float
    step: int
    stage: str
    percent: float
    action: str
    reason: str
    report: GuardReport
    candidate_requests: int
    candidate_conversations: int
    # The report as the live task stores it (``Evaluation.report_json``).
    report_json: dict[str, object] = field(default_factory=dict)

    @classmethod
    def of(cls, evaluation: Evaluation) -> Tick:
        """The tick of one evaluation (``guard_tick.RecordEvaluation``)."""
        judged, decision = evaluation.rollout, evaluation.decision
        return cls(
            at_s=evaluation.at,
            step=judged.step,
            stage=judged.stage.value,
            percent=judged.percent,
            action=decision.action.value,
            reason=decision.reason,
            report=evaluation.report,
            candidate_requests=evaluation.candidate.requests,
            candidate_conversations=evaluation.candidate.conversations,
            report_json=evaluation.report_json(),
        )

    def result(self, name: str) -> GuardResult:
        return self.report.result(name)

    def as_dict(self) -> dict[str, object]:
        return {
            "at_s": self.at_s,
            "step": self.step,
            "stage": self.stage,
            "percent": self.percent,
            "action": self.action,
            "reason": self.reason,
            "candidate_requests": self.candidate_requests,
            "candidate_conversations": self.candidate_conversations,
            "live_requests": self.report.live_requests,
            "expected_decision_s": self.report_json.get("expected_decision_s"),
            "guards": {
                r.name: {
                    "verdict": r.verdict.value,
                    "candidate": r.candidate,
                    "live": r.live,
                    "change": r.change,
                    "p_value": r.p_value,
                    "candidate_samples": r.candidate_samples,
                    "live_samples": r.live_samples,
                }
                for r in self.report.results
            },
        }


@dataclass(frozen=True, slots=True)
class MidChatMoves:
    """Conversations whose turn went to another version than their previous one's
    (module docstring): by cause, each conversation counted once."""

    rollback: int = 0
    before_memory: int = 0
    other: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "rollback": self.rollback,
            "before_memory": self.before_memory,
            "other": self.other,
        }


@dataclass(frozen=True, slots=True)
class ScenarioOutcome:
    """What one scenario's rollout did (times in seconds from the rollout's start).

    ``decision``: ``rolled_back``, ``promoted`` or ``pending`` (no decision within
    the plan's durations and the hold allowance). ``detection_s``: from the
    candidate's first traffic (a canary request or a shadow copy) to the rollback.
    ``conversations_saw`` / ``requests_saw``: the canary's, whose answers came
    from the candidate (a shadow's never reach anyone). ``steps``: (time, label)
    of each step's start.
    """

    candidate: Candidate
    plan: RolloutPlan
    decision: str
    decided_at_s: float | None
    step: int
    stage: str
    percent: float
    reason: str
    first_candidate_s: float | None
    tripped: tuple[GuardResult, ...]
    conversations_saw: int
    requests_saw: int
    shadow_copies: int
    moves: MidChatMoves
    ticks: tuple[Tick, ...]
    steps: tuple[tuple[float, str], ...]
    requests: int
    conversations: int
    replayed_s: float

    @property
    def name(self) -> str:
        return self.candidate.name

    @property
    def detection_s(self) -> float | None:
        if self.decision != Decision.ROLLED_BACK or self.decided_at_s is None:
            return None
        if self.first_candidate_s is None:
            return None
        return self.decided_at_s - self.first_candidate_s

    @property
    def promotion_s(self) -> float | None:
        return self.decided_at_s if self.decision == Decision.PROMOTED else None

    @property
    def tripped_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.tripped)

    def as_dict(self, guard_period_s: float) -> dict[str, object]:
        detection = self.detection_s
        return {
            "scenario": self.name,
            "description": self.candidate.description,
            "decision": self.decision,
            "decided_at_s": self.decided_at_s,
            "step": self.step,
            "stage": self.stage,
            "percent": self.percent,
            "reason": self.reason,
            "first_candidate_s": self.first_candidate_s,
            "detection_s": detection,
            "detection_guard_periods": (
                None if detection is None else detection / guard_period_s
            ),
            "promotion_s": self.promotion_s,
            "tripped": [r.to_json() for r in self.tripped],
            "conversations_saw": self.conversations_saw,
            "requests_saw": self.requests_saw,
            "shadow_copies": self.shadow_copies,
            "mid_chat_moves": self.moves.as_dict(),
            "requests": self.requests,
            "conversations": self.conversations,
            "replayed_s": self.replayed_s,
            "plan": self.plan.to_json(),
            "steps": [{"at_s": at, "step": label} for at, label in self.steps],
            "ticks": [tick.as_dict() for tick in self.ticks],
        }


def _plan_for(candidate: Candidate, plan: RolloutPlan) -> RolloutPlan:
    if not candidate.skips_shadow:
        return plan
    steps = tuple(step for step in plan.steps if step.stage is not Stage.SHADOW)
    return replace(plan, steps=steps)


def _traffic_record(record: ModelRecord, spec: StepSpec) -> ModelRecord:
    """The model's routing for a step (``plans.apply_traffic`` and the snapshot's
    shadows: a shadow step sets the shadow, a canary step the canary)."""
    if spec.stage is Stage.SHADOW:
        return replace(
            record,
            canary_version=None,
            canary_percent=0.0,
            shadow_version=CANDIDATE_VERSION,
            shadow_percent=spec.percent,
        )
    return replace(
        record,
        canary_version=CANDIDATE_VERSION,
        canary_percent=spec.percent,
        shadow_version=None,
        shadow_percent=0.0,
    )


class _Answer(NamedTuple):
    """One answer's figures, recorded when it ends."""

    finished_at: float
    ttft_s: float | None
    output_tokens: int | None
    error_kind: str | None
    refused: bool


def _live_answer(turn: Turn) -> _Answer | None:
    if turn.outcome in _NOT_RECORDED or turn.finished_at is None:
        return None
    ttft = None if turn.first_token_at is None else turn.first_token_at - turn.at
    if turn.outcome == "ok":
        return _Answer(turn.finished_at, ttft, turn.output_tokens, None, refused=False)
    # A failure after the first token broke the stream; before it, no replica
    # could start an answer.
    kind = "broken" if ttft is not None else "upstream"
    return _Answer(turn.finished_at, ttft, None, kind, refused=False)


def _candidate_answer(
    turn: Turn, candidate: Candidate, *, is_refusal: bool
) -> _Answer | None:
    live = _live_answer(turn)
    if live is None or live.ttft_s is None or turn.first_token_at is None:
        return live
    ttft = live.ttft_s * candidate.ttft_factor
    decode_s = live.finished_at - turn.first_token_at
    if live.error_kind is not None:
        return live._replace(ttft_s=ttft, finished_at=turn.at + ttft + decode_s)
    if candidate.is_degraded:
        # The same time per output token, for the refusal's tokens.
        per_token = decode_s / max(1, turn.output_tokens)
        return _Answer(
            turn.at + ttft + per_token * REFUSAL_TOKENS,
            ttft,
            REFUSAL_TOKENS,
            None,
            refused=is_refusal,
        )
    return live._replace(ttft_s=ttft, finished_at=turn.at + ttft + decode_s)


class FigureStore:
    """The drill's figures per role, version and bucket of ``bucket_s``.

    An answer is recorded when it ends (``record``: the gateway records a request
    in ``finally``) and lands in its end's bucket at the next ``drain`` (the guard
    task's flush). ``figures`` reads as ``metering.services.version_figures``
    does: every bucket from the one holding ``since`` on, summed.
    """

    def __init__(self, bucket_s: float) -> None:
        self.bucket_s = bucket_s
        self.buckets: dict[tuple[str, str, int], FigureBucket] = {}
        self._pending: list[tuple[float, int, str, str, str, _Answer]] = []
        self._seq = 0

    def bucket(self, role: str, version: str, at: float) -> FigureBucket:
        """Return the bucket holding time ``at`` (created empty if need be)."""
        key = (role, version, math.floor(at / self.bucket_s))
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = FigureBucket()
        return bucket

    def figures(self, role: str, version: str, since: float) -> VersionFigures:
        """Return the figures of every bucket from the one holding ``since`` on."""
        first = math.floor(since / self.bucket_s)
        total = VersionFigures()
        for (r, v, index), bucket in self.buckets.items():
            if r == role and v == version and index >= first:
                total = total + bucket.figures()
        return total

    def record(
        self, role: str, version: str, conversation: str, answer: _Answer | None
    ) -> None:
        """Hold an answer's figures until its end is drained (None: nothing)."""
        if answer is None:
            return
        self._seq += 1
        heapq.heappush(
            self._pending,
            (answer.finished_at, self._seq, role, version, conversation, answer),
        )

    def drain(self, until: float) -> None:
        """Add the answers that ended by ``until`` to their end's bucket."""
        pending = self._pending
        while pending and pending[0][0] <= until:
            finished_at, _, role, version, conversation, answer = heapq.heappop(pending)
            self.bucket(role, version, finished_at).add(
                ttft_s=answer.ttft_s,
                output_tokens=answer.output_tokens,
                error_kind=answer.error_kind,
                refused=answer.refused,
                conversation=conversation,
            )


class SimulatedRollout:
    """One rollout in virtual time: the model's routing, the plan's state, and the
    guard tick's effects (``rollouts.domain.guard_tick``) performed on them.

    As the live task does (``control.rollout_guard``): advance, the next step's
    share from now; promote, the alias moves and the old version is retained;
    roll back, the canary and the shadow go. Nothing else writes the rollout, so
    the lock always holds, and the candidate passed its gates (no refusal).
    One writer: whoever calls ``begin`` and ``tick``.
    """

    def __init__(
        self,
        plan: RolloutPlan,
        store: FigureStore,
        *,
        pool_rps: float | None = None,
        guard_period_s: float = 60.0,
    ) -> None:
        self.plan = plan
        self.store = store
        self.pool_rps = pool_rps
        self.guard_period_s = guard_period_s
        self.percent = 0.0
        self.record = ModelRecord(
            model=MODEL,
            live_version=LIVE_VERSION,
            canary_version=None,
            canary_percent=0.0,
            shadow_version=None,
            shadow_percent=0.0,
        )
        self.step = 0
        self.step_started_at = 0.0
        self.decision: str = Decision.PENDING.value
        self.decided_at: float | None = None
        self.reason = ""
        self.tripped: tuple[GuardResult, ...] = ()
        self.ticks: list[Tick] = []
        self.steps: list[tuple[float, str]] = []
        self.memory_began_at: float | None = None
        self.rolled_back_at: float | None = None

    def begin(self, at: float) -> None:
        """Start the plan's first step at ``at`` (``plans.begin_step``)."""
        # The gateways remember conversations from the rollout's start (the
        # snapshot's rollout_pending), before any canary share can take them.
        self.record = replace(self.record, rollout_pending=True)
        self.step, self.step_started_at = 0, at
        share = step_share(self.plan, 0, self.pool_rps, self.guard_period_s)
        self._apply(replace(self.plan.steps[0], percent=share), at)

    def tick(self, at: float) -> Evaluation | None:
        """One guard tick at ``at`` (``control.rollout_guard.tick_rollout``)."""
        spec = self.plan.steps[self.step]
        guarded = GuardedRollout(
            model=MODEL,
            candidate=CANDIDATE_VERSION,
            live=self.record.live_version,
            stage=spec.stage,
            percent=self.percent,
            step=self.step,
            step_started_at=self.step_started_at,
            plan=self.plan,
            pool_rps=self.pool_rps,
            guard_period_s=self.guard_period_s,
        )
        return drive(guard_tick(guarded, now=at), partial(self._perform, at))

    def _perform(self, at: float, effect: Effect) -> Reply:
        if isinstance(effect, ReadFigures):
            return self.store.figures(effect.role, effect.version, effect.since)
        if isinstance(effect, LockRollout):
            return True
        if isinstance(effect, ReadGates):
            return None
        if isinstance(effect, RecordEvaluation):
            self.ticks.append(Tick.of(effect.evaluation))
        elif isinstance(effect, RollBack):
            self._roll_back(effect, at)
        elif isinstance(effect, Promote):
            self._promote(effect, at)
        elif isinstance(effect, AdvanceStep):
            self.step, self.step_started_at = effect.step, at
            self._apply(effect.spec, at)
        elif isinstance(effect, RaiseShare):
            self._apply(replace(self.plan.steps[self.step], percent=effect.percent), at)
        return None

    def _apply(self, spec: StepSpec, at: float) -> None:
        self.percent = spec.percent
        self.record = _traffic_record(self.record, spec)
        self.steps.append((at, spec.label))
        if self.memory_began_at is None and needs_memory(self.record):
            self.memory_began_at = at

    def _roll_back(self, effect: RollBack, at: float) -> None:
        self._decide(Decision.ROLLED_BACK, at, effect.reason)
        self.tripped = effect.report.tripped
        self.rolled_back_at = at
        self.record = replace(
            self.record,
            rollout_pending=False,
            canary_version=None,
            canary_percent=0.0,
            shadow_version=None,
            shadow_percent=0.0,
        )

    def _promote(self, effect: Promote, at: float) -> None:
        self._decide(Decision.PROMOTED, at, effect.reason)
        self.record = replace(
            self.record,
            live_version=CANDIDATE_VERSION,
            rollout_pending=False,
            canary_version=None,
            canary_percent=0.0,
            shadow_version=None,
            shadow_percent=0.0,
            retained_version=LIVE_VERSION,
        )

    def _decide(self, decision: Decision, at: float, reason: str) -> None:
        self.decision, self.decided_at, self.reason = decision.value, at, reason


class _Replay:
    """The state of one scenario's replay: the traffic, the conversation memory,
    the figures and the rollout. One writer: ``run``."""

    def __init__(
        self,
        traffic: Traffic,
        candidate: Candidate,
        settings: RolloutDrillSettings,
    ) -> None:
        self.traffic = traffic
        self.candidate = candidate
        self.settings = settings
        self.store = FigureStore(settings.bucket_s)
        # Told the pool's rate, as the live task reads it from the figures.
        self.rollout = SimulatedRollout(
            _plan_for(candidate, settings.plan),
            self.store,
            pool_rps=traffic.arrival_rate,
            guard_period_s=settings.guard_period_s,
        )
        self.is_refusal = RefusalDetector().is_refusal(REFUSAL_TEXT)
        self.versions = frozenset({(MODEL, LIVE_VERSION), (MODEL, CANDIDATE_VERSION)})
        self.memory: dict[str, Remembered] = {}
        self.last: dict[str, tuple[str, float]] = {}
        self.moved: dict[str, str] = {}
        self.first_candidate_at: float | None = None
        self.saw: set[str] = set()
        self.requests_saw = 0
        self.shadow_copies = 0
        self.requests = 0
        self.conversations: set[str] = set()

    def tick(self, at: float) -> None:
        """Flush what ended by ``at``, then one guard tick."""
        self.store.drain(at)
        self.rollout.tick(at)

    # -- one request --------------------------------------------------------------------

    def route(self, turn: Turn, draw: float) -> None:
        """Resolve one request as the gateway does, and record its figures."""
        key = f"conv:{turn.conversation}"
        record = self.rollout.record
        resolution = resolve(MODEL, {MODEL: record}, self.versions, key, draw)
        remembered: Remembered | None = None
        if needs_memory(record):
            remembered = self.memory.get(key)
            if remembered is None or remembered.version not in routable_versions(
                record
            ):
                remembered = first_choice(
                    resolution, record, first_turn=turn.first_turn, routing_key=key
                )
            self.memory[key] = remembered
            resolution = stick(resolution, remembered, record)
        version = resolution.version
        self.requests += 1
        self.conversations.add(key)
        self._note_move(key, version, turn.at)
        role = figure_role(resolution, remembered, record)
        if version == CANDIDATE_VERSION and resolution.is_canary:
            self._first_candidate(turn.at)
            self.saw.add(key)
            self.requests_saw += 1
            answer = _candidate_answer(turn, self.candidate, is_refusal=self.is_refusal)
            if role is not None:
                self.store.record(role, version, key, answer)
        elif version == CANDIDATE_VERSION:
            # Promoted: the candidate is live, and no figures are recorded any more.
            pass
        elif role is not None:
            self.store.record(role, version, key, _live_answer(turn))
        if resolution.shadow_version == CANDIDATE_VERSION:
            self._first_candidate(turn.at)
            self.shadow_copies += 1
            self.store.record(
                Role.SHADOW,
                CANDIDATE_VERSION,
                key,
                _candidate_answer(turn, self.candidate, is_refusal=self.is_refusal),
            )

    def _first_candidate(self, at: float) -> None:
        if self.first_candidate_at is None:
            self.first_candidate_at = at

    def _note_move(self, key: str, version: str, at: float) -> None:
        previous = self.last.get(key)
        self.last[key] = (version, at)
        if previous is None or previous[0] == version or key in self.moved:
            return
        before = previous[1]
        rolled_back_at = self.rollout.rolled_back_at
        memory_began_at = self.rollout.memory_began_at
        if rolled_back_at is not None and before < rolled_back_at <= at:
            cause = "rollback"
        elif memory_began_at is not None and before < memory_began_at <= at:
            cause = "before_memory"
        else:
            cause = "other"
        self.moved[key] = cause

    # -- the run ------------------------------------------------------------------------

    def run(self) -> ScenarioOutcome:
        s = self.settings
        rollout = self.rollout
        start = s.lead_s
        horizon = start + s.plan_s + s.hold_allowance_s
        end = horizon + s.after_s
        period = s.guard_period_s
        draws = random.Random(f"{s.seed}:shadow")
        begun = False
        next_tick = start + period
        last_at = start
        for turn in self.traffic.replay(end):
            at = turn.at
            if not begun and at >= start:
                rollout.begin(start)
                begun = True
            while (
                begun and rollout.decided_at is None and next_tick <= min(at, horizon)
            ):
                self.tick(next_tick)
                next_tick += period
            if rollout.decided_at is not None and at > rollout.decided_at + s.after_s:
                break
            if rollout.decided_at is None and at > horizon:
                break
            self.route(turn, draws.random())
            last_at = at
        return self._outcome(start, last_at)

    def _outcome(self, start: float, last_at: float) -> ScenarioOutcome:
        moves = {"rollback": 0, "before_memory": 0, "other": 0}
        for cause in self.moved.values():
            moves[cause] += 1
        rollout = self.rollout
        spec = rollout.plan.steps[rollout.step]

        def rel(at: float | None) -> float | None:
            return None if at is None else at - start

        return ScenarioOutcome(
            candidate=self.candidate,
            plan=rollout.plan,
            decision=rollout.decision,
            decided_at_s=rel(rollout.decided_at),
            step=rollout.step,
            stage=spec.stage.value,
            percent=spec.percent,
            reason=rollout.reason
            or (rollout.ticks[-1].reason if rollout.ticks else ""),
            first_candidate_s=rel(self.first_candidate_at),
            tripped=rollout.tripped,
            conversations_saw=len(self.saw),
            requests_saw=self.requests_saw,
            shadow_copies=self.shadow_copies,
            moves=MidChatMoves(**moves),
            ticks=tuple(replace(t, at_s=t.at_s - start) for t in rollout.ticks),
            steps=tuple((at - start, label) for at, label in rollout.steps),
            requests=self.requests,
            conversations=len(self.conversations),
            replayed_s=last_at,
        )


def replay_rollout(
    traffic: Traffic, candidate: Candidate, settings: RolloutDrillSettings
) -> ScenarioOutcome:
    """Replay one rollout of ``candidate`` over ``traffic`` (module docstring)."""
    return _Replay(traffic, candidate, settings).run()


@dataclass(frozen=True, slots=True)
class DrillOutcome:
    """The traffic, every scenario's rollout, and the issue's targets judged."""

    settings: RolloutDrillSettings
    traffic: Traffic
    scenarios: tuple[ScenarioOutcome, ...]
    checks: tuple[Check, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def scenario(self, name: str) -> ScenarioOutcome | None:
        return next((s for s in self.scenarios if s.name == name), None)

    @property
    def cycles(self) -> int:
        """The most windows any scenario's replay used."""
        return max(
            (self.traffic.cycles_used(s.replayed_s) for s in self.scenarios),
            default=1,
        )


def _first_canary(plan: RolloutPlan) -> int:
    return next(i for i, step in enumerate(plan.steps) if step.stage is Stage.CANARY)


def judge(outcome: DrillOutcome) -> tuple[Check, ...]:
    """Return the issue's targets, each judged on the scenarios that ran."""
    period = outcome.settings.guard_period_s
    checks: list[Check] = []
    bad = outcome.scenario("bad")
    if bad is not None:
        first = _first_canary(bad.plan)
        spec = bad.plan.steps[first]
        detection = bad.detection_s
        checks.append(
            Check(
                "bad_rolled_back_at_first_canary_within_two_periods",
                bad.decision == Decision.ROLLED_BACK
                and bad.step == first
                and detection is not None
                and detection <= 2 * period,
                f"{bad.decision} at {bad.stage} {bad.percent:g}% (first canary step: "
                f"{spec.label}) {_after(detection)}; {bad.conversations_saw} "
                f"conversations ({bad.requests_saw} requests) saw its answers; "
                f"tripped: {', '.join(bad.tripped_names) or 'nothing'}",
            )
        )
    shadowed = outcome.scenario("bad_shadow")
    if shadowed is not None:
        checks.append(
            Check(
                "bad_caught_by_shadow_before_any_user",
                shadowed.decision == Decision.ROLLED_BACK
                and shadowed.stage == Stage.SHADOW.value
                and shadowed.conversations_saw == 0,
                f"{shadowed.decision} at {shadowed.stage} {shadowed.percent:g}% "
                f"{_after(shadowed.detection_s)}; {shadowed.conversations_saw} "
                f"conversations saw its answers ({shadowed.shadow_copies} shadow "
                "copies, discarded)",
            )
        )
    good = outcome.scenario("good")
    if good is not None:
        trips = sum(1 for t in good.ticks if t.report.tripped)
        checks.append(
            Check(
                "good_promoted_without_trip",
                good.decision == Decision.PROMOTED and trips == 0,
                f"{good.decision}"
                + (
                    f" {good.promotion_s:.0f} s after the rollout began"
                    if good.promotion_s is not None
                    else f" (last: {good.reason})"
                )
                + f"; {trips} evaluations tripped of {len(good.ticks)}",
            )
        )
    slow = outcome.scenario("slow")
    if slow is not None:
        checks.append(
            Check(
                "slow_trips_ttft_guard",
                slow.decision == Decision.ROLLED_BACK
                and "p95_ttft" in slow.tripped_names
                and "refusal_rate" not in slow.tripped_names,
                f"{slow.decision} at {slow.stage} {slow.percent:g}% "
                f"{_after(slow.detection_s)}; tripped: "
                f"{', '.join(slow.tripped_names) or 'nothing'}",
            )
        )
    moves = [(s.name, s.moves) for s in outcome.scenarios]
    checks.append(
        Check(
            "no_mid_chat_change",
            all(m.other == 0 and m.before_memory == 0 for _, m in moves),
            "; ".join(
                f"{name}: {m.other} other, {m.before_memory} at the first canary "
                f"step (under way before any memory), {m.rollback} at the rollback "
                "(allowed)"
                for name, m in moves
            ),
        )
    )
    return tuple(checks)


def _after(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.0f} s after its first traffic"


def run_drill(
    config: FleetConfig,
    settings: RolloutDrillSettings,
    *,
    scenarios: Sequence[str] = SCENARIO_NAMES,
    traffic: Traffic | None = None,
) -> DrillOutcome:
    """Simulate the traffic (unless given) and replay every scenario's rollout.

    Raises ``ValueError`` for an unknown scenario.
    """
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown or not scenarios:
        raise ValueError(
            f"scenarios are {', '.join(SCENARIO_NAMES)}; got "
            f"{', '.join(unknown) or 'none'}"
        )
    traffic = traffic if traffic is not None else simulate_traffic(config, settings)
    outcomes = tuple(
        replay_rollout(traffic, SCENARIOS[name], settings)
        for name in SCENARIO_NAMES
        if name in scenarios
    )
    outcome = DrillOutcome(settings, traffic, outcomes)
    return replace(outcome, checks=judge(outcome))
