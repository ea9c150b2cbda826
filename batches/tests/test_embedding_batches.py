"""Embedding batches: checked at creation, run through the gateway's embeddings.

Creation is held to OpenAI's rules (one endpoint per batch, a model of the
endpoint's kind, at most 50,000 inputs in all); a malformed body is the line's own
400, from the gateway. The runner is run against the gateway's app in this
process (``routing.tests.embedded_gateway``) in front of a real simulated replica
run as vLLM's pooling runner, so every line takes the way of a live
``/v1/embeddings`` request: admission at the batch tier, the team's limits, and
the usage counter, which must say batch work, input tokens only.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from accounts import services as accounts_services
from batches import runner, services
from batches.domain.lines import MAX_EMBEDDING_INPUTS, InputRejected, parse_input
from batches.models import Batch, BatchLine
from batches.tests.conftest import jsonl, line
from config.errors import InvalidRequest
from localrun.processes import Process, sim_replica
from metering.domain.usage import UsageCounts
from models_registry import services as registry_services
from routing.tests.embedded_gateway import BATCH_KEY, EMBEDDING_MODEL, EmbeddedGateway

if TYPE_CHECKING:
    from pytest_django import Settings

    from accounts.models import Team
    from models_registry.models import Model

EMBEDDINGS = "/v1/embeddings"


def embed_line(
    custom_id: str, text: Any = "a few words", **body: Any
) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": EMBEDDINGS,
        "body": {"model": EMBEDDING_MODEL, "input": text, **body},
    }


@pytest.fixture
def embed_model(db: None, team: Team) -> Model:
    """embed-1, an embedding model, with the 'search' team's limits on it."""
    model = registry_services.create_model(
        model_id=EMBEDDING_MODEL,
        kind="embedding",
        dimensions=4,
        max_input_tokens=32,
    )
    accounts_services.set_team_limit(
        team_id=team.team,
        model_id=EMBEDDING_MODEL,
        tokens_per_minute=600_000,
        max_concurrency=64,
        guaranteed_share=0.0,
    )
    return model


def create(team: Team, rows: list[Any], endpoint: str = EMBEDDINGS) -> Batch:
    uploaded = services.create_file(
        team_id=team.team, filename="in.jsonl", purpose="batch", chunks=[jsonl(*rows)]
    )
    return services.create_batch(
        team_id=team.team,
        input_file_id=uploaded.id,
        endpoint=endpoint,
        completion_window="1h",
    )


def refusal(team: Team, rows: list[Any], endpoint: str = EMBEDDINGS) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        create(team, rows, endpoint)
    assert not Batch.objects.exists()
    return refused.value


# -- creation ------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_embeddings_batch_is_created_on_its_endpoint(
    store: Path, team: Team, embed_model: Model
) -> None:
    batch = create(
        team,
        [
            embed_line("a"),
            embed_line("b", ["one", "two"]),
            embed_line("c", stream=True),
            {"custom_id": "d", "method": "POST", "body": {"input": "x"}},
        ],
    )
    assert (batch.endpoint, batch.model_id, batch.status) == (
        EMBEDDINGS,
        EMBEDDING_MODEL,
        "in_progress",
    )
    assert services.batch_object(batch)["endpoint"] == EMBEDDINGS
    rows = {r.custom_id: r for r in BatchLine.objects.filter(batch=batch)}
    assert {k: r.status for k, r in rows.items()} == {
        "a": "pending",
        "b": "pending",
        "c": "failed",
        "d": "failed",
    }
    assert (rows["c"].error or {})["code"] == "stream_unsupported"
    assert (rows["d"].error or {})["code"] == "invalid_url"
    assert (batch.total, batch.failed) == (4, 2)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("endpoint", "rows"),
    [
        # Mixed endpoints in one file.
        (EMBEDDINGS, [embed_line("a"), line("b")]),
        # Every line for chat, the batch for embeddings.
        (EMBEDDINGS, [{**embed_line("a"), "url": "/v1/chat/completions"}]),
        # And the other way round.
        ("/v1/chat/completions", [line("a"), {**line("b"), "url": EMBEDDINGS}]),
    ],
)
def test_a_line_for_another_endpoint_refuses_the_file(
    store: Path,
    team: Team,
    embed_model: Model,
    chat_model: Model,
    endpoint: str,
    rows: list[Any],
) -> None:
    error = refusal(team, rows, endpoint)
    assert (error.code, error.status_code) == ("url_mismatch", 400)
    assert "line" in error.message


