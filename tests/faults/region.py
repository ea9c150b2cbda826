"""Two regions behind HAProxy, the first of them in a network namespace we can cut.

Public surface: ``CutRegions``, ``LIVE_CHECK``.

As ``drills.failover_live.TwoRegions`` runs them (one PostgreSQL, a gateway, a
node agent with simulated replicas and a Redis per region, HAProxy rendered by
``routing.domain.global_lb``), except that the first region's gateway, agent,
replicas and Redis all run inside a network namespace (``tests.faults.netns``):
blackholing its veth pair cuts the whole region off, from its clients' balancer
and from the control plane at once, as a lost network would. The second region
and PostgreSQL run in the root namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from localrun.own_postgres import OwnPostgres
from localrun.processes import (
    Process,
    agent_argv,
    free_port,
    gateway_argv,
    manage,
    spawn,
    start_agent,
    wait_until,
)
from routing.domain.global_lb import HealthCheck, Region, render_haproxy
from tests.faults.netns import Netns
from tests.live import RedisServer

__all__ = ["LIVE_CHECK", "CutRegions"]

# Checked every half second, out after two failures; a check times out after 2 s.
LIVE_CHECK = HealthCheck(inter_s=0.5, fall=2, rise=2)


@dataclass
class CutRegions:
    """The two regions (``east`` in the namespace, ``west`` not) and HAProxy."""

    tmp: Path
    redis_binary: str
    east_entry: str = ""
    east_gateway: str = ""
    team_key: str = ""
    netns: Netns | None = None
    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> CutRegions:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        netns = self.netns = self._stack.enter_context(Netns())
        pg = self._stack.enter_context(OwnPostgres(host="0.0.0.0"))
        pg.create_database("platform")
        east_redis = RedisServer(
            self.tmp,
            binary=self.redis_binary,
            host=netns.ip,
            command_prefix=netns.exec_argv([]),
        )
        west_redis = RedisServer(self.tmp, binary=self.redis_binary)
        for server in (east_redis, west_redis):
            server.start()
            self._stack.callback(server.stop)
        shared = {
            "SECRET_KEY": f"faults-{secrets.token_urlsafe(16)}",
            "PLATFORM_ENGINE_API_KEY": f"engine-{secrets.token_urlsafe(16)}",
            "PLATFORM_SIM_ADMIN_TOKEN": f"sim-admin-{secrets.token_urlsafe(16)}",
            "PLATFORM_METRICS_TOKEN": f"metrics-{secrets.token_urlsafe(16)}",
            "PLATFORM_ALLOWED_HOSTS": "*",
            "PLATFORM_SNAPSHOT_REFRESH_S": "0.5",
            "PLATFORM_USAGE_FLUSH_S": "1",
            "PLATFORM_DB_POOL_TIMEOUT_S": "1",
        }
        base = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
        prefix = f"faults-{secrets.token_hex(4)}"
        for name, host, redis in (
            ("east", netns.host_ip, east_redis),
            ("west", "127.0.0.1", west_redis),
        ):
            self.envs[name] = {
                **base,
                **shared,
                "DATABASE_URL": f"postgresql://postgres@{host}:{pg.port}/platform",
                "REDIS_URL": redis.url,
                "PLATFORM_REGION": name,
                "PLATFORM_REDIS_PREFIX": f"{prefix}-{name}",
                "PLATFORM_SNAPSHOT_PATH": str(self.tmp / f"snapshot-{name}.json"),
            }
        manage(self.envs["west"], "migrate", "--noinput")
        credentials = self.tmp / "credentials.json"
        for env in self.envs.values():
            manage(env, "bootstrap_local", "--json", "--credentials", str(credentials))
        self.team_key = json.loads(credentials.read_text())["team_key"]
        self._stack.callback(self._stop_processes)
        # East's agent (so its replicas) and gateway inside the namespace.
        self.processes.append(
            spawn(
                netns.exec_argv(agent_argv(self.tmp, region="east", node="east")),
                self.envs["east"],
                self.tmp / "agent-east.log",
                "",
            )
        )
        self.processes.append(
            start_agent(self.envs["west"], self.tmp, region="west", node="west")
        )
        east_port, west_port = free_port(), free_port()
        self.east_gateway = f"http://{netns.ip}:{east_port}"
        argv = gateway_argv(east_port, host="0.0.0.0")
        self.processes.append(
            spawn(
                netns.exec_argv(argv),
                self.envs["east"],
                self.tmp / "gateway-east.log",
                self.east_gateway,
            )
        )
        west_url = f"http://127.0.0.1:{west_port}"
        self.processes.append(
            spawn(
                gateway_argv(west_port),
                self.envs["west"],
                self.tmp / "gateway-west.log",
                west_url,
            )
        )
        for url in (self.east_gateway, west_url):
            wait_until(
                partial(ready, url),
                timeout_s=90,
                interval_s=0.2,
                message=f"{url} ready (/healthz 200)",
            )
        east_listen, west_listen = free_port(), free_port()
        config = self.tmp / "haproxy.cfg"
        config.write_text(
            render_haproxy(
                [
                    Region(
                        "east", f"{netns.ip}:{east_port}", f"127.0.0.1:{east_listen}"
                    ),
                    Region(
                        "west", f"127.0.0.1:{west_port}", f"127.0.0.1:{west_listen}"
                    ),
                ],
                check=LIVE_CHECK,
            )
        )
        haproxy = spawn(
            ["haproxy", "-db", "-f", str(config)],
            dict(os.environ),
            self.tmp / "haproxy.log",
            f"http://127.0.0.1:{east_listen}",
        )
        self.processes.append(haproxy)
        self.east_entry = haproxy.url
        wait_until(
            lambda: ready(self.east_entry) or haproxy.popen.poll() is not None,
            timeout_s=30,
            message="HAProxy to take connections",
        )
        assert haproxy.popen.poll() is None, haproxy.log()

    def east_ready(self) -> bool:
        return ready(self.east_gateway)

    def flush_usage(self) -> None:
        """Write both regions' usage to rows now (``FaultPlatform.flush_usage``)."""
        code = (
            "import redis; from datetime import timedelta; "
            "from django.conf import settings; from django.utils import timezone; "
            "from metering.services import flush_redis_usage; "
            "c = redis.Redis.from_url(settings.REDIS_URL); "
            "flush_redis_usage(client=c, prefix=settings.REDIS_KEY_PREFIX, "
            "now=timezone.now() + timedelta(minutes=2))"
        )
        for env in self.envs.values():
            manage(env, "shell", "-c", code, timeout_s=60)

    def _stop_processes(self) -> None:
        for process in reversed(self.processes):
            process.stop(grace_s=10)


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
