"""Benchmark the gateway's token relay against a bare relay, peer gateways and the upstream.

In one run, against the same fake upstream (``bench/fake_upstream.py``: vLLM-shaped
SSE, 300 tokens at 30 tokens/s), for each concurrency level, interleaved:

1. **direct**: the load generator (``bench/loadgen.py``) talks to the upstream;
2. **bare**: ``bench/bare_relay.py`` (uvicorn + Channels router + raw ASGI callable +
   one shared aiohttp session, no parsing) in between;
3. **gateway**: the real gateway, ``uvicorn config.asgi:application``, on a fresh
   PostgreSQL database (migrated, then dropped), Redis db 14 under a unique key
   prefix, with a team, a key, a model, a pool and replica rows pointing at the
   upstream processes; a thread publishes the replicas' Redis beats every second.
   Worker counts above 1 (``--gateway-workers``) run at levels of at least
   ``--multi-worker-min-level``.
4. **smg**, **litellm**: the gateways teams would pick instead (``bench/peers.py``:
   SMG's Rust router and the LiteLLM proxy, each installed into its own venv under
   ``.local/peers/`` on first use and skipped with a message when that fails), in
   front of the same upstreams, pinned and counted as the relays are. LiteLLM runs
   only at levels up to ``--litellm-max-level`` (100): it cannot carry more.
5. **server variants**, ``gateway@daphne``, ``gateway@granian``, ``bare@daphne``,
   ``bare@granian``: the same app under another ASGI server (one worker).
6. **traced**: the gateway with OpenTelemetry traces on at the default sampling
   (``PLATFORM_TRACES_SAMPLE_RATIO``), exporting over OTLP/HTTP to the tests'
   receiver (``tests/otlp_collector.py``) run beside it; ``checks`` judges its
   CPU per relayed token within 5% of the gateway's (issue 40);
7. **recorded**: the gateway with its pool recording every conversation for the
   traffic twin (``record_traffic_share`` 1, ``routing.traffic``: the records'
   hashing and their Redis writes included); the pool's share is set as each
   gateway target starts (0 for the others). ``--per-request`` runs it by default
   and ``checks`` judges its CPU per request within 5% of the gateway's;
8. **baseline** (with ``--baseline-tree PATH``): the gateway again, run from another
   checkout (say, the code before a change), against the same database and Redis,
   so that before and after are measured side by side in one run.

Per run: events/s, tokens/s, TTFT and gap percentiles (between content events),
errors (from the load generator, over a window after one stream length of
ramp-up), and the relay's CPU (utime + stime of the process and its children from
/proc over the window) per 10,000 relayed events, per 10,000 relayed tokens and per
request. The summary gives, per level, the one-worker gateway's CPU as a ratio of
each other target's ("gateway / X") and judges the issue's targets (``checks``).
``--per-request`` measures the fixed cost of a request instead (50 users, 2-token
answers, the upstream at 1,000 tokens/s; bare, gateway, smg, litellm) and judges the
gateway's CPU per request against SMG's. ``--tokens-per-event 1,4`` repeats
everything with the upstream putting up to N tokens in one SSE event (as vLLM does
under load), restarted on the same ports for each N. By default the relay is pinned
to CPU 0 and the upstream and load generator to CPU 1 (``--pin none`` turns this
off; multi-worker gateways get both CPUs). Every process started is stopped and the
database dropped on exit, Ctrl-C included. Run from the repository root:

    .venv/bin/python bench/gateway.py --out bench/results/gateway.json \
        [--levels 100,500,1000] [--duration-s 20] [--repeat 1] [--profile] \
        [--targets direct,bare,gateway,gateway@daphne,smg,litellm] \
        [--tokens-per-event 1,4] [--baseline-tree /tmp/before]
    .venv/bin/python bench/gateway.py --per-request \
        --out bench/results/gateway_per_request.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402
from localrun.processes import SERVERS, free_port, gateway_argv  # noqa: E402

BENCH = ROOT / "bench"
LOG_DIR = ROOT / ".local" / "bench-gateway"
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
REGION = "bench"
MODEL = "chat-7b"
TOKEN_TEXT = " word"  # the fake upstream's text of every token
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
TARGETS = {
    "gateway_cpu_ratio_max": 1.3,
    "added_ttft_p99_ms_at_100": 25.0,
    "gap_p99_ms_at_1000": 66.0,
    # Issue 20: the one-worker gateway (uvicorn) against SMG in the same run.
    "cpu_per_token_over_smg_max": 1.0,
    "nominal_share_at_1000": 0.97,
    "cpu_per_request_over_smg_max": 1.5,
    # Issue 40: tracing on (default sampling) over off, CPU per relayed token.
    "traced_cpu_per_token_over_gateway_max": 1.05,
    # The traffic twin: recording on (every conversation) over off, CPU per request.
    "recorded_cpu_per_request_over_gateway_max": 1.05,
}
# The two kinds of run: streams (the relay's cost per token) and --per-request (its
# fixed cost per request: 2-token answers from an upstream at 1,000 tokens/s, so
# that a request is almost all auth, admission, routing and metering).
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "streams": {
        "levels": "100,500,1000",
        "targets": "direct,bare,gateway,traced,gateway@daphne,smg,litellm",
        "max_tokens": 300,
        "rate": 30.0,
        "ramp_s": 10.0,
    },
    "per_request": {
        "levels": "50",
        "targets": "bare,gateway,recorded,smg,litellm",
        "max_tokens": 2,
        "rate": 1000.0,
        "ramp_s": 1.0,
    },
}

# -- processes ------------------------------------------------------------------------------


class Processes:
    """Every child process this run started, each in its own process group."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cpus: str | None = None,
        nice: int = 0,
        stdout: int | None = None,
        cwd: Path = ROOT,
    ) -> subprocess.Popen[bytes]:
        prefix: list[str] = []
        if cpus and shutil.which("taskset"):
            prefix += ["taskset", "-c", cpus]
        if nice:
            prefix += ["nice", "-n", str(nice)]
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log = (LOG_DIR / f"{name}.log").open("ab")
        try:
            popen = subprocess.Popen(
                prefix + argv,
                cwd=cwd,
                env=env,
                stdout=stdout if stdout is not None else log,
                stderr=log,
                start_new_session=True,
            )
        finally:
            log.close()
        self.started.append(popen)
        return popen

    def stop(self, popen: subprocess.Popen[bytes], grace_s: float = 8.0) -> None:
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGTERM)
            try:
                popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                try:
                    # On a saturated machine a killed relay with hundreds of open
                    # sockets has taken over 5 s to go; never fail the run on it.
                    popen.wait(60)
                except subprocess.TimeoutExpired:
                    print(f"pid {popen.pid} survived SIGKILL for 60 s", flush=True)
        # Workers left behind by a dead parent are still in the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signal.SIGKILL)
        if popen in self.started:
            self.started.remove(popen)

    def stop_all(self) -> None:
        for popen in list(reversed(self.started)):
            self.stop(popen)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text.rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """Return ``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children[int(fields[1])].append(int(entry.name))
    tree, queue = [], [pid]
    while queue:
        current = queue.pop()
        tree.append(current)
        queue.extend(children.get(current, ()))
    return tree


def cpu_of(pids: list[int]) -> dict[int, float]:
    """Return utime + stime seconds of each live pid."""
    out = {}
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            out[pid] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(value - before.get(pid, 0.0) for pid, value in after.items())


def machine_busy_s() -> float:
    """Return the machine's busy CPU seconds since boot (all CPUs)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / CLK_TCK


