"""The rollout guard tick's two drivers decide alike on the same observations.

The tick is ``rollouts.domain.guard_tick.guard_tick``; the live task
(``control.rollout_guard.guard_rollouts``) performs its effects on the database,
the rollout drill (``drills.domain.rollout_drill.SimulatedRollout``) on its own
state in virtual time. Each scenario below is a stream of requests per version,
role and minute; every request is recorded the way each side records one (the
gateway's ``MemoryFigureRecorder`` flushed to the rows, the drill's
``FigureStore``), and at each guard period both drivers tick. They must take the
same decision, for the same reason, on the same report, and leave the same
routing.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from control import rollout_guard
from drills.domain.rollout_drill import (
    CANDIDATE_VERSION,
    LIVE_VERSION,
    MODEL,
    FigureStore,
    SimulatedRollout,
)
from metering import services as metering
from metering.domain.figures import Role, one_request
from metering.figures import FigureKey, MemoryFigureRecorder
from models_registry import services as registry
from models_registry.models import Model, ModelVersion, Pool
from rollouts import plans, services
from rollouts.domain.plan import parse_plan
from rollouts.models import GuardEvaluation
from tests.factories import ReplicaFactory, accept, digest, version_body

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _pool_rate_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both drivers at the steps' own shares: the drill is told a pool's rate
    (``SimulatedRollout(pool_rps=...)``), the live task reads it from the
    figures, so here neither knows it (the raise is tested on each side)."""
    monkeypatch.setattr(rollout_guard, "_pool_rps", lambda *a, **k: None)


T0 = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)  # on a bucket boundary
BUCKET_S = 60
START_S = 30.0  # the rollout begins half a bucket in, as a beat's phase is arbitrary
PERIOD_S = 60.0
MAX_TICKS = 10
STEP = {"min_requests": 20, "min_conversations": 5}
PLAN: dict[str, Any] = {
    "steps": [
        # Longer than one period: the first tick waits (continue).
        {"stage": "shadow", "percent": 5, "min_duration_s": 90, **STEP},
        {"stage": "canary", "percent": 10, "min_duration_s": 60, **STEP},
        {"stage": "canary", "percent": 50, "min_duration_s": 60, **STEP},
    ],
    "retention_s": 3600,
    # Wide rate margins: a few dozen requests a minute must let the sequential
    # guards decide within the ten ticks (the drivers' parity is the subject).
    "thresholds": {
        "min_samples": 20,
        "error_rate_points": 10.0,
        "refusal_rate_points": 10.0,
    },
}


@dataclass(frozen=True, slots=True)
class Profile:
    """How one version answers in one role: per minute, ``n`` requests."""

    n: int
    ttft_s: float = 0.2
    output_tokens: int = 300
    refusal_rate: float = 0.0
    error_rate: float = 0.0


@dataclass(frozen=True, slots=True)
class Request:
    at_s: float
    version: str
    role: Role
    conversation: str
    ttft_s: float | None
    output_tokens: int | None
    error_kind: str | None
    refused: bool


GOOD = Profile(30)
# The live version's band beside the canary is thin: the first canary tick has
# too few of its samples and holds.
THIN_BASELINE = Profile(8)
SCENARIOS: dict[str, dict[tuple[str, Role], Profile]] = {
    "good": {
        (LIVE_VERSION, Role.LIVE): Profile(60),
        (LIVE_VERSION, Role.BASELINE): THIN_BASELINE,
        (CANDIDATE_VERSION, Role.SHADOW): GOOD,
        (CANDIDATE_VERSION, Role.CANARY): GOOD,
    },
    "refuses_at_canary": {
        (LIVE_VERSION, Role.LIVE): Profile(60),
        (LIVE_VERSION, Role.BASELINE): Profile(30),
        (CANDIDATE_VERSION, Role.SHADOW): GOOD,
        (CANDIDATE_VERSION, Role.CANARY): Profile(
            30, output_tokens=10, refusal_rate=1.0
        ),
    },
    "slow_in_shadow": {
        (LIVE_VERSION, Role.LIVE): Profile(60),
        (LIVE_VERSION, Role.BASELINE): Profile(30),
        (CANDIDATE_VERSION, Role.SHADOW): Profile(30, ttft_s=0.5),
        (CANDIDATE_VERSION, Role.CANARY): GOOD,
    },
    "errors_at_canary": {
        (LIVE_VERSION, Role.LIVE): Profile(60, error_rate=0.01),
        (LIVE_VERSION, Role.BASELINE): Profile(40, error_rate=0.01),
        (CANDIDATE_VERSION, Role.SHADOW): GOOD,
        (CANDIDATE_VERSION, Role.CANARY): Profile(40, error_rate=0.3),
    },
}


