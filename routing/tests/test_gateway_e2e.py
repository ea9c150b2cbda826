"""The gateway end to end: real gateway, agent and replica processes, the openai SDK."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from django.utils import timezone

from engine_nodes import services as engine_services
from localrun.processes import (
    free_port,
    gateway_argv,
    start_gateway,
    wait_until,
)
from metering.models import Usage
from rollouts import services as rollouts
from routing.tests.hostile_bodies import HOSTILE
from tests.live import (
    LivePlatform,
    cached_tokens_of,
    extra_of,
    start_platform,
    usage_of,
)

if TYPE_CHECKING:
    from openai.types.chat import (
        ChatCompletion,
        ChatCompletionChunk,
        ChatCompletionMessageParam,
        ChatCompletionSystemMessageParam,
    )
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("platform")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp, pools={"v1": 3, "v2": 1}, PLATFORM_AFFINITY_MIN_BOUND_TOKENS="0"
        ) as live,
    ):
        yield live


# daphne first: pytest stops a module fixture's gateway when the next parameter
# starts, so the second gateway is gone before the tests that take ``platform``.
@pytest.fixture(scope="module", params=["daphne", "uvicorn"])
def served(
    request: pytest.FixtureRequest,
    platform: LivePlatform,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    """The platform seen through a gateway under each supported ASGI server.

    The streaming tests take this, the others ``platform``: a second gateway on the
    same replicas costs a few seconds, a second platform a minute. The platform's
    own gateway serves when it already runs that server (PLATFORM_SERVER unset).
    """
    server = request.param
    port = int(platform.url.rsplit(":", 1)[1])
    if platform.gateway.popen.args == gateway_argv(port, server=server):
        yield platform
        return
    tmp = tmp_path_factory.mktemp(server)
    gateway = start_gateway(platform.env, tmp, name=f"gateway-{server}", server=server)
    try:
        yield replace(platform, url=gateway.url, gateway=gateway)
    finally:
        gateway.stop()


def chat(
    platform: LivePlatform,
    conversation: str,
    *,
    team: str = "alpha",
    max_tokens: int = 4,
    content: str = "hello",
    **extra: Any,
) -> tuple[list[ChatCompletionChunk], dict[str, Any]]:
    """Send one streaming request; return (chunks, final event dict)."""
    stream = platform.client(team).chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        stream=True,
        extra_headers={"x-conversation-id": conversation},
        **extra,
    )
    chunks = list(stream)
    return chunks, extra_of(chunks[-1]) | {"usage": usage_of(chunks[-1]).model_dump()}


def test_stream_ends_with_usage_version_region_and_replica(
    served: LivePlatform,
) -> None:
    chunks, final = chat(
        served, "conv-usage", max_tokens=6, extra_body={"ignore_eos": True}
    )
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) == 6
    assert chunks[-1].choices == []
    assert final["usage"]["completion_tokens"] == 6
    assert final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + 6
    assert "cached_tokens" in final["usage"]
    assert final["model_version"] == "v1"
    assert final["region"] == "e2e"
    assert final["replica_id"].startswith("chat-7b-v1-e2e-")


def test_response_headers_and_raw_stream_end(served: LivePlatform) -> None:
    with httpx.stream(
        "POST",
        f"{served.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {served.keys['alpha']}"},
        json={
            "model": "chat-7b",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "stream": True,
        },
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-model-version"] == "v1"
        assert response.headers["x-region"] == "e2e"
        assert response.headers["x-replica-id"].startswith("chat-7b-v1")
        assert response.headers["x-request-id"].startswith("chatcmpl-")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2].removeprefix("data: "))
    assert final["replica_id"] == response.headers["x-replica-id"]


def test_non_streaming_answer(platform: LivePlatform) -> None:
    answer = platform.client().chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.content
    assert usage_of(answer).completion_tokens == 5
    assert extra_of(answer)["model_version"] == "v1"


def test_second_turn_lands_on_the_same_replica_with_cached_tokens(
    platform: LivePlatform,
) -> None:
    system: ChatCompletionSystemMessageParam = {
        "role": "system",
        "content": "You answer briefly. " * 40,
    }
    first = platform.client().chat.completions.create(
        model="chat-7b",
        messages=[system, {"role": "user", "content": "one"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    follow: list[ChatCompletionMessageParam] = [
        system,
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "two"},
    ]
    second = platform.client().chat.completions.create(
        model="chat-7b", messages=follow, max_tokens=4
    )
    assert extra_of(second)["replica_id"] == extra_of(first)["replica_id"]
    assert extra_of(usage_of(second))["cached_tokens"] > 0
    assert cached_tokens_of(second) > 0


def test_models_lists_what_the_team_may_call(platform: LivePlatform) -> None:
    models = platform.client().models.list()
    assert [m.id for m in models.data] == ["chat-7b"]


@pytest.mark.parametrize(
    ("headers", "body", "status", "param"),
    [
        ({"x-priority": "urgent"}, {}, 400, "x-priority"),
        ({}, {"model": "nope"}, 404, "model"),
        ({}, {"model": "chat-7b@v9"}, 404, "model"),
        ({}, {"messages": []}, 400, "messages"),
        ({}, {"max_tokens": 0}, 400, "max_tokens"),
        ({}, {"temperature": 5}, 400, "temperature"),
        ({}, {"max_tokens": 9000}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(
    platform: LivePlatform,
    headers: dict[str, str],
    body: dict[str, object],
    status: int,
    param: str,
) -> None:
    payload = {
        "model": "chat-7b",
        "messages": [{"role": "user", "content": "x"}],
        **body,
    }
    response = httpx.post(
        f"{platform.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {platform.keys['alpha']}", **headers},
        json=payload,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"]


def test_bad_key_is_401_and_oversized_body_is_413(platform: LivePlatform) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{platform.url}/v1", api_key="sk-team-nope", max_retries=0
        ).models.list()
    response = httpx.post(
        f"{platform.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {platform.keys['alpha']}"},
        content=b"x" * (5 * 1024 * 1024),
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("body", "param"),
    [pytest.param(body, param, id=name) for name, body, param in HOSTILE],
)
def test_hostile_bodies_get_openai_400s_naming_the_param(
    platform: LivePlatform, body: str, param: str
) -> None:
    response = httpx.post(
        f"{platform.url}/v1/chat/completions",
        headers={
            "Authorization": f"Bearer {platform.keys['alpha']}",
            "Content-Type": "application/json",
        },
        content=body.encode(),
    )
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"type", "message", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_every_chunk_of_a_stream_has_the_engines_id(served: LivePlatform) -> None:
    chunks, _ = chat(served, "conv-ids", max_tokens=3)
    assert len({chunk.id for chunk in chunks}) == 1
    with httpx.stream(
        "POST",
        f"{served.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {served.keys['alpha']}"},
        json={
            "model": "chat-7b",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "stream": True,
        },
    ) as response:
        raw = response.read().decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    ids = {json.loads(event)["id"] for event in events[:-1]}
    assert ids == {response.headers["x-request-id"]}


def test_stream_without_include_usage_sends_no_usage_yet_is_metered(
    served: LivePlatform, unblocked: None
) -> None:
    def output_tokens() -> int:
        flush_usage(served)
        rows = Usage.objects.filter(team_id="beta").values_list(
            "output_tokens", flat=True
        )
        return sum(rows)

    before = output_tokens()
    stream = served.client("beta").chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": False},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(chunk.choices and chunk.usage is None for chunk in chunks)
    assert sum(bool(c.choices[0].delta.content) for c in chunks) == 7
    wait_until(
        lambda: output_tokens() >= before + 7,
        timeout_s=20,
        message="the usage of a stream without a usage chunk",
    )


def test_tokenize_passes_through_to_the_versions_replicas(
    platform: LivePlatform,
) -> None:
    from simengine.domain import tokens

    url = f"{platform.url}/tokenize"
    auth = {"Authorization": f"Bearer {platform.keys['alpha']}"}
    messages = [{"role": "user", "content": "hello there"}]
    prompt = httpx.post(url, headers=auth, json={"model": "chat-7b", "prompt": "hi"})
    chat_form = httpx.post(
        url, headers=auth, json={"model": "chat-7b@v2", "messages": messages}
    )

    # The simulated replicas count with the stand-in tokenizer: the engine's answer.
    assert prompt.status_code == 200, prompt.text
    assert prompt.json()["tokens"] == tokens.encode("hi")
    assert prompt.json()["count"] == len(tokens.encode("hi"))
    assert chat_form.status_code == 200, chat_form.text
    assert chat_form.json()["tokens"] == tokens.encode(tokens.render_chat(messages))
    for headers, body, status in (
        ({}, {"model": "chat-7b", "prompt": "hi"}, 401),
        (auth, {"model": "chat-7b@v9", "prompt": "hi"}, 404),
        (auth, {"model": "chat-7b", "prompt": 3}, 400),
    ):
        refused = httpx.post(url, headers=headers, json=body)
        assert refused.status_code == status, refused.text
        assert set(refused.json()["error"]) == {"type", "message", "param", "code"}


def test_pinned_version_is_served_by_that_version(platform: LivePlatform) -> None:
    answer = platform.client().chat.completions.create(
        model="chat-7b@v2", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert extra_of(answer)["model_version"] == "v2"
    assert extra_of(answer)["replica_id"].startswith("chat-7b-v2")


def test_bounded_load_moves_traffic_off_a_hot_replica(platform: LivePlatform) -> None:
    _, first = chat(platform, "conv-hot")
    owner = first["replica_id"]
    started = threading.Event()
    done = threading.Event()

    def long_stream() -> None:
        try:
            stream = platform.client().chat.completions.create(
                model="chat-7b",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
                extra_headers={"x-conversation-id": "conv-hot"},
            )
            for _ in stream:
                started.set()
        finally:
            done.set()

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        assert started.wait(timeout=30)
        # While the owner holds a long answer, the same conversation goes elsewhere.
        _, moved = chat(platform, "conv-hot")
        assert moved["replica_id"] != owner
        assert not done.is_set()
    finally:
        thread.join(timeout=60)
    _, back = chat(platform, "conv-hot")
    assert back["replica_id"] == owner


def test_canary_split_is_stable_per_conversation(
    platform: LivePlatform, unblocked: None
) -> None:
    rollouts.set_rollout(
        model_id="chat-7b", version="v2", stage="canary", percent=50, now=timezone.now()
    )
    try:
        wait_until(
            lambda: any(
                chat(platform, f"conv-canary-{i}")[1]["model_version"] == "v2"
                for i in range(12)
            ),
            timeout_s=15,
            message="the canary to reach the gateway",
        )
        seen: dict[int, str] = {}
        for i in range(24):
            versions = {
                chat(platform, f"conv-split-{i}")[1]["model_version"] for _ in range(3)
            }
            assert len(versions) == 1, f"conversation {i} changed version: {versions}"
            seen[i] = versions.pop()
        assert set(seen.values()) == {"v1", "v2"}
    finally:
        rollouts.set_alias(model_id="chat-7b", version="v1")
        # Later tests assume every conversation is on v1 (three replicas) again:
        # wait until the gateway's snapshot has dropped the canary, or a test that
        # kills "its" replica may have killed v2's only one.
        wait_until(
            lambda: all(
                chat(platform, f"conv-canary-{i}")[1]["model_version"] == "v1"
                for i in range(12)
            ),
            timeout_s=15,
            message="the canary to end at the gateway",
        )


def test_usage_rows_are_written_per_team_and_minute(
    platform: LivePlatform, unblocked: None
) -> None:
    chat(
        platform,
        "conv-usage-beta",
        team="beta",
        max_tokens=7,
        extra_body={"ignore_eos": True},
    )
    flush_usage(platform)

    def flushed_row() -> Usage | None:
        flush_usage(platform)
        return Usage.objects.filter(team_id="beta").first()

    row = wait_until(
        flushed_row,
        timeout_s=20,
        message="beta's usage row",
    )
    assert row.output_tokens >= 7
    assert row.requests >= 1
    assert row.prompt_tokens > 0


def flush_usage(platform: LivePlatform) -> None:
    """Flush closed and open minutes (Redis mode); the embedded gateway flushes itself."""
    if not os.environ.get("REDIS_URL"):
        return None
    import redis

    from metering.services import flush_redis_usage

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    flush_redis_usage(
        client=client, prefix=platform.prefix, now=timezone.now() + timedelta(minutes=2)
    )
    return None


def test_usage_flush_is_idempotent(
    redis_url: str, platform: LivePlatform, unblocked: None
) -> None:
    chat(platform, "conv-idem", team="beta", max_tokens=3)
    flush_usage(platform)
    before = list(Usage.objects.order_by("id").values())
    flush_usage(platform)
    assert list(Usage.objects.order_by("id").values()) == before


def test_replica_killed_before_first_token_is_retried_invisibly(
    platform: LivePlatform, unblocked: None
) -> None:
    _, first = chat(platform, "conv-victim")
    victim = first["replica_id"]
    url = next(r.url for r in platform.serving() if r.replica_id == victim)
    state = httpx.get(f"{url}/sim/state", headers=platform.sim_admin_headers())
    pid = state.json()["pid"]
    os.kill(pid, signal.SIGKILL)
    _, again = chat(platform, "conv-victim")
    assert again["replica_id"] != victim
    assert again["usage"]["completion_tokens"] >= 1
    _replace_dead_replicas(platform, victim)


def test_replica_killed_mid_stream_gives_an_error_event_and_usage(
    platform: LivePlatform, unblocked: None
) -> None:
    # Every serving replica is armed, not only the one the conversation went to last:
    # a replacement from an earlier test may join the gateway's ring between two
    # requests and move the conversation. Not too few tokens before the crash: on a
    # loaded machine the engine could make them all before its handler wrote the
    # first, and the gateway would then (rightly) retry the request elsewhere
    # instead of breaking the stream.
    armed = {r.replica_id: r.url for r in platform.serving("v1")}
    for url in armed.values():
        httpx.post(
            f"{url}/sim/faults",
            json={"crash_after_tokens": 20},
            headers=platform.sim_admin_headers(),
        ).raise_for_status()
    before = sum(
        Usage.objects.filter(team_id="beta").values_list("requests", flat=True)
    )
    received = 0
    with pytest.raises(openai.APIError) as caught:
        stream = platform.client("beta").chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"x-conversation-id": "conv-crash"},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
    assert 1 <= received <= 20
    assert "mid-stream" in str(caught.value)
    dead = []
    for replica_id, url in armed.items():
        try:
            httpx.post(
                f"{url}/sim/faults",
                json={"crash_after_tokens": None},
                headers=platform.sim_admin_headers(),
            ).raise_for_status()
        except httpx.TransportError:
            dead.append(replica_id)
    assert len(dead) == 1, dead

    def flushed_and_metered() -> bool:
        flush_usage(platform)
        metered = Usage.objects.filter(team_id="beta").values_list(
            "requests", flat=True
        )
        return sum(metered) > before

    wait_until(
        flushed_and_metered,
        timeout_s=20,
        message="the broken stream's usage row",
    )
    _replace_dead_replicas(platform, dead[0])


def _replace_dead_replicas(platform: LivePlatform, victim: str) -> None:
    """Reap the dead replica (as the beat task would) and wait for a replacement."""
    wait_until(
        lambda: (
            engine_services.reap_silent_replicas(now=timezone.now()) is not None
            and victim not in {r.replica_id for r in platform.serving()}
            and len(platform.serving("v1")) == 3
        ),
        timeout_s=40,
        message="a replacement replica",
    )


def test_gateway_keeps_serving_with_the_database_unreachable(
    postgres: None, platform: LivePlatform, tmp_path: Path
) -> None:
    """The drill cuts the database's network path, so it needs PostgreSQL."""
    from django.db import connection

    from tests.tcp_proxy import TcpProxy

    settings = connection.settings_dict
    proxy = TcpProxy(
        settings.get("HOST") or "127.0.0.1", int(settings.get("PORT") or 5432)
    )
    user = settings.get("USER") or "postgres"
    env = dict(
        platform.env,
        DATABASE_URL=f"postgresql://{user}@127.0.0.1:{proxy.port}/{settings['NAME']}",
        # A connection is given up on after 1 s, not 5: the gateway notices the
        # cut sooner, and does the same once it has.
        PLATFORM_DB_POOL_TIMEOUT_S="1",
    )
    gateway = start_gateway(env, tmp_path, name="gateway-db-drill")
    try:
        client = openai.OpenAI(
            base_url=f"{gateway.url}/v1", api_key=platform.keys["alpha"], max_retries=0
        )

        def ask() -> ChatCompletion:
            return client.chat.completions.create(
                model="chat-7b",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
            )

        assert usage_of(ask()).completion_tokens == 3
        proxy.cut()
        health = wait_until(
            lambda: (
                (h := httpx.get(f"{gateway.url}/healthz").json())["control_plane"]
                == "unreachable"
                and h
            ),
            timeout_s=20,
            message="the gateway to notice the database is gone",
        )
        # Serving from the last snapshot is what every region does while the
        # control plane is down: degraded, yet ready for the balancer.
        assert health["status"] == "degraded"
        assert health["ready"] is True
        assert health["snapshot"] == "stale"
        for _ in range(3):
            assert usage_of(ask()).completion_tokens == 3
        assert httpx.get(f"{gateway.url}/healthz").json()["snapshot_age_s"] > 0
        exported = platform.metrics(gateway.url)
        assert "platform_control_plane_up 0.0" in exported
    finally:
        gateway.stop()
        proxy.stop()