def wait_idle(limit_s: float, threshold_cores: float) -> float:
    """Wait up to ``limit_s`` for the machine to be idle; return the last busy level."""
    deadline = time.monotonic() + limit_s
    busy = 0.0
    while True:
        before, t0 = machine_busy_s(), time.monotonic()
        time.sleep(1.0)
        busy = (machine_busy_s() - before) / (time.monotonic() - t0)
        if busy < threshold_cores or time.monotonic() > deadline:
            return busy


def http(
    url: str, body: dict[str, Any] | None = None, key: str = "", timeout: float = 5.0
) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data)
    if body is not None:
        request.add_header("content-type", "application/json")
    if key:
        request.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_for(
    condition: Any, timeout_s: float, what: str, proc: subprocess.Popen[bytes] | None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited ({proc.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


# -- the platform's state: database, rows, Redis beats --------------------------------------


REGISTER = """
import json, os
from django.utils import timezone
from localrun.seeding import (
    LimitSeed, ModelSeed, PlatformSeed, TeamSeed, VersionSeed, digest, seed_platform,
    version_body,
)
from engine_nodes.models import Replica

urls = json.loads(os.environ["BENCH_REPLICA_URLS"])
now = timezone.now()
seeded = seed_platform(
    seed=PlatformSeed(
        region="bench",
        teams=(TeamSeed("bench"),),
        models=(
            ModelSeed("chat-7b", versions=(
                VersionSeed("v1", version_body(weights_hash=digest("bench")),
                            min_replicas=len(urls), max_replicas=len(urls)),
            )),
        ),
        limits=(
            LimitSeed("bench", "chat-7b", tokens_per_minute=10**12,
                      max_concurrency=1_000_000),
        ),
    ),
    now=now,
)
version = seeded.versions["chat-7b"][0]
for index, url in enumerate(urls):
    Replica.objects.create(
        replica_id=f"bench-r{index}", model_id="chat-7b", version=version,
        region="bench", node="bench-node", url=url, state="serving",
        last_heartbeat=now,
    )
print("BENCH " + json.dumps({"key": seeded.keys["bench"], "version": version.version}))
"""


class Platform:
    """A database and Redis prefix of its own, the rows, and the beat thread.

    ``register`` seeds the rows (a ``manage.py shell`` script that prints the key
    and version) for ``model``, whose replicas' beats the thread publishes; a
    subclass serves another model (``bench/embeddings.py``).
    """

    model = MODEL
    register = REGISTER

    def __init__(self, redis_url: str) -> None:
        self.db = f"bench_gateway_{os.getpid()}"
        self.redis_url = redis_url
        self.prefix = f"bench-gw-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.created = False
        self.key = ""
        self.version = "v1"
        self.replicas: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beat_failures = 0

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
        env.update(
            DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{self.db}",
            REDIS_URL=self.redis_url,
            PLATFORM_REDIS_PREFIX=self.prefix,
            PLATFORM_REGION=REGION,
            SECRET_KEY="bench",
            PLATFORM_DEFAULT_TOKENS_PER_MINUTE="0",
            # Admission's pool capacity must not be what limits a relay benchmark.
            PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT=str(10**9),
        )
        return env

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(sql)

    def create(self, replica_urls: list[str]) -> None:
        self._admin(f'CREATE DATABASE "{self.db}"')
        self.created = True
        env = self.env()
        subprocess.run(
            [PY, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=ROOT,
            env=env,
            check=True,
            timeout=300,
        )
        env["BENCH_REPLICA_URLS"] = json.dumps(replica_urls)
        out = subprocess.run(
            [PY, "manage.py", "shell", "-c", self.register],
            cwd=ROOT,
            env=env,
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        ).stdout
        line = next(x for x in out.splitlines() if x.startswith("BENCH "))
        info = json.loads(line[6:])
        self.key, self.version = info["key"], info["version"]
        self.replicas = [(f"bench-r{i}", url) for i, url in enumerate(replica_urls)]

    def set_traffic_share(self, share: float) -> None:
        """Set the share of the pool's conversations the gateway records."""
        import psycopg

        url = f"postgresql://postgres@127.0.0.1:5432/{self.db}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE pools SET record_traffic_share = %s", (share,))

    def start_beats(self) -> None:
        from engine_nodes.domain.beats import ReplicaBeat
        from engine_nodes.heartbeats import RedisBeatStore

        store = RedisBeatStore.from_url(self.redis_url, prefix=self.prefix, ttl_s=3.0)

        def publish() -> None:
            now = time.time()
            store.publish(
                ReplicaBeat(
                    replica_id=replica_id,
                    model=self.model,
                    version=self.version,
                    region=REGION,
                    node="bench-node",
                    url=url,
                    state="serving",
                    queue_depth=0,
                    num_running=0,
                    tokens_in_flight=0,
                    kv_cache_usage_perc=0.0,
                    beat_at=now,
                )
                for replica_id, url in self.replicas
            )

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    publish()
                except Exception:
                    self.beat_failures += 1
                self._stop.wait(1.0)

        publish()
        self._thread = threading.Thread(target=loop, name="beats", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with contextlib.suppress(Exception):
            import redis

            client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
            keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
            if keys:
                client.delete(*keys)
        if self.created:
            self._admin(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')
            self.created = False


# -- targets --------------------------------------------------------------------------------


def split_target(target: str) -> tuple[str, str]:
    """``gateway@daphne`` -> ``("gateway", "daphne")``; without ``@``, uvicorn."""
    base, _, server = target.partition("@")
    return base, server or "uvicorn"


def is_gateway(target: str) -> bool:
    """True for the gateway and the baseline, under any server."""
    return split_target(target)[0] in GATEWAYS


def target_error(target: str) -> str | None:
    """Why ``target`` is not one this bench can run, or None."""
    base, server = split_target(target)
    if base in peers.PEERS or base == "direct":
        return f"{target}: {base} has no server variants" if "@" in target else None
    if base not in GATEWAYS and base.split("+")[0] != "bare":
        return f"unknown target {target!r}"
    if server not in SERVERS:
        return f"{target}: unknown server {server!r} (one of {', '.join(SERVERS)})"
    return None


def bare_argv(port: int, server: str = "uvicorn") -> list[str]:
    """The bare relay under ``server``, configured as ``gateway_argv`` configures
    the gateway under it, but with no lifespan (the relay has no startup work)."""
    app = "bench.bare_relay:application"
    host = "127.0.0.1"
    if server == "daphne":
        # daphne sends no lifespan events; -v 0: no access log.
        return [PY, "-m", "daphne", "-b", host, "-p", str(port), "-v", "0", app]
    if server == "granian":
        # asginl: the ASGI interface without lifespan events.
        return [
            PY, "-m", "granian",
            "--interface", "asginl",
            "--host", host, "--port", str(port),
            "--workers", "1",
            "--loop", "uvloop",
            "--no-access-log",
            "--log-level", "warning",
            app,
        ]  # fmt: skip
    if server != "uvicorn":
        raise ValueError(f"unknown server {server!r}")
    return [
        PY, "-m", "uvicorn", app,
        "--host", host, "--port", str(port),
        "--loop", "uvloop",
        "--http", "httptools",
        "--no-access-log",
        "--log-level", "warning",
        "--lifespan", "off",
    ]  # fmt: skip


# -- one run ----------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs = Processes()
        self.platform = Platform(args.redis_url)
        self.upstreams: list[tuple[subprocess.Popen[bytes], str]] = []
        pin = args.pin == "split" and (os.cpu_count() or 1) >= 2
        self.relay_cpus = "0" if pin else None
        self.harness_cpus = "1" if pin else None
        self.nice = args.nice if os.geteuid() == 0 else 0
        self.tokens_per_event = 1
        self._collector_url: str | None = None

    def collector_url(self) -> str:
        """Start the OTLP/HTTP receiver (once, on the harness's CPU); return its
        traces URL."""
        if self._collector_url is None:
            port = free_port()
            LOG_DIR.mkdir(parents=True, exist_ok=True)
            popen = self.procs.start(
                "otlp-collector",
                [
                    PY,
                    "-m",
                    "tests.otlp_collector",
                    "--port",
                    str(port),
                    "--out",
                    str(LOG_DIR / "spans.jsonl"),
                ],
                env=dict(os.environ),
                cpus=self.harness_cpus,
            )
            self._collector_url = f"http://127.0.0.1:{port}/v1/traces"
            wait_for(
                lambda: http(self._collector_url or "")[0] in (404, 405, 501),
                30,
                "the OTLP collector",
                popen,
            )
        return self._collector_url

    # upstream -------------------------------------------------------------------------

    def start_upstreams(self, tokens_per_event: int) -> None:
        """Start the upstreams, or restart them on the same ports (the gateway's
        replica rows name them) to change how many tokens go in one event."""
        ports = [int(url.rsplit(":", 1)[1]) for _, url in self.upstreams]
        for popen, _ in self.upstreams:
            self.procs.stop(popen)
        self.upstreams = []
        self.tokens_per_event = tokens_per_event
        for index in range(self.args.upstreams):
            port = ports[index] if ports else free_port()
            popen = self.procs.start(
                f"upstream-{index}",
                [
                    PY,
                    str(BENCH / "fake_upstream.py"),
                    "--port",
                    str(port),
                    "--rate",
                    str(self.args.rate),
                    "--tokens-per-event",
                    str(tokens_per_event),
                ],
                cpus=self.harness_cpus,
                nice=self.nice,
            )
            url = f"http://127.0.0.1:{port}"
            wait_for(
                lambda url=url: http(f"{url}/health")[0] == 200,
                20,
                "fake upstream",
                popen,
            )
            self.upstreams.append((popen, url))

    def upstream_urls(self) -> list[str]:
        return [url for _, url in self.upstreams]

    # relays ---------------------------------------------------------------------------

    def start_bare(self, target: str) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        base, server = split_target(target)
        env = dict(os.environ)
        env["BARE_RELAY_UPSTREAMS"] = ",".join(self.upstream_urls())
        # "bare+race+parse": the bare relay with pieces of the gateway's loop.
        env["BARE_RELAY_MODE"] = ",".join(base.split("+")[1:])
        popen = self.procs.start(
            target,
            bare_argv(port, server),
            env=env,
            cpus=self.relay_cpus,
            nice=self.nice,
        )
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http(f"{url}/healthz")[0] == 200, 30, "bare relay", popen)
        self._probe(url, popen, successes=3)
        return popen, url

    def start_peer(self, name: str) -> tuple[subprocess.Popen[bytes], str, str]:
        """Start a peer gateway; return it, its URL and the key to send it."""
        port = free_port()
        start = peers.launch(name, port, self.upstream_urls())
        popen = self.procs.start(
            name,
            start.argv,
            env=start.env,
            cpus=self.relay_cpus,
            nice=self.nice,
            cwd=start.cwd,
        )
        url = f"http://127.0.0.1:{port}"
        # LiteLLM imports for half a minute on a loaded core.
        wait_for(lambda: http(start.health_url)[0] == 200, 180, name, popen)
        self._probe(url, popen, successes=3, key=start.key)
        return popen, url, start.key

    def start_gateway(
        self, workers: int, target: str = "gateway"
    ) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        base, server = split_target(target)
        # The server named, never PLATFORM_SERVER from the caller's shell: plain
        # "gateway" is uvicorn, the reference.
        argv = gateway_argv(port, workers=workers, server=server)
        env = self.platform.env()
        # Only the recorded target's pool records (one gateway runs at a time).
        self.platform.set_traffic_share(1.0 if base == "recorded" else 0.0)
        if base == "traced":
            env |= {
                "PLATFORM_TRACES_ENABLED": "true",
                "PLATFORM_TRACES_ENDPOINT": self.collector_url(),
            }
        popen = self.procs.start(
            f"{target}-w{workers}",
            argv,
            env=env,
            cpus=self.relay_cpus if workers == 1 else None,
            nice=self.nice,
            # The baseline's code comes from its own tree (python -m puts the
            # working directory first on sys.path).
            cwd=self.args.baseline_tree if base == "baseline" else ROOT,
        )
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http(f"{url}/healthz")[0] == 200, 90, "the gateway", popen)
        # Every worker must have read the beats: a few successes in a row.
        self._probe(url, popen, successes=4 * workers)
        return popen, url

    def _probe(
        self,
        url: str,
        popen: subprocess.Popen[bytes],
        successes: int,
        key: str | None = None,
    ) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 2,
            "stream": True,
        }
        streak = 0
        deadline = time.monotonic() + 60
        last: tuple[int, bytes] = (0, b"")
        while streak < successes:
            if popen.poll() is not None:
                raise RuntimeError(f"relay at {url} exited ({popen.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"relay at {url} never served: {last!r}")
            last = http(
                f"{url}/v1/chat/completions",
                body,
                self.platform.key if key is None else key,
                10,
            )
            if last[0] == 200 and b"[DONE]" in last[1]:
                streak += 1
            else:
                streak = 0
                time.sleep(0.25)

    # one measured run -----------------------------------------------------------------

    def run(self, level: int, target: str, workers: int, repeat: int) -> dict[str, Any]:
        args = self.args
        busy_before = wait_idle(args.idle_wait_s, args.idle_threshold)
        gateway_like = is_gateway(target)
        log_name: str | None = None
        if target != "direct":
            log_name = f"{target}-w{workers}" if gateway_like else target
        log_path = LOG_DIR / f"{log_name}.log" if log_name else None
        log_from = log_path.stat().st_size if log_path and log_path.exists() else 0
        relay: subprocess.Popen[bytes] | None = None
        profiler: subprocess.Popen[bytes] | None = None
        key = self.platform.key or "none"
        try:
            if target == "direct":
                urls = self.upstream_urls()
            elif target in peers.PEERS:
                relay, url, key = self.start_peer(target)
                urls = [url]
            elif target.startswith("bare"):
                relay, url = self.start_bare(target)
                urls = [url]
            else:
                relay, url = self.start_gateway(workers, target)
                urls = [url]
            idle_cores = None
            if relay is not None and args.idle_sample_s > 0:
                # The relay's own background work (snapshot, Redis exchange), unloaded.
                tree = descendants(relay.pid)
                idle_from, idle_t0 = cpu_of(tree), time.monotonic()
                time.sleep(args.idle_sample_s)
                idle_cores = cpu_delta(idle_from, cpu_of(tree)) / (
                    time.monotonic() - idle_t0
                )
            argv = [PY, str(BENCH / "loadgen.py"), "-c", str(level)]
            for url in urls:
                argv += ["--url", url]
            argv += [
                "--key",
                key,
                "--max-tokens",
                str(args.max_tokens),
                "--system-words",
                str(args.system_words),
                "--rate",
                str(args.rate),
                "--ramp-s",
                str(args.ramp_s),
                "--warmup-s",
                str(args.warmup_s),
                "--duration-s",
                str(args.duration_s),
                "--token-text",
                TOKEN_TEXT,
            ]
            loadgen = self.procs.start(
                "loadgen",
                argv,
                cpus=self.harness_cpus,
                nice=self.nice,
                stdout=subprocess.PIPE,
            )
            hard_limit = args.warmup_s + args.duration_s + 60
            watchdog = threading.Timer(hard_limit, self.procs.stop, (loadgen, 2.0))
            watchdog.daemon = True
            watchdog.start()
            relay_tree: list[int] = []
            before: dict[str, Any] = {}
            after: dict[str, Any] = {}
            result: dict[str, Any] | None = None
            assert loadgen.stdout is not None
            for raw in loadgen.stdout:
                line = raw.decode().strip()
                if line == "window start":
                    relay_tree = descendants(relay.pid) if relay else []
                    before = self._sample(relay_tree, loadgen.pid)
                    if args.profile_now and relay is not None:
                        profiler = self._start_profiler(relay_tree, level)
                elif line == "window end":
                    after = self._sample(relay_tree, loadgen.pid)
                elif line.startswith("{"):
                    result = json.loads(line)
            watchdog.cancel()
            loadgen.wait(10)
            self.procs.stop(loadgen)
            if result is None or not before or not after:
                raise RuntimeError(
                    f"load generator failed (see {LOG_DIR / 'loadgen.log'})"
                )
            if profiler is not None:
                profiler.wait(args.duration_s + 30)
        finally:
            if relay is not None:
                self.procs.stop(relay)
        window = after["wall"] - before["wall"]
        relay_cpu = cpu_delta(before["relay"], after["relay"])
        upstream_cpu = cpu_delta(before["upstream"], after["upstream"])
        loadgen_cpu = cpu_delta(before["loadgen"], after["loadgen"])
        busy = after["busy"] - before["busy"]
        events = result["events_in_window"]
        tokens = result["tokens_in_window"]
        requests = result["requests_ended_in_window"]
        record = {
            "level": level,
            "target": target,
            "workers": workers if gateway_like else (1 if relay else 0),
            "repeat": repeat,
            "tokens_per_event": self.tokens_per_event,
            "window_s": window,
            "events_per_s": result["events_per_s"],
            "content_events_per_s": result["content_events_per_s"],
            "tokens_per_s": result["tokens_per_s"],
            "tokens_per_content_event": result["tokens_per_content_event"],
            "nominal_tokens_per_s": level
            * args.max_tokens
            / ((args.max_tokens - 1) / args.rate),
            "ttft_ms": result["ttft_ms"],
            "gap_ms": result["gap_ms"],
            "errors": result["errors"],
            "errors_in_window": result["errors_in_window"],
            "errors_by_kind": result["errors_by_kind"],
            "error_samples": result["error_samples"],
            "short_answers": result["short_answers"],
            "requests_started_in_window": result["requests_started_in_window"],
            "relay_pids": len(relay_tree),
            "relay_cpu_s": relay_cpu,
            "relay_cores": relay_cpu / window if relay else None,
            "relay_idle_cores": idle_cores,
            "relay_cpu_s_per_10k_events": (relay_cpu / events * 10_000)
            if relay and events
            else None,
            "relay_cpu_s_per_10k_tokens": (relay_cpu / tokens * 10_000)
            if relay and tokens
            else None,
            "requests_ended_in_window": requests,
            "relay_cpu_us_per_request": (relay_cpu / requests * 1e6)
            if relay and requests
            else None,
            "upstream_cores": upstream_cpu / window,
            "loadgen_cores": loadgen_cpu / window,
            "foreign_cores": max(0.0, (busy - relay_cpu - upstream_cpu - loadgen_cpu))
            / window,
            "machine_busy_cores_before": busy_before,
            "beat_failures": self.platform.beat_failures,
            "relay_log": log_summary(log_path, log_from) if log_path else None,
        }
        if profiler is not None:
            record["profile"] = summarize_profile(self._profile_path(level))
        return record

    def measure(
        self, level: int, target: str, workers: int, repeat: int, started: float
    ) -> list[dict[str, Any]]:
        """Run once; again if the run failed or other load shared the machine.

        Every attempt is returned; the one with the least foreign load is marked
        ``kept`` (the summary uses only kept runs).
        """
        args = self.args
        label = f"{target}-w{workers}" if is_gateway(target) else target
        attempts: list[dict[str, Any]] = []
        for attempt in range(1 + max(0, args.retries)):
            print(
                f"[{time.monotonic() - started:6.0f}s] C={level} "
                f"N={self.tokens_per_event} {label} "
                f"(repeat {repeat + 1}/{args.repeat}, attempt {attempt + 1})",
                flush=True,
            )
            try:
                record = self.run(level, target, workers, repeat)
            except RuntimeError as exc:
                print(f"  failed: {exc}", flush=True)
                attempts.append(
                    {
                        "level": level,
                        "target": target,
                        "workers": workers,
                        "repeat": repeat,
                        "tokens_per_event": self.tokens_per_event,
                        "failed": str(exc),
                    }
                )
                time.sleep(5)
                continue
            record["attempt"] = attempt
            attempts.append(record)
            print(
                f"  tok/s {record['tokens_per_s']:.0f}, "
                f"CPU-s/10k tok {_fmt(record['relay_cpu_s_per_10k_tokens'], 3)}, "
                f"TTFT p99 {_fmt(record['ttft_ms']['p99'])} ms, "
                f"gap p99 {_fmt(record['gap_ms']['p99'])} ms, "
                f"errors {record['errors']}, relay cores "
                f"{_fmt(record['relay_cores'], 2)}, foreign "
                f"{record['foreign_cores']:.2f}",
                flush=True,
            )
            if record["foreign_cores"] <= args.max_foreign_cores:
                break
            print("  other load on the machine: measuring again", flush=True)
        measured = [r for r in attempts if "failed" not in r]
        if measured:
            best = min(measured, key=lambda r: r["foreign_cores"])
            for record in measured:
                record["kept"] = record is best
        return attempts

    def _sample(self, relay_tree: list[int], loadgen_pid: int) -> dict[str, Any]:
        upstream_pids = [pid for popen, _ in self.upstreams for pid in [popen.pid]]
        return {
            "wall": time.monotonic(),
            "busy": machine_busy_s(),
            "relay": cpu_of(relay_tree),
            "upstream": cpu_of([p for pid in upstream_pids for p in descendants(pid)]),
            "loadgen": cpu_of(descendants(loadgen_pid)),
        }

    def _profile_path(self, level: int) -> Path:
        return self.args.out.parent / f"gateway-pyspy-c{level}.txt"

    def _start_profiler(
        self, relay_tree: list[int], level: int
    ) -> subprocess.Popen[bytes] | None:
        spy = shutil.which("py-spy") or str(Path(PY).parent / "py-spy")
        if not Path(spy).exists():
            print("py-spy not found: no profile", file=sys.stderr)
            return None
        # The process that serves: the uvicorn process itself with one worker.
        python_pids = [
            pid
            for pid in relay_tree
            if "uvicorn" in _cmdline(pid) or "spawn_main" in _cmdline(pid)
        ]
        pid = python_pids[-1] if python_pids else relay_tree[0]
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        return self.procs.start(
            "py-spy",
            [
                spy,
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(int(self.args.duration_s)),
                "--rate",
                "200",
                # Native frames (uvloop, the interpreter) need the process paused.
                *(["--native"] if self.args.profile_native else ["--nonblocking"]),
                "--format",
                "raw",
                "--output",
                str(self._profile_path(level)),
            ],
        )


def log_summary(path: Path, offset: int) -> dict[str, Any]:
    """Count the relay's logged failures since ``offset`` (its log is appended to)."""
    if not path.exists():
        return {}
    with path.open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    lines = text.splitlines()
    last_errors = [
        line
        for line in lines
        if line.endswith(("Error", "Error."))
        or ("Error:" in line and not line.startswith(" "))
    ]
    kinds: dict[str, int] = defaultdict(int)
    for line in last_errors:
        kinds[line.strip()[:120]] += 1
    return {
        "asgi_exceptions": sum("Exception in ASGI application" in x for x in lines),
        "warnings": sum(" WARNING " in x for x in lines),
        "error_lines": dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:5]),
    }


def git_state() -> dict[str, Any]:
    """Return the commit and the uncommitted files the gateway ran with."""

    def git(*argv: str) -> str:
        try:
            return subprocess.run(
                ["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "head": git("rev-parse", "HEAD").strip(),
        "dirty": [line for line in git("status", "--porcelain").splitlines() if line],
    }


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def summarize_profile(path: Path, top: int = 30) -> dict[str, Any]:
    """Return the hottest functions and packages of a py-spy raw (collapsed) profile.

    Frames are merged per function (line numbers dropped). "self" is where samples
    ended; "inclusive" counts a function once per sample it is on the stack of. The
    time uvloop spends in C (I/O, callbacks) shows as ``Runner.run`` self time.
    """
    if not path.exists():
        return {"error": f"no profile at {path}"}
    own: dict[str, int] = defaultdict(int)
    inclusive: dict[str, int] = defaultdict(int)
    packages: dict[str, int] = defaultdict(int)
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_function(frame) for frame in stack.split(";")]
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
        where = frames[-1].rpartition("(")[2].rstrip(")")
        packages[where.split("/", 1)[0] if "/" in where else where] += count
    if not total:
        return {"error": f"empty profile at {path}"}

    def share(table: dict[str, int]) -> list[tuple[str, float]]:
        ranked = sorted(table.items(), key=lambda kv: -kv[1])[:top]
        return [(frame, round(100 * n / total, 1)) for frame, n in ranked]

    return {
        "samples": total,
        "file": str(path),
        "self_pct": share(own),
        "inclusive_pct": share(inclusive),
        "self_pct_by_package": share(packages),
    }


def _function(frame: str) -> str:
    """``f (path/x.py:12)`` -> ``f (path/x.py)``."""
    head, sep, tail = frame.rpartition(":")
    return f"{head})" if sep and tail.rstrip(")").isdigit() else frame


# -- summary ----------------------------------------------------------------------------------


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repeats of each (N, level, target, workers), with added TTFT."""
    groups: dict[tuple[int, int, str, int], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        key = (run.get("tokens_per_event", 1), run["level"], run["target"])
        groups[(*key, run["workers"])].append(run)
    direct: dict[tuple[int, int, int], dict[str, Any]] = {
        (r.get("tokens_per_event", 1), r["level"], r["repeat"]): r
        for r in runs
        if r["target"] == "direct"
    }
    rows = []
    for (tpe, level, target, workers), group in sorted(
        groups.items(),
        key=lambda kv: (
            kv[0][0],
            kv[0][1],
            _rank(kv[0][2]),
            kv[0][2],
            kv[0][3],
        ),
    ):

        def med(fn: Any, group: list[dict[str, Any]] = group) -> float | None:
            return _median([fn(r) for r in group])

        def added(r: dict[str, Any], q: str) -> float | None:
            base = direct.get((r.get("tokens_per_event", 1), r["level"], r["repeat"]))
            if base is None or r["ttft_ms"][q] is None or base["ttft_ms"][q] is None:
                return None
            return r["ttft_ms"][q] - base["ttft_ms"][q]

        rows.append(
            {
                "tokens_per_event": tpe,
                "level": level,
                "target": target,
                "workers": workers,
                "runs": len(group),
                "events_per_s": med(lambda r: r["events_per_s"]),
                "tokens_per_s": med(lambda r: r["tokens_per_s"]),
                "nominal_tokens_per_s": group[0]["nominal_tokens_per_s"],
                "ttft_p50_ms": med(lambda r: r["ttft_ms"]["p50"]),
                "ttft_p99_ms": med(lambda r: r["ttft_ms"]["p99"]),
                "added_ttft_p50_ms": med(lambda r: added(r, "p50")),
                "added_ttft_p99_ms": med(lambda r: added(r, "p99")),
                "gap_p50_ms": med(lambda r: r["gap_ms"]["p50"]),
                "gap_p99_ms": med(lambda r: r["gap_ms"]["p99"]),
                "errors": max(r["errors"] for r in group),
                "relay_cores": med(lambda r: r["relay_cores"]),
                "relay_idle_cores": med(lambda r: r.get("relay_idle_cores")),
                "relay_cpu_s_per_10k_events": med(
                    lambda r: r["relay_cpu_s_per_10k_events"]
                ),
                "relay_cpu_s_per_10k_tokens": med(
                    lambda r: r.get("relay_cpu_s_per_10k_tokens")
                ),
                "relay_cpu_us_per_request": med(
                    lambda r: r.get("relay_cpu_us_per_request")
                ),
                "upstream_cores": med(lambda r: r["upstream_cores"]),
                "loadgen_cores": med(lambda r: r["loadgen_cores"]),
                "foreign_cores": med(lambda r: r["foreign_cores"]),
            }
        )
    for column, reference in (
        ("cpu_ratio_vs_bare", "bare"),
        ("cpu_ratio_vs_consumer", CONSUMER),
    ):
        per_token = {
            (r["tokens_per_event"], r["level"]): r["relay_cpu_s_per_10k_tokens"]
            for r in rows
            if r["target"] == reference
        }
        for row in rows:
            # Per token: the same as per event when both relay the same stream.
            base = per_token.get((row["tokens_per_event"], row["level"]))
            mine = row["relay_cpu_s_per_10k_tokens"]
            row[column] = (
                mine / base if row["target"] != "direct" and base and mine else None
            )
    return rows


# The reference: "a minimal Channels consumer that only forwards bytes".
# Plain "bare" (a raw ASGI callable behind the Channels router) is stricter.
CONSUMER = "bare+consumer"
GATEWAYS = ("gateway", "baseline", "traced", "recorded")
# What the targets are set for: our gateway, one worker, under uvicorn.
REFERENCE = "gateway"


def _rank(target: str) -> int:
    """Order of the targets in a level's rows: references, peers, then ours."""
    base = split_target(target)[0]
    if base == "direct":
        return 0
    if base.startswith("bare"):
        return 1
    if base in peers.PEERS:
        return 2
    if base == "baseline":
        return 3
    return 4 if target == REFERENCE else 5


def gateway_ratios(rows: list[dict[str, Any]], column: str) -> list[dict[str, Any]]:
    """Per (N, level): the one-worker gateway's ``column`` over each other target's.

    Above 1 the other target is cheaper than our gateway; below 1 ours is. Only
    one-process targets are compared (multi-worker gateways use both CPUs).
    """
    by_level: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    for row in rows:
        if row["target"] == "direct" or row["workers"] != 1 or row[column] is None:
            continue
        by_level[(row["tokens_per_event"], row["level"])][row["target"]] = row[column]
    out = []
    for (tpe, level), values in sorted(by_level.items()):
        mine = values.get(REFERENCE)
        if not mine:
            continue
        out.append(
            {
                "tokens_per_event": tpe,
                "level": level,
                "column": column,
                "gateway": mine,
                "gateway_over": {
                    target: mine / value
                    for target, value in sorted(
                        values.items(), key=lambda kv: (_rank(kv[0]), kv[0])
                    )
                    if target != REFERENCE and value
                },
            }
        )
    return out


def _reference_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # The targets are set for one token per event (vLLM at low load).
    return [r for r in rows if r["target"] == REFERENCE and r["tokens_per_event"] == 1]


def _over(
    ratios: list[dict[str, Any]], other: str, levels: tuple[int, ...] | None = None
) -> dict[str, float]:
    return {
        f"c{r['level']}": r["gateway_over"][other]
        for r in ratios
        if r["tokens_per_event"] == 1
        and other in r["gateway_over"]
        and (levels is None or r["level"] in levels)
    }


def check_targets(
    rows: list[dict[str, Any]], nominal_ok: float = 0.95
) -> dict[str, Any]:
    """Judge the issue's targets from the summary rows of a streams run."""

    def ok_stream(row: dict[str, Any], share: float = nominal_ok) -> bool:
        return (
            row["errors"] == 0
            and row["gap_p99_ms"] is not None
            and row["gap_p99_ms"] < TARGETS["gap_p99_ms_at_1000"]
            and row["tokens_per_s"] >= share * row["nominal_tokens_per_s"]
        )

    gateway_rows = _reference_rows(rows)

    def ratios(column: str) -> dict[str, float]:
        return {
            f"c{r['level']}_w{r['workers']}": r[column]
            for r in gateway_rows
            if r[column] is not None
        }

    def within(column: str) -> bool | None:
        one_worker = [
            r[column]
            for r in gateway_rows
            if r["workers"] == 1 and r[column] is not None
        ]
        if not one_worker:
            return None
        return all(v <= TARGETS["gateway_cpu_ratio_max"] for v in one_worker)

    at_100 = [r for r in gateway_rows if r["level"] == 100 and r["workers"] == 1]
    at_1000 = [r for r in gateway_rows if r["level"] == 1000]
    carried = [r for r in at_1000 if ok_stream(r)]
    one_core = next((r for r in at_1000 if r["workers"] == 1), None)
    over_smg = _over(
        gateway_ratios(rows, "relay_cpu_s_per_10k_tokens"), "smg", (500, 1000)
    )
    traced = {
        f"c{r['level']}": 1 / r["gateway_over"]["traced"]
        for r in gateway_ratios(rows, "relay_cpu_s_per_10k_tokens")
        if r["tokens_per_event"] == 1 and r["gateway_over"].get("traced")
    }
    return {
        "cpu_ratio_vs_consumer": ratios("cpu_ratio_vs_consumer"),
        "cpu_ratio_within_1_3_of_consumer": within("cpu_ratio_vs_consumer"),
        "cpu_ratio_vs_bare": ratios("cpu_ratio_vs_bare"),
        "cpu_ratio_within_1_3_of_bare": within("cpu_ratio_vs_bare"),
        "added_ttft_p99_ms_at_100": at_100[0]["added_ttft_p99_ms"] if at_100 else None,
        "added_ttft_p99_under_25ms_at_100": (
            at_100[0]["added_ttft_p99_ms"] is not None
            and at_100[0]["added_ttft_p99_ms"] < TARGETS["added_ttft_p99_ms_at_100"]
        )
        if at_100
        else None,
        "streams_1000_carried": bool(carried) if at_1000 else None,
        "streams_1000_carried_with_workers": [r["workers"] for r in carried],
        "rule": "errors 0, gap p99 < 66 ms, tokens/s >= 95% of nominal",
        # Issue 20's targets, for the one-worker gateway under uvicorn.
        "cpu_per_token_gateway_over_smg": over_smg,
        "cpu_per_token_at_or_below_smg_at_500_and_1000": (
            all(v <= TARGETS["cpu_per_token_over_smg_max"] for v in over_smg.values())
            if len(over_smg) == 2
            else None
        ),
        "streams_1000_one_core": {
            "errors": one_core["errors"],
            "tokens_share_of_nominal": one_core["tokens_per_s"]
            / one_core["nominal_tokens_per_s"],
            "gap_p99_ms": one_core["gap_p99_ms"],
            "ok": ok_stream(one_core, TARGETS["nominal_share_at_1000"]),
        }
        if one_core
        else None,
        "streams_1000_one_core_rule": "1 worker: errors 0, gap p99 < 66 ms, "
        "tokens/s >= 97% of nominal",
        # Issue 40: the traced gateway's CPU per relayed token over the gateway's.
        "traced_cpu_per_token_over_gateway": traced,
        "traced_within_5pct": (
            all(
                v <= TARGETS["traced_cpu_per_token_over_gateway_max"]
                for v in traced.values()
            )
            if traced
            else None
        ),
    }


def check_per_request(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Judge the per-request target (``--per-request``): CPU per request, one
    process each, and the gateway's over SMG's against 1.5."""
    us: dict[str, dict[str, float]] = defaultdict(dict)
    for row in rows:
        if row["workers"] == 1 and row["relay_cpu_us_per_request"] is not None:
            us[f"c{row['level']}"][row["target"]] = row["relay_cpu_us_per_request"]
    per_request = gateway_ratios(rows, "relay_cpu_us_per_request")
    over_smg = _over(per_request, "smg")
    # The traffic twin: recording on over off, per level.
    recorded = {
        f"c{r['level']}": 1 / r["gateway_over"]["recorded"]
        for r in per_request
        if r["tokens_per_event"] == 1 and r["gateway_over"].get("recorded")
    }
    return {
        "recorded_cpu_per_request_over_gateway": recorded,
        "recorded_within_5pct": (
            all(
                v <= TARGETS["recorded_cpu_per_request_over_gateway_max"]
                for v in recorded.values()
            )
            if recorded
            else None
        ),
        "cpu_us_per_request": dict(us),
        "cpu_per_request_gateway_over_smg": over_smg,
        "cpu_per_request_within_1_5_of_smg": (
            all(v <= TARGETS["cpu_per_request_over_smg_max"] for v in over_smg.values())
            if over_smg
            else None
        ),
        "errors": {
            f"c{r['level']}_{r['target']}": r["errors"]
            for r in rows
            if r["workers"] <= 1 and r["errors"]
        },
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _label(row: dict[str, Any]) -> str:
    name: str = row["target"]
    return f"{name}-w{row['workers']}" if is_gateway(name) else name


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'N':>2} {'C':>5} {'target':<19} {'ev/s':>7} {'tok/s':>7} {'nominal':>7} "
        f"{'TTFT p50/p99 ms':>16} {'added p50/p99':>14} {'gap p50/p99 ms':>15} "
        f"{'err':>4} {'cores':>5} {'CPU-s/10k ev':>12} {'CPU-s/10k tok':>13} "
        f"{'us/req':>7} {'ratio':>5} {'/cons':>5} {'foreign':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['tokens_per_event']:>2} {r['level']:>5} {_label(r):<19} "
            f"{_fmt(r['events_per_s'], 0):>7} "
            f"{_fmt(r['tokens_per_s'], 0):>7} {_fmt(r['nominal_tokens_per_s'], 0):>7} "
            f"{_fmt(r['ttft_p50_ms']) + '/' + _fmt(r['ttft_p99_ms']):>16} "
            f"{_fmt(r['added_ttft_p50_ms']) + '/' + _fmt(r['added_ttft_p99_ms']):>14} "
            f"{_fmt(r['gap_p50_ms']) + '/' + _fmt(r['gap_p99_ms']):>15} "
            f"{r['errors']:>4} {_fmt(r['relay_cores'], 2):>5} "
            f"{_fmt(r['relay_cpu_s_per_10k_events'], 3):>12} "
            f"{_fmt(r['relay_cpu_s_per_10k_tokens'], 3):>13} "
            f"{_fmt(r['relay_cpu_us_per_request'], 0):>7} "
            f"{_fmt(r['cpu_ratio_vs_bare'], 2):>5} "
            f"{_fmt(r['cpu_ratio_vs_consumer'], 2):>5} {_fmt(r['foreign_cores'], 2):>7}"
        )
    return "\n".join(lines)


def ratio_table(ratios: list[dict[str, Any]]) -> str:
    """The "gateway / X" table: one row per (N, level), one column per target."""
    if not ratios:
        return ""
    others: list[str] = []
    for r in ratios:
        others += [t for t in r["gateway_over"] if t not in others]
    others.sort(key=lambda t: (_rank(t), t))
    width = max([9, *(len(t) for t in others)])
    unit = (
        "CPU per request"
        if ratios[0]["column"] == "relay_cpu_us_per_request"
        else "CPU per token"
    )
    title = f"gateway-w1 / X, {unit} (above 1: X is cheaper than the gateway)"
    header = f"{'N':>2} {'C':>5} " + " ".join(f"{t:>{width}}" for t in others)
    lines = [title, header, "-" * len(header)]
    for r in ratios:
        cells = [_fmt(r["gateway_over"].get(t), 2) for t in others]
        lines.append(
            f"{r['tokens_per_event']:>2} {r['level']:>5} "
            + " ".join(f"{c:>{width}}" for c in cells)
        )
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def prepare_targets(targets: list[str]) -> tuple[list[str], list[str]]:
    """Install the peers named and check the servers named; return the targets
    that can run and a message for each one that cannot (the run goes on)."""
    kept, skipped = [], []
    for target in targets:
        base, server = split_target(target)
        reason = None
        if base in peers.PEERS:
            try:
                peers.install(base)
            except peers.PeerUnavailable as exc:
                reason = str(exc)
        elif importlib.util.find_spec(server) is None:
            reason = f"{server} is not installed in {sys.prefix} (make venv)"
        if reason is None:
            kept.append(target)
        else:
            message = f"{target}: {reason}"
            print(f"skipping {message}", flush=True)
            skipped.append(message)
    return kept, skipped


def plan_level(
    targets: list[str],
    level: int,
    *,
    workers_list: list[int],
    multi_worker_min_level: int,
    max_level: dict[str, int],
) -> tuple[list[tuple[str, int]], list[str]]:
    """The (target, workers) runs at one level, and why any target sits it out.

    Worker counts above 1 are for the gateway (and baseline) under uvicorn only,
    at levels of at least ``multi_worker_min_level``.
    """
    plan: list[tuple[str, int]] = []
    left_out: list[str] = []
    for target in targets:
        cap = max_level.get(target)
        if cap is not None and level > cap:
            left_out.append(
                f"{target} at C={level}: only up to C={cap} (--{target}-max-level; "
                "it cannot carry more streams on one core)"
            )
            continue
        if not is_gateway(target) or "@" in target:
            plan.append((target, 1))
            continue
        for workers in workers_list:
            if workers == 1 or level >= multi_worker_min_level:
                plan.append((target, workers))
    return plan, left_out


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=BENCH / "results/gateway.json")
    parser.add_argument(
        "--per-request",
        action="store_true",
        help="measure the fixed cost per request instead of the cost per token: "
        "defaults --levels 50 --max-tokens 2 --rate 1000 --ramp-s 1 --targets "
        "bare,gateway,recorded,smg,litellm, and the checks judge CPU per request",
    )
    parser.add_argument(
        "--levels", default=None, help="default 100,500,1000 (--per-request: 50)"
    )
    parser.add_argument(
        "--targets",
        default=None,
        help="default direct,bare,gateway,gateway@daphne,smg,litellm "
        "(--per-request: bare,gateway,recorded,smg,litellm). smg, litellm: the peer "
        "gateways (bench/peers.py); TARGET@daphne, TARGET@granian: the gateway or "
        "a bare relay under that ASGI server; bare+consumer: the bare relay as a "
        "Channels AsyncHttpConsumer; also bare+race, bare+parse, bare+race+parse, "
        "bare+deep: the bare relay with pieces of the gateway's relay loop (see "
        "bench/bare_relay.py); baseline: the gateway from --baseline-tree",
    )
    parser.add_argument(
        "--litellm-max-level",
        type=int,
        default=100,
        help="run LiteLLM only at levels up to this (it cannot carry 500 streams "
        "on one core)",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="a checkout whose gateway runs as the 'baseline' target (added to "
        "--targets when given), e.g. a copy of this tree before a change",
    )
    parser.add_argument(
        "--tokens-per-event",
        default="1",
        help="comma-separated: tokens the upstream puts in one SSE event after "
        "the first (each value runs every level and target)",
    )
    parser.add_argument(
        "--gateway-workers",
        default="1,2",
        help="uvicorn worker counts for the gateway (counts above 1 only at levels "
        ">= --multi-worker-min-level)",
    )
    parser.add_argument("--multi-worker-min-level", type=int, default=1000)
    parser.add_argument(
        "--system-words",
        type=int,
        default=0,
        help="a shared system prompt of about this many tokens on every request "
        "(what the recorded target hashes; default none)",
    )
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--ramp-s", type=float, default=None, help="default 10 (1)")
    parser.add_argument(
        "--warmup-s", type=float, default=None, help="default: ramp + 2 s"
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--idle-sample-s",
        type=float,
        default=5.0,
        help="measure each relay's CPU unloaded for this long before the load",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="default 300 (--per-request: 2)"
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="the upstream's tokens/s per stream: default 30 (--per-request: 1000)",
    )
    parser.add_argument("--upstreams", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--pin", choices=["split", "none"], default="split")
    parser.add_argument("--nice", type=int, default=-10, help="when run as root")
    parser.add_argument("--idle-wait-s", type=float, default=30.0)
    parser.add_argument(
        "--max-foreign-cores",
        type=float,
        default=0.3,
        help="a run during which other processes used more CPU is measured again",
    )
    parser.add_argument(
        "--retries", type=int, default=1, help="extra attempts per failed/noisy run"
    )
    parser.add_argument("--idle-threshold", type=float, default=0.15)
    parser.add_argument(
        "--profile-native",
        action="store_true",
        help="profile C frames too (uvloop, CPython); pauses the gateway per sample",
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the measured runs, one more gateway run (1 worker) at "
        "--profile-level (default 500 when measured) under py-spy record",
    )
    parser.add_argument("--profile-level", type=int, default=None)
    args = parser.parse_args()
    mode = "per_request" if args.per_request else "streams"
    for name, value in MODE_DEFAULTS[mode].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.warmup_s is None:
        args.warmup_s = args.ramp_s + 2.0
    args.profile_now = False
    levels = [int(x) for x in args.levels.split(",") if x]
    targets = [t for t in args.targets.split(",") if t]
    if args.baseline_tree is not None:
        args.baseline_tree = args.baseline_tree.resolve()
        if not (args.baseline_tree / "config" / "asgi.py").exists():
            parser.error(f"--baseline-tree {args.baseline_tree}: no config/asgi.py")
        if "baseline" not in targets:
            targets.append("baseline")
    elif any(split_target(t)[0] == "baseline" for t in targets):
        parser.error("the baseline target needs --baseline-tree")
    for target in targets:
        error = target_error(target)
        if error:
            parser.error(error)
    per_event = [int(x) for x in args.tokens_per_event.split(",") if x]
    if not per_event or min(per_event) < 1:
        parser.error("--tokens-per-event takes numbers of 1 or more")
    workers_list = [int(x) for x in args.gateway_workers.split(",") if x]
    signal.signal(signal.SIGTERM, _interrupt)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    for old in LOG_DIR.glob("*.log"):
        old.unlink()

    bench = Bench(args)
    targets, skipped = prepare_targets(targets)
    max_level = {"litellm": args.litellm_max_level}
    runs: list[dict[str, Any]] = []
    output: dict[str, Any] = {
        "command": " ".join([Path(PY).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
        },
        "mode": mode,
        "pinning": (
            "relay or peer (its whole process tree) on CPU 0; upstreams + load "
            "generator on CPU 1; multi-worker gateways unpinned"
            if bench.relay_cpus
            else "none"
        ),
        "nice": bench.nice,
        "targets": TARGETS,
        "peers": {name: peers.version(name) for name in peers.PEERS if name in targets},
        "code": git_state(),
    }
    started = time.monotonic()
    try:
        bench.start_upstreams(per_event[0])
        replica_urls = [
            bench.upstream_urls()[i % args.upstreams] for i in range(args.replicas)
        ]
        if any(is_gateway(t) for t in targets):
            bench.platform.create(replica_urls)
            bench.platform.start_beats()
        for tokens_per_event in per_event:
            if tokens_per_event != bench.tokens_per_event:
                bench.start_upstreams(tokens_per_event)
            for repeat in range(args.repeat):
                for level in levels:
                    plan, left_out = plan_level(
                        targets,
                        level,
                        workers_list=workers_list,
                        multi_worker_min_level=args.multi_worker_min_level,
                        max_level=max_level,
                    )
                    for message in left_out:
                        if message not in skipped:
                            print(message, flush=True)
                            skipped.append(message)
                    for target, workers in plan:
                        runs.extend(
                            bench.measure(level, target, workers, repeat, started)
                        )
        if args.profile and "gateway" in targets:
            level = args.profile_level or (500 if 500 in levels else max(levels))
            print(f"profiling the gateway at C={level} (py-spy)", flush=True)
            args.profile_now = True
            try:
                profiled = bench.run(level, "gateway", 1, -1)
                output["profile"] = profiled.get("profile")
                output["profile_run"] = {
                    k: v for k, v in profiled.items() if k != "profile"
                }
            except RuntimeError as exc:
                output["profile"] = {"error": str(exc)}
            args.profile_now = False
    except KeyboardInterrupt:
        print("interrupted: cleaning up", file=sys.stderr, flush=True)
        output["interrupted"] = True
    finally:
        bench.procs.stop_all()
        bench.platform.close()
    measured = [r for r in runs if "failed" not in r and r.get("kept", True)]
    rows = summarize(measured)
    ratios = gateway_ratios(
        rows,
        "relay_cpu_us_per_request"
        if args.per_request
        else "relay_cpu_s_per_10k_tokens",
    )
    output["skipped"] = skipped
    output["runs"] = runs
    output["summary"] = rows
    output["gateway_ratios"] = ratios
    output["checks"] = (
        check_per_request(rows) if args.per_request else check_targets(rows)
    )
    output["elapsed_s"] = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(output, indent=2))
    print()
    print(table(rows))
    if ratios:
        print()
        print(ratio_table(ratios))
    if skipped:
        print()
        print("\n".join(f"skipped: {message}" for message in skipped))
    print()
    print(json.dumps(output["checks"], indent=2))
    if output.get("profile") and "self_pct" in output["profile"]:
        print("\nprofile (self %):")
        for frame, pct in output["profile"]["self_pct"][:15]:
            print(f"  {pct:5.1f}  {frame}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
