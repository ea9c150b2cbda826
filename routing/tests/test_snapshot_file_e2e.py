"""A gateway restarted while the database is down serves from its snapshot file:
real gateway, agent and replica processes, the openai SDK."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from engine_nodes.local_processes import free_port, start_gateway, wait_until
from tests.live import LivePlatform, start_platform, usage_of

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion
    from pytest_django import DjangoDbBlocker

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("platform")
    with django_db_blocker.unblock(), start_platform(tmp, pools={"v1": 1}) as live:
        yield live


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
        answer = wait_until(
            lambda: _ask(client),
            timeout_s=20,
            message="a chat served from the snapshot file",
        )
        assert usage_of(answer).completion_tokens == 3
        assert gateway.popen.poll() is None
    finally:
        gateway.stop()


def _ask(client: openai.OpenAI) -> ChatCompletion | None:
    try:
        return client.chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
        )
    except openai.APIStatusError:
        return None
