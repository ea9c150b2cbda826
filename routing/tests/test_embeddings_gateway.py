"""``POST /v1/embeddings`` through the gateway, in process, with the openai SDK.

The replica is a tiny aiohttp app on the gateway's own event loop that answers
``/v1/embeddings`` as vLLM 0.32 does (one JSON body, float or base64 vectors,
``usage.prompt_tokens`` its own count: one token per word here, unlike the
gateway's stand-in count, so the test sees whose count is metered). The SDK
talks to the ``EmbeddedGateway``'s ASGI app, so the test reads what was metered
and charged.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
from aiohttp import web

from localrun.processes import free_port
from metering.domain.usage import UsageCounts
from routing.domain.admission_control import AdmissionRequest, Ticket
from routing.domain.tiers import Tier
from routing.embeddings import longest_input
from routing.plan import DEFAULT_MAX_MODEL_LEN
from routing.prompt_tokens import STAND_IN
from routing.tests.embedded_gateway import (
    BATCH_KEY,
    EMBEDDING_MODEL,
    MODEL,
    TEAM_KEY,
    EmbeddedGateway,
    _snapshot,
)

DIMENSIONS = 4


def vector(text: Any, index: int) -> list[float]:
    seed = len(str(text)) + index
    return [float(seed + d) / 8 for d in range(DIMENSIONS)]


class Replica:
    """A replica that embeds every input as vLLM answers, keeping the bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.status = 200
        # Answers with this status before the others (a replica failing once).
        self.first_status: int | None = None
        # Answers 500 to every body with an input holding this text.
        self.fails_on: str | None = None

    async def embed(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        status, self.first_status = self.first_status or self.status, None
        if self.fails_on is not None and self.fails_on in json.dumps(body["input"]):
            status = 500
        if status != 200:
            return web.json_response(
                {"error": {"message": "no", "code": status}}, status=status
            )
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        if inputs and isinstance(inputs[0], int):
            inputs = [inputs]
        data = []
        for index, item in enumerate(inputs):
            floats = vector(item, index)
            embedding: Any = floats
            if body.get("encoding_format") == "base64":
                packed = struct.pack(f"<{len(floats)}f", *floats)
                embedding = base64.b64encode(packed).decode()
            data.append({"index": index, "object": "embedding", "embedding": embedding})
        words = sum(
            len(item) if isinstance(item, list) else len(item.split())
            for item in inputs
        )
        return web.json_response(
            {
                "id": "embd-engine-1",
                "object": "list",
                "created": 1,
                "model": body["model"],
                "data": data,
                "usage": {
                    "prompt_tokens": words,
                    "total_tokens": words,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            }
        )


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[tuple[EmbeddedGateway, Replica]]:
    """A gateway and its replica; ``param`` is the number of replicas, or the
    ``EmbeddedGateway``'s keywords (``embedding_replicas``, limits)."""
    param = getattr(request, "param", 1)
    options = param if isinstance(param, dict) else {"embedding_replicas": param}
    replica = Replica()
    app = web.Application()
    app.router.add_post("/v1/embeddings", replica.embed)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    port = free_port()
    with EmbeddedGateway(
        f"http://127.0.0.1:{port}", embedding=True, **options
    ) as gateway:
        gateway.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", port)
        gateway.loop.run_until_complete(site.start())
        try:
            yield gateway, replica
        finally:
            gateway.loop.run_until_complete(runner.cleanup())


def embed(gateway: EmbeddedGateway, **kwargs: Any) -> Any:
    """Call ``client.embeddings.create`` on the gateway's app and loop."""

    async def call() -> Any:
        transport = httpx2.ASGITransport(app=gateway.app)
        async with httpx2.AsyncClient(
            transport=transport, base_url="http://127.0.0.1"
        ) as http:
            client = openai.AsyncOpenAI(
                api_key=TEAM_KEY,
                base_url="http://127.0.0.1/v1",
                http_client=http,
                max_retries=0,
            )
            return await client.embeddings.with_raw_response.create(**kwargs)

    return gateway.loop.run_until_complete(call())


def metered(gateway: EmbeddedGateway) -> UsageCounts:
    return sum(gateway.metered().values(), UsageCounts())


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
@pytest.mark.parametrize(
    "text", ["one two three", ["one two", "three four five", "six"]]
)
def test_the_sdk_gets_its_vectors_and_usage_is_the_engines(
    served: tuple[EmbeddedGateway, Replica],
    text: str | list[str],
    encoding_format: str,
) -> None:
    gateway, replica = served
    raw = embed(
        gateway,
        model=EMBEDDING_MODEL,
        input=text,
        encoding_format=encoding_format,
    )
    answer = raw.parse()
    inputs = text if isinstance(text, list) else [text]
    assert [item.index for item in answer.data] == list(range(len(inputs)))
    for item, given in zip(answer.data, inputs, strict=True):
        if encoding_format == "float":
            assert item.embedding == vector(given, item.index)
        else:  # the SDK hands base64 back as the engine sent it
            assert isinstance(item.embedding, str)
            floats = struct.unpack("<4f", base64.b64decode(item.embedding))
            assert list(floats) == pytest.approx(vector(given, item.index))
    words = sum(len(t.split()) for t in inputs)
    assert answer.model == EMBEDDING_MODEL
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (words, words)
    assert raw.headers["x-model-version"] == "v1"
    assert raw.headers["x-request-id"] == "embd-engine-1"
    sent = replica.bodies[-1]
    assert "stream" not in sent and sent["model"] == EMBEDDING_MODEL
    assert sent["encoding_format"] == encoding_format
    usage = metered(gateway)
    assert (usage.prompt_tokens, usage.output_tokens, usage.requests) == (
        words,
        0,
        1,
    )


def test_the_sdks_default_base64_comes_back_as_floats(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    answer = embed(gateway, model=EMBEDDING_MODEL, input="one two").parse()
    assert replica.bodies[-1]["encoding_format"] == "base64"
    assert answer.data[0].embedding == pytest.approx(vector("one two", 0))
    assert metered(gateway).prompt_tokens == 2


def test_the_answer_says_who_served_it(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, _ = served
    answer = gateway.request(
        "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": [[1, 2, 3]]}
    )
    assert answer.status == 200, answer.body
    body = answer.json()
    assert (body["object"], body["model_version"], body["region"]) == (
        "list",
        "v1",
        "embedded",
    )
    assert body["replica_id"] == f"{EMBEDDING_MODEL}-v1-embedded-0"
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


def test_models_says_each_models_kind_and_an_embedding_models_sizes(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, _ = served

    async def listed() -> list[Any]:
        transport = httpx2.ASGITransport(app=gateway.app)
        async with httpx2.AsyncClient(
            transport=transport, base_url="http://127.0.0.1"
        ) as http:
            client = openai.AsyncOpenAI(
                api_key=TEAM_KEY, base_url="http://127.0.0.1/v1", http_client=http
            )
            return [model async for model in client.models.list()]

    models = {model.id: model for model in gateway.loop.run_until_complete(listed())}
    assert sorted(models) == sorted([EMBEDDING_MODEL, MODEL])
    chat, embedder = models[MODEL], models[EMBEDDING_MODEL]
    assert (chat.object, chat.owned_by) == ("model", "platform")
    assert chat.model_extra == {"live_version": "v1", "kind": "chat"}
    assert embedder.model_extra == {
        "live_version": "v1",
        "kind": "embedding",
        "dimensions": DIMENSIONS,
        "max_input_tokens": 32,
    }


@pytest.mark.parametrize(
    ("max_input_tokens", "max_model_len", "longest"),
    [(32, 8192, 32), (0, 512, 512), (0, None, DEFAULT_MAX_MODEL_LEN)],
)
def test_the_longest_input_is_the_models_else_its_versions_context(
    max_input_tokens: int, max_model_len: int | None, longest: int
) -> None:
    snapshot = _snapshot(None, embedding=True)
    record = dataclasses.replace(
        snapshot.models[EMBEDDING_MODEL], max_input_tokens=max_input_tokens
    )
    version = (
        None
        if max_model_len is None
        else dataclasses.replace(
            snapshot.versions[(EMBEDDING_MODEL, "v1")], max_model_len=max_model_len
        )
    )
    assert longest_input(record, version) == longest


def test_an_input_over_the_longest_is_400_and_not_charged(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    with pytest.raises(openai.BadRequestError) as caught:
        embed(gateway, model=EMBEDDING_MODEL, input=["short", "word " * 200])
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    assert replica.bodies == []
    assert not gateway.is_charged()
    assert metered(gateway) == UsageCounts()


@pytest.mark.parametrize("tier", ["batch", "standard"])
def test_a_batch_jobs_key_embeds_metered_as_batch_work_input_only(
    served: tuple[EmbeddedGateway, Replica], tier: str
) -> None:
    """An embeddings batch's runner sends its lines with the job's key, at the
    batch tier or raised to standard near the deadline: batch work either way."""
    gateway, replica = served
    answer = gateway.request(
        "/v1/embeddings",
        {"model": EMBEDDING_MODEL, "input": ["one two", "three"]},
        key=BATCH_KEY,
        headers={"x-priority": tier},
    )
    assert answer.status == 200, answer.body
    assert [d["index"] for d in answer.json()["data"]] == [0, 1]
    assert len(replica.bodies) == 1
    usage = metered(gateway)
    assert (usage.requests, usage.batch_requests) == (1, 1)
    assert usage.prompt_tokens == usage.batch_prompt_tokens == 3
    assert (usage.output_tokens, usage.batch_output_tokens) == (0, 0)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
        ("/v1/responses", {"model": MODEL, "input": "hi"}),
    ],
)
def test_a_batch_jobs_key_opens_no_other_generation_api(
    served: tuple[EmbeddedGateway, Replica], path: str, body: dict[str, Any]
) -> None:
    gateway, _ = served
    answer = gateway.request(path, body, key=BATCH_KEY)
    assert answer.status == 403, answer.body
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == (
        "permission_error",
        "batch_key_not_allowed",
    )
    assert not gateway.is_charged()


def test_a_chat_model_asked_for_embeddings_is_400_naming_model(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    with pytest.raises(openai.BadRequestError) as caught:
        embed(gateway, model=MODEL, input="hello")
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "model"
    assert replica.bodies == []
    assert not gateway.is_charged()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
def test_an_embedding_model_asked_to_generate_is_400_naming_model(
    served: tuple[EmbeddedGateway, Replica], path: str, body: dict[str, Any]
) -> None:
    gateway, _ = served
    answer = gateway.request(path, {**body, "model": EMBEDDING_MODEL})
    assert answer.status == 400, answer.body
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_supported")
    assert error["message"] == (
        f"{EMBEDDING_MODEL} is an embedding model: use it with /v1/embeddings"
    )
    assert not gateway.is_charged()


def test_dimensions_over_the_models_are_400(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    answer = gateway.request(
        "/v1/embeddings",
        {"model": EMBEDDING_MODEL, "input": "hi", "dimensions": DIMENSIONS + 1},
    )
    assert answer.status == 400
    assert answer.json()["error"]["param"] == "dimensions"
    assert replica.bodies == []


def test_an_engines_4xx_passes_as_openais_error_and_is_not_metered(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    replica.status = 400
    answer = gateway.request(
        "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "hello"}
    )
    assert answer.status == 400
    assert answer.json()["error"]["message"] == "no"
    assert metered(gateway).prompt_tokens == 0


def test_an_engines_5xx_is_a_503_after_the_pools_replicas(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    replica.status = 500
    answer = gateway.request(
        "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "hello"}
    )
    assert answer.status == 503
    assert answer.json()["error"]["code"] == "no_replica_available"
    assert metered(gateway).prompt_tokens == 0


def test_admission_charges_the_input_only_and_is_given_back_the_rest(
    served: tuple[EmbeddedGateway, Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway, _ = served
    admission = gateway.app.chat.admission
    released: list[tuple[int, int]] = []
    release = admission.release

    async def recording(ticket: Ticket, *, used_tokens: int) -> None:
        released.append((ticket.charged, used_tokens))
        await release(ticket, used_tokens=used_tokens)

    monkeypatch.setattr(admission, "release", recording)
    text = "one two three four"
    answer = gateway.request(
        "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": text}
    )
    assert answer.status == 200, answer.body
    counted = STAND_IN.count_prompt(text)  # the gateway's count: all it charges
    # Used is the engine's count (one per word), so the refund is the difference
    # and never more: nothing was charged for output.
    assert released == [(counted, 4)]
    assert metered(gateway).prompt_tokens == 4


def test_embedding_pools_route_by_least_tokens_in_flight(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, _ = served
    snapshot = gateway.snapshots.current
    assert snapshot is not None
    chat = gateway.app.chat
    assert chat._policy(snapshot, EMBEDDING_MODEL, "v1").name == "least_tokens"
    assert chat._policy(snapshot, MODEL, "v1").name == "prefix_affinity"


@pytest.mark.parametrize("served", [2], indirect=True)
def test_a_5xx_before_the_body_fails_over_to_the_next_replica(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    replica.first_status = 503
    answer = gateway.request(
        "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "one two"}
    )
    assert answer.status == 200, answer.body
    assert len(replica.bodies) == 2
    ids = {f"{EMBEDDING_MODEL}-v1-embedded-{index}" for index in range(2)}
    assert answer.json()["replica_id"] in ids
    usage = metered(gateway)
    assert (usage.requests, usage.prompt_tokens, usage.output_tokens) == (1, 2, 0)


# A team's limits on embed-1 small enough to reach: a token a second.
TIGHT = {"tokens_per_minute": 60, "max_concurrency": 2}
LIMIT_KEY = f"alpha:{EMBEDDING_MODEL}"


def hold(gateway: EmbeddedGateway, tokens: int) -> Ticket:
    """Admit another request of the team on embed-1 (``tokens`` charged), as one
    in flight would be."""
    snapshot = gateway.snapshots.current
    assert snapshot is not None
    return gateway.loop.run_until_complete(
        gateway.app.chat.admission.admit(
            AdmissionRequest(
                team="alpha",
                model=EMBEDDING_MODEL,
                version="v1",
                tier=Tier.STANDARD,
                prompt_tokens=tokens,
                max_tokens=0,
                limit=snapshot.limits[("alpha", EMBEDDING_MODEL)],
            )
        )
    )


def bucket_tokens(gateway: EmbeddedGateway) -> float:
    bucket = gateway.loop.run_until_complete(
        gateway.buckets.peek(LIMIT_KEY, capacity=60, refill_per_s=1.0, now=time.time())
    )
    return bucket.tokens


def slots_held(gateway: EmbeddedGateway) -> int:
    return gateway.loop.run_until_complete(gateway.slots.count(LIMIT_KEY, time.time()))


@pytest.mark.parametrize("served", [TIGHT], indirect=True)
def test_inputs_over_what_the_bucket_holds_are_a_429_that_takes_nothing(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    """GIVEN another request of the team holds 55 of its 60 tokens a minute,
    WHEN an embeddings request's inputs count more than the 5 left,
    THEN it is OpenAI's 429 with Retry-After, no replica sees it, the bucket and
    slots are as they were, and usage counts one request rate limited, no tokens.
    """
    gateway, replica = served
    inputs = ["one two three four five six", "seven eight nine ten eleven"]
    counted = sum(STAND_IN.count_prompt(text) for text in inputs)
    assert 5 + 5 < counted <= 2 * 32  # over what is left, within the model
    held = hold(gateway, 55)
    before = bucket_tokens(gateway)
    with pytest.raises(openai.RateLimitError) as refused:
        embed(gateway, model=EMBEDDING_MODEL, input=inputs)
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    headers = refused.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-tokens"] == "60"
    assert replica.bodies == []
    # A token a second refills while the test runs: a few at most, never a charge.
    assert before - 0.01 <= bucket_tokens(gateway) <= before + 5
    assert slots_held(gateway) == 1  # the held request's only
    counts = metered(gateway)
    assert (counts.requests, counts.rate_limited, counts.prompt_tokens) == (0, 1, 0)
    gateway.loop.run_until_complete(
        gateway.app.chat.admission.release(held, used_tokens=55)
    )
    assert slots_held(gateway) == 0


@pytest.mark.parametrize("served", [TIGHT], indirect=True)
def test_an_embedding_over_the_concurrency_cap_is_a_429_that_takes_nothing(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    held = [hold(gateway, 1) for _ in range(TIGHT["max_concurrency"])]
    before = bucket_tokens(gateway)
    with pytest.raises(openai.RateLimitError) as refused:
        embed(gateway, model=EMBEDDING_MODEL, input="one two")
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["code"]) == (
        "rate_limit_error",
        "concurrency_limit_exceeded",
    )
    assert replica.bodies == []
    assert before - 0.01 <= bucket_tokens(gateway) <= before + 5
    assert slots_held(gateway) == len(held)
    assert metered(gateway).rate_limited == 1
    for ticket in held:
        gateway.loop.run_until_complete(
            gateway.app.chat.admission.release(ticket, used_tokens=1)
        )
    # Slots free again: the next embedding is served, and metered once.
    answer = embed(gateway, model=EMBEDDING_MODEL, input="one two")
    assert answer.status_code == 200
    assert slots_held(gateway) == 0
    counts = metered(gateway)
    assert (counts.requests, counts.prompt_tokens) == (1, 2)


# Enough inputs and tokens for the default rule to split them over 2 replicas.
SPLIT_INPUTS = [f"text {i} " + "word " * 20 for i in range(40)]


@pytest.mark.parametrize("served", [2], indirect=True)
def test_a_large_request_is_split_over_idle_replicas_and_merged_in_order(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    answer = embed(gateway, model=EMBEDDING_MODEL, input=SPLIT_INPUTS)
    assert answer.status_code == 200
    result = answer.parse()
    # Two chunks, contiguous, each to its own replica.
    assert [len(body["input"]) for body in replica.bodies] == [20, 20]
    assert sorted(body["input"][0] for body in replica.bodies) == [
        SPLIT_INPUTS[0],
        SPLIT_INPUTS[20],
    ]
    assert [item.index for item in result.data] == list(range(40))
    # Each chunk's replica numbered its vectors from 0: merged, they are the
    # inputs' own (the vector is a function of the text and its index there).
    for item in result.data:
        assert item.embedding == pytest.approx(
            vector(SPLIT_INPUTS[item.index], item.index % 20)
        )
    assert sorted(result.model_extra["replica_ids"]) == [
        f"{EMBEDDING_MODEL}-v1-embedded-{index}" for index in range(2)
    ]
    words = sum(len(text.split()) for text in SPLIT_INPUTS)
    assert (result.usage.prompt_tokens, result.usage.total_tokens) == (words, words)
    usage = metered(gateway)
    assert (usage.requests, usage.prompt_tokens) == (1, words)
    assert slots_held(gateway) == 0


@pytest.mark.parametrize("served", [1], indirect=True)
def test_a_large_request_goes_whole_to_a_single_replica(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    answer = embed(gateway, model=EMBEDDING_MODEL, input=SPLIT_INPUTS)
    assert answer.status_code == 200
    assert [len(body["input"]) for body in replica.bodies] == [40]
    assert "replica_ids" not in answer.parse().model_extra


@pytest.mark.parametrize("served", [2], indirect=True)
def test_a_chunk_that_fails_once_fails_over_to_the_other_replica(
    served: tuple[EmbeddedGateway, Replica],
) -> None:
    gateway, replica = served
    replica.first_status = 503
    answer = embed(gateway, model=EMBEDDING_MODEL, input=SPLIT_INPUTS)
    assert answer.status_code == 200
    assert len(replica.bodies) == 3  # one chunk twice
    assert [item.index for item in answer.parse().data] == list(range(40))
    usage = metered(gateway)
    words = sum(len(text.split()) for text in SPLIT_INPUTS)
    assert (usage.requests, usage.prompt_tokens) == (1, words)


@pytest.mark.parametrize("served", [2], indirect=True)
def test_a_chunk_no_replica_answers_fails_the_request_and_settles_the_charge(
    served: tuple[EmbeddedGateway, Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GIVEN the second half of the inputs fails on every replica, WHEN the
    request is split, THEN the client gets OpenAI's 503, the first chunk's usage
    (the engine's count) is metered once, and the charge is given back but for it.
    """
    gateway, replica = served
    admission = gateway.app.chat.admission
    released: list[tuple[int, int]] = []
    release = admission.release

    async def recording(ticket: Ticket, *, used_tokens: int) -> None:
        released.append((ticket.charged, used_tokens))
        await release(ticket, used_tokens=used_tokens)

    monkeypatch.setattr(admission, "release", recording)
    replica.fails_on = "text 30 "
    with pytest.raises(openai.InternalServerError) as failed:
        embed(gateway, model=EMBEDDING_MODEL, input=SPLIT_INPUTS)
    error = failed.value.body
    assert isinstance(error, dict)
    assert failed.value.status_code == 503
    assert error["code"] == "no_replica_available"
    first_half = sum(len(text.split()) for text in SPLIT_INPUTS[:20])
    counted = sum(STAND_IN.count_prompt(text) for text in SPLIT_INPUTS)
    assert released == [(counted, first_half)]
    usage = metered(gateway)
    assert (usage.requests, usage.prompt_tokens) == (1, first_half)
    assert slots_held(gateway) == 0
