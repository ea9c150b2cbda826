"""The live-answer judge, end to end: a subtly worse canary rolled back by it.

Real processes: the gateway (and admin API), the node agent and its simulated
replicas of chat-7b v1 (right on every gradable prompt), of v4 (right on one in
five: the same short numbers, wrong ones) and of the judge model judge-7b, a
Celery worker with beat (the guard task every ``GUARD_S``), PostgreSQL and
Redis. Single-turn maths questions go through the gateway with the ``openai``
SDK.

GIVEN v4 on a plan whose canary step only a guard can end, with the other
guards' margins wide (a few dozen requests cannot show them not worse) and a
judge, WHEN its canary serves, THEN the gateway has judge-7b compare v4's
answers with v1's and the judge guard rolls v4 back; the figures keep the
verdicts' counts, and no prompt or answer text is stored anywhere the guards
write.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pytest

from localrun.processes import wait_until
from localrun.seeding import VERSION_BODY, ModelSeed, VersionSeed, digest, version_body
from metering.models import VersionFigure
from models_registry.models import Model
from rollouts.models import GuardEvaluation, Rollout
from tests.live import LivePlatform, start_platform

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GUARD_S = 2.0
PLAN: dict[str, Any] = {
    "steps": [
        {
            "stage": "canary",
            "percent": 50,
            "min_duration_s": 600,
            "min_requests": 10,
            "min_conversations": 3,
        }
    ],
    "retention_s": 600,
    "thresholds": {
        "min_samples": 5,
        "error_rate_points": 30.0,
        "refusal_rate_points": 30.0,
        "output_length_ratio": 0.6,
        "p95_ttft_ratio": 2.0,
    },
    "judge": {"model": "judge-7b", "share": 1.0, "per_minute": 600},
}


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    judge = ModelSeed(
        model_id="judge-7b",
        versions=(
            VersionSeed(
                "v1",
                version_body(
                    weights_hash=digest("judge weights"),
                    engine_config={**VERSION_BODY["engine_config"], "sim_quality": 1.0},
                ),
                min_replicas=1,
                max_replicas=1,
            ),
        ),
    )
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp_path_factory.mktemp("live-judge"),
            pools={"v1": 1, "v4": 0},
            autoscaler=True,
            extra_models=(judge,),
            version_configs={"v1": {"sim_quality": 1.0}, "v4": {"sim_quality": 0.2}},
            PLATFORM_ROLLOUT_GUARD_INTERVAL_S=str(GUARD_S),
            PLATFORM_AUTOSCALE_INTERVAL_S="1",
            PLATFORM_FIGURES_BUCKET_S="2",
        ) as live,
    ):
        yield live


class Questions:
    """Single-turn maths questions from a few threads until stopped."""

    def __init__(self, platform: LivePlatform, threads: int = 3) -> None:
        self.client = platform.client("alpha", timeout=30)
        self.prompts: list[str] = []
        self.versions: list[str] = []
        self.errors: list[str] = []
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads)
        self._futures = [self._pool.submit(self._run, i) for i in range(threads)]

    def _run(self, worker: int) -> None:
        rng = random.Random(worker)
        while not self._stop.is_set():
            n = next(self._ids)
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            prompt = f"What is {a} + {b}? Answer with the number."
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model="chat-7b",
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=8,
                    extra_headers={"x-conversation-id": f"q-{n}"},
                )
            except Exception as exc:  # every failure is the test's business
                with self._lock:
                    self.errors.append(repr(exc))
                continue
            with self._lock:
                self.prompts.append(prompt)
                self.versions.append(raw.headers["x-model-version"])

    def stop(self) -> None:
        self._stop.set()
        for future in self._futures:
            future.result(timeout=60)
        self._pool.shutdown()


def _ended(rollout_id: int) -> Rollout | None:
    return Rollout.objects.exclude(decision="pending").filter(pk=rollout_id).first()


def test_a_subtly_worse_canary_is_rolled_back_by_the_judge(
    platform: LivePlatform, django_db_blocker: DjangoDbBlocker
) -> None:
    with (
        django_db_blocker.unblock(),
        platform.admin_api("live-judge-e2e") as api,
    ):
        questions = Questions(platform)
        try:
            wait_until(
                lambda: len(questions.prompts) >= 10, timeout_s=30, message="traffic"
            )
            unknown = {**PLAN, "judge": {"model": "no-such-judge"}}
            refused = api.put(
                "/admin/models/chat-7b/rollout", json={"version": "v4", "plan": unknown}
            )
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "plan.judge.model"
            response = api.put(
                "/admin/models/chat-7b/rollout", json={"version": "v4", "plan": PLAN}
            )
            assert response.status_code == 200, response.text
            rollout_id = response.json()["id"]
            ended = wait_until(
                lambda: _ended(rollout_id), timeout_s=120, message="the judge's verdict"
            )
        finally:
            questions.stop()
        # Two races of the rollout's own, not the judge's, may show here on a
        # loaded machine, each a 503 on the candidate: its step begins once the
        # control plane sees its replica serving, a moment before the gateway
        # has heard the replica's beat; and its pool is released four snapshot
        # refreshes after the rollback, which a slow gateway may outlast.
        assert all(
            "chat-7b@v4" in e and "none serving" in e for e in questions.errors
        ), questions.errors
        assert "v4" in questions.versions  # the canary served
        assert ended.decision == "rolled_back", ended.reason
        tripped = {
            r["name"]: r
            for r in ended.guard_metrics["results"]
            if r["verdict"] == "worse"
        }
        assert set(tripped) == {"judge_win_rate"}, ended.reason
        judge = tripped["judge_win_rate"]
        assert judge["candidate"] < 0.45 and judge["candidate_samples"] > 0
        # The verdicts are counted on the candidate's canary figures, no request.
        rows = VersionFigure.objects.filter(
            model_id="chat-7b", version="v4", role="canary"
        )
        judged: dict[str, int] = {}
        for row in rows:
            for outcome, count in (row.judged or {}).items():
                judged[outcome] = judged.get(outcome, 0) + count
        assert judged.get("loss", 0) > judged.get("win", 0), judged
        assert not VersionFigure.objects.filter(
            model_id="chat-7b", version="v1", judged__has_key="loss"
        ).exists()
        # Neither prompts nor answers are kept where the guards write.
        stored = json.dumps(
            [ended.guard_metrics, ended.reason]
            + [e.report for e in GuardEvaluation.objects.filter(rollout_id=rollout_id)]
            + [r.judged for r in VersionFigure.objects.all()]
        )
        for prompt in questions.prompts[:50]:
            assert prompt not in stored
        assert Model.objects.get(pk="chat-7b").live_version.version == "v1"  # type: ignore[union-attr]
