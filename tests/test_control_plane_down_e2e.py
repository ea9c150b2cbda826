"""The control plane's database down: serving goes on and no usage is lost.

GIVEN a platform on a PostgreSQL of the test's own (``localrun.own_postgres``), its
own Redis, a gateway, a node agent with simulated replicas and a Celery worker
with beat (the usage flush), and a second team with a small tokens_per_minute,
already over it
WHEN the database is stopped
THEN chats still succeed through the ``openai`` SDK, every one of them for three
times the gateways' missed-beat window (the node agent's beats do not wait on the
database's pool timeout), the small team is still
refused 429 (its bucket is in Redis), an admin limit change answers 503 with
Retry-After, and a gateway restarted meanwhile serves from its snapshot on disk
AND once the database is back the usage rows hold exactly the requests and tokens
the answers reported: nothing lost, nothing doubled, and the replicas that served
through the outage are still serving (not reaped for their stale database beats).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import pytest

from localrun.own_postgres import OwnPostgres
from localrun.processes import (
    Process,
    bootstrap_platform,
    spawn,
    start_agent,
    start_gateway,
    wait_until,
)
from tests.live import RedisServer

pytestmark = pytest.mark.slow

REGION = "local"
# The settings' defaults, which the processes run with.
HEARTBEAT_S = 1.0
MISSED_BEATS = 3


def _chat(client: openai.OpenAI) -> tuple[int, int]:
    answer = client.chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": "say hello"}],
        max_tokens=8,
    )
    assert answer.usage is not None
    return answer.usage.prompt_tokens, answer.usage.completion_tokens


def _can_chat(client: openai.OpenAI) -> bool:
    try:
        _chat(client)
    except openai.APIError:
        return False
    return True


def _usage_totals(url: str, team: str) -> tuple[int, int, int] | None:
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            row = conn.execute(
                "SELECT coalesce(sum(requests), 0), coalesce(sum(prompt_tokens), 0),"
                " coalesce(sum(output_tokens), 0) FROM usage WHERE team_id = %s",
                [team],
            ).fetchone()
    except psycopg.OperationalError:
        return None
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def _replica_states(url: str) -> set[str]:
    with psycopg.connect(url, connect_timeout=2) as conn:
        rows = conn.execute("SELECT state FROM replicas").fetchall()
    return {state for (state,) in rows}


def _admin(url: str, token: str, method: str, path: str, body: Any) -> httpx.Response:
    return httpx.request(
        method,
        f"{url}/admin/{path}",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def test_control_plane_down_keeps_serving_and_loses_no_usage(
    tmp_path: Path, redis_server_binary: str
) -> None:
    with OwnPostgres() as pg:
        db_url = pg.create_database("platform")
        redis_server = RedisServer(tmp_path, binary=redis_server_binary)
        redis_server.start()
        processes: list[Process] = []
        try:
            env = {
                **os.environ,
                "DATABASE_URL": db_url,
                "REDIS_URL": redis_server.url,
                "PLATFORM_REGION": REGION,
                "PLATFORM_REDIS_PREFIX": f"cpd-{uuid.uuid4().hex[:8]}",
                "PLATFORM_SNAPSHOT_REFRESH_S": "0.5",
                "PLATFORM_SNAPSHOT_PERSIST_S": "0.5",
                "PLATFORM_SNAPSHOT_PATH": str(tmp_path / "snapshots" / "local.json"),
                "PLATFORM_USAGE_FLUSH_S": "1",
                "PLATFORM_KEY_LAST_USED_FLUSH_S": "0.5",
                "PLATFORM_CONTROL_PLANE_RETRY_AFTER_S": "7",
                "SECRET_KEY": "e2e-only",
            }
            env.pop("DJANGO_SETTINGS_MODULE", None)
            creds = bootstrap_platform(env, tmp_path / "credentials.json")
            processes.append(start_agent(env, tmp_path, region=REGION))
            gateway = start_gateway(env, tmp_path, wait_for_snapshot=False)
            processes.append(gateway)
            argv = [sys.executable, "-m", "celery", "-A", "config", "worker", "-B"]
            argv += ["-Q", "celery", "--concurrency", "1", "--loglevel", "INFO"]
            argv += ["--schedule", str(tmp_path / "celerybeat-schedule")]
            processes.append(spawn(argv, env, tmp_path / "worker.log", ""))

            demo = openai.OpenAI(
                base_url=f"{gateway.url}/v1", api_key=creds["team_key"], max_retries=0
            )
            # Every chat that succeeds is counted against the rows at the end.
            sent: list[tuple[int, int]] = []
            errors: list[str] = []

            def try_chat() -> bool:
                """Chat as demo (whichever gateway `demo` points at); count it."""
                try:
                    sent.append(_chat(demo))
                except openai.APIError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    return False
                return True

            wait_until(try_chat, timeout_s=60, message="a first chat")

            # A second team, over a small limit before the database stops.
            admin = creds["admin_token"]
            url = gateway.url
            assert _admin(url, admin, "POST", "teams", {"team": "small"}).is_success
            key = _admin(url, admin, "POST", "teams/small/keys", {}).json()["key"]
            limit = {"model": "chat-7b", "tokens_per_minute": 60, "max_concurrency": 4}
            assert _admin(url, admin, "PUT", "teams/small/limits", limit).is_success
            small = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

            def is_refused() -> bool:
                try:
                    _chat(small)
                except openai.RateLimitError:
                    return True
                except openai.APIError:
                    return False  # not in the snapshot yet
                return False

            wait_until(is_refused, timeout_s=20, message="the small team's 429")

            sent += [_chat(demo) for _ in range(3)]
            # Persisted at least once since (PLATFORM_SNAPSHOT_PERSIST_S).
            snapshot_file = Path(env["PLATFORM_SNAPSHOT_PATH"])
            wait_until(snapshot_file.exists, message="the snapshot on disk")

            pg.stop()

            with pytest.raises(openai.RateLimitError):
                _chat(small)
            change = _admin(
                url,
                admin,
                "PUT",
                "teams/small/limits",
                {**limit, "tokens_per_minute": 10**6},
            )
            assert change.status_code == 503, change.text
            assert change.headers["Retry-After"] == "7"
            assert change.json()["error"]["code"] == "control_plane_unavailable"

            # Chats for longer than the gateways' missed-beat window: the agent's
            # passes now wait out the pool's timeout on every query (5 s by
            # default), and its beats must not (``NodeAgent.run``).
            outage_s = 3 * HEARTBEAT_S * MISSED_BEATS
            ends_at = time.monotonic() + outage_s
            during = 0
            while time.monotonic() < ends_at:
                sent.append(_chat(demo))  # any error fails the test
                during += 1
            assert during >= outage_s  # at least one a second got through

            gateway.stop()
            processes.remove(gateway)
            gateway = start_gateway(env, tmp_path, "gateway-2")
            processes.append(gateway)
            demo = openai.OpenAI(
                base_url=f"{gateway.url}/v1", api_key=creds["team_key"], max_retries=0
            )
            # It serves once it has read the replicas' beats from Redis.
            errors.clear()
            try:
                wait_until(try_chat, timeout_s=30, message="a chat after the restart")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; last error: {errors[-1:]}") from None
            sent += [_chat(demo) for _ in range(3)]

            pg.start()

            expected = (
                len(sent),
                sum(p for p, _ in sent),
                sum(c for _, c in sent),
            )
            # The current minute is flushed once it has closed (and a grace).
            wait_until(
                lambda: _usage_totals(db_url, "demo") == expected,
                timeout_s=90,
                interval_s=0.5,
                message=f"usage rows totalling {expected}",
            )
            # Recovered, the replicas that served through it serve on: the reaper
            # (its worker beats every 5 s) did not take their database heartbeats,
            # stale from the outage, for death (they beat to Redis all along).
            assert _replica_states(db_url) == {"serving"}
            _chat(demo)
        finally:
            for process in reversed(processes):
                process.stop(grace_s=10)
            redis_server.stop()
