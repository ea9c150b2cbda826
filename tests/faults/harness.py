"""The fault suite's harness: a platform whose PostgreSQL and Redis we can cut.

Public surface: ``FaultPlatform``, ``start_fault_platform``, ``Case``, ``Figures``,
``Drill``, ``run_drill``, ``FIGURES_DIR`` (and, from ``tests.faults.load``,
``Load``, ``Answer``, ``HealthWatch``).

``start_fault_platform`` runs, for the whole suite, a PostgreSQL of its own
(``localrun.own_postgres``) and a redis-server of its own
(``tests.live.RedisServer``), each in a network
namespace of its own (``tests.faults.netns``), and in the root namespace the
platform's processes as ``make up`` runs them: the node agent with its simulated
replicas, a gateway and a Celery worker with beat (the usage flush). The machine's
shared PostgreSQL and Redis are never touched.

Each case takes a team of its own (``FaultPlatform.case``: made through the
admin API, so its usage rows are the case's alone), runs a ``Load`` of a few
concurrent streams through the ``openai`` SDK, each with a deadline, while a
``HealthWatch`` samples the gateway's ``/healthz``; it injects its fault, takes it
away, and then checks the usage rows and ``/v1/organization/usage`` against the
usage the clients were told. ``Figures`` are what a case measured: they go to the
test's report (printed at the end of the run) and to ``.local/faults/<case>.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg

from localrun.own_postgres import OwnPostgres
from localrun.processes import (
    ROOT,
    Process,
    bootstrap_platform,
    gateway_argv,
    manage,
    server_pgid,
    spawn,
    start_agent,
    start_gateway,
    wait_until,
)
from tests.faults.load import Answer, HealthWatch, Load, outcomes, told_usage
from tests.faults.netns import Netns
from tests.live import RedisServer

__all__ = [
    "FIGURES_DIR",
    "Answer",
    "Case",
    "Drill",
    "FaultPlatform",
    "Figures",
    "HealthWatch",
    "Load",
    "run_drill",
    "start_fault_platform",
]

FIGURES_DIR = ROOT / ".local" / "faults"
REGION = "local"
MODEL = "chat-7b"


@dataclass
class FaultPlatform:
    """The running platform of the suite and the servers its faults act on."""

    env: dict[str, str]
    creds: dict[str, str]
    pg: OwnPostgres
    pg_netns: Netns
    redis: RedisServer
    redis_netns: Netns
    agent: Process
    gateway: Process
    worker: Process
    tmp: Path
    db_url: str
    # What the suite stops at its end (``start_fault_platform``): a process
    # started again takes the place of the one it replaces.
    processes: list[Process] = field(default_factory=list)

    def admin(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return httpx.request(
            method,
            f"{self.gateway.url}/admin/{path}",
            json=body,
            headers={"Authorization": f"Bearer {self.creds['admin_token']}"},
            timeout=30,
        )

    def case(self, name: str, *, tokens_per_minute: int = 10**9) -> Case:
        """Make team ``name`` (unique per run) with a key and a limit on chat-7b;
        return once the gateway serves it."""
        team = f"{name.replace('_', '-')[:40]}-{uuid.uuid4().hex[:6]}"
        assert self.admin("POST", "teams", {"team": team}).is_success
        key = self.admin("POST", f"teams/{team}/keys", {}).json()["key"]
        limit = {
            "model": MODEL,
            "tokens_per_minute": tokens_per_minute,
            "max_concurrency": 1000,
        }
        response = self.admin("PUT", f"teams/{team}/limits", limit)
        assert response.is_success, response.text
        case = Case(self, name, team, key, tokens_per_minute)
        wait_until(case.can_chat, timeout_s=30, message=f"team {team} to be served")
        return case

    def replica_urls(self) -> list[str]:
        """Return the URLs of chat-7b's serving replicas (database view)."""
        with psycopg.connect(self.db_url, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT url FROM replicas WHERE model_id = %s AND state = 'serving'"
                " ORDER BY replica_id",
                [MODEL],
            ).fetchall()
        return [str(url) for (url,) in rows]

    def live_replica_urls(self) -> list[str]:
        """Return the URLs of every model's replicas not marked gone (database)."""
        with psycopg.connect(self.db_url, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT url FROM replicas WHERE state <> 'gone' ORDER BY replica_id"
            ).fetchall()
        return [str(url) for (url,) in rows]

    def kill_replica(self, url: str) -> None:
        """SIGKILL the process group of the replica serving ``url``."""
        os.killpg(server_pgid(url), signal.SIGKILL)

    def kill_gateway(self) -> None:
        """SIGKILL the gateway (uvicorn, one process in its group) and reap it."""
        os.killpg(self.gateway.popen.pid, signal.SIGKILL)
        self.gateway.popen.wait(10)

    def restart_gateway(self) -> None:
        """Start the gateway again on its port, as its supervisor would; return
        at once (the caller measures how long it takes to serve)."""
        old = self.gateway
        port = int(old.url.rsplit(":", 1)[1])
        self.gateway = self._replace(
            old, gateway_argv(port), f"gateway-{port}-again-{time.time_ns()}.log"
        )

    def kill_agent(self) -> None:
        """SIGKILL the node agent's process alone (as the OOM killer would) and
        reap it; its replicas run in sessions of their own."""
        os.kill(self.agent.popen.pid, signal.SIGKILL)
        self.agent.popen.wait(10)

    def restart_agent(self) -> None:
        """Start the node agent again with its command line (node, ports, log
        folder), as its supervisor would; return at once."""
        old = self.agent
        self.agent = self._replace(
            old, argv_of(old), f"agent-again-{time.time_ns()}.log"
        )

    def _replace(self, old: Process, argv: list[str], log: str) -> Process:
        new = spawn(argv, self.env, self.tmp / log, old.url)
        self.processes[[p is old for p in self.processes].index(True)] = new
        return new

    def replica_processes(self) -> list[tuple[int, int]]:
        """Return (port, pid) of each simulated replica's leader running on the
        node agent's ports, whichever agent started it (a port twice: a
        duplicate)."""
        argv = argv_of(self.agent)
        first, last = (int(p) for p in argv[argv.index("--ports") + 1].split("-"))
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
                pid = int(entry.name)
                if b"simengine" in words and b"--port" in words:
                    port = int(words[words.index(b"--port") + 1])
                    if first <= port <= last and os.getpgid(pid) == pid:
                        found.append((port, pid))
            except (OSError, ValueError, IndexError):
                continue
        return sorted(found)

    def healthz(self) -> tuple[int, dict[str, Any]]:
        response = httpx.get(f"{self.gateway.url}/healthz", timeout=5)
        return response.status_code, response.json()

    def flush_usage(self) -> None:
        """Write every minute's usage to rows now, as the flush task does once the
        minute closes (``metering.services.flush_redis_usage``)."""
        code = (
            "import redis; from datetime import timedelta; "
            "from django.conf import settings; from django.utils import timezone; "
            "from metering.services import flush_redis_usage; "
            "c = redis.Redis.from_url(settings.REDIS_URL); "
            "flush_redis_usage(client=c, prefix=settings.REDIS_KEY_PREFIX, "
            "now=timezone.now() + timedelta(minutes=2))"
        )
        manage(self.env, "shell", "-c", code, timeout_s=60)


