"""The rollout guards' loop against the real database, with figures injected.

``rollouts.plans`` and ``control.rollout_guard`` run here in this process,
the clock moved by hand and the figures read from a dict the test fills, so every
step of a plan (begin, advance, promote, roll back, retire, release) is checked
for what it leaves in the rows; the whole chain with real processes is
``tests/test_rollouts_e2e``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from config.errors import Conflict, InvalidRequest, NotFound
from control import rollout_guard
from engine_nodes.models import Replica
from metering.domain.figures import VersionFigures, one_request
from models_registry import services as registry
from models_registry.models import Model, ModelVersion, Pool
from rollouts import plans, services
from rollouts.models import GuardEvaluation, Rollout
from tests.factories import ReplicaFactory, accept, digest, version_body

pytestmark = pytest.mark.django_db

STEP = {"min_duration_s": 60, "min_requests": 20, "min_conversations": 5}
PLAN: dict[str, Any] = {
    "steps": [
        {"stage": "shadow", "percent": 5, **STEP},
        {"stage": "canary", "percent": 10, **STEP},
        {"stage": "canary", "percent": 50, **STEP},
    ],
    "retention_s": 3600,
    "thresholds": {"min_samples": 20},
}


def many(n: int, **kwargs: Any) -> VersionFigures:
    total = VersionFigures()
    for i in range(n):
        total += one_request(**{"ttft_s": 0.2 + (i % 7) * 0.01, **kwargs})
    return VersionFigures(
        requests=total.requests,
        answered=total.answered,
        refusals=total.refusals,
        output_tokens=total.output_tokens,
        conversations=n // 2,
        errors=total.errors,
        ttft=total.ttft,
        output=total.output,
    )


# Enough for the sequential guards to decide not worse (about 800 a side).
GOOD = many(1000, output_tokens=100)
BAD = many(40, output_tokens=10, refused=True)


class Figures:
    """What the guards read: set per (version, role)."""

    def __init__(self) -> None:
        self.by: dict[tuple[str, str], VersionFigures] = {}
        self.reads: list[tuple[str, str, datetime]] = []

    def __call__(
        self, model: str, version: str, role: str, since: datetime
    ) -> VersionFigures:
        self.reads.append((version, role, since))
        return self.by.get((version, role), VersionFigures())


@pytest.fixture
def fleet(chat_v1: ModelVersion) -> dict[str, ModelVersion]:
    """chat-7b@v1 live with a pool of 4 in us-east; v2 ready, with no pool."""
    services.set_alias(model_id="chat-7b", version="v1")
    Pool.objects.create(
        model_id="chat-7b",
        version=chat_v1,
        region="us-east",
        min_replicas=4,
        max_replicas=8,
    )
    v2 = accept(
        registry.register_version(
            model_id="chat-7b",
            version="v2",
            **version_body(weights_hash=digest("weights v2")),
        )
    )
    return {"v1": chat_v1, "v2": v2}


def serve(version: ModelVersion, at: datetime, region: str = "us-east") -> Replica:
    return ReplicaFactory.create(version=version, region=region, last_heartbeat=at)


def _tick_with(
    now: datetime, figures: Callable[..., VersionFigures]
) -> rollout_guard.GuardTick:
    return rollout_guard.guard_rollouts(now=now, flush=False, figures=figures)


def test_a_plan_waits_for_its_replicas_then_advances_and_promotes(
    fleet: dict[str, ModelVersion], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plan's walk at its own shares: the pool's traffic unknown (the quiet
    # pool's raise has its own test below).
    monkeypatch.setattr(rollout_guard, "_pool_rps", lambda *a, **k: None)
    t0 = timezone.now()
    rollout = plans.start_plan(model_id="chat-7b", version="v2", now=t0, plan=PLAN)
    # Extra capacity beside the live pool, sized for the first step's share.
    pool = Pool.objects.get(version=fleet["v2"], region="us-east")
    assert (pool.min_replicas, pool.max_replicas, pool.desired_replicas) == (1, 8, 1)
    assert Pool.objects.get(version=fleet["v1"]).min_replicas == 4
    figures = Figures()
    # No serving replica yet: no traffic, no evaluation.
    assert _tick_with(t0, figures).begun == []
    assert Rollout.objects.get(pk=rollout.pk).step_started_at is None
    serve(fleet["v2"], t0 + timedelta(seconds=5))
    assert _tick_with(t0 + timedelta(seconds=5), figures).begun == [rollout.pk]
    rollout.refresh_from_db()
    assert rollout.step_started_at == t0 + timedelta(seconds=5)
    assert Model.objects.get(pk="chat-7b").canary_version_id is None  # shadow
    figures.by[("v1", "live")] = GOOD
    figures.by[("v1", "baseline")] = GOOD
    figures.by[("v2", "shadow")] = GOOD
    # Too early: continue; then the step's minutes have passed: advance.
    assert _tick_with(t0 + timedelta(seconds=30), figures).actions == {
        rollout.pk: "continue"
    }
    at = t0 + timedelta(seconds=70)
    assert _tick_with(at, figures).actions == {rollout.pk: "advance"}
    rollout.refresh_from_db()
    assert (rollout.stage, rollout.percent, rollout.step) == ("canary", 10.0, 1)
    assert rollout.step_started_at == at
    model = Model.objects.get(pk="chat-7b")
    assert (model.canary_version_id, model.canary_percent) == (fleet["v2"].pk, 10.0)
    # The guards read the candidate's step from its start, live over the same.
    began = t0 + timedelta(seconds=5)
    # A shadow is compared with all of live (its copies sample every request).
    assert figures.reads[-3:] == [
        ("v2", "shadow", began),
        ("v1", "live", began),
        ("v1", "baseline", began),
    ]
    figures.by[("v2", "canary")] = GOOD
    at += timedelta(seconds=61)
    assert _tick_with(at, figures).actions == {rollout.pk: "advance"}
    assert Pool.objects.get(version=fleet["v2"]).desired_replicas == 2  # 50% of 4
    at += timedelta(seconds=61)
    assert _tick_with(at, figures).actions == {rollout.pk: "advance"}
    rollout.refresh_from_db()
    assert rollout.decision == "promoted"
    assert rollout.retire_after == at + timedelta(seconds=3600)
    model = Model.objects.get(pk="chat-7b")
    assert (model.live_version_id, model.canary_version_id) == (fleet["v2"].pk, None)
    v1 = ModelVersion.objects.get(pk=fleet["v1"].pk)
    assert v1.status == "ready"
    # Through its retention v1 keeps its pool; after it, it is retired, then its
    # pool is released once the gateways have had time to notice.
    assert _tick_with(at + timedelta(seconds=3599), figures).retired == []
    assert Pool.objects.filter(version=fleet["v1"]).exists()
    replica = serve(fleet["v1"], at)
    done = _tick_with(at + timedelta(seconds=3600), figures)
    assert done.retired == ["chat-7b@v1"]
    assert ModelVersion.objects.get(pk=fleet["v1"].pk).status == "retired"
    assert done.released == []
    later = _tick_with(at + timedelta(seconds=3700), figures)
    assert later.released == ["chat-7b@v1"]
    assert not Pool.objects.filter(version=fleet["v1"]).exists()
    replica.refresh_from_db()
    assert replica.state == "draining"
    kinds = list(
        GuardEvaluation.objects.filter(rollout=rollout)
        .order_by("at")
        .values_list("action", flat=True)
    )
    assert kinds == ["continue", "advance", "advance", "advance"]


def test_a_tripped_guard_rolls_back_and_rejects_the_candidate(
    fleet: dict[str, ModelVersion],
) -> None:
    t0 = timezone.now()
    plan = {**PLAN, "steps": PLAN["steps"][1:]}
    rollout = plans.start_plan(model_id="chat-7b", version="v2", now=t0, plan=plan)
    serve(fleet["v2"], t0)
    figures = Figures()
    _tick_with(t0, figures)
    assert Model.objects.get(pk="chat-7b").canary_version_id == fleet["v2"].pk
    figures.by[("v1", "live")] = GOOD
    figures.by[("v1", "baseline")] = GOOD
    figures.by[("v2", "canary")] = BAD
    # Paused or not, a trip rolls back at once.
    plans.control("chat-7b", "pause", by="admin", now=t0)
    assert _tick_with(t0 + timedelta(seconds=10), figures).actions == {
        rollout.pk: "roll_back"
    }
    rollout.refresh_from_db()
    assert rollout.decision == "rolled_back"
    assert "refusal" in rollout.reason
    model = Model.objects.get(pk="chat-7b")
    assert (model.live_version_id, model.canary_version_id) == (fleet["v1"].pk, None)
    v2 = ModelVersion.objects.get(pk=fleet["v2"].pk)
    assert v2.status == "rejected"
    assert v2.status_reason.startswith("rolled back at canary 10%")
    # Its pool goes once the gateways have noticed; v1's never.
    assert _tick_with(t0 + timedelta(seconds=11), figures).released == []
    assert _tick_with(t0 + timedelta(seconds=60), figures).released == ["chat-7b@v2"]
    assert Pool.objects.filter(version=fleet["v1"]).exists()
    # A rejected version needs an override to go out again.
    with pytest.raises(Conflict):
        plans.start_plan(model_id="chat-7b", version="v2", now=t0, plan=plan)


def test_admin_controls(fleet: dict[str, ModelVersion]) -> None:
    t0 = timezone.now()
    with pytest.raises(NotFound):
        plans.control("chat-7b", "pause", by="admin", now=t0)
    with pytest.raises(InvalidRequest):
        plans.start_plan(
            model_id="chat-7b", version="v2", now=t0, plan={"steps": "all"}
        )
    approval = {
        **PLAN,
        "steps": [{**PLAN["steps"][1], "needs_approval": True}],
    }
    rollout = plans.start_plan(model_id="chat-7b", version="v2", now=t0, plan=approval)
    serve(fleet["v2"], t0)
    figures = Figures()
    figures.by[("v1", "live")] = GOOD
    figures.by[("v1", "baseline")] = GOOD
    figures.by[("v2", "canary")] = GOOD
    _tick_with(t0, figures)
    later = t0 + timedelta(seconds=120)
    assert _tick_with(later, figures).actions == {rollout.pk: "hold"}
    assert "approval" in Rollout.objects.get(pk=rollout.pk).reason
    plans.control("chat-7b", "pause", by="admin", now=later)
    plans.control("chat-7b", "approve", by="admin", now=later)
    assert _tick_with(later, figures).actions == {rollout.pk: "hold"}  # paused
    plans.control("chat-7b", "resume", by="admin", now=later)
    assert _tick_with(later, figures).actions == {rollout.pk: "advance"}
    assert Rollout.objects.get(pk=rollout.pk).decision == "promoted"
    # A stage set by hand has no plan to pause; abort works on either.
    manual = services.set_rollout(
        model_id="chat-7b", version="v1", stage="canary", percent=5.0, now=later
    )
    with pytest.raises(Conflict):
        plans.control("chat-7b", "pause", by="admin", now=later)
    ended = plans.control("chat-7b", "abort", by="admin", now=later)
    assert ended.pk == manual.pk and ended.decision == "aborted"
    assert Model.objects.get(pk="chat-7b").canary_version_id is None
    assert ModelVersion.objects.get(pk=fleet["v1"].pk).status == "ready"


def test_a_candidate_that_never_serves_is_aborted(
    fleet: dict[str, ModelVersion], settings: Any
) -> None:
    settings.PLATFORM_ROLLOUT_CAPACITY_TIMEOUT_S = 60.0
    t0 = timezone.now()
    rollout = plans.start_plan(model_id="chat-7b", version="v2", now=t0, plan=PLAN)
    figures = Figures()
    assert _tick_with(t0 + timedelta(seconds=59), figures).aborted == []
    assert _tick_with(t0 + timedelta(seconds=61), figures).aborted == [rollout.pk]
    rollout.refresh_from_db()
    assert rollout.decision == "aborted"
    assert "no serving replica" in rollout.reason


def test_a_plan_whose_version_is_not_ready_holds_before_the_alias_moves(
    fleet: dict[str, ModelVersion],
) -> None:
    """A plan started past the gates (an override) passes its guards, but the
    alias does not move by itself: that is an alias change, needing its own."""
    ModelVersion.objects.filter(pk=fleet["v2"].pk).update(
        status="rejected", status_reason="reasoning dropped"
    )
    t0 = timezone.now()
    plan = {**PLAN, "steps": PLAN["steps"][1:2]}
    rollout = plans.start_plan(
        model_id="chat-7b",
        version="v2",
        now=t0,
        plan=plan,
        override=services.Override(by="admin", reason="a hotfix"),
    )
    serve(fleet["v2"], t0)
    figures = Figures()
    figures.by[("v1", "baseline")] = GOOD
    figures.by[("v2", "canary")] = GOOD
    _tick_with(t0, figures)
    assert _tick_with(t0 + timedelta(seconds=61), figures).actions == {
        rollout.pk: "hold"
    }
    rollout.refresh_from_db()
    assert rollout.decision == "pending"
    assert "rejected by its gates" in rollout.reason
    assert Model.objects.get(pk="chat-7b").live_version_id == fleet["v1"].pk


def test_an_old_version_kept_by_a_later_promotion_waits_for_its_retention(
    fleet: dict[str, ModelVersion],
) -> None:
    """v1 -> v2 promoted, the alias back to v1, v1 -> v2 promoted again: v1 is
    kept for the second promotion's retention, not retired at the first's."""
    t0 = timezone.now()
    first = Rollout.objects.create(
        model_id="chat-7b",
        version=fleet["v2"],
        stage="canary",
        percent=50.0,
        started_at=t0,
        decision="promoted",
        decided_at=t0,
        previous_version=fleet["v1"],
        retire_after=t0 + timedelta(seconds=60),
    )
    second = Rollout.objects.create(
        model_id="chat-7b",
        version=fleet["v2"],
        stage="canary",
        percent=50.0,
        started_at=t0 + timedelta(seconds=30),
        decision="promoted",
        decided_at=t0 + timedelta(seconds=30),
        previous_version=fleet["v1"],
        retire_after=t0 + timedelta(seconds=90),
    )
    services.set_alias(model_id="chat-7b", version="v2")
    assert plans.retire_expired(now=t0 + timedelta(seconds=61)) == []
    first.refresh_from_db()
    assert first.retired_at is not None  # done with; the second one governs
    assert ModelVersion.objects.get(pk=fleet["v1"].pk).status == "ready"
    assert plans.retire_expired(now=t0 + timedelta(seconds=91)) == ["chat-7b@v1"]
    second.refresh_from_db()
    assert second.retired_at is not None
    assert ModelVersion.objects.get(pk=fleet["v1"].pk).status == "retired"


def test_a_quiet_pool_raises_the_steps_share_and_its_pools(
    fleet: dict[str, ModelVersion],
) -> None:
    """The figures say about 5 requests/s: too quiet for shadow 5% to decide
    within the plan's hour, so the step stays at a larger share (up to the
    plan's largest canary share) and the evaluation says when a decision is
    expected."""
    t0 = timezone.now()
    rollout = plans.start_plan(model_id="chat-7b", version="v2", now=t0, plan=PLAN)
    figures = Figures()
    serve(fleet["v2"], t0 + timedelta(seconds=5))
    figures.by[("v1", "live")] = GOOD
    figures.by[("v1", "baseline")] = GOOD
    figures.by[("v2", "shadow")] = GOOD
    assert _tick_with(t0 + timedelta(seconds=5), figures).begun == [rollout.pk]
    rollout.refresh_from_db()
    assert rollout.percent > 5.0  # begun at a larger share
    begun_at = rollout.percent
    _tick_with(t0 + timedelta(seconds=30), figures)
    rollout.refresh_from_db()
    assert begun_at <= rollout.percent <= 50.0
    assert "expected_decision_s" in rollout.guard_metrics
    evaluation = rollout.evaluations.order_by("-at").first()
    assert evaluation is not None
    assert "expected_decision_s" in evaluation.report
