"""Run the rollout drill live: gateway + node agent + simulated replicas + the guards.

Public surface: ``LiveRolloutPlan``, ``LiveOutcome``, ``LIVE_SCENARIOS``,
``run_live_rollout``.

``run_live_rollout`` registers a scratch model (``ro-chat``: v1 live on a pool of
``replicas``, the candidate v2 with an empty pool and the scenario's
``engine_config``: ``sim_degraded`` for a broken chat template, ``sim_ttft_factor``
1.3 for a slow version), starts a node agent and a gateway as real processes,
sends conversations of three turns from a few threads for the whole run, starts
the candidate on a short plan (``rollouts.plans.start_plan``) and every
``guard_s`` runs the platform's own guard tick
(``control.rollout_guard.guard_rollouts``, what Celery beat runs every
minute) after flushing the gateway's figures. It stops at the rollout's end (and,
for a promotion, once the old version is retired and its pool released), and
removes everything it created. The fleet simulator runs the same policy at the
seed's scale (``drills.domain.rollout_drill``).

At this scale a replica's TTFT is tens of milliseconds, so the slow scenario's
plan drops the TTFT guard's 50 ms floor (``p95_ttft_min_s``): otherwise a 30%
slower version is, by design, no regression a user would feel. It runs at a
canary only: a shadow copy's TTFT is measured on its own connection and reads a
few milliseconds (here about 20%) above the caller's, which the floor exists to
ignore. The other scenarios keep the floor.
"""

from __future__ import annotations

import logging
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from itertools import count, pairwise
from pathlib import Path
from typing import Any

import httpx
import redis
from django.conf import settings
from django.utils import timezone

from accounts.models import Team
from control import rollout_guard
from localrun.processes import (
    drill_env,
    serving_replicas,
    start_agent,
    start_gateway,
    wait_until,
)
from localrun.seeding import (
    LimitSeed,
    ModelSeed,
    PlatformSeed,
    TeamSeed,
    VersionSeed,
    digest,
    remove_scratch_model,
    seed_platform,
)
from metering import services as metering
from models_registry.models import Pool
from rollouts import plans
from rollouts.models import GuardEvaluation, Rollout

logger = logging.getLogger(__name__)

__all__ = ["LIVE_SCENARIOS", "LiveOutcome", "LiveRolloutPlan", "run_live_rollout"]

MODEL = "ro-chat"
TEAM = "ro-team"
_BODY = {
    "weights_uri": "s3://models/ro-chat/drill/",
    "tokenizer_hash": digest("ro-chat drill tokenizer"),
    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "precision": "fp16",
    "gpus_per_replica": 1,
}
_FAST = {"min_duration_s": 3, "min_requests": 10, "min_conversations": 3}
_THRESHOLDS = {"min_samples": 10}
# The slow scenario's: no TTFT floor (see the module docstring).
_NO_FLOOR = {"min_samples": 10, "p95_ttft_min_s": 0.0}
LIVE_SCENARIOS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (what it is, the candidate's engine_config, its plan)
    "bad": (
        "broken chat template (every answer a refusal), canary 30% first",
        {"sim_degraded": True},
        {
            "steps": [
                {"stage": "canary", "percent": 30, **_FAST, "min_duration_s": 600}
            ],
            "retention_s": 600,
            # Few samples suffice for refusals against none (Fisher's test).
            "thresholds": {"min_samples": 5},
        },
    ),
    "good": (
        "a good version: shadow 50%, canary 30%, 60%, promote, 5 s retention",
        {},
        {
            "steps": [
                {"stage": "shadow", "percent": 50, **_FAST},
                {"stage": "canary", "percent": 30, **_FAST},
                {"stage": "canary", "percent": 60, **_FAST},
            ],
            "retention_s": 5,
            "thresholds": _THRESHOLDS,
        },
    ),
    "slow": (
        "TTFT x1.3, canary 30% first, no TTFT floor",
        {"sim_ttft_factor": 1.3},
        {
            "steps": [
                {"stage": "canary", "percent": 30, **_FAST, "min_duration_s": 600}
            ],
            "retention_s": 5,
            "thresholds": _NO_FLOOR,
        },
    ),
}


@dataclass(frozen=True)
class LiveRolloutPlan:
    """The shape of one live run."""

    guard_s: float = 2.0
    bucket_s: int = 2
    threads: int = 4
    replicas: int = 2
    max_tokens: int = 12
    max_s: float = 120.0


@dataclass(frozen=True)
class _Turn:
    conversation: str
    index: int
    version: str
    started: float
    refused: bool