def observations(name: str, seed: int = 7) -> Iterator[Request]:
    """Yield the scenario's requests in order of their end, minute by minute."""
    rng = random.Random(f"{name}:{seed}")
    for minute in range(MAX_TICKS + 2):
        batch: list[Request] = []
        for (version, role), profile in SCENARIOS[name].items():
            for i in range(profile.n):
                failed = rng.random() < profile.error_rate
                batch.append(
                    Request(
                        at_s=minute * BUCKET_S + (i + 0.5) * BUCKET_S / profile.n,
                        version=version,
                        role=role,
                        conversation=f"{version}:{role}:{minute}:{i // 2}",
                        ttft_s=None
                        if failed
                        else profile.ttft_s * rng.uniform(0.8, 1.2),
                        output_tokens=None
                        if failed
                        else max(
                            1, round(profile.output_tokens * rng.uniform(0.8, 1.2))
                        ),
                        error_kind="upstream" if failed else None,
                        refused=rng.random() < profile.refusal_rate,
                    )
                )
        yield from sorted(batch, key=lambda r: r.at_s)


def _figures(request: Request) -> dict[str, Any]:
    return {
        "ttft_s": request.ttft_s,
        "output_tokens": request.output_tokens,
        "error_kind": request.error_kind,
        "refused": request.refused,
    }


class LiveSide:
    """The gateway's recorder, flushed to the rows; the live guard task ticks."""

    def __init__(self) -> None:
        self.recorder = MemoryFigureRecorder()

    def record(self, requests: list[Request]) -> None:
        async def add_all() -> None:
            for r in requests:
                key = FigureKey.from_time(
                    MODEL, r.version, r.role, T0.timestamp() + r.at_s, BUCKET_S
                )
                await self.recorder.add(key, one_request(**_figures(r)), r.conversation)

        asyncio.run(add_all())

    def tick(self, at_s: float) -> None:
        now = T0 + timedelta(seconds=at_s)
        metering.flush_memory_figures(
            entries=self.recorder.drain(now.timestamp()), region="us-east"
        )
        rollout_guard.guard_rollouts(now=now, flush=False)


class DrillSide:
    """The drill's figure store; its simulated rollout ticks."""

    def __init__(self) -> None:
        self.store = FigureStore(BUCKET_S)
        self.rollout = SimulatedRollout(parse_plan(PLAN), self.store)

    def record(self, requests: list[Request]) -> None:
        for r in requests:
            bucket = self.store.bucket(r.role, r.version, r.at_s)
            bucket.add(**_figures(r), conversation=r.conversation)

    def tick(self, at_s: float) -> None:
        self.rollout.tick(at_s)


@pytest.fixture
def fleet(chat_v1: ModelVersion) -> ModelVersion:
    """chat-7b@v1 live with a pool in us-east; return v2, ready, serving there."""
    services.set_alias(model_id=MODEL, version=LIVE_VERSION)
    Pool.objects.create(
        model_id=MODEL,
        version=chat_v1,
        region="us-east",
        min_replicas=4,
        max_replicas=8,
    )
    v2 = accept(
        registry.register_version(
            model_id=MODEL,
            version=CANDIDATE_VERSION,
            **version_body(weights_hash=digest("weights v2")),
        )
    )
    return v2


