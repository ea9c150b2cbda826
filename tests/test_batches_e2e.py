"""Batches end to end: the ``openai`` SDK, the gateway, Celery and the replicas.

Real processes: the gateway (which also serves the Files and Batch APIs), the node
agent and its simulated replica, a Celery worker with beat (the dispatcher every
half second, the usage flush) and a second worker on the ``batches`` queue (the
runners), which the test kills and starts again. PostgreSQL and Redis are the
machine's. Leases are short (2 s), so a killed runner's job moves on quickly.

GIVEN chat-7b@v1 on one replica whose capacity is 2,000 tokens in flight,
- WHEN alpha uploads a file and creates a batch with the SDK and the batch worker
  is killed (SIGKILL) halfway and started again, THEN the batch completes and its
  output file holds every line's answer exactly once, the malformed line is in the
  error file with its custom_id, no line that had finished ran again, and the
  lines are metered as batch requests;
- WHEN beta holds the pool with interactive streams, THEN alpha's batch is refused
  (it pauses) while no interactive request fails, and it finishes once the load
  ends;
- a cancelled batch ends ``cancelled`` saying how many lines were done, an expired
  one ``expired`` with what finished; bad input is refused at creation.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest
import redis
from django.conf import settings
from django.db.models import Sum

from batches.models import Batch, BatchLine
from localrun.processes import Process, wait_until
from metering.models import Usage
from tests.batch_client import content, start_celery, upload, wait_batch
from tests.live import LivePlatform, start_platform

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("batches")
    store = tmp / "store"
    store.mkdir()
    roots = ",".join([*settings.PLATFORM_STORAGE_ROOTS, f"file://{store}/"])
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 1},
            replica_tokens_in_flight=2000,
            guaranteed_shares={"beta": 1.0},
            PLATFORM_STORAGE_ROOTS=roots,
            PLATFORM_BATCH_STORAGE_URI=f"file://{store}/batches/",
            PLATFORM_BATCH_FILE_MAX_BYTES=str(64 * 1024),
            PLATFORM_BATCH_DISPATCH_S="0.5",
            PLATFORM_BATCH_LEASE_S="2",
            PLATFORM_BATCH_SLICE_S="20",
            PLATFORM_BATCH_MAX_WINDOW="4",
            PLATFORM_ADMISSION_MAX_WAIT_S="0.5",
        ) as live,
    ):
        live.env["PLATFORM_BATCH_GATEWAY_URL"] = live.url
        beat = start_celery(live.env, tmp, "beat", ["-B", "-Q", "celery"])
        live.extra.append(beat)
        try:
            yield live
        finally:
            for process in live.extra:
                process.stop(grace_s=10)


@pytest.fixture(scope="module")
def runners(
    platform: LivePlatform, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Process]]:
    """The batch workers started so far; the last one is the live one."""
    tmp = tmp_path_factory.mktemp("runners")
    started = [start_celery(platform.env, tmp, "batches", ["-Q", "batches"])]
    yield started
    for process in started:
        process.stop(grace_s=10)


def _line(custom_id: str, content: str, max_tokens: int = 16) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "chat-7b",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
        },
    }


def test_a_batch_survives_its_worker_being_killed(
    platform: LivePlatform, runners: list[Process], tmp_path: Path, unblocked: None
) -> None:
    client = platform.client("alpha", timeout=30)
    rows: list[Any] = [_line(f"q-{i}", f"question {i}") for i in range(40)]
    rows.insert(
        7,
        {
            "custom_id": "broken",
            "method": "GET",
            "url": "/v1/chat/completions",
            "body": {},
        },
    )
    file_id = upload(client, tmp_path, rows)
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"suite": "e2e"},
    )
    assert batch.status == "in_progress"
    assert batch.request_counts is not None and batch.request_counts.total == 41

    # Kill the runner's worker once a few lines are done.
    wait_batch(client, batch.id, lambda b: b.request_counts.completed >= 8)
    runners[-1].popen.kill()
    import os
    import signal

    os.killpg(runners[-1].popen.pid, signal.SIGKILL)
    runners[-1].popen.wait(10)
    killed_at = time.time()
    done_at_kill = set(
        BatchLine.objects.filter(batch_id=batch.id, status="done").values_list(
            "custom_id", flat=True
        )
    )
    runners.append(start_celery(platform.env, tmp_path, "batches", ["-Q", "batches"]))

    ended = wait_batch(client, batch.id, lambda b: b.status == "completed")
    assert ended.request_counts.completed == 40
    assert ended.request_counts.failed == 1
    output = content(client, ended.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"q-{i}" for i in range(40))
    for record in output:
        assert record["response"]["status_code"] == 200
        assert record["response"]["body"]["choices"][0]["message"]["content"]
    errors = content(client, ended.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("broken", "invalid_method")
    ]
    # A line that had finished before the kill never ran again; the lines the
    # dead runner had in flight (at most its window of 4) ran a second time.
    lines = BatchLine.objects.filter(batch_id=batch.id, status="done")
    assert all(x.attempts == 1 for x in lines if x.custom_id in done_at_kill)
    assert sum(x.attempts - 1 for x in lines) <= 4
    assert len(done_at_kill) < 40, "the worker was killed too late to matter"
    completed_at = Batch.objects.get(pk=batch.id).completed_at
    assert completed_at is not None and completed_at.timestamp() > killed_at
    # Metered as batch requests, against alpha: with Redis, the gateway's usage
    # hashes there (the rows follow when the minute closes); without, the rows
    # its own ledger adds to at every flush.
    wait_until(
        lambda: _batch_requests(platform, "alpha") >= 40,
        timeout_s=60,
        message="alpha's batch requests metered",
    )


def _batch_requests(platform: LivePlatform, team: str) -> int:
    url = platform.env.get("REDIS_URL")
    if not url:
        total = Usage.objects.filter(team_id=team).aggregate(n=Sum("batch_requests"))
        return int(total["n"] or 0)
    with redis.Redis.from_url(url) as client:
        return sum(
            int(client.hget(key, "batch_requests") or 0)
            for key in client.scan_iter(f"{platform.prefix}:usage:*:{team}:*")
        )


def test_under_interactive_load_the_batch_pauses_then_resumes(
    platform: LivePlatform, runners: list[Process], tmp_path: Path, unblocked: None
) -> None:
    interactive = platform.client("beta", timeout=60)
    errors: list[str] = []
    answered = [0]
    stop = threading.Event()

    def hold_the_pool() -> None:
        # Four streams hold ~1,940 of the pool's 2,000 tokens, five seconds each:
        # above the batch ceiling (90%), inside beta's guarantee.
        while not stop.is_set():
            try:
                interactive.chat.completions.create(
                    model="chat-7b",
                    messages=[{"role": "user", "content": "a long answer please"}],
                    max_tokens=470,
                    extra_headers={"x-priority": "interactive"},
                )
                answered[0] += 1
            except Exception as exc:  # every failure is the test's business
                errors.append(repr(exc))

    threads = [threading.Thread(target=hold_the_pool) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        client = platform.client("alpha", timeout=30)
        file_id = upload(
            client, tmp_path, [_line(f"p-{i}", f"p {i}") for i in range(12)]
        )
        batch = client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        paused = wait_batch(client, batch.id, lambda b: b.refused >= 3, timeout_s=40)
        assert paused.status == "in_progress"
        assert paused.request_counts.completed < 12
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    ended = wait_batch(client, batch.id, lambda b: b.status == "completed")
    assert ended.request_counts.completed == 12
    assert errors == []
    assert answered[0] >= 4


def test_cancel_and_expiry_keep_what_was_done(
    platform: LivePlatform, runners: list[Process], tmp_path: Path, unblocked: None
) -> None:
    client = platform.client("alpha", timeout=30)
    rows = [_line(f"c-{i}", f"c {i}", max_tokens=32) for i in range(300)]
    cancelled = client.batches.create(
        input_file_id=upload(client, tmp_path, rows),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    expiring = client.batches.create(
        input_file_id=upload(client, tmp_path, rows),
        endpoint="/v1/chat/completions",
        # OpenAI offers only 24h (the SDK's type says so); the platform takes any
        # window up to a week.
        completion_window="24h",
        extra_body={"completion_window": "6s"},
    )
    wait_batch(client, cancelled.id, lambda b: b.request_counts.completed >= 3)
    assert client.batches.cancel(cancelled.id).status == "cancelling"
    ended = wait_batch(client, cancelled.id, lambda b: b.status == "cancelled")
    done = ended.request_counts.completed
    assert 3 <= done < 300
    assert len(content(client, ended.output_file_id)) == done
    left = content(client, ended.error_file_id)
    assert len(left) == 300 - done
    assert {e["error"]["code"] for e in left} == {"batch_cancelled"}

    gone = wait_batch(client, expiring.id, lambda b: b.status == "expired")
    finished = gone.request_counts.completed
    assert 0 < finished < 300
    assert gone.expired_at is not None
    assert len(content(client, gone.output_file_id)) == finished
    assert {e["error"]["code"] for e in content(client, gone.error_file_id)} == {
        "batch_expired"
    }


def test_bad_input_is_refused_in_openais_shape(
    platform: LivePlatform, tmp_path: Path, unblocked: None
) -> None:
    client = platform.client("alpha", timeout=30)
    twice = upload(client, tmp_path, [_line("same", "a"), _line("same", "b")])
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=twice,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    assert refused.value.code == "duplicate_custom_id"
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps(_line("x", "y" * 70_000)) + "\n")
    with big.open("rb") as handle, pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=handle, purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        platform.client("beta").batches.retrieve(client.batches.list().data[0].id)