@dataclass
class LiveOutcome:
    """What one live scenario did (times in seconds, from the rollout's start)."""

    scenario: str
    description: str
    decision: str
    stage: str
    percent: float
    reason: str
    detection_s: float | None
    promotion_s: float | None
    retired: bool
    conversations_saw: int
    requests_saw: int
    requests: int
    moves_rollback: int
    moves_other: int
    errors: list[str]
    evaluations: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tripped(self) -> list[str]:
        last = self.evaluations[-1]["report"] if self.evaluations else {}
        return [
            r["name"] for r in last.get("results", []) if r.get("verdict") == "worse"
        ]


class _Traffic:
    """Conversations of three turns from a few threads until stopped."""

    def __init__(self, url: str, key: str, plan: LiveRolloutPlan) -> None:
        self.url, self.key, self.plan = url, key, plan
        self.turns: list[_Turn] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._ids = count()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, daemon=True) for _ in range(plan.threads)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self._stop.is_set():
                conversation = f"ro-{next(self._ids)}"
                messages: list[dict[str, str]] = []
                for index in range(3):
                    messages.append({"role": "user", "content": f"turn {index}"})
                    started = time.time()
                    try:
                        response = client.post(
                            "/v1/chat/completions",
                            json={
                                "model": MODEL,
                                "messages": messages,
                                "max_tokens": self.plan.max_tokens,
                            },
                            headers={
                                "Authorization": f"Bearer {self.key}",
                                "x-conversation-id": conversation,
                            },
                        )
                    except httpx.HTTPError as exc:
                        self._error(f"{conversation}#{index}: {type(exc).__name__}")
                        break
                    if response.status_code != 200:
                        self._error(f"{conversation}#{index}: {response.status_code}")
                        break
                    text = response.json()["choices"][0]["message"]["content"] or ""
                    with self._lock:
                        self.turns.append(
                            _Turn(
                                conversation,
                                index,
                                response.headers.get("x-model-version", ""),
                                started,
                                text.startswith("I am sorry"),
                            )
                        )
                    messages.append({"role": "assistant", "content": text})

    def _error(self, what: str) -> None:
        with self._lock:
            self.errors.append(what)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def run_live_rollout(scenario: str, plan: LiveRolloutPlan) -> LiveOutcome:
    """Run one scenario of ``LIVE_SCENARIOS`` against fresh processes."""
    description, engine_config, rollout_plan = LIVE_SCENARIOS[scenario]
    region = f"ro-{secrets.token_hex(3)}"
    prefix = f"{settings.REDIS_KEY_PREFIX}-ro-{secrets.token_hex(3)}"
    key = _register(plan, region, engine_config)
    env = drill_env(
        region=region, prefix=prefix, PLATFORM_FIGURES_BUCKET_S=str(plan.bucket_s)
    )
    tmp = Path(tempfile.mkdtemp(prefix="rollout-drill-"))
    agent = start_agent(
        env, tmp, region=region, node="ro-node", gpus=2 * plan.replicas + 1
    )
    gateway = None
    traffic = None
    try:
        wait_until(
            lambda: (
                serving_replicas(region) == plan.replicas
                or agent.popen.poll() is not None
            ),
            timeout_s=60,
            message="the drill's live replicas",
        )
        if agent.popen.poll() is not None:
            raise RuntimeError(f"the node agent exited:\n{agent.log()}")
        gateway = start_gateway(env, tmp, name="ro-gateway")
        traffic = _Traffic(gateway.url, key, plan)
        wait_until(lambda: len(traffic.turns) >= 20, timeout_s=30, message="traffic")
        started = timezone.now()
        rollout = plans.start_plan(
            model_id=MODEL, version="v2", now=started, plan=rollout_plan
        )
        ended = _guard_until_done(rollout.pk, plan, prefix=prefix, region=region)
        traffic.stop()
        return _outcome(scenario, description, ended, started, traffic)
    finally:
        if traffic is not None:
            traffic.stop()
        if gateway is not None:
            gateway.stop()
        agent.stop(grace_s=20)
        remove_scratch_model(MODEL, region=region, team_id=TEAM)


