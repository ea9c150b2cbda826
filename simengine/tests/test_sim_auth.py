"""The simulated replica's secrets, as vLLM's: an engine key on /v1, an admin token.

Both are read from the environment (``VLLM_API_KEY``, ``SIM_ADMIN_TOKEN``), the way
the node agent passes them; the flags (``--api-key``, ``--sim-admin-token``) win.
The full probe table against real vLLM is in ``test_sim_conformance.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from localrun.processes import Process, sim_replica

pytestmark = pytest.mark.e2e

ENGINE_KEY = "sk-engine-from-env"
ADMIN_TOKEN = "sim-admin-from-env"
CHAT = {
    "model": "chat-7b",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
}


@pytest.fixture(scope="module")
def replica(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Process]:
    tmp = tmp_path_factory.mktemp("sim-auth")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_API_KEY", ENGINE_KEY)
        patch.setenv("SIM_ADMIN_TOKEN", ADMIN_TOKEN)
        with sim_replica(tmp) as process:
            patch.undo()
            yield process


def test_v1_without_the_engine_key_gets_vllms_401(replica: Process) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "x"}):
        response = httpx.post(
            f"{replica.url}/v1/chat/completions", json=CHAT, headers=headers
        )
        assert response.status_code == 401
        assert response.content == b'{"error":"Unauthorized"}'
        assert response.headers["content-type"] == "application/json"
    assert httpx.get(f"{replica.url}/v1/models").status_code == 401


def test_v1_with_the_engine_key_serves_the_openai_sdk(replica: Process) -> None:
    client = openai.OpenAI(
        base_url=f"{replica.url}/v1", api_key=ENGINE_KEY, max_retries=0
    )
    answer = client.chat.completions.create(
        model="chat-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list()] == ["chat-7b"]


def test_health_metrics_version_and_tokenize_stay_open(replica: Process) -> None:
    assert httpx.get(f"{replica.url}/health").status_code == 200
    assert httpx.get(f"{replica.url}/metrics").status_code == 200
    assert httpx.get(f"{replica.url}/version").status_code == 200
    tokenized = httpx.post(
        f"{replica.url}/tokenize", json={"model": "chat-7b", "prompt": "hi"}
    )
    assert tokenized.status_code == 200


def test_faults_need_the_admin_token_not_the_engine_key(replica: Process) -> None:
    for token in (None, ENGINE_KEY, "wrong"):
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        refused = httpx.post(
            f"{replica.url}/sim/faults", json={"fail_next": 1}, headers=headers
        )
        assert refused.status_code == 401
        assert httpx.get(f"{replica.url}/sim/state", headers=headers).status_code == 401
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    faults = httpx.post(f"{replica.url}/sim/faults", json={}, headers=admin)
    assert faults.status_code == 200
    assert faults.json()["fail_next"] == 0  # the refused posts changed nothing


def test_api_key_flag_takes_several_keys_and_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", ENGINE_KEY)
    with sim_replica(tmp_path, "--api-key", "key-a", "key-b") as process:
        url = f"{process.url}/v1/models"
        assert httpx.get(url, headers={"Authorization": "Bearer key-a"}).is_success
        assert httpx.get(url, headers={"Authorization": "Bearer key-b"}).is_success
        assert (
            httpx.get(url, headers={"Authorization": f"Bearer {ENGINE_KEY}"})
        ).status_code == 401
