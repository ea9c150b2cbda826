"""The platform's secrets end to end: real gateway, agent and replica processes.

The agent starts replicas with the engine key and the simulator's admin token in
their environment; the replicas refuse whoever lacks them and serve the gateway,
which sends the key. ``/metrics`` wants its scrape token, ``/v1`` a Host that
ALLOWED_HOSTS allows, and a key's use reaches ``last_used_at`` off the hot path.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from django.utils import timezone

from accounts.models import ApiKey
from localrun.processes import server_pgid, wait_until
from tests.live import LivePlatform, extra_of, process_cmdlines

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHAT = {
    "model": "chat-7b",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
}


@pytest.fixture(scope="module")
def platform(shared_platform: LivePlatform) -> LivePlatform:
    """The shared platform (conftest.py); chat-7b answers from v1's replicas."""
    return shared_platform


@pytest.fixture
def unblocked(django_db_blocker: DjangoDbBlocker) -> Iterator[None]:
    with django_db_blocker.unblock():
        yield


@pytest.fixture
def replica_url(platform: LivePlatform, unblocked: None) -> str:
    return platform.serving("v1")[0].url


def test_agents_replica_refuses_a_keyless_request_and_serves_the_gateway(
    platform: LivePlatform, replica_url: str
) -> None:
    for headers in ({}, {"Authorization": "Bearer not-the-engine-key"}):
        refused = httpx.post(
            f"{replica_url}/v1/chat/completions", json=CHAT, headers=headers
        )
        assert refused.status_code == 401
        assert refused.json() == {"error": "Unauthorized"}
    engine_key = platform.env["PLATFORM_ENGINE_API_KEY"]
    direct = httpx.post(
        f"{replica_url}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {engine_key}"},
    )
    assert direct.status_code == 200

    answer = platform.client().chat.completions.create(
        model="chat-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    served_by = {replica.replica_id for replica in platform.serving("v1")}
    assert extra_of(answer)["replica_id"] in served_by


def test_agents_replica_faults_need_the_sim_admin_token(
    platform: LivePlatform, replica_url: str
) -> None:
    refused = httpx.post(f"{replica_url}/sim/faults", json={"fail_next": 1})
    assert refused.status_code == 401
    faults = httpx.post(
        f"{replica_url}/sim/faults", json={}, headers=platform.sim_admin_headers()
    )
    assert faults.status_code == 200
    assert faults.json()["fail_next"] == 0


def test_agents_replica_keeps_the_secrets_out_of_the_process_list(
    platform: LivePlatform, replica_url: str
) -> None:
    pid = server_pgid(replica_url)
    cmdlines = process_cmdlines()
    environ = dict(
        item.split(b"=", 1)
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"=" in item
    )
    for name in (
        "PLATFORM_ENGINE_API_KEY",
        "PLATFORM_SIM_ADMIN_TOKEN",
        "PLATFORM_METRICS_TOKEN",
    ):
        assert platform.env[name].encode() not in cmdlines
    assert environ[b"VLLM_API_KEY"] == platform.env["PLATFORM_ENGINE_API_KEY"].encode()
    assert environ[b"SIM_ADMIN_TOKEN"] == (
        platform.env["PLATFORM_SIM_ADMIN_TOKEN"].encode()
    )
    # The agent's own secrets stay with the agent.
    assert b"DATABASE_URL" not in environ
    assert b"PLATFORM_METRICS_TOKEN" not in environ


def test_metrics_need_the_scrape_token(platform: LivePlatform) -> None:
    platform.client().chat.completions.create(
        model="chat-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.get(f"{platform.url}/metrics", headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_metrics_token"
        assert "team=" not in refused.text
    assert 'team="alpha"' in platform.metrics()


def test_v1_refuses_a_host_that_is_not_allowed(platform: LivePlatform) -> None:
    key = {"Authorization": f"Bearer {platform.keys['alpha']}"}
    for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example", "a b"):
        refused = httpx.post(
            f"{platform.url}/v1/chat/completions",
            json=CHAT,
            headers={**key, "Host": host},
        )
        assert refused.status_code == 400, host
        assert refused.json() == {
            "error": {
                "type": "invalid_request_error",
                "message": "the Host header names a host this server does not "
                "serve (PLATFORM_ALLOWED_HOSTS)",
                "param": None,
                "code": "invalid_host",
            }
        }
        models = httpx.get(f"{platform.url}/v1/models", headers={**key, "Host": host})
        assert models.status_code == 400
    port = platform.url.rsplit(":", 1)[1]
    allowed = httpx.post(
        f"{platform.url}/v1/chat/completions",
        json=CHAT,
        headers={**key, "Host": f"localhost:{port}"},
        timeout=30,
    )
    assert allowed.status_code == 200
    # Probes (load balancers, kubelets) call /healthz by address: not checked.
    health = httpx.get(f"{platform.url}/healthz", headers={"Host": "10.1.2.3:8000"})
    assert health.status_code == 200


def test_a_keys_use_reaches_last_used_at_in_a_batch(
    platform: LivePlatform, unblocked: None
) -> None:
    """GIVEN team beta's key, unused since ``before`` (a module before this one
    on the shared platform may have used it earlier)
    WHEN it opens requests (a chat and a model list)
    THEN the gateway writes its last_used_at within the flush interval.
    """
    key = ApiKey.objects.get(team_id="beta")
    before = timezone.now()
    client = platform.client("beta")
    client.models.list()
    client.chat.completions.create(
        model="chat-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )

    def stamped() -> datetime | None:
        used_at = ApiKey.objects.get(pk=key.pk).last_used_at
        return used_at if used_at is not None and used_at >= before else None

    used_at = wait_until(stamped, timeout_s=10, message="beta's key to be stamped")
    assert ApiKey.objects.get(team_id="alpha").last_used_at is not None
    assert used_at >= key.created_at
