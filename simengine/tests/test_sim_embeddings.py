"""The simulated replica's ``/v1/embeddings`` (``--runner pooling``) against the
capture of real vLLM 0.32.0 serving all-MiniLM-L6-v2, and through the openai SDK."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from localrun.processes import Process, sim_replica
from simengine import embeddings
from simengine.conformance import diff_json_shapes, json_shape
from simengine.embedding_capture import (
    EMBEDDING_CASES,
    EMBEDDINGS_DIR,
    MINILM,
    capture_embeddings,
    read_embeddings,
)

pytestmark = pytest.mark.e2e

POOLING_FLAGS = ("--runner", "pooling", "--max-model-len", "256")


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    tmp = tmp_path_factory.mktemp("sim-embeddings")
    with sim_replica(tmp, *POOLING_FLAGS, model=MINILM) as process:
        yield process


@pytest.fixture(scope="module")
def client(replica: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def simulated(
    replica: Process, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[int, Any]]:
    outdir = tmp_path_factory.mktemp("sim-embeddings-capture")
    capture_embeddings(replica.url, MINILM, outdir)
    return read_embeddings(outdir)


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[int, Any]]:
    return read_embeddings()


@pytest.mark.parametrize("case", sorted(EMBEDDING_CASES))
def test_sim_embeddings_answer_in_vllms_shape(
    case: str,
    reference: dict[str, tuple[int, Any]],
    simulated: dict[str, tuple[int, Any]],
) -> None:
    status, body = reference[case]
    sim_status, sim_body = simulated[case]
    assert sim_status == status
    assert diff_json_shapes(json_shape(body), json_shape(sim_body)) == []
    if status != 200:
        assert sim_body == body  # vLLM's error, word for word
    else:
        assert len(sim_body["data"]) == len(body["data"])
        assert sim_body["id"].startswith("embd-")
        if isinstance(body["data"][0]["embedding"], list):
            assert len(sim_body["data"][0]["embedding"]) == 384


def test_sim_models_list_has_the_pooling_servers_shape(replica: Process) -> None:
    real = json.loads((EMBEDDINGS_DIR / "models.json").read_text())
    models = httpx.get(f"{replica.url}/v1/models").json()
    assert diff_json_shapes(json_shape(real), json_shape(models)) == []
    assert models["data"][0]["max_model_len"] == real["data"][0]["max_model_len"]


def test_sdk_embeds_a_string_as_a_unit_vector(client: openai.OpenAI) -> None:
    answer = client.embeddings.create(model=MINILM, input="The quick brown fox.")
    assert answer.object == "list"
    assert answer.model == MINILM
    assert len(answer.data) == 1
    vector = answer.data[0].embedding
    assert len(vector) == 384
    assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0, rel_tol=1e-5)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0
    again = client.embeddings.create(model=MINILM, input="The quick brown fox.")
    assert again.data[0].embedding == vector


def test_sdk_embeds_a_list_in_order(client: openai.OpenAI) -> None:
    texts = ["one", "two words", "and three words here"]
    answer = client.embeddings.create(model=MINILM, input=texts)
    assert [item.index for item in answer.data] == [0, 1, 2]
    singles = [
        client.embeddings.create(model=MINILM, input=text).data[0].embedding
        for text in texts
    ]
    assert [item.embedding for item in answer.data] == singles
    assert singles[0] != singles[1]


def test_sdk_base64_decodes_to_the_same_floats(replica: Process) -> None:
    url = f"{replica.url}/v1/embeddings"
    floats = httpx.post(url, json={"model": MINILM, "input": "same text"}).json()
    packed = httpx.post(
        url, json={"model": MINILM, "input": "same text", "encoding_format": "base64"}
    ).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert (
        list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats["data"][0]["embedding"]
    )


def test_sdk_sees_the_over_length_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MINILM, input="word " * 400)
    assert "maximum context length is 256 tokens" in str(caught.value)


def test_pooling_replica_refuses_chat_and_a_generating_one_embeddings(
    replica: Process, tmp_path: Path
) -> None:
    chat = httpx.post(
        f"{replica.url}/v1/chat/completions",
        json={"model": MINILM, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert (chat.status_code, chat.json()) == (404, {"detail": "Not Found"})
    with sim_replica(tmp_path, model="chat-7b") as generating:
        answer = httpx.post(
            f"{generating.url}/v1/embeddings", json={"model": "chat-7b", "input": "x"}
        )
    assert (answer.status_code, answer.json()) == (404, {"detail": "Not Found"})


def test_embedding_vector_is_seeded_unit_norm_float32() -> None:
    vector = embeddings.embedding_vector([1, 2, 3], 64)
    assert vector == embeddings.embedding_vector([1, 2, 3], 64)
    assert vector != embeddings.embedding_vector([1, 2, 4], 64)
    assert math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-5)
    packed = struct.pack("<64f", *vector)
    assert list(struct.unpack("<64f", packed)) == vector


def test_batcher_runs_waiting_requests_as_one_batch() -> None:
    async def scenario() -> float:
        batcher = embeddings.EmbeddingBatcher(max_batch=8)
        started = time.monotonic()
        await asyncio.gather(*(batcher.run(100) for _ in range(4)))
        return time.monotonic() - started

    elapsed = asyncio.run(scenario())
    one_batch = embeddings.batch_seconds(400)
    assert one_batch <= elapsed < one_batch + 0.1


def _sample(metrics: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == name and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                return float(sample.value)
    raise AssertionError(f"no {name} {labels}")


def test_sim_counts_embedded_prompts_as_vllms_pooling_server(
    tmp_path: Path,
) -> None:
    with sim_replica(tmp_path, *POOLING_FLAGS, model=MINILM) as replica:
        url = replica.url
        answer = httpx.post(
            f"{url}/v1/embeddings",
            json={"model": MINILM, "input": ["one two", "three four five"]},
        ).json()
        metrics = httpx.get(f"{url}/metrics").text
    tokens = float(answer["usage"]["prompt_tokens"])
    assert _sample(metrics, "vllm:prompt_tokens_total") == tokens
    assert _sample(metrics, "vllm:request_prompt_tokens_sum") == tokens
    assert _sample(metrics, "vllm:request_success_total", finished_reason="stop") == 2
    assert _sample(metrics, "vllm:e2e_request_latency_seconds_count") == 2
    assert _sample(metrics, "vllm:generation_tokens_total") == 0


def test_vectors_of_texts_that_share_words_lie_closer() -> None:
    def vector(text: str, *, is_random: bool = False) -> list[float]:
        ids = embeddings.parse_inputs(text, 256)[0]
        return embeddings.embedding_vector(ids, 384, is_random=is_random)

    def cosine(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    query = "How do I reset my account password?"
    related = "To reset your account password, open settings."
    unrelated = "Penguins huddle together through the polar winter."
    assert cosine(vector(query), vector(related)) > 0.3
    assert cosine(vector(query), vector(related)) > cosine(
        vector(query), vector(unrelated)
    )
    noise = [vector(t, is_random=True) for t in (query, related)]
    assert abs(cosine(*noise)) < 0.3
    assert math.isclose(math.sqrt(cosine(noise[0], noise[0])), 1.0, rel_tol=1e-5)
    assert math.isclose(math.sqrt(cosine(vector(""), vector(""))), 1.0, rel_tol=1e-5)