@pytest.mark.django_db
def test_a_model_of_the_other_kind_is_refused_naming_model(
    store: Path, team: Team, embed_model: Model, chat_model: Model
) -> None:
    chat_for_vectors = refusal(team, [embed_line("a", model="chat-7b")])
    assert (chat_for_vectors.param, chat_for_vectors.code) == (
        "model",
        "model_not_supported",
    )
    assert "/v1/chat/completions" in chat_for_vectors.message
    vectors_for_chat = refusal(
        team,
        [{**line("a", model=EMBEDDING_MODEL)}],
        "/v1/chat/completions",
    )
    assert (vectors_for_chat.param, vectors_for_chat.code) == (
        "model",
        "model_not_supported",
    )
    assert EMBEDDINGS in vectors_for_chat.message


@pytest.mark.django_db
def test_an_endpoint_a_batch_cannot_run_is_a_400(
    store: Path, team: Team, embed_model: Model
) -> None:
    error = refusal(team, [embed_line("a")], "/v1/moderations")
    assert (error.param, error.status_code) == ("endpoint", 400)


def test_an_embeddings_batch_holds_at_most_50000_inputs() -> None:
    per_line = 2048
    full, rest = divmod(MAX_EMBEDDING_INPUTS, per_line)
    rows = [embed_line(f"l{i}", ["w"] * per_line) for i in range(full)]
    rows.append(embed_line("last", ["w"] * rest))
    at_cap = parse_input(
        (json.dumps(r).encode() for r in rows), model=None, endpoint=EMBEDDINGS
    )
    assert at_cap.runnable == full + 1
    # One token-id list is one input; one more text is one too many.
    rows.append(embed_line("over", "w"))
    with pytest.raises(InputRejected) as refused:
        parse_input(
            (json.dumps(r).encode() for r in rows), model=None, endpoint=EMBEDDINGS
        )
    assert (refused.value.code, refused.value.line) == ("too_many_inputs", full + 2)


# -- running -------------------------------------------------------------------------


class GatewayBridge(httpx.BaseTransport):
    """The runner's HTTP, handed to the gateway app one request at a time.

    The gateway knows the batch's key as ``BATCH_KEY`` (its snapshot is built by
    hand); every path and header else is passed as the runner sent it.
    """

    def __init__(self, gateway: EmbeddedGateway, secret: str) -> None:
        self.gateway = gateway
        self.secret = secret
        self.sent: Counter[str] = Counter()
        self.paths: set[str] = set()
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == f"Bearer {self.secret}"
        body = request.read()
        with self._lock:  # the gateway's event loop runs one call at a time
            self.sent[hashlib.sha256(body).hexdigest()] += 1
            self.paths.add(request.url.path)
            answer = self.gateway.request(
                request.url.path,
                body,
                key=BATCH_KEY,
                headers={
                    "x-priority": request.headers["x-priority"],
                    "content-type": "application/json",
                },
            )
        return httpx.Response(
            answer.status, headers=answer.headers, content=answer.body
        )


@pytest.fixture(scope="module")
def pooling_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    with sim_replica(
        tmp_path_factory.mktemp("pooling"),
        "--runner",
        "pooling",
        "--sim-embedding-dim",
        "4",
        model=EMBEDDING_MODEL,
    ) as process:
        yield process


@pytest.fixture
def fast(settings: Settings) -> None:
    settings.PLATFORM_BATCH_GATEWAY_URL = "http://gateway.test"
    settings.PLATFORM_BATCH_MAX_WINDOW = 4
    settings.PLATFORM_BATCH_MIN_OBSERVED_S = 0.2


def contents(batch: Batch, which: str) -> list[dict[str, Any]]:
    found = getattr(batch, which)
    assert found is not None, which
    raw = b"".join(services.file_content(team_id=batch.team_id, file_id=found.id))
    return [json.loads(x) for x in raw.splitlines()]


