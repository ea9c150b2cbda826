"""Real vLLM's pooling runner on real weights: all-MiniLM-L6-v2 on CPU, through the
platform.

One platform serves the module: the embedding model ``minilm`` registered from
``make minilm``'s weights (no chat template: an embedding model needs none), a
node agent (``engine_agent --kind vllm``) that starts one real vLLM 0.32.0 (CPU
build) replica of it with ``MINILM_ENGINE_CONFIG``, and a gateway. The ``openai``
SDK embeds 50 texts through the gateway, and each vector is held to
sentence-transformers' own embedding of the same text (computed in the vLLM venv,
which has sentence-transformers, by a subprocess): cosine at least 0.999. The
gateway's token count (it charges before the engine answers) is held to the
model's own tokenizer, the usage it reports and meters to the engine's. The
replica is also re-captured on ``/v1/embeddings`` and the shapes diffed against
the committed capture the simulated replica is held to
(``simengine/tests/data/vllm_embeddings``), so a vLLM upgrade that changes the
surface fails here.

The Batch API on the same replica: the batch test adds (``batch_runner``) a Celery
worker with beat and one on the ``batches`` queue, as
``tests/test_embedding_batches_e2e.py`` runs them beside a simulated replica;
the SDK uploads 200 ``/v1/embeddings`` lines, creates the batch and polls it to
its end, and the output, the lines' attempts and the usage rows are checked.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from batches.models import BatchLine
from engine_nodes.models import Replica
from engine_nodes.weights import local_identity
from localrun.processes import start_gateway, wait_until
from localrun.seeding import (
    LimitSeed,
    ModelSeed,
    PlatformSeed,
    TeamSeed,
    VersionSeed,
    seed_platform,
)
from localrun.vllm_cpu import start_vllm_agent, tiny_engine_config
from metering.models import Usage
from simengine.conformance import diff_json_shapes, json_shape
from simengine.embedding_capture import (
    MINILM,
    MINILM_ENGINE_CONFIG,
    capture_embeddings,
    read_embeddings,
)
from tests.batch_client import content, start_celery, upload, wait_batch
from tests.live import LivePlatform, extra_of, platform_env
from tests.test_vllm_e2e import flush_usage

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]

REGION = "e2e-minilm"
ENGINE_KEY = "sk-engine-minilm"
DIMENSIONS = 384
MAX_INPUT_TOKENS = 256
SERVING_TIMEOUT_S = 300
BATCH_TIMEOUT_S = 300

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".vllm" / "bin" / "python"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SUBJECTS = ["The cat", "A rocket", "My neighbour", "The old bridge", "A quiet river"]
ACTIONS = [
    "sleeps through the afternoon",
    "was launched at dawn",
    "plays the violin badly",
    "needs a new coat of paint",
    "floods every spring",
    "appears in the evening news",
    "costs more than expected",
    "is older than the town itself",
    "confuses every visitor",
    "smells faintly of pine",
]
TEXTS = [f"{s} {a}." for s in SUBJECTS for a in ACTIONS]

_REFERENCE = """
import json, sys
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], device="cpu")
texts = json.load(sys.stdin)
vectors = model.encode(texts, convert_to_numpy=True).tolist()
counts = [len(ids) for ids in model.tokenizer(texts)["input_ids"]]
json.dump([vectors, counts], sys.stdout)
"""


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    minilm_model: Path,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("vllm-minilm")
    with django_db_blocker.unblock(), start_minilm_platform(tmp, minilm_model) as live:
        yield live


@pytest.fixture(scope="module")
def batch_runner(
    platform: LivePlatform, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LivePlatform]:
    """The module's platform with what the Batch API's runner needs: a Celery
    worker with beat (it dispatches batches every half second and flushes usage)
    and one on the ``batches`` queue (the runner, which posts each line to the
    gateway). Started by the batch test alone, so the others do without them."""
    tmp = tmp_path_factory.mktemp("vllm-minilm-batches")
    env = {**platform.env, "PLATFORM_BATCH_GATEWAY_URL": platform.url}
    workers = [
        start_celery(env, tmp, "beat", ["-B", "-Q", "celery"], concurrency=1),
        start_celery(env, tmp, "batches", ["-Q", "batches"], concurrency=1),
    ]
    try:
        yield platform
    finally:
        for worker in workers:
            worker.stop(grace_s=10)


@contextmanager
def start_minilm_platform(tmp: Path, model_dir: Path) -> Iterator[LivePlatform]:
    """Register MiniLM as an embedding model, start the agent (one vLLM replica)
    and a gateway."""
    name = str(connection.settings_dict["NAME"])
    test_name = connection.settings_dict.get("TEST", {}).get("NAME")
    if not (name.startswith("test_") or name == test_name):
        raise RuntimeError(f"refusing to run end-to-end tests against {name}")
    identity = local_identity(model_dir, kind="embedding")
    assert identity["chat_template"] == ""
    del identity["chat_template"]
    body = {
        **identity,
        "precision": "fp16",
        "gpus_per_replica": 1,
        "engine_config": {**tiny_engine_config(), **MINILM_ENGINE_CONFIG},
    }
    seeded = seed_platform(
        seed=PlatformSeed(
            region=REGION,
            teams=(TeamSeed("alpha"),),
            models=(
                ModelSeed(
                    model_id=MINILM,
                    versions=(VersionSeed("v1", body, min_replicas=1, max_replicas=1),),
                    kind="embedding",
                    dimensions=DIMENSIONS,
                    max_input_tokens=MAX_INPUT_TOKENS,
                ),
            ),
            limits=(
                LimitSeed(
                    team_id="alpha",
                    model_id=MINILM,
                    tokens_per_minute=10**9,
                    max_concurrency=100,
                ),
            ),
        ),
        now=timezone.now(),
    )
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    # The Files and Batch APIs' store: a storage root of the module's own.
    store = tmp / "store"
    store.mkdir()
    env = platform_env(
        region=REGION,
        prefix=prefix,
        PLATFORM_ENGINE_API_KEY=ENGINE_KEY,
        PLATFORM_STORAGE_ROOTS=",".join(
            [*settings.PLATFORM_STORAGE_ROOTS, f"file://{store}/"]
        ),
        PLATFORM_BATCH_STORAGE_URI=f"file://{store}/batches/",
        PLATFORM_BATCH_DISPATCH_S="0.5",
        **OFFLINE,
    )
    agent = start_vllm_agent(
        env,
        tmp,
        node="e2e-minilm-node",
        region=REGION,
        gpus=1,
        start_timeout_s=SERVING_TIMEOUT_S,
    )
    gateway = None
    try:
        wait_until(
            lambda: (
                Replica.objects.filter(region=REGION, state="serving").exists()
                or agent.popen.poll() is not None
            ),
            timeout_s=SERVING_TIMEOUT_S,
            interval_s=0.5,
            message="a serving vLLM MiniLM replica",
        )
        if agent.popen.poll() is not None:
            raise AssertionError(f"agent exited:\n{agent.log()}")
        gateway = start_gateway(env, tmp)
        live = LivePlatform(
            url=gateway.url,
            region=REGION,
            keys=dict(seeded.keys),
            env=env,
            gateway=gateway,
            agent=agent,
            prefix=prefix,
        )
        wait_until(
            lambda: _embeds(live),
            timeout_s=30,
            message="the gateway to route to the MiniLM replica",
        )

        def probe_metered() -> bool:
            # The gateway hands usage to Redis in the background: the probe's
            # row ("ping", 3 tokens) is in before any test takes a baseline.
            flush_usage(live)
            return _metered(live)[1] >= 3

        wait_until(probe_metered, timeout_s=30, message="the probe's usage row")
        yield live
    finally:
        if gateway is not None:
            gateway.stop()
        agent.stop(grace_s=30)
        call_command("flush", interactive=False, verbosity=0)


def _embeds(platform: LivePlatform) -> bool:
    try:
        response = httpx.post(
            f"{platform.url}/v1/embeddings",
            headers={"Authorization": f"Bearer {platform.keys['alpha']}"},
            json={"model": MINILM, "input": "ping"},
            timeout=30,
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def replica_url(platform: LivePlatform) -> str:
    (replica,) = platform.serving()
    return str(replica.url)


def reference(
    model_dir: Path, texts: Sequence[str]
) -> tuple[list[list[float]], list[int]]:
    """Return sentence-transformers' embeddings of ``texts`` and each text's
    token count by the model's own tokenizer, special tokens included (vLLM's
    venv)."""
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", _REFERENCE, str(model_dir)],
        input=json.dumps(list(texts)),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **OFFLINE},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    vectors, counts = json.loads(done.stdout)
    return vectors, counts


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_the_gateway_embeds_as_sentence_transformers_does(
    platform: LivePlatform, minilm_model: Path, unblocked: None
) -> None:
    """GIVEN real MiniLM served by vLLM behind the gateway
    WHEN a team embeds 50 texts with the openai SDK
    THEN every vector is sentence-transformers' own, the usage is the model's
    token count, and the usage row (no output tokens) says the same.
    """
    flush_usage(platform)
    before = _metered(platform)  # the start's probe is in (the fixture waited)
    answer = platform.client().embeddings.create(model=MINILM, input=TEXTS)
    assert [item.index for item in answer.data] == list(range(len(TEXTS)))
    assert {len(item.embedding) for item in answer.data} == {DIMENSIONS}
    assert extra_of(answer)["region"] == REGION
    expected, counts = reference(minilm_model, TEXTS)
    similarities = [
        cosine(item.embedding, vector)
        for item, vector in zip(answer.data, expected, strict=True)
    ]
    assert min(similarities) >= 0.999, similarities
    assert answer.usage.prompt_tokens == sum(counts)
    assert answer.usage.total_tokens == sum(counts)

    def metered() -> bool:
        flush_usage(platform)
        return _metered(platform)[0] > before[0]

    wait_until(metered, timeout_s=20, message="the embeddings' usage row")
    requests, prompt, output = _metered(platform)
    assert (requests - before[0], prompt - before[1], output - before[2]) == (
        1,
        sum(counts),
        0,
    )


def test_the_gateway_counts_input_tokens_with_the_models_tokenizer(
    platform: LivePlatform, minilm_model: Path
) -> None:
    """The gateway refuses an over-long input before the engine sees it, and the
    count it gives is the model's own (WordPiece, [CLS] and [SEP] included)."""
    text = "Tokenizers split unusual words like photosynthesising. " * 40
    refused = httpx.post(
        f"{platform.url}/v1/embeddings",
        headers={"Authorization": f"Bearer {platform.keys['alpha']}"},
        json={"model": MINILM, "input": ["short", text]},
        timeout=30,
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    match = re.search(r"input 1 takes (\d+)", error["message"])
    assert match is not None, error["message"]
    _, counts = reference(minilm_model, [text])
    assert int(match.group(1)) == counts[0] > MAX_INPUT_TOKENS


def test_vllm_embeddings_keep_the_captured_shapes(
    platform: LivePlatform, tmp_path: Path, unblocked: None
) -> None:
    capture_embeddings(replica_url(platform), MINILM, tmp_path, api_key=ENGINE_KEY)
    live = read_embeddings(tmp_path)
    committed = read_embeddings()
    assert sorted(live) == sorted(committed)
    for case, (status, body) in committed.items():
        live_status, live_body = live[case]
        assert live_status == status, case
        assert diff_json_shapes(json_shape(body), json_shape(live_body)) == [], case
        if status != 200:
            assert live_body == body, case


BATCH_SIZE = 200
BATCH_USAGE = (
    "batch_requests",
    "batch_prompt_tokens",
    "batch_output_tokens",
    "requests",
    "prompt_tokens",
    "output_tokens",
)


def batch_inputs(count: int) -> dict[str, str | list[str]]:
    """``count`` varied short inputs by custom_id: every fifth a list of two to
    four texts, the others one text each."""
    inputs: dict[str, str | list[str]] = {}
    for i in range(count):
        text = f"{TEXTS[(i * 7) % len(TEXTS)]} Note {i}."
        if i % 5 == 0:
            inputs[f"line-{i}"] = [
                f"{TEXTS[(i + j * 11) % len(TEXTS)]} Part {j} of {i}."
                for j in range(2 + i % 3)
            ]
        else:
            inputs[f"line-{i}"] = text
    return inputs


def test_a_batch_of_embeddings_completes_on_real_vllm(
    batch_runner: LivePlatform, tmp_path: Path, unblocked: None
) -> None:
    """GIVEN real MiniLM served by vLLM, the batch runner and beat
    WHEN a team uploads 200 ``/v1/embeddings`` lines and creates a batch
    THEN it completes, its output holds each line once with a 384-float vector
    per input, no line was sent twice, and the usage rows hold the 200 lines as
    batch work: the input tokens the answers report, no output tokens.
    """
    platform = batch_runner
    client = platform.client(timeout=30)
    inputs = batch_inputs(BATCH_SIZE)
    rows = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": MINILM, "input": given},
        }
        for custom_id, given in inputs.items()
    ]
    flush_usage(platform)  # what earlier tests left in Redis, before we count
    before = _metered(platform, BATCH_USAGE)
    batch = client.batches.create(
        input_file_id=upload(client, tmp_path, rows),
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    assert batch.request_counts is not None
    assert batch.request_counts.total == BATCH_SIZE

    ended = wait_batch(
        client,
        batch.id,
        lambda b: b.status in {"completed", "failed", "expired", "cancelled"},
        timeout_s=BATCH_TIMEOUT_S,
    )
    assert ended.status == "completed", ended
    assert (ended.request_counts.completed, ended.request_counts.failed) == (
        BATCH_SIZE,
        0,
    )
    assert ended.error_file_id is None

    output = content(client, ended.output_file_id)
    assert len(output) == BATCH_SIZE
    assert sorted(record["custom_id"] for record in output) == sorted(inputs)
    told = 0
    for record in output:
        assert record["error"] is None, record
        response = record["response"]
        assert response["status_code"] == 200, record
        body = response["body"]
        given = inputs[record["custom_id"]]
        wanted = given if isinstance(given, list) else [given]
        assert body["model"] == MINILM
        assert [d["index"] for d in body["data"]] == list(range(len(wanted)))
        assert {len(d["embedding"]) for d in body["data"]} == {DIMENSIONS}
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] > 0
        told += usage["prompt_tokens"]

    # No line was sent twice: each was claimed and posted once.
    attempts = BatchLine.objects.filter(batch_id=batch.id).values_list(
        "attempts", flat=True
    )
    assert sorted(attempts) == [1] * BATCH_SIZE
    # Metered once per line, as batch work, input tokens only.
    wanted_usage = (BATCH_SIZE, told, 0, BATCH_SIZE, told, 0)
    seen: list[tuple[int, ...]] = []

    def metered() -> bool:
        flush_usage(platform)
        after = _metered(platform, BATCH_USAGE)
        seen[:] = [tuple(a - b for a, b in zip(after, before, strict=True))]
        return seen[0] == wanted_usage

    try:
        wait_until(metered, timeout_s=30, interval_s=0.5, message="the batch metered")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {seen} != {wanted_usage}") from None


def _metered(
    platform: LivePlatform,
    fields: Sequence[str] = ("requests", "prompt_tokens", "output_tokens"),
) -> tuple[int, ...]:
    rows = Usage.objects.filter(model_id=MINILM)
    return tuple(sum(rows.values_list(name, flat=True)) for name in fields)
