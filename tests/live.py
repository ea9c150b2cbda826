"""A live platform for end-to-end tests: the gateway and the node agent as processes.

``start_platform`` seeds the control-plane rows into the test database
(``localrun.seeding``; committed, so the processes see them), starts ``manage.py
engine_agent`` (which starts the simulated replicas) and the gateway under uvicorn,
and waits until the gateway serves. Everything talks HTTP on loopback; Redis is used when REDIS_URL is set.
``SharedPlatform`` is one such platform that several small modules use in turn.
``RedisServer`` is a Redis of a test's own, which the test may stop and start
again (never the machine's shared one).

As under `make up`, the platform runs with its process secrets: replicas demand an
engine key on ``/v1`` (the gateway sends it), ``/sim/faults`` an admin token and
``/metrics`` a scrape token. ``LivePlatform.metrics``, ``scrape_metrics`` and
``LivePlatform.sim_admin_headers`` send them. ``LivePlatform.admin_api`` is a
control-plane client whose admin writes are checked against the audit trail.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from control.autoscaling import set_pool_autoscaling
from engine_nodes.models import Replica
from localrun.processes import (
    Process,
    database_url,
    free_port,
    spawn,
    start_agent,
    start_gateway,
    wait_until,
)
from localrun.seeding import (
    VERSION_BODY,
    LimitSeed,
    ModelSeed,
    PlatformSeed,
    TeamSeed,
    VersionSeed,
    digest,
    seed_platform,
    version_body,
)
from models_registry.models import ModelVersion, Pool
from tests.audit_check import admin_api

if TYPE_CHECKING:
    import openai
    import pytest
    from openai.types import CompletionUsage
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from pytest_django import DjangoDbBlocker


@dataclass
class LivePlatform:
    """What a test needs of the running platform."""

    url: str
    region: str
    keys: dict[str, str]
    env: dict[str, str]
    gateway: Process
    agent: Process
    prefix: str
    extra: list[Process] = field(default_factory=list)
    worker: Process | None = None  # the Celery worker with beat (``autoscaler=True``)

    def client(self, team: str = "alpha", **kwargs: Any) -> openai.OpenAI:
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.keys[team], max_retries=0, **kwargs
        )

    def metrics(self, url: str | None = None) -> str:
        """Return the /metrics exposition of the gateway at ``url`` (default: ours)."""
        return scrape_metrics(url or self.url, self.env)

    def admin_api(
        self, name: str, *, blocker: DjangoDbBlocker | None = None
    ) -> AbstractContextManager[httpx.Client]:
        """Return a client of the control plane with a new admin token ``name``;
        once it is done, every admin write it made is checked against the audit
        trail (``tests.audit_check``)."""
        return admin_api(self.url, name=name, blocker=blocker)

    def sim_admin_headers(self) -> dict[str, str]:
        """Return the headers that open a simulated replica's /sim/faults."""
        return {"Authorization": f"Bearer {self.env['PLATFORM_SIM_ADMIN_TOKEN']}"}

    def serving(self, version: str | None = None) -> list[Replica]:
        replicas = Replica.objects.filter(region=self.region, state="serving")
        if version is not None:
            replicas = replicas.filter(version__version=version)
        return list(replicas.order_by("replica_id"))


def gateway_env(base: Mapping[str, str], **overrides: str) -> dict[str, str]:
    """Return the environment of a gateway or agent process."""
    env = dict(base)
    env.update(overrides)
    return env


def platform_env(*, region: str, prefix: str, **overrides: str) -> dict[str, str]:
    """Return the environment of an end-to-end platform's gateway and agent: the
    test database, one region, its own Redis prefix, fast refresh and flush, and
    fresh process secrets (engine key, sim admin token, metrics token)."""
    defaults = {
        "DATABASE_URL": database_url(),
        "PLATFORM_REGION": region,
        "PLATFORM_REDIS_PREFIX": prefix,
        "PLATFORM_SNAPSHOT_REFRESH_S": "0.5",
        # No snapshot file unless a test asks for one (its own path): gateways
        # of other tests must not serve each other's snapshots.
        "PLATFORM_SNAPSHOT_PATH": "",
        "PLATFORM_USAGE_FLUSH_S": "1",
        "PLATFORM_KEY_LAST_USED_FLUSH_S": "0.5",
        "PLATFORM_DEFAULT_TOKENS_PER_MINUTE": "0",
        "SECRET_KEY": "e2e-only",
        "PLATFORM_ENGINE_API_KEY": f"engine-{secrets.token_urlsafe(16)}",
        "PLATFORM_SIM_ADMIN_TOKEN": f"sim-admin-{secrets.token_urlsafe(16)}",
        "PLATFORM_METRICS_TOKEN": f"metrics-{secrets.token_urlsafe(16)}",
    }
    env = gateway_env(os.environ, **{**defaults, **overrides})
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