def _guard_until_done(
    rollout_id: int, plan: LiveRolloutPlan, *, prefix: str, region: str
) -> Rollout:
    """Tick the guards every ``guard_s`` until the rollout ends (and a promoted
    one's old version is retired and released), or ``max_s`` passes."""
    deadline = time.monotonic() + plan.max_s
    with redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10) as client:
        while time.monotonic() < deadline:
            next_tick = time.monotonic() + plan.guard_s
            now = timezone.now()
            metering.flush_redis_figures(
                client=client, prefix=prefix, region=region, now=now
            )
            rollout_guard.guard_rollouts(now=now, flush=False)
            rollout = Rollout.objects.get(pk=rollout_id)
            if rollout.decision == "promoted" and rollout.retired_at is not None:
                old = rollout.previous_version_id
                if not Pool.objects.filter(version_id=old).exists():
                    return rollout
            elif rollout.decision not in ("pending", "promoted"):
                return rollout
            # The guard period, as beat keeps it: the drill's clock, not a wait
            # for a condition.
            time.sleep(max(0.0, next_tick - time.monotonic()))
    return Rollout.objects.get(pk=rollout_id)


def _outcome(
    scenario: str,
    description: str,
    rollout: Rollout,
    started: datetime,
    traffic: _Traffic,
) -> LiveOutcome:
    evaluations = [
        {
            "at_s": (e.at - started).total_seconds(),
            "stage": e.stage,
            "percent": e.percent,
            "action": e.action,
            "reason": e.reason,
            "report": e.report,
        }
        for e in GuardEvaluation.objects.filter(rollout=rollout).order_by("at")
    ]
    decided = rollout.decided_at
    began = rollout.step_started_at
    decided_ts = decided.timestamp() if decided is not None else float("inf")
    retired_ts = (
        rollout.retired_at.timestamp() if rollout.retired_at is not None else None
    )
    by: dict[str, list[_Turn]] = {}
    for turn in sorted(traffic.turns, key=lambda t: (t.conversation, t.index)):
        by.setdefault(turn.conversation, []).append(turn)
    moves_rollback = moves_other = 0
    for turns in by.values():
        for before, after in pairwise(turns):
            if before.version == after.version:
                continue
            if rollout.decision == "rolled_back" and (
                before.version,
                after.version,
            ) == (
                "v2",
                "v1",
            ):
                moves_rollback += 1  # what a rollback is for
            elif retired_ts is not None and after.started >= retired_ts:
                pass  # a retired version's conversation going on to the live one
            else:
                moves_other += 1
    # Before a promotion, v2's answers were the candidate's; after, live's.
    saw = [t for t in traffic.turns if t.version == "v2" and t.started < decided_ts]
    is_rollback = rollout.decision == "rolled_back"
    return LiveOutcome(
        scenario=scenario,
        description=description,
        decision=rollout.decision,
        stage=rollout.stage,
        percent=rollout.percent,
        reason=rollout.reason,
        detection_s=(
            (decided - began).total_seconds()
            if is_rollback and decided is not None and began is not None
            else None
        ),
        promotion_s=(
            (decided - started).total_seconds()
            if rollout.decision == "promoted" and decided is not None
            else None
        ),
        retired=rollout.retired_at is not None,
        conversations_saw=len({t.conversation for t in saw}),
        requests_saw=len(saw),
        requests=len(traffic.turns),
        moves_rollback=moves_rollback,
        moves_other=moves_other,
        errors=list(traffic.errors),
        evaluations=evaluations,
    )


def _register(plan: LiveRolloutPlan, region: str, engine_config: dict[str, Any]) -> str:
    remove_scratch_model(MODEL, region=region, team_id=TEAM)
    Team.objects.filter(pk=TEAM).delete()
    versions = (
        VersionSeed(
            "v1",
            {**_BODY, "weights_hash": digest("ro-chat v1"), "engine_config": {}},
            min_replicas=plan.replicas,
            max_replicas=plan.replicas,
        ),
        VersionSeed(
            "v2",
            {
                **_BODY,
                "weights_hash": digest(f"ro-chat v2 {sorted(engine_config.items())}"),
                "engine_config": engine_config,
            },
            min_replicas=0,
            max_replicas=plan.replicas,
        ),
    )
    seeded = seed_platform(
        seed=PlatformSeed(
            region=region,
            teams=(TeamSeed(TEAM),),
            models=(
                ModelSeed(
                    model_id=MODEL, description="rollout drill", versions=versions
                ),
            ),
            limits=(
                LimitSeed(
                    team_id=TEAM,
                    model_id=MODEL,
                    tokens_per_minute=10**9,
                    max_concurrency=10_000,
                    guaranteed_share=0.0,
                ),
            ),
            key_name="rollout drill",
        ),
        now=timezone.now(),
    )
    return dict(seeded.keys)[TEAM]