@pytest.mark.django_db
def test_lines_run_as_live_embeddings_metered_as_batch_input_only(
    store: Path,
    fast: None,
    team: Team,
    embed_model: Model,
    pooling_replica: Process,
) -> None:
    texts = {f"e-{i}": [f"text {i} {w}" for w in range(i % 3 + 1)] for i in range(9)}
    rows: list[Any] = [embed_line(k, v) for k, v in texts.items()]
    rows.insert(3, embed_line("empty", []))
    rows.insert(5, embed_line("too-long", "word " * 200))
    batch = create(team, rows)
    with EmbeddedGateway(pooling_replica.url, embedding=True) as gateway:
        bridge = GatewayBridge(gateway, services.batch_key_secret(batch.id))
        outcome = runner.run_batch(batch.id, transport=bridge)
        usage = sum(gateway.metered().values(), UsageCounts())
        buckets = len(gateway.buckets)

    assert outcome is runner.Outcome.ENDED
    assert bridge.paths == {EMBEDDINGS}
    # Every line sent once: none refused, none retried.
    assert sorted(bridge.sent.values()) == [1] * 11
    batch.refresh_from_db()
    assert (batch.status, batch.completed, batch.failed) == ("completed", 9, 2)

    output = contents(batch, "output_file")
    assert [o["custom_id"] for o in output] == list(texts)
    told = 0
    for record in output:
        assert record["error"] is None
        response = record["response"]
        assert response["status_code"] == 200
        assert response["request_id"] == record["id"]
        body = response["body"]
        assert body["object"] == "list"
        assert body["model"] == EMBEDDING_MODEL
        wanted = texts[record["custom_id"]]
        assert [d["index"] for d in body["data"]] == list(range(len(wanted)))
        assert all(len(d["embedding"]) == 4 for d in body["data"])
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0
        told += body["usage"]["prompt_tokens"]

    # The malformed bodies are their own 400s, in OpenAI's batch error shape.
    errors = {e["custom_id"]: e for e in contents(batch, "error_file")}
    assert set(errors) == {"empty", "too-long"}
    for record in errors.values():
        assert record["error"] is None
        assert record["response"]["status_code"] == 400
        refused = record["response"]["body"]["error"]
        assert (refused["type"], refused["param"]) == ("invalid_request_error", "input")
    assert errors["too-long"]["response"]["body"]["error"]["code"] == (
        "context_length_exceeded"
    )

    # Metered once per answered line, as batch work, input tokens only; the
    # refused lines were never charged.
    assert (usage.requests, usage.batch_requests) == (9, 9)
    assert usage.prompt_tokens == usage.batch_prompt_tokens == told
    assert (usage.output_tokens, usage.batch_output_tokens) == (0, 0)
    assert buckets == 1  # the team's bucket on embed-1, and only it
    tokens = BatchLine.objects.filter(batch=batch, status="done").values_list(
        "tokens", flat=True
    )
    assert sum(tokens) == told


@pytest.mark.django_db
def test_a_dead_runners_lines_run_again_and_finished_ones_never(
    store: Path,
    fast: None,
    team: Team,
    embed_model: Model,
    pooling_replica: Process,
) -> None:
    batch = create(team, [embed_line(f"e-{i}", f"line {i}") for i in range(6)])
    # A runner died: it had finished two lines and claimed two more.
    lines = list(BatchLine.objects.filter(batch=batch).order_by("index"))
    for row in lines[:2]:
        BatchLine.objects.filter(pk=row.pk).update(
            status="done", attempts=1, status_code=200, response={"kept": True}
        )
    Batch.objects.filter(pk=batch.pk).update(completed=2)
    BatchLine.objects.filter(pk__in=[r.pk for r in lines[2:4]]).update(
        status="running", runner="runner-dead", attempts=1
    )
    with EmbeddedGateway(pooling_replica.url, embedding=True) as gateway:
        bridge = GatewayBridge(gateway, services.batch_key_secret(batch.id))
        outcome = runner.run_batch(batch.id, transport=bridge)
        usage = sum(gateway.metered().values(), UsageCounts())

    assert outcome is runner.Outcome.ENDED
    assert sum(bridge.sent.values()) == 4 == usage.batch_requests
    batch.refresh_from_db()
    assert (batch.status, batch.completed, batch.failed) == ("completed", 6, 0)
    output = contents(batch, "output_file")
    assert [o["custom_id"] for o in output] == [f"e-{i}" for i in range(6)]
    assert [o["response"]["body"] for o in output[:2]] == [{"kept": True}] * 2
    attempts = dict(
        BatchLine.objects.filter(batch=batch).values_list("custom_id", "attempts")
    )
    assert attempts == {"e-0": 1, "e-1": 1, "e-2": 2, "e-3": 2, "e-4": 1, "e-5": 1}