def test_gateway_started_with_the_database_down_serves_once_it_answers(
    postgres: None, platform: LivePlatform, tmp_path: Path
) -> None:
    """GIVEN a gateway started while its database is unreachable
    WHEN it is asked to serve, and then the database comes back
    THEN it starts anyway, says unavailable in /healthz and its metrics, refuses chats
    with a 503 and Retry-After, and serves as soon as a refresh reaches the database.
    """
    from django.db import connection

    from tests.tcp_proxy import TcpProxy

    settings = connection.settings_dict
    proxy = TcpProxy(
        settings.get("HOST") or "127.0.0.1",
        int(settings.get("PORT") or 5432),
        listening=False,
    )
    user = settings.get("USER") or "postgres"
    env = dict(
        platform.env,
        DATABASE_URL=f"postgresql://{user}@127.0.0.1:{proxy.port}/{settings['NAME']}",
        # A connection is given up on after 1 s, not 5: the gateway notices the
        # cut sooner, and does the same once it has.
        PLATFORM_DB_POOL_TIMEOUT_S="1",
    )
    gateway = start_gateway(
        env, tmp_path, name="gateway-db-down", wait_for_snapshot=False
    )
    try:
        health = httpx.get(f"{gateway.url}/healthz")
        assert health.status_code == 503
        # Among the fields (Redis's and the limits' are test_redis_outage_e2e's).
        assert (
            health.json().items()
            >= {
                "status": "unavailable",
                "ready": False,
                "reasons": ["no control-plane snapshot yet"],
                "control_plane": "unreachable",
                "snapshot": "none",
                "snapshot_source": None,
                "snapshot_age_s": None,
                "region": platform.region,
            }.items()
        )
        exported = platform.metrics(gateway.url)
        assert "platform_control_plane_up 0.0" in exported
        assert "platform_snapshot_age_seconds NaN" in exported
        assert "platform_region_ready 0.0" in exported
        client = openai.OpenAI(
            base_url=f"{gateway.url}/v1", api_key=platform.keys["alpha"], max_retries=0
        )

        def ask() -> ChatCompletion:
            return client.chat.completions.create(
                model="chat-7b",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
            )

        with pytest.raises(openai.APIStatusError) as refused:
            ask()
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "2"
        assert gateway.popen.poll() is None  # still running, not crashed

        proxy.resume()
        wait_until(
            lambda: httpx.get(f"{gateway.url}/healthz").status_code == 200,
            timeout_s=30,
            message="the gateway to load its first snapshot",
        )
        assert httpx.get(f"{gateway.url}/healthz").json()["control_plane"] == "up"
        wait_until(
            lambda: _answers(ask),
            timeout_s=20,
            message="the gateway to see its replicas beat",
        )
        assert usage_of(ask()).completion_tokens == 3
    finally:
        gateway.stop()
        proxy.stop()


