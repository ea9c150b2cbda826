"""Embedding batches end to end: the ``openai`` SDK, the gateway, Celery and a
simulated replica run as vLLM's pooling runner (``--runner pooling``).

Real processes, as ``tests/test_batches_e2e.py`` runs them: the gateway (which
also serves the Files and Batch APIs), the node agent and its replicas (chat-7b,
and embed-1 on the pooling runner), a Celery worker with beat (the dispatcher
every half second, the usage flush) and a worker on the ``batches`` queue (the
runner). PostgreSQL and Redis are the machine's.

GIVEN embed-1@v1 on one pooling replica,
- WHEN alpha uploads a file of ``/v1/embeddings`` lines and creates a batch with
  endpoint ``/v1/embeddings``, THEN the batch completes, its output file holds
  every answered line once in OpenAI's batch shape (``response.body`` the
  embeddings answer), the malformed bodies are in the error file with the
  gateway's 400 in OpenAI's error shape, no line ran twice, and the lines are
  metered as batch requests with input tokens only;
- a file that mixes endpoints, or names a chat model for embeddings, is refused
  at creation in OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import openai
import pytest
import redis
from django.conf import settings
from django.db.models import Sum

from batches.models import BatchLine
from localrun.processes import wait_until
from metering.models import Usage
from tests.batch_client import content, start_celery, upload, wait_batch
from tests.factories import embedding_model_seed
from tests.live import LivePlatform, start_platform

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "embed-1"
DIMENSIONS = 384  # the simulated replica's default vector size
LONGEST = 64
EMBEDDINGS: Final = "/v1/embeddings"


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    embed = embedding_model_seed(dimensions=DIMENSIONS, max_input_tokens=LONGEST)
    tmp = tmp_path_factory.mktemp("embedding-batches")
    store = tmp / "store"
    store.mkdir()
    roots = ",".join([*settings.PLATFORM_STORAGE_ROOTS, f"file://{store}/"])
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 1},
            extra_models=(embed,),
            PLATFORM_STORAGE_ROOTS=roots,
            PLATFORM_BATCH_STORAGE_URI=f"file://{store}/batches/",
            PLATFORM_BATCH_DISPATCH_S="0.5",
            PLATFORM_BATCH_LEASE_S="2",
            PLATFORM_BATCH_SLICE_S="20",
            PLATFORM_BATCH_MAX_WINDOW="4",
        ) as live,
    ):
        live.env["PLATFORM_BATCH_GATEWAY_URL"] = live.url
        live.extra.append(start_celery(live.env, tmp, "beat", ["-B", "-Q", "celery"]))
        live.extra.append(start_celery(live.env, tmp, "batches", ["-Q", "batches"]))
        try:
            yield live
        finally:
            for process in live.extra:
                process.stop(grace_s=10)


@pytest.fixture
def unblocked(django_db_blocker: DjangoDbBlocker) -> Iterator[None]:
    with django_db_blocker.unblock():
        yield


def _line(custom_id: str, text: Any, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": EMBEDDINGS,
        "body": {"model": MODEL, "input": text, **body},
    }


def _metered(platform: LivePlatform, team: str) -> tuple[int, int, int]:
    """(batch requests, batch prompt tokens, batch output tokens) of ``team`` on
    embed-1: the gateway's usage hashes in Redis, or the rows without it."""
    url = platform.env.get("REDIS_URL")
    fields = ("batch_requests", "batch_prompt_tokens", "batch_output_tokens")
    if not url:
        total = Usage.objects.filter(team_id=team, model_id=MODEL).aggregate(
            **{name: Sum(name) for name in fields}
        )
        requests, prompt, output = (int(total[name] or 0) for name in fields)
        return requests, prompt, output
    with redis.Redis.from_url(url) as client:
        sums = [0, 0, 0]
        for key in client.scan_iter(f"{platform.prefix}:usage:*:{team}:*"):
            if MODEL not in str(key):
                continue
            for i, name in enumerate(fields):
                sums[i] += int(client.hget(key, name) or 0)
        return sums[0], sums[1], sums[2]


def test_an_embeddings_batch_runs_through_the_gateway(
    platform: LivePlatform, tmp_path: Path, unblocked: None
) -> None:
    client = platform.client("alpha", timeout=30)
    texts = {
        f"e-{i}": (
            [f"text {i} number {w}" for w in range(i % 4 + 1)] if i % 2 else f"text {i}"
        )
        for i in range(16)
    }
    rows: list[Any] = [_line(k, v) for k, v in texts.items()]
    rows.insert(4, _line("empty", []))
    rows.insert(9, _line("too-long", "word " * (4 * LONGEST)))
    batch = client.batches.create(
        input_file_id=upload(client, tmp_path, rows),
        endpoint=EMBEDDINGS,
        completion_window="24h",
    )
    assert (batch.endpoint, batch.status) == (EMBEDDINGS, "in_progress")
    assert batch.request_counts is not None and batch.request_counts.total == 18

    ended = wait_batch(client, batch.id, lambda b: b.status == "completed")
    assert (ended.request_counts.completed, ended.request_counts.failed) == (16, 2)

    output = content(client, ended.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(texts)
    told = 0
    for record in output:
        assert record["error"] is None
        response = record["response"]
        assert response["status_code"] == 200
        body = response["body"]
        given = texts[record["custom_id"]]
        wanted = given if isinstance(given, list) else [given]
        assert body["object"] == "list" and body["model"] == MODEL
        assert [d["index"] for d in body["data"]] == list(range(len(wanted)))
        assert all(len(d["embedding"]) == DIMENSIONS for d in body["data"])
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0
        told += body["usage"]["prompt_tokens"]

    errors = {e["custom_id"]: e for e in content(client, ended.error_file_id)}
    assert set(errors) == {"empty", "too-long"}
    for record in errors.values():
        assert record["error"] is None
        assert record["response"]["status_code"] == 400
        refused = record["response"]["body"]["error"]
        assert (refused["type"], refused["param"]) == ("invalid_request_error", "input")

    # No line ran twice: each was claimed and sent once.
    attempts = BatchLine.objects.filter(batch_id=batch.id).values_list(
        "attempts", flat=True
    )
    assert sorted(attempts) == [1] * 18
    # Metered once per answered line, as batch work, input tokens only.
    wait_until(
        lambda: _metered(platform, "alpha") == (16, told, 0),
        timeout_s=60,
        message=f"alpha's embeddings batch metered as (16, {told}, 0)",
    )


def test_bad_embedding_batches_are_refused_in_openais_shape(
    platform: LivePlatform, tmp_path: Path, unblocked: None
) -> None:
    client = platform.client("alpha", timeout=30)
    chat_line = {
        "custom_id": "chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    }
    mixed = upload(client, tmp_path, [_line("a", "hello"), chat_line])
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=mixed, endpoint=EMBEDDINGS, completion_window="24h"
        )
    assert refused.value.code == "url_mismatch"
    chat_model = upload(client, tmp_path, [_line("a", "hello", model="chat-7b")])
    with pytest.raises(openai.BadRequestError) as wrong_kind:
        client.batches.create(
            input_file_id=chat_model, endpoint=EMBEDDINGS, completion_window="24h"
        )
    assert (wrong_kind.value.code, wrong_kind.value.param) == (
        "model_not_supported",
        "model",
    )
    assert "/v1/chat/completions" in wrong_kind.value.message