def argv_of(process: Process) -> list[str]:
    """Return the command line ``process`` was started with."""
    args = process.popen.args
    assert isinstance(args, list), args
    return [str(arg) for arg in args]


@contextlib.contextmanager
def start_fault_platform(tmp: Path, redis_binary: str) -> Iterator[FaultPlatform]:
    """Run the suite's platform (see the module's docstring) while the block runs."""
    with contextlib.ExitStack() as stack:
        pg_netns = stack.enter_context(Netns())
        redis_netns = stack.enter_context(Netns())
        pg = stack.enter_context(
            OwnPostgres(host=pg_netns.ip, command_prefix=pg_netns.exec_argv([]))
        )
        db_url = pg.create_database("platform")
        redis_server = RedisServer(
            tmp,
            binary=redis_binary,
            host=redis_netns.ip,
            command_prefix=redis_netns.exec_argv([]),
        )
        redis_server.start()
        stack.callback(redis_server.stop)
        env = {
            **os.environ,
            "DATABASE_URL": db_url,
            "REDIS_URL": redis_server.url,
            "PLATFORM_REGION": REGION,
            "PLATFORM_REDIS_PREFIX": f"faults-{uuid.uuid4().hex[:8]}",
            "PLATFORM_SNAPSHOT_REFRESH_S": "0.5",
            "PLATFORM_SNAPSHOT_PERSIST_S": "0.5",
            "PLATFORM_SNAPSHOT_PATH": str(tmp / "snapshots" / "local.json"),
            "PLATFORM_USAGE_FLUSH_S": "1",
            "PLATFORM_KEY_LAST_USED_FLUSH_S": "0.5",
            "PLATFORM_DB_POOL_TIMEOUT_S": "1",
            "SECRET_KEY": "faults-only",
        }
        env.pop("DJANGO_SETTINGS_MODULE", None)
        creds = bootstrap_platform(env, tmp / "credentials.json")
        processes: list[Process] = []

        def stop_all() -> None:
            for process in reversed(processes):
                process.stop(grace_s=10)

        stack.callback(stop_all)
        agent = start_agent(env, tmp, region=REGION, node="faults-node")
        processes.append(agent)
        gateway = start_gateway(env, tmp)
        processes.append(gateway)
        argv = [sys.executable, "-m", "celery", "-A", "config", "worker", "-B"]
        argv += ["-Q", "celery", "--concurrency", "1", "--loglevel", "INFO"]
        argv += ["--schedule", str(tmp / "celerybeat-schedule")]
        worker = spawn(argv, env, tmp / "worker.log", "")
        processes.append(worker)
        platform = FaultPlatform(
            env=env,
            creds=creds,
            pg=pg,
            pg_netns=pg_netns,
            redis=redis_server,
            redis_netns=redis_netns,
            agent=agent,
            gateway=gateway,
            worker=worker,
            tmp=tmp,
            db_url=db_url,
            processes=processes,
        )
        wait_until(
            lambda: len(platform.replica_urls()) >= 2 and platform.healthz()[0] == 200,
            timeout_s=90,
            interval_s=0.5,
            message="two chat-7b replicas serving and /healthz ready",
        )
        yield platform