def test_a_gateway_restarted_with_the_database_down_serves_its_snapshot_file(
    postgres: None, platform: LivePlatform, tmp_path: Path
) -> None:
    """GIVEN a gateway that wrote its snapshot file, then stopped
    WHEN a gateway starts with the same file while the database is unreachable
    THEN it serves chats from the file, and /healthz says the snapshot came from
    disk and the control plane is unreachable; the file holds no key secret.
    """
    path = tmp_path / "snapshots" / f"{platform.region}.json"
    env = dict(
        platform.env, PLATFORM_SNAPSHOT_PATH=str(path), PLATFORM_SNAPSHOT_PERSIST_S="1"
    )
    first = start_gateway(env, tmp_path, name="gateway-writes-file")
    try:
        wait_until(path.exists, timeout_s=20, message="the snapshot file")
        health = httpx.get(f"{first.url}/healthz").json()
        assert health["snapshot_source"] == "database"
    finally:
        first.stop()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    raw = path.read_bytes()
    for secret in platform.keys.values():
        assert secret.encode() not in raw

    user = env["DATABASE_URL"].split("://", 1)[1].split("@", 1)[0]
    name = env["DATABASE_URL"].rsplit("/", 1)[1]
    down = dict(
        env,
        # Nothing listens there: every refresh fails.
        DATABASE_URL=f"postgresql://{user}@127.0.0.1:{free_port()}/{name}",
        PLATFORM_DB_POOL_TIMEOUT_S="1",
    )
    gateway = start_gateway(
        down, tmp_path, name="gateway-from-file", wait_for_snapshot=False
    )
    try:
        health = wait_until(
            lambda: (
                (h := httpx.get(f"{gateway.url}/healthz").json())["snapshot_source"]
                == "disk"
                and h
            ),
            timeout_s=20,
            message="the gateway to serve its snapshot file",
        )
        assert health["control_plane"] == "unreachable"
        assert health["snapshot_age_s"] > 0
        assert "platform_snapshot_from_disk 1.0" in platform.metrics(gateway.url)
        client = openai.OpenAI(
            base_url=f"{gateway.url}/v1", api_key=platform.keys["alpha"], max_retries=0
        )

        def ask() -> ChatCompletion:
            return client.chat.completions.create(
                model="chat-7b",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
            )

        wait_until(
            lambda: _answers(ask),
            timeout_s=20,
            message="a chat served from the snapshot file",
        )
        assert usage_of(ask()).completion_tokens == 3
        assert gateway.popen.poll() is None
    finally:
        gateway.stop()


def _answers(ask: Callable[[], object]) -> bool:
    try:
        ask()
    except openai.APIStatusError:
        return False
    return True
