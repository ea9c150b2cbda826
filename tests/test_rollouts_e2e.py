"""Rollouts that run themselves, end to end, with the guards in Celery beat.

Real processes: the gateway (which also serves the admin API), the node agent and
its simulated replicas, a Celery worker with beat (the guard task every
``GUARD_S``), PostgreSQL and Redis. Conversations of three turns go through the
gateway with the ``openai`` SDK the whole time, from four threads; each answer's
``x-model-version`` says which version served it. Plans are short (seconds, a
few requests per step), the mechanism is the one production runs.

GIVEN chat-7b@v1 live on two replicas,
WHEN v3 (a broken chat template: every answer a short refusal) starts on a plan at
a 30% canary, THEN the guards roll it back within two guard periods of its canary
starting, the alias never points at it, v3 is rejected saying why and its pool is
released; WHEN v2 (as good as v1) starts on a plan (shadow, canary 30%, 60%),
THEN it advances by itself and is promoted with no trip, v1 stays loaded through
its retention and is then retired and its pool released; and in all of it no
caller sees an error and no conversation changes version mid-chat (except the
rollback's own move of canary conversations back to the live version, and a
retired version's conversations moving on).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from django.db.models import Max

from audit.models import AuditEntry
from engine_nodes.models import Replica
from localrun.processes import wait_until
from models_registry.models import Model, ModelVersion, Pool
from rollouts.models import GuardEvaluation, Rollout
from tests.live import LivePlatform, start_platform

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GUARD_S = 2.0
# A step's minimums and the guards' sample floor, small for a short test.
THRESHOLDS = {"min_samples": 5}
BAD_PLAN: dict[str, Any] = {
    # Long minimums: only a guard can end this step.
    "steps": [
        {
            "stage": "canary",
            "percent": 30,
            "min_duration_s": 600,
            "min_requests": 10,
            "min_conversations": 3,
        }
    ],
    "retention_s": 600,
    "thresholds": THRESHOLDS,
}
STEP = {"min_duration_s": 3, "min_requests": 10, "min_conversations": 3}
# The guards are sequential: a step advances once each guard shows the candidate
# not worse than its threshold, and the seed's thresholds (0.5 points of errors)
# need thousands of requests to show that. A test of a few dozen requests per
# step proves it against wide margins instead; the fleet drill holds the seed's
# thresholds at the seed's traffic (rollout_drill --sequential-check).
WIDE_THRESHOLDS = {
    **THRESHOLDS,
    "error_rate_points": 30.0,
    "refusal_rate_points": 30.0,
    "output_length_ratio": 0.6,
    "p95_ttft_ratio": 2.0,
}
GOOD_PLAN: dict[str, Any] = {
    "steps": [
        {"stage": "shadow", "percent": 50, **STEP},
        {"stage": "canary", "percent": 30, **STEP},
        {"stage": "canary", "percent": 60, **STEP},
    ],
    "retention_s": 4,
    "thresholds": WIDE_THRESHOLDS,
}


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("rollouts")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            # v2 and v3 have pools of no replica until a rollout sizes them.
            pools={"v1": 2, "v2": 0, "v3": 0},
            autoscaler=True,
            PLATFORM_ROLLOUT_GUARD_INTERVAL_S=str(GUARD_S),
            # The worker is ready once the autoscaler has ticked: soon.
            PLATFORM_AUTOSCALE_INTERVAL_S="1",
            version_configs={"v3": {"sim_degraded": True}},
            PLATFORM_FIGURES_BUCKET_S="2",
        ) as live,
    ):
        yield live


@pytest.fixture
def unblocked(django_db_blocker: DjangoDbBlocker) -> Iterator[None]:
    with django_db_blocker.unblock():
        yield


@pytest.fixture(scope="module")
def api(
    platform: LivePlatform, django_db_blocker: DjangoDbBlocker
) -> Iterator[httpx.Client]:
    """The control plane with an admin token of the module's; its writes are
    checked against the audit trail once the module is done."""
    with platform.admin_api("rollouts-e2e", blocker=django_db_blocker) as client:
        yield client


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: str
    index: int
    version: str
    started: float  # unix seconds
    ended: float
    refused: bool


class Traffic:
    """Conversations of three turns from a few threads until stopped."""

    def __init__(self, platform: LivePlatform, *, name: str, threads: int = 4) -> None:
        self.client = platform.client("alpha", timeout=30)
        self.name = name
        self.turns: list[Turn] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads)
        self._futures = [self._pool.submit(self._run) for _ in range(threads)]

    def _run(self) -> None:
        while not self._stop.is_set():
            conversation = f"{self.name}-{next(self._ids)}"
            messages: list[dict[str, str]] = []
            for index in range(3):
                messages.append({"role": "user", "content": f"turn {index} please"})
                started = time.time()
                try:
                    raw = self.client.chat.completions.with_raw_response.create(
                        model="chat-7b",
                        messages=messages,  # type: ignore[arg-type]
                        max_tokens=12,
                        extra_headers={"x-conversation-id": conversation},
                    )
                except Exception as exc:  # every failure is the test's business
                    with self._lock:
                        self.errors.append(f"{conversation}#{index}: {exc!r}")
                    break
                answer = raw.parse()
                text = answer.choices[0].message.content or ""
                with self._lock:
                    self.turns.append(
                        Turn(
                            conversation,
                            index,
                            raw.headers["x-model-version"],
                            started,
                            time.time(),
                            text.startswith("I am sorry"),
                        )
                    )
                messages.append({"role": "assistant", "content": text})

    def stop(self) -> None:
        self._stop.set()
        for future in self._futures:
            future.result(timeout=60)
        self._pool.shutdown()

    def conversations(self) -> dict[str, list[Turn]]:
        by: dict[str, list[Turn]] = {}
        for turn in sorted(self.turns, key=lambda t: (t.conversation, t.index)):
            by.setdefault(turn.conversation, []).append(turn)
        return by


def _pending_or_last(model: str = "chat-7b") -> Rollout:
    return Rollout.objects.filter(model_id=model).order_by("-started_at", "-id")[0]


def _ended(rollout_id: int) -> Rollout | None:
    rollout = Rollout.objects.get(pk=rollout_id)
    return rollout if rollout.decision != "pending" else None


def _released(label: str) -> bool:
    return (
        not Pool.objects.filter(model_id="chat-7b", version__version=label).exists()
        and not Replica.objects.filter(
            model_id="chat-7b", version__version=label, state="serving"
        ).exists()
    )


def _version_changes(
    turns: dict[str, list[Turn]], *, before: float
) -> list[tuple[str, list[Turn]]]:
    """Conversations that changed version between two turns started before
    ``before``."""
    changed = []
    for conversation, its in turns.items():
        kept = [t for t in its if t.started < before]
        if len({t.version for t in kept}) > 1:
            changed.append((conversation, kept))
    return changed


def test_a_broken_version_is_rolled_back_by_the_guards(
    platform: LivePlatform, api: httpx.Client, unblocked: None
) -> None:
    traffic = Traffic(platform, name="bad")
    try:
        wait_until(lambda: len(traffic.turns) >= 20, timeout_s=30, message="traffic")
        response = api.put(
            "/admin/models/chat-7b/rollout", json={"version": "v3", "plan": BAD_PLAN}
        )
        assert response.status_code == 200, response.text
        rollout_id = response.json()["id"]
        ended = wait_until(
            lambda: _ended(rollout_id), timeout_s=90, message="the guards' verdict"
        )
        # When the verdict was seen committed: ``decided_at`` is the guard tick's
        # start, and a loaded machine's tick can commit seconds after it.
        committed = time.time()
        stop_at = time.time() + 2 * float(platform.env["PLATFORM_SNAPSHOT_REFRESH_S"])
        wait_until(lambda: time.time() > stop_at, timeout_s=10, message="a refresh")
    finally:
        traffic.stop()
    assert traffic.errors == []
    assert ended.decision == "rolled_back", ended.reason
    assert "refusal" in ended.reason
    assert ended.step_started_at is not None and ended.decided_at is not None
    # Within two guard periods of the canary's start: the step begins at a tick,
    # the first or second tick after it trips (each tick takes a moment itself).
    evaluations = list(
        GuardEvaluation.objects.filter(rollout_id=rollout_id).order_by("at")
    )
    assert len(evaluations) <= 2, [(e.action, e.reason) for e in evaluations]
    assert evaluations[-1].action == "roll_back"
    detection_s = (ended.decided_at - ended.step_started_at).total_seconds()
    assert detection_s <= 2 * GUARD_S + 1.0, detection_s
    # The figures that tripped it are kept with the rollout.
    tripped = [r for r in ended.guard_metrics["results"] if r["verdict"] == "worse"]
    assert "refusal_rate" in {r["name"] for r in tripped}
    # The alias never moved; the candidate's answers were refusals, v1's not.
    assert Model.objects.get(pk="chat-7b").live_version.version == "v1"  # type: ignore[union-attr]
    turns = traffic.turns
    assert {t.version for t in turns} == {"v1", "v3"}
    assert all(t.refused for t in turns if t.version == "v3")
    assert not any(t.refused for t in turns if t.version == "v1")
    # Gateways read the verdict from the database: two refreshes after it is
    # committed, none sends a new turn to the rolled-back version.
    late = committed + 2 * float(platform.env["PLATFORM_SNAPSHOT_REFRESH_S"])
    assert all(t.version == "v1" for t in turns if t.started > late)
    # No conversation went from v1 to v3 mid-chat (the canary takes only
    # conversations that begin on it); only the rollback moved v3's back to v1.
    for conversation, its in traffic.conversations().items():
        for before, after in pairwise(its):
            assert after.version in (before.version, "v1"), (conversation, its)
    version = ModelVersion.objects.get(model_id="chat-7b", version="v3")
    assert version.status == "rejected"
    assert "rolled back" in version.status_reason
    wait_until(lambda: _released("v3"), timeout_s=30, message="v3's pool released")


def test_a_good_version_is_promoted_by_itself_and_the_old_one_retired(
    platform: LivePlatform, api: httpx.Client, unblocked: None
) -> None:
    traffic = Traffic(platform, name="good")
    try:
        wait_until(lambda: len(traffic.turns) >= 20, timeout_s=30, message="traffic")
        response = api.put(
            "/admin/models/chat-7b/rollout", json={"version": "v2", "plan": GOOD_PLAN}
        )
        assert response.status_code == 200, response.text
        rollout_id = response.json()["id"]
        ended = wait_until(
            lambda: _ended(rollout_id), timeout_s=120, message="the promotion"
        )
        assert ended.decision == "promoted", ended.reason
        # v1 stays loaded through its retention, then is retired and released.
        old = ModelVersion.objects.get(model_id="chat-7b", version="v1")
        assert old.status == "ready"
        retired = wait_until(
            lambda: Rollout.objects.filter(
                pk=rollout_id, retired_at__isnull=False
            ).first(),
            timeout_s=60,
            message="v1's retirement",
        )
        wait_until(lambda: _released("v1"), timeout_s=60, message="v1's pool released")
        mark = time.time()
        wait_until(
            lambda: len([t for t in traffic.turns if t.started > mark]) >= 10,
            timeout_s=30,
            message="traffic after the retirement",
        )
    finally:
        traffic.stop()
    assert traffic.errors == []
    actions = list(
        GuardEvaluation.objects.filter(rollout_id=rollout_id)
        .order_by("at")
        .values_list("action", flat=True)
    )
    assert "roll_back" not in actions
    assert actions.count("advance") == len(GOOD_PLAN["steps"])  # the last promotes
    assert Model.objects.get(pk="chat-7b").live_version.version == "v2"  # type: ignore[union-attr]
    assert retired.retire_after is not None and retired.retired_at is not None
    assert retired.retired_at >= retired.retire_after
    assert (
        ModelVersion.objects.get(model_id="chat-7b", version="v1").status == "retired"
    )
    # Through every step and the promotion, no conversation changed version; after
    # the retirement v1's last conversations went on to v2.
    changes = _version_changes(
        traffic.conversations(), before=_unix(retired.retired_at)
    )
    assert changes == [], changes[:3]
    assert {t.version for t in traffic.turns if t.started > mark} == {"v2"}
    # The rollout's page shows the plan, the steps it went through, and why.
    state = api.get("/admin/models/chat-7b/rollout").json()
    assert state["pending"] is None
    assert state["history"][0]["decision"] == "promoted"
    assert [e["action"] for e in state["evaluations"]][::-1] == actions[-50:]


def _unix(at: datetime) -> float:
    return at.timestamp()


def test_pause_resume_and_abort_over_the_api(
    platform: LivePlatform, api: httpx.Client, unblocked: None
) -> None:
    url = "/admin/models/chat-7b/rollout"
    audited_before = AuditEntry.objects.aggregate(last=Max("id"))["last"] or 0
    # v3 was rolled back (rejected): refused, unless an admin overrides.
    refused = api.put(url, json={"version": "v3", "plan": {}})
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "version_not_ready"
    assert api.put(url, json={"action": "pause"}).status_code == 404
    bad = api.put(
        url,
        json={"version": "v3", "plan": {"steps": [{"stage": "canary", "percent": 0}]}},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"].startswith("plan.steps[0]")
    started = api.put(
        url,
        json={
            "version": "v3",
            "plan": BAD_PLAN,
            "override": {"reason": "checking the controls"},
        },
    )
    assert started.status_code == 200, started.text
    paused = api.put(url, json={"action": "pause"}).json()
    assert paused["paused"] is True and "paused by" in paused["reason"]
    assert api.put(url, json={"action": "resume"}).json()["paused"] is False
    aborted = api.put(url, json={"action": "abort"}).json()
    assert aborted["decision"] == "aborted"
    model = Model.objects.get(pk="chat-7b")
    assert model.canary_version_id is None
    assert model.live_version.version == "v2"  # type: ignore[union-attr]
    # Aborted is not rejected: the version keeps what its gates said, and its
    # pool (an admin may go on with it).
    assert ModelVersion.objects.get(model_id="chat-7b", version="v3").status == (
        "rejected"
    )
    assert Pool.objects.filter(model_id="chat-7b", version__version="v3").exists()
    # Each change above is in the audit trail once, by this test's token (the
    # refused requests wrote nothing), while the guards and the autoscaler ran.
    ours = AuditEntry.objects.filter(
        id__gt=audited_before, actor_name__endswith="(rollouts-e2e)", path=url
    ).order_by("id")
    assert all(e.remote_addr == "127.0.0.1" for e in ours)
    assert len({e.request_id for e in ours}) == 4  # start, pause, resume, abort
    rollout_id = str(started.json()["id"])
    rollout = [
        (e.action, sorted(set(e.changed_fields) & {"paused", "decision"}))
        for e in ours
        if e.object_type == "rollouts.rollout" and e.object_id == rollout_id
    ]
    assert rollout == [
        ("create", ["decision", "paused"]),
        ("update", ["paused"]),
        ("update", ["paused"]),
        ("update", ["decision"]),
    ]
    assert [e.action for e in ours if e.object_type == "rollouts.versionoverride"] == [
        "create"
    ]