@dataclass
class Figures:
    """What one case measured (its JSON under .local/faults/)."""

    case: str
    fault: str
    outage_s: float
    answers: dict[str, int] = field(default_factory=dict)
    hung: int = 0
    recovery_s: float | None = None
    healthz_not_ready: int = 0
    healthz_samples: int = 0
    usage_told: dict[str, int] = field(default_factory=dict)
    usage_rows: dict[str, int] = field(default_factory=dict)
    usage_api: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def write(self) -> Path:
        FIGURES_DIR.mkdir(parents=True, exist_ok=True)
        path = FIGURES_DIR / f"{self.case}.json"
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        return path

    def line(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass
class Case:
    """One drill: its team, its key and what it measured."""

    platform: FaultPlatform
    name: str
    team: str
    key: str
    tokens_per_minute: int
    started: float = field(default_factory=time.time)
    pings: list[Answer] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.platform.gateway.url}/v1",
            api_key=self.key,
            max_retries=0,
            timeout=10,
        )

    def can_chat(self) -> bool:
        """Send one chat; keep its usage in ``pings`` (the rows count it too)."""
        started = time.monotonic()
        try:
            answer = self.client().chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "ping"}],
                max_tokens=1,
            )
        except openai.APIError:
            return False
        assert answer.usage is not None
        details = answer.usage.prompt_tokens_details
        self.pings.append(
            Answer(
                started=started,
                ended=time.monotonic(),
                outcome="ok",
                prompt_tokens=answer.usage.prompt_tokens,
                cached_tokens=(details.cached_tokens or 0) if details else 0,
                output_tokens=answer.usage.completion_tokens,
            )
        )
        return True

    def load(self, **kwargs: Any) -> Load:
        return Load(self.platform.gateway.url, self.key, **kwargs)

    def usage_rows(self) -> dict[str, int] | None:
        """The team's usage rows summed, or None while the database is away."""
        try:
            with psycopg.connect(self.platform.db_url, connect_timeout=2) as conn:
                row = conn.execute(
                    "SELECT coalesce(sum(requests), 0), coalesce(sum(prompt_tokens), 0),"
                    " coalesce(sum(cached_tokens), 0), coalesce(sum(output_tokens), 0),"
                    " coalesce(sum(rate_limited), 0) FROM usage WHERE team_id = %s",
                    [self.team],
                ).fetchone()
        except psycopg.OperationalError:
            return None
        assert row is not None
        names = ("requests", "prompt_tokens", "cached_tokens", "output_tokens")
        return dict(zip((*names, "rate_limited"), (int(v) for v in row), strict=True))

    def usage_api(self) -> dict[str, int]:
        """The team's usage as ``/v1/organization/usage/completions`` says it."""
        response = httpx.get(
            f"{self.platform.gateway.url}/v1/organization/usage/completions",
            params={"start_time": int(self.started) - 86400, "bucket_width": "1d"},
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=10,
        )
        response.raise_for_status()
        totals: Counter[str] = Counter()
        for bucket in response.json()["data"]:
            for result in bucket["results"]:
                totals["requests"] += result["num_model_requests"]
                totals["prompt_tokens"] += result["input_tokens"]
                totals["cached_tokens"] += result["input_cached_tokens"]
                totals["output_tokens"] += result["output_tokens"]
                totals["rate_limited"] += result.get("rate_limited_requests", 0)
        return dict(totals)

    def settle_usage(self, told: dict[str, int], *, timeout_s: float = 15) -> None:
        """Wait until the rows hold ``told``, flushing as the worker would; the
        last rows read stay in ``self.last_rows`` for the figures."""
        self.last_rows: dict[str, int] | None = None

        def matches() -> bool:
            self.platform.flush_usage()
            self.last_rows = self.usage_rows()
            return self.last_rows == told

        with contextlib.suppress(AssertionError):
            wait_until(matches, timeout_s=timeout_s, interval_s=1)


