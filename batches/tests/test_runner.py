"""The runner against a scripted gateway: every line once, refusals, a dead
runner's lines, retries, escalation and the at-risk report.

The gateway here is an ``httpx.MockTransport`` that answers as the gateway does
(200 with usage, 503 with Retry-After, 4xx/5xx bodies in OpenAI's shape), so the
runner's bookkeeping is checked line by line; ``tests/test_batches_e2e.py`` runs
it against the real gateway, replicas and Celery.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from django.utils import timezone

from accounts import services as accounts_services
from batches import runner, services
from batches.models import Batch, BatchLine
from batches.tests.conftest import jsonl, line
from models_registry.models import Pool

if TYPE_CHECKING:
    from pytest_django import Settings

    from accounts.models import Team
    from models_registry.models import Model, ModelVersion

pytestmark = pytest.mark.django_db


class Gateway:
    """Answers like the gateway; ``script(index, tier, call)`` picks the answer."""

    def __init__(self, script: Callable[[int, str, int], httpx.Response] | None = None):
        self.script = script or (lambda index, tier, call: ok(index))
        self.calls: Counter[int] = Counter()
        self.tiers: list[tuple[int, str]] = []
        self.auth: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        index = int(body["messages"][0]["content"].removeprefix("line "))
        tier = request.headers["x-priority"]
        with self._lock:
            self.calls[index] += 1
            call = self.calls[index]
            self.tiers.append((index, tier))
            self.auth.add(request.headers["authorization"])
        return self.script(index, tier, call)

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def ok(index: int) -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "id": f"chatcmpl-{index}",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}],
            "usage": {
                "prompt_tokens": 40,
                "completion_tokens": 60,
                "total_tokens": 100,
            },
        },
    )


def shed(retry_after: str = "0.05") -> httpx.Response:
    return httpx.Response(
        503,
        headers={"retry-after": retry_after},
        json={"error": {"type": "service_unavailable_error", "message": "busy"}},
    )


def make_batch(team: Team, lines: int, *, window: str = "1h") -> Batch:
    rows = [line(f"id-{i}", f"line {i}") for i in range(lines)]
    uploaded = services.create_file(
        team_id=team.team, filename="in.jsonl", purpose="batch", chunks=[jsonl(*rows)]
    )
    return services.create_batch(
        team_id=team.team, input_file_id=uploaded.id, completion_window=window
    )


@pytest.fixture
def fast(settings: Settings) -> None:
    settings.PLATFORM_BATCH_GATEWAY_URL = "http://gateway.test"
    settings.PLATFORM_BATCH_MAX_WINDOW = 8
    settings.PLATFORM_BATCH_MIN_OBSERVED_S = 0.2


def output_of(batch: Batch) -> list[dict[str, Any]]:
    batch.refresh_from_db()
    assert batch.output_file is not None
    content = b"".join(
        services.file_content(team_id=batch.team_id, file_id=batch.output_file.id)
    )
    return [json.loads(x) for x in content.splitlines()]


def test_every_line_runs_once_and_the_output_holds_them_all(
    store: Path, fast: None, team: Team, chat_model: Model
) -> None:
    batch = make_batch(team, 20)
    gateway = Gateway()
    outcome = runner.run_batch(batch.id, transport=gateway.transport)
    assert outcome is runner.Outcome.ENDED
    assert gateway.calls == Counter({i: 1 for i in range(20)})
    assert gateway.auth == {f"Bearer {services.batch_key_secret(batch.id)}"}
    assert {tier for _, tier in gateway.tiers} == {"batch"}
    batch.refresh_from_db()
    assert batch.status == "completed"
    assert (batch.completed, batch.failed, batch.total) == (20, 0, 20)
    assert batch.error_file is None
    output = output_of(batch)
    assert [o["custom_id"] for o in output] == [f"id-{i}" for i in range(20)]
    assert all(o["response"]["status_code"] == 200 for o in output)
    assert batch.key is not None and batch.key.revoked_at is not None


def test_refused_lines_go_back_and_run_later_without_counting_as_attempts(
    store: Path, fast: None, team: Team, chat_model: Model
) -> None:
    batch = make_batch(team, 6)
    # The pool is busy for each line's first two tries.
    gateway = Gateway(lambda index, tier, call: shed() if call <= 2 else ok(index))
    assert (
        runner.run_batch(batch.id, transport=gateway.transport) is runner.Outcome.ENDED
    )
    assert gateway.calls == Counter({i: 3 for i in range(6)})
    lines = BatchLine.objects.filter(batch=batch)
    assert {(x.status, x.attempts) for x in lines} == {("done", 1)}


def test_a_dead_runners_lines_run_again_and_finished_ones_never(
    store: Path, fast: None, team: Team, chat_model: Model
) -> None:
    batch = make_batch(team, 5)
    past = timezone.now() - timedelta(seconds=1)
    # A runner died holding the lease, lines 0 and 1 in flight; 2 had finished.
    Batch.objects.filter(pk=batch.pk).update(runner="runner-dead", lease_until=past)
    BatchLine.objects.filter(batch=batch, index__in=[0, 1]).update(
        status="running", runner="runner-dead", attempts=1
    )
    BatchLine.objects.filter(batch=batch, index=2).update(
        status="done", status_code=200, response={"kept": True}, tokens=100
    )
    Batch.objects.filter(pk=batch.pk).update(completed=1)
    gateway = Gateway()
    assert (
        runner.run_batch(batch.id, transport=gateway.transport) is runner.Outcome.ENDED
    )
    assert gateway.calls == Counter({0: 1, 1: 1, 3: 1, 4: 1})
    output = output_of(batch)
    assert [o["custom_id"] for o in output] == [f"id-{i}" for i in range(5)]
    assert output[2]["response"]["body"] == {"kept": True}


def test_a_live_lease_keeps_a_second_runner_out(
    store: Path, fast: None, team: Team, chat_model: Model
) -> None:
    batch = make_batch(team, 2)
    future = timezone.now() + timedelta(seconds=30)
    Batch.objects.filter(pk=batch.pk).update(runner="runner-alive", lease_until=future)
    gateway = Gateway()
    assert (
        runner.run_batch(batch.id, transport=gateway.transport) is runner.Outcome.BUSY
    )
    assert not gateway.calls


def test_client_errors_are_results_and_server_errors_are_retried_then_failed(
    store: Path, fast: None, team: Team, chat_model: Model, settings: Settings
) -> None:
    settings.PLATFORM_BATCH_MAX_ATTEMPTS = 3

    def script(index: int, tier: str, call: int) -> httpx.Response:
        if index == 0:
            return httpx.Response(
                400, json={"error": {"message": "bad", "type": "invalid_request_error"}}
            )
        if index == 1:
            return httpx.Response(
                500, json={"error": {"message": "boom", "type": "server_error"}}
            )
        if index == 2 and call == 1:
            raise httpx.ConnectError("refused")
        return ok(index)

    batch = make_batch(team, 3)
    gateway = Gateway(script)
    assert (
        runner.run_batch(batch.id, transport=gateway.transport) is runner.Outcome.ENDED
    )
    assert gateway.calls == Counter({0: 1, 1: 3, 2: 2})
    # No gateway at all is an outage, not the line's attempt.
    assert BatchLine.objects.get(batch=batch, index=2).attempts == 1
    batch.refresh_from_db()
    assert (batch.completed, batch.failed) == (1, 2)
    assert batch.error_file is not None
    content = b"".join(
        services.file_content(team_id=team.team, file_id=batch.error_file.id)
    )
    errors = {e["custom_id"]: e for e in map(json.loads, content.splitlines())}
    assert errors["id-0"]["response"]["status_code"] == 400
    assert errors["id-1"]["response"]["status_code"] == 500


def test_an_answer_the_database_cannot_hold_is_cleaned(
    store: Path, fast: None, team: Team, chat_model: Model
) -> None:
    def nul(index: int, tier: str, call: int) -> httpx.Response:
        answer = ok(index)
        body = json.loads(answer.content)
        body["choices"][0]["message"]["content"] = "a\u0000b"
        return httpx.Response(200, json=body)

    batch = make_batch(team, 1)
    assert (
        runner.run_batch(batch.id, transport=Gateway(nul).transport)
        is runner.Outcome.ENDED
    )
    [record] = output_of(batch)
    assert record["response"]["body"]["choices"][0]["message"]["content"] == "a\ufffdb"


def test_a_line_whose_runner_dies_every_time_fails_alone(
    store: Path, fast: None, team: Team, chat_model: Model, settings: Settings
) -> None:
    settings.PLATFORM_BATCH_MAX_ATTEMPTS = 2
    batch = make_batch(team, 2)
    # Line 0 was claimed twice by runners that died before writing its answer.
    BatchLine.objects.filter(batch=batch, index=0).update(attempts=2)
    gateway = Gateway()
    assert (
        runner.run_batch(batch.id, transport=gateway.transport) is runner.Outcome.ENDED
    )
    assert gateway.calls == Counter({1: 1})
    batch.refresh_from_db()
    assert (batch.completed, batch.failed) == (1, 1)


def test_a_starved_job_is_raised_to_standard_and_reported_at_risk_early(
    store: Path, fast: None, team: Team, chat_model: Model
) -> None:
    # One token per second at the standard tier: 5 lines cannot finish in a minute.
    accounts_services.set_team_limit(
        team_id=team.team,
        model_id=chat_model.model,
        tokens_per_minute=60,
        max_concurrency=10,
        guaranteed_share=0.0,
    )
    batch = make_batch(team, 5, window="60s")
    starved = Gateway(lambda index, tier, call: shed())
    outcome = runner.run_batch(batch.id, slice_s=1.0, transport=starved.transport)
    assert outcome is runner.Outcome.CONTINUE
    batch.refresh_from_db()
    assert batch.priority == "standard"
    assert batch.escalated_at is not None
    assert batch.at_risk is True
    assert batch.at_risk_since is not None
    assert batch.schedule_reason.startswith("at risk")
    assert "standard" in {tier for _, tier in starved.tiers}
    # Capacity comes back: it finishes at the standard tier, the risk report kept.
    served = Gateway()
    assert (
        runner.run_batch(batch.id, transport=served.transport) is runner.Outcome.ENDED
    )
    assert {tier for _, tier in served.tiers} == {"standard"}
    batch.refresh_from_db()
    assert batch.status == "completed" and batch.at_risk_since is not None


def test_a_job_with_room_stays_on_idle_capacity(
    store: Path, fast: None, team: Team, chat_model: Model
) -> None:
    batch = make_batch(team, 30, window="1h")

    def slow(index: int, tier: str, call: int) -> httpx.Response:
        time.sleep(0.02)
        return ok(index)

    gateway = Gateway(slow)
    assert (
        runner.run_batch(batch.id, transport=gateway.transport) is runner.Outcome.ENDED
    )
    batch.refresh_from_db()
    assert {tier for _, tier in gateway.tiers} == {"batch"}
    assert batch.priority == "batch" and not batch.at_risk


def test_a_slice_starts_from_the_tokens_its_finished_lines_made(
    store: Path, fast: None, team: Team, chat_model: Model
) -> None:
    # The scheduler's mean rate counts every finished line, not only the last
    # minute's: a new slice seeds its running sum from the database.
    batch = make_batch(team, 4)
    BatchLine.objects.filter(batch=batch, index=0).update(status="done", tokens=100)
    BatchLine.objects.filter(batch=batch, index=1).update(status="done", tokens=300)
    batch.refresh_from_db()
    with runner._Job(batch, "runner-x", clock=time.time, transport=None) as job:
        assert (job.done_lines, job.done_tokens) == (2, 400)
        assert job.tokens_per_line == pytest.approx(200.0)
    # The slice runs only the lines left.
    gateway = Gateway()
    assert (
        runner.run_batch(batch.id, transport=gateway.transport) is runner.Outcome.ENDED
    )
    assert gateway.calls == Counter({2: 1, 3: 1})


def forecast_pool(
    version: ModelVersion, settings: Settings
) -> Callable[[float, float], None]:
    """Create the chat pool of 4 replicas with the guard backing off from 0.45 to
    0.6 over a 240 s horizon; return a setter of the autoscaler's trend of its
    demand (level and slope per second, shares of its capacity)."""
    settings.PLATFORM_BATCH_GUARD_HORIZON_S = 240.0
    settings.PLATFORM_BATCH_GUARD_BACKOFF_FROM = 0.45
    settings.PLATFORM_BATCH_GUARD_BACKOFF_TO = 0.6
    capacity = 4 * 110_000.0
    pool = Pool.objects.create(model_id="chat-7b", version=version, region="local")

    def trend(level: float, slope_per_s: float) -> None:
        pool.autoscaler_state = {
            "state": {
                "trend": [0.0, level * capacity, slope_per_s * capacity, 0, None]
            },
            "last": {"signals": {"serving": 4.0, "replica_tokens_in_flight": 110_000}},
        }
        pool.save(update_fields=["autoscaler_state"])

    return trend


def test_a_forecast_ramp_holds_new_lines_back_until_it_passes(
    chat_v1: ModelVersion,  # registered before ``store`` moves the storage root
    store: Path,
    fast: None,
    settings: Settings,
    team: Team,
    chat_model: Model,
) -> None:
    """GIVEN the autoscaler's trend of the pool at 0.4 of its capacity and rising
    0.1 a minute (0.8 expected 4 minutes ahead) WHEN the runner works a slice THEN
    it sends no line; once the trend is flat at 0.2 every line runs."""
    trend = forecast_pool(chat_v1, settings)
    trend(0.4, 0.1 / 60)
    assert services.demand_trend("chat-7b", horizon_s=240.0) is not None
    batch = make_batch(team, 6)
    gateway = Gateway()
    outcome = runner.run_batch(batch.id, slice_s=0.6, transport=gateway.transport)
    assert outcome is runner.Outcome.CONTINUE
    assert gateway.calls == Counter()
    trend(0.2, 0.0)
    while runner.run_batch(batch.id, transport=gateway.transport) is not (
        runner.Outcome.ENDED
    ):
        pass
    assert gateway.calls == Counter({i: 1 for i in range(6)})


def test_a_job_the_forecast_holds_back_is_reported_at_risk_at_once(
    chat_v1: ModelVersion,
    store: Path,
    fast: None,
    settings: Settings,
    team: Team,
    chat_model: Model,
) -> None:
    """GIVEN the pool's forecast past the back-off (0.8 expected ahead) and a job
    due within its first verdict WHEN the runner works a slice THEN it sends
    nothing, is raised, and is reported at risk: the guard leaves a raised job
    none of its window, so the standard tier cannot finish it either."""
    settings.PLATFORM_BATCH_GUARD_RAISED_SHARE = 0.0
    forecast_pool(chat_v1, settings)(0.4, 0.1 / 60)
    batch = make_batch(team, 6, window="60s")
    gateway = Gateway()
    outcome = runner.run_batch(batch.id, slice_s=0.6, transport=gateway.transport)
    assert outcome is runner.Outcome.CONTINUE
    assert gateway.calls == Counter()
    batch.refresh_from_db()
    assert batch.priority == "standard"
    assert batch.at_risk is True and batch.at_risk_since is not None
    assert "finishes never" in batch.schedule_reason