@contextmanager
def start_platform(
    tmp: Path,
    *,
    pools: dict[str, int],
    canary: bool = False,
    engine_config: Mapping[str, Any] | None = None,
    replica_tokens_in_flight: int | None = None,
    pool_settings: Mapping[str, Any] | None = None,
    guaranteed_shares: Mapping[str, float] | None = None,
    autoscaler: bool = False,
    extra_models: Sequence[ModelSeed] = (),
    version_configs: Mapping[str, Mapping[str, Any]] | None = None,
    **env_overrides: str,
) -> Iterator[LivePlatform]:
    """Run a platform with ``pools`` ({version: replicas}) of chat-7b in region e2e.

    ``engine_config`` is merged into every version's (``sim_profile``,
    ``max_num_seqs``...); ``replica_tokens_in_flight`` is stored as every version's
    load-tested capacity per replica (what admission and the autoscaler divide by);
    ``pool_settings`` are autoscaling settings applied to every pool through the
    service (``max_replicas``, windows...; checked as the API checks them);
    ``guaranteed_shares`` ({team: share}) go into the teams' limits. With
    ``autoscaler``, a Celery worker with beat runs too (``start_worker``), so the
    autoscaler's tick sizes the pools; it starts once the gateway serves, and it
    runs the version gates too (queue ``gates``, through this gateway).
    ``extra_models`` are seeded beside chat-7b (a judge model, say), their versions
    live and their pools started like chat-7b's; the teams may call them.
    ``version_configs`` ({label: engine_config}) is merged into one version's
    config (``sim_degraded`` for a broken version, say).
    """
    test_name = connection.settings_dict.get("TEST", {}).get("NAME")
    name = str(connection.settings_dict["NAME"])
    if not (name.startswith("test_") or name == test_name):
        raise RuntimeError(f"refusing to run end-to-end tests against {name}")
    region = "e2e"
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    teams = ("alpha", "beta")
    seeded = seed_platform(
        seed=PlatformSeed(
            region=region,
            teams=tuple(TeamSeed(team) for team in teams),
            models=(
                *extra_models,
                ModelSeed(
                    model_id="chat-7b",
                    versions=tuple(
                        VersionSeed(
                            label,
                            version_body(
                                weights_hash=digest(f"weights {label}"),
                                engine_config={
                                    **VERSION_BODY["engine_config"],
                                    **(engine_config or {}),
                                    **(version_configs or {}).get(label, {}),
                                },
                            ),
                            min_replicas=count,
                            max_replicas=max(count, 1),
                        )
                        for label, count in sorted(pools.items())
                    ),
                ),
            ),
            limits=tuple(
                LimitSeed(
                    team_id=team,
                    model_id=model_id,
                    tokens_per_minute=10**9,
                    max_concurrency=10_000,
                    guaranteed_share=(guaranteed_shares or {}).get(team, 0.0),
                )
                for team in teams
                for model_id in ("chat-7b", *(m.model_id for m in extra_models))
            ),
        ),
        now=timezone.now(),
    )
    keys = dict(seeded.keys)
    if replica_tokens_in_flight is not None:
        ModelVersion.objects.filter(model_id="chat-7b").update(
            load_test_tokens_in_flight=replica_tokens_in_flight
        )
    if pool_settings:
        for label in pools:
            set_pool_autoscaling(
                model_id="chat-7b",
                version=label,
                region=region,
                changes=dict(pool_settings),
            )
    env = platform_env(region=region, prefix=prefix, **env_overrides)
    agent = start_agent(env, tmp, region=region, node="e2e-node")
    gateway = worker = None
    try:
        total = sum(pools.values()) + sum(
            v.min_replicas for m in extra_models for v in m.versions
        )
        wait_until(
            lambda: (
                Replica.objects.filter(region=region, state="serving").count() == total
                or agent.popen.poll() is not None
            ),
            timeout_s=60,
            message=f"{total} serving replicas",
        )
        if agent.popen.poll() is not None:
            raise AssertionError(f"agent exited:\n{agent.log()}")
        gateway = start_gateway(env, tmp)
        platform = LivePlatform(
            url=gateway.url,
            region=region,
            keys=keys,
            env=env,
            gateway=gateway,
            agent=agent,
            prefix=prefix,
        )
        # The gateway serves once it has seen the replicas beat.
        wait_until(
            lambda: can_serve(platform),
            timeout_s=30,
            message="the gateway to route to a replica",
        )
        if autoscaler:
            env["PLATFORM_GATE_GATEWAY_URL"] = gateway.url
            worker = platform.worker = start_worker(env, tmp, region=region)
        yield platform
    finally:
        if worker is not None:
            worker.stop(grace_s=10)
        if gateway is not None:
            gateway.stop()
        agent.stop(grace_s=20)
        call_command("flush", interactive=False, verbosity=0)