def recovery_after(
    condition: Any, *, healed_at: float, timeout_s: float, message: str
) -> float:
    """Poll ``condition`` until it holds; return seconds since ``healed_at``."""
    wait_until(condition, timeout_s=timeout_s, interval_s=0.1, message=message)
    return round(time.monotonic() - healed_at, 2)


def hold(seconds: float) -> None:
    """Keep a fault on for ``seconds`` (a scheduled outage, not a wait for a
    condition: the load and the health watch run meanwhile in their threads)."""
    threading.Event().wait(seconds)


@dataclass
class Drill:
    """What ``run_drill`` leaves to a case's assertions: the main team's answers
    and figures, and each side team's answers, usage told and rows."""

    figures: Figures
    answers: list[Answer]
    watch: HealthWatch
    fault_at: float
    healed_at: float
    told: dict[str, int]
    side: list[tuple[Case, list[Answer], dict[str, int]]] = field(default_factory=list)


def run_drill(
    case: Case,
    *,
    fault: str,
    inject: Callable[[], object],
    heal: Callable[[], object],
    recovered: Callable[[], bool],
    outage_s: float,
    load: Load | None = None,
    side: Sequence[tuple[Case, Load]] = (),
    before_fault: Callable[[], bool] = lambda: True,
) -> Drill:
    """Run ``load`` (3 streams by default) through ``case``'s team, and the
    ``side`` loads through theirs: a few answers, then ``inject``, ``outage_s`` of
    outage, ``heal``, and the loads go on until ``recovered()`` holds and three
    more answers came; then settle the usage. ``before_fault`` must hold too
    before the fault (a side team over its limit already, say).

    The recovery time is from ``heal`` to ``recovered()`` (None if it never
    held within a minute: the figures are still made, for the case to fail on).
    """
    load = load or case.load()
    recovery_s: float | None = None
    with contextlib.ExitStack() as stack:
        watch = stack.enter_context(HealthWatch(case.platform.gateway.url))
        for running in (load, *(side_load for _, side_load in side)):
            stack.enter_context(running)
        wait_until(
            lambda: load.count_ok_since(0) >= 3 and before_fault(),
            timeout_s=30,
            message="three answers (and before_fault) before the fault",
        )
        fault_at = time.monotonic()
        inject()
        try:
            hold(outage_s)
        finally:
            heal()
        healed_at = time.monotonic()
        with contextlib.suppress(AssertionError):
            recovery_s = recovery_after(
                recovered,
                healed_at=healed_at,
                timeout_s=60,
                message=f"recovery from {fault}",
            )
        since = time.monotonic()
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: load.count_ok_since(since) >= 3,
                timeout_s=30,
                message="three answers after the recovery",
            )
    answers = load.snapshot()
    told = told_usage([*case.pings, *answers])
    case.settle_usage(told)
    sides = []
    for side_case, side_load in side:
        side_answers = side_load.snapshot()
        side_told = told_usage([*side_case.pings, *side_answers])
        side_case.settle_usage(side_told)
        sides.append((side_case, side_answers, side_told))
    figures = Figures(
        case=case.name,
        fault=fault,
        outage_s=outage_s,
        answers=outcomes(answers),
        hung=sum(1 for a in answers if a.outcome == "hung"),
        recovery_s=recovery_s,
        healthz_not_ready=len(watch.not_ready()),
        healthz_samples=len(watch.samples),
        usage_told=told,
        usage_rows=case.last_rows or {},
        usage_api=case.usage_api(),
    )
    return Drill(figures, answers, watch, fault_at, healed_at, told, sides)