def _live_routing() -> tuple[str, str | None, float]:
    model = Model.objects.select_related("live_version", "canary_version").get(pk=MODEL)
    assert model.live_version is not None
    canary = model.canary_version.version if model.canary_version else None
    return model.live_version.version, canary, model.canary_percent


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_live_and_drill_guards_decide_alike(scenario: str, fleet: ModelVersion) -> None:
    live, drill = LiveSide(), DrillSide()
    start = T0 + timedelta(seconds=START_S)
    rollout = plans.start_plan(
        model_id=MODEL, version=CANDIDATE_VERSION, now=start, plan=PLAN
    )
    ReplicaFactory.create(version=fleet, region="us-east", last_heartbeat=start)
    assert rollout_guard.guard_rollouts(now=start, flush=False).begun == [rollout.pk]
    drill.rollout.begin(START_S)

    stream = observations(scenario)
    waiting: Request | None = None
    routing: list[tuple[str, str | None, float]] = []
    for n in range(1, MAX_TICKS + 1):
        at_s = START_S + n * PERIOD_S
        ended: list[Request] = [waiting] if waiting is not None else []
        waiting = None
        for request in stream:
            if request.at_s > at_s:
                waiting = request
                break
            ended.append(request)
        live.record(ended)
        drill.record(ended)
        live.tick(at_s)
        drill.tick(at_s)
        record = drill.rollout.record
        assert _live_routing() == (
            record.live_version,
            record.canary_version,
            record.canary_percent,
        ), f"after the tick at {at_s:g} s"
        routing.append(_live_routing())
        if drill.rollout.decided_at is not None:
            break

    evaluations = GuardEvaluation.objects.filter(rollout=rollout).order_by("at")
    live_ticks = [
        (
            (e.at - T0).total_seconds(),
            e.step,
            e.stage,
            e.percent,
            e.action,
            e.reason,
            e.report,
        )
        for e in evaluations
    ]
    drill_ticks = [
        (t.at_s, t.step, t.stage, t.percent, t.action, t.reason, t.report_json)
        for t in drill.rollout.ticks
    ]
    assert live_ticks == drill_ticks
    rollout.refresh_from_db()
    assert rollout.decision == drill.rollout.decision
    assert rollout.step == drill.rollout.step
    # The scenario took the path it was written for (so the comparison covered it).
    actions = [t[4] for t in drill_ticks]
    assert EXPECTED[scenario] == (actions, drill.rollout.decision)


EXPECTED: dict[str, tuple[list[str], str]] = {
    # The sequential guards hold a tick longer per canary step than the old
    # fixed test: the thin baseline band needs two more minutes to show the
    # candidate not worse.
    "good": (
        ["continue", "advance", "hold", "hold", "advance", "hold", "hold", "advance"],
        "promoted",
    ),
    "refuses_at_canary": (["continue", "advance", "roll_back"], "rolled_back"),
    "slow_in_shadow": (["roll_back"], "rolled_back"),
    "errors_at_canary": (["continue", "advance", "roll_back"], "rolled_back"),
}


def test_a_rejected_candidate_holds_live_and_would_promote_in_the_drill(
    fleet: ModelVersion,
) -> None:
    """Where the drivers differ by design: the drill's candidate passed its gates,
    so the lock and the gates never stop it; live, a candidate rejected by its
    gates meanwhile holds before the alias moves."""
    ModelVersion.objects.filter(pk=fleet.pk).update(
        status="rejected", status_reason="reasoning dropped"
    )
    start = T0 + timedelta(seconds=START_S)
    plan = {**PLAN, "steps": PLAN["steps"][2:]}
    rollout = plans.start_plan(
        model_id=MODEL,
        version=CANDIDATE_VERSION,
        now=start,
        plan=plan,
        override=services.Override(by="admin", reason="a hotfix"),
    )
    ReplicaFactory.create(version=fleet, region="us-east", last_heartbeat=start)
    rollout_guard.guard_rollouts(now=start, flush=False)
    live, drill = LiveSide(), DrillSide()
    drill.rollout = SimulatedRollout(parse_plan(plan), drill.store)
    drill.rollout.begin(START_S)
    # Three minutes: enough for the sequential guards to call it not worse.
    at_s = START_S + 3 * PERIOD_S
    ended = [r for r in observations("good") if r.at_s <= at_s]
    live.record(ended)
    drill.record(ended)
    live.tick(at_s)
    drill.tick(at_s)
    rollout.refresh_from_db()
    assert rollout.decision == "pending"
    assert "rejected by its gates" in rollout.reason
    assert drill.rollout.decision == "promoted"
    assert drill.rollout.ticks[-1].reason.endswith(": promote")