# The platform that the modules of conftest.py's SHARED_PLATFORM_MODULES use in
# turn: v1 live on two replicas, v2 ready on one (for canaries and shadows), and a
# request that names no max_tokens ends after 6 (the fuzzed bodies: a property of
# the gateway, not of long answers). A module that needs other settings starts a
# platform of its own.
SHARED_POOLS = {"v1": 2, "v2": 1}


class SharedPlatform:
    """One running platform for several test modules, started when one asks for it.

    Every module that starts a platform of its own costs a start (seeding, the
    agent, its replicas, the gateway) and a stop (a database flush); the small
    end-to-end modules that need nothing special take this one instead
    (conftest.py's ``shared_platform``). It stays up while such modules follow
    one another and stops (``stop``) before a test that does not use it runs, so
    the other tests find the database empty and no processes of it left; the next
    module that asks starts it again. conftest.py's WORK_UNITS give those
    modules to one pytest-xdist worker, one after another, so it starts once.

    A module using it leaves it as it found it: the alias on v1, no rollout, no
    fault left on a replica, the seeded team limits.
    """

    def __init__(
        self, tmp_path_factory: pytest.TempPathFactory, blocker: DjangoDbBlocker
    ) -> None:
        self._tmp_path_factory = tmp_path_factory
        self._blocker = blocker
        self._stack: contextlib.ExitStack | None = None
        self._live: LivePlatform | None = None

    def get(self) -> LivePlatform:
        """Return the running platform, started first if it is not running."""
        if self._live is None:
            with contextlib.ExitStack() as stack:
                # The processes read the seeded rows; the stop flushes them.
                stack.enter_context(self._blocker.unblock())
                tmp = self._tmp_path_factory.mktemp("shared-platform")
                self._live = stack.enter_context(
                    start_platform(
                        tmp, pools=SHARED_POOLS, PLATFORM_DEFAULT_MAX_TOKENS="6"
                    )
                )
                self._stack = stack.pop_all()
        return self._live

    def stop(self) -> None:
        """Stop the platform and flush its rows (nothing when it is not running)."""
        stack, self._stack, self._live = self._stack, None, None
        if stack is not None:
            stack.close()


def start_worker(env: dict[str, str], tmp: Path, *, region: str) -> Process:
    """Start a Celery worker with beat (as ``make up`` does) and wait for its first
    autoscaler tick on ``region``'s pools.

    Its beat schedule file is under ``tmp``; its broker is the platform's Redis
    under the platform's prefix (``CELERY_BROKER_TRANSPORT_OPTIONS``), so it takes
    no other run's tasks.
    """
    argv = [sys.executable, "-m", "celery", "-A", "config", "worker", "-B"]
    # Two processes, as make up runs: the gates (minutes) never hold up a tick.
    argv += ["-Q", "celery,gates", "--concurrency", "2", "--loglevel", "INFO"]
    argv += ["--schedule", str(tmp / "celerybeat-schedule")]
    worker = spawn(argv, env, tmp / "worker.log", "")
    try:
        wait_until(
            lambda: (
                all(
                    isinstance(state, dict) and "last" in state
                    for state in Pool.objects.filter(region=region).values_list(
                        "autoscaler_state", flat=True
                    )
                )
                or worker.popen.poll() is not None
            ),
            timeout_s=60,
            interval_s=0.2,
            message="the autoscaler's first tick",
        )
        if worker.popen.poll() is not None:
            raise AssertionError(f"celery worker exited:\n{worker.log()}")
    except BaseException:
        worker.stop()
        raise
    return worker


def can_serve(
    platform: LivePlatform, model: str = "chat-7b", *, timeout_s: float = 10
) -> bool:
    """Return True once team alpha gets a one-token answer from ``model``."""
    try:
        response = httpx.post(
            f"{platform.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {platform.keys['alpha']}"},
            json={
                "model": model,
                "messages": [{"role": "user", "content": "ping"}],
                "max_tokens": 1,
            },
            timeout=timeout_s,
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def scrape_metrics(url: str, env: Mapping[str, str]) -> str:
    """Return ``url``'s /metrics as a scraper with ``env``'s metrics token gets it."""
    response = httpx.get(
        f"{url}/metrics",
        headers={"Authorization": f"Bearer {env['PLATFORM_METRICS_TOKEN']}"},
        timeout=10,
    )
    response.raise_for_status()
    return response.text


def process_cmdlines() -> bytes:
    """Return every process's command line, as `ps` shows them to any user."""
    lines = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # a process that just exited
            lines.append(path.read_bytes())
    return b"\n".join(lines)


def usage_of(answer: ChatCompletion | ChatCompletionChunk) -> CompletionUsage:
    """Return the usage the platform sends on every answer and every final event."""
    assert answer.usage is not None, answer
    return answer.usage


def cached_tokens_of(answer: ChatCompletion | ChatCompletionChunk) -> int:
    """Return the answer's ``usage.prompt_tokens_details.cached_tokens``."""
    details = usage_of(answer).prompt_tokens_details
    assert details is not None, answer
    assert details.cached_tokens is not None, answer
    return details.cached_tokens


def extra_of(answer: openai.BaseModel) -> dict[str, Any]:
    """Return the fields the platform adds to OpenAI's (model_version, replica_id...)."""
    assert answer.model_extra is not None, answer
    return answer.model_extra


class RedisServer:
    """A redis-server of a test's own on a free port, which the test stops and starts.

    Never the machine's shared Redis. It keeps its data across a restart (an
    append-only file under its folder, synced on every write), as a production
    Redis must for the usage counts it holds until they are flushed. ``host`` is
    the address it listens on (127.0.0.1 unless a fault drill puts it in a
    network namespace of its own) and ``command_prefix`` runs it under another
    command (``ip netns exec NAME``, so the server lives there), as
    ``localrun.own_postgres.OwnPostgres`` takes them.
    """

    def __init__(
        self,
        tmp: Path,
        *,
        binary: str = "redis-server",
        host: str = "127.0.0.1",
        command_prefix: Sequence[str] = (),
    ) -> None:
        self.binary = binary  # the conftest's ``redis_server_binary``
        self.host = host
        self.command_prefix = tuple(command_prefix)
        self.port = free_port()
        self.folder = tmp / f"redis-{self.port}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process: Process | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def is_up(self) -> bool:
        import redis

        try:
            with redis.Redis.from_url(
                self.url, socket_connect_timeout=0.5, socket_timeout=0.5
            ) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def start(self) -> None:
        """Start the server (again, on the same port and data) and wait for it."""
        argv = [*self.command_prefix, self.binary, "--port", str(self.port)]
        # Not protected: a server in a namespace is reached from outside loopback.
        argv += ["--bind", self.host, "--protected-mode", "no"]
        argv += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        argv += ["--dir", str(self.folder), "--daemonize", "no"]
        process = spawn(argv, dict(os.environ), self.folder / "redis.log", self.url)
        self.process = process
        wait_until(
            lambda: self.is_up() or process.popen.poll() is not None,
            timeout_s=20,
            message=f"redis-server on {self.url}",
        )
        if process.popen.poll() is not None:
            raise AssertionError(f"redis-server exited:\n{process.log()}")

    def stop(self) -> None:
        """Stop the server (SIGTERM: it syncs its file and exits)."""
        if self.process is not None:
            self.process.stop(grace_s=10)
            self.process = None


def assert_conforms_to_schema(
    schema_url: str,
    *,
    token: str,
    config: Path,
    hooks: str,
    seed: int,
    max_examples: int,
    budget_s: float,
    workdir: Path,
    request_timeout_s: int = 10,
) -> None:
    """Run schemathesis (``st run``: every phase and check) against a live schema;
    fail with its report unless it finds no issue within ``budget_s``.

    Bounded and seeded, with no example database (a failure found once is not
    replayed next run); ``hooks`` is the module of its hooks, imported from here.
    """
    argv = [
        str(Path(sys.executable).with_name("st")),
        "--no-color",
        "--config-file",
        str(config),
        "run",
        schema_url,
        "--header",
        f"Authorization: Bearer {token}",
        "--seed",
        str(seed),
        "--max-examples",
        str(max_examples),
        "--generation-database",
        "none",
        "--workers",
        "1",
        "--request-timeout",
        str(request_timeout_s),
    ]
    repo = Path(__file__).resolve().parent.parent
    started = time.monotonic()
    run = subprocess.run(
        argv,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=budget_s,
        check=False,
        env={
            **os.environ,
            "SCHEMATHESIS_HOOKS": hooks,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(repo), os.environ.get("PYTHONPATH")])
            ),
        },
    )
    took_s = time.monotonic() - started
    assert run.returncode == 0, f"{run.stdout[-20000:]}\n{run.stderr[-4000:]}"
    assert "No issues found" in run.stdout, run.stdout[-4000:]
    assert took_s < budget_s
