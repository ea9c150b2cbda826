"""The failover game day, live: two regions on this machine behind a real HAProxy.

Public surface: ``TwoRegions``, ``Sample``, ``run_load``, ``run_live``.

``TwoRegions`` runs what ``make up REGIONS=2`` runs, in miniature and of its own:
a PostgreSQL server of its own (``localrun.own_postgres``: the control plane, which
a drill may stop), migrated and bootstrapped per region (``bootstrap_local``: the
demo team and models, each region's pools); per region a node agent with its
simulated replicas, a gateway on a fixed port and a Redis logical database; and
HAProxy in front (``routing.domain.global_lb``), one frontend per region, checking
each region's ``/healthz``.

``run_live`` (``manage.py failover_drill`` without ``--sim``) sends streams to
region A's frontend with the ``openai`` SDK (no client retries: every error is
counted), kills A's gateway at ``loss_at`` seconds (SIGKILL: its streams break, its
port refuses), restarts it at ``return_at`` and measures what clients saw: when
errors stopped, TTFT before and during the shift, which region served each request
(the final event names it), and when traffic came home. Batch work and the
survivor's scale-up are the fleet simulator's (``--sim``); this drill proves the
wiring: the balancer, the health checks and the regions' independence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from drills.domain.failover_drill import FailoverReport, SeriesPoint, judge
from drills.domain.overload import Check
from localrun.own_postgres import OwnPostgres
from localrun.processes import (
    Process,
    free_port,
    spawn,
    start_agent,
    start_gateway,
    wait_until,
)
from routing.domain.global_lb import HealthCheck, Region, render_haproxy
from simengine.domain.percentiles import percentile

__all__ = ["Sample", "TwoRegions", "run_live", "run_load"]

# How fast the balancer notices here: checked every half second, out after two
# failures (a 1 s window), back after two successes.
LIVE_CHECK = HealthCheck(inter_s=0.5, fall=2, rise=2)


@dataclass
class LiveRegion:
    """One region's processes and environment."""

    name: str
    gateway_port: int
    listen_port: int
    env: dict[str, str]
    agent: Process | None = None
    gateway: Process | None = None

    @property
    def entry(self) -> str:
        """The region's frontend on the balancer: what its clients dial."""
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"


@dataclass
class TwoRegions:
    """Two regions, their control plane and the balancer (a context manager)."""

    tmp: Path
    redis_url: str
    names: tuple[str, str] = ("east", "west")
    check: HealthCheck = LIVE_CHECK
    regions: dict[str, LiveRegion] = field(default_factory=dict)
    team_key: str = ""
    postgres: OwnPostgres | None = None
    haproxy: Process | None = None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> TwoRegions:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        postgres = self.postgres = self._stack.enter_context(OwnPostgres())
        database_url = postgres.create_database("platform")
        shared = {
            "DATABASE_URL": database_url,
            "SECRET_KEY": f"drill-{secrets.token_urlsafe(16)}",
            "PLATFORM_ENGINE_API_KEY": f"engine-{secrets.token_urlsafe(16)}",
            "PLATFORM_SIM_ADMIN_TOKEN": f"sim-admin-{secrets.token_urlsafe(16)}",
            "PLATFORM_METRICS_TOKEN": f"metrics-{secrets.token_urlsafe(16)}",
            "PLATFORM_ALLOWED_HOSTS": "127.0.0.1,localhost",
            "PLATFORM_SNAPSHOT_REFRESH_S": "0.5",
            "PLATFORM_USAGE_FLUSH_S": "1",
        }
        base = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
        prefix = f"drill-{secrets.token_hex(4)}"
        for index, name in enumerate(self.names):
            env = {
                **base,
                **shared,
                "PLATFORM_REGION": name,
                "REDIS_URL": _redis_db(self.redis_url, index),
                "PLATFORM_REDIS_PREFIX": f"{prefix}-{name}",
                "PLATFORM_SNAPSHOT_PATH": str(self.tmp / f"snapshot-{name}.json"),
            }
            self.regions[name] = LiveRegion(
                name=name, gateway_port=free_port(), listen_port=free_port(), env=env
            )
        first = self.regions[self.names[0]].env
        _manage(["migrate", "--noinput"], first, self.tmp / "migrate.log")
        credentials = self.tmp / "credentials.json"
        for region in self.regions.values():
            _manage(
                ["bootstrap_local", "--json", "--credentials", str(credentials)],
                region.env,
                self.tmp / f"bootstrap-{region.name}.log",
            )
        self.team_key = json.loads(credentials.read_text())["team_key"]
        for region in self.regions.values():
            region.agent = start_agent(
                region.env, self.tmp, region=region.name, node=f"{region.name}-node"
            )
            self._stack.callback(region.agent.stop, grace_s=20)
        for region in self.regions.values():
            self.start_gateway(region.name)
        self._stack.callback(self._stop_gateways)
        self._start_haproxy()

    def start_gateway(self, name: str) -> None:
        """(Re)start ``name``'s gateway on its port; wait until the region is ready."""
        region = self.regions[name]
        region.gateway = start_gateway(
            region.env, self.tmp, name=f"gateway-{name}", port=region.gateway_port
        )
        wait_until(
            lambda: self.region_ready(name),
            timeout_s=90,
            message=f"region {name} to be ready (/healthz 200)",
        )

    def kill_gateway(self, name: str) -> None:
        """Lose ``name``'s gateway at once (SIGKILL): streams break, the port refuses."""
        gateway = self.regions[name].gateway
        if gateway is not None and gateway.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(gateway.popen.pid, signal.SIGKILL)
            gateway.popen.wait(10)

    def region_ready(self, name: str) -> bool:
        try:
            response = httpx.get(f"{self.regions[name].gateway_url}/healthz", timeout=2)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _stop_gateways(self) -> None:
        for region in self.regions.values():
            if region.gateway is not None:
                region.gateway.stop()

    def _start_haproxy(self) -> None:
        config = self.tmp / "haproxy.cfg"
        config.write_text(
            render_haproxy(
                [
                    Region(
                        name,
                        gateway=f"127.0.0.1:{region.gateway_port}",
                        listen=f"127.0.0.1:{region.listen_port}",
                    )
                    for name, region in self.regions.items()
                ],
                check=self.check,
            )
        )
        first = self.regions[self.names[0]]
        self.haproxy = spawn(
            ["haproxy", "-db", "-f", str(config)],
            dict(os.environ),
            self.tmp / "haproxy.log",
            first.entry,
        )
        self._stack.callback(self.haproxy.stop)
        wait_until(
            lambda: _answers(f"{first.entry}/healthz") or self.haproxy_exited(),
            timeout_s=30,
            message="HAProxy to take connections",
        )
        if self.haproxy_exited():
            raise RuntimeError(f"haproxy exited:\n{self.haproxy.log()}")

    def haproxy_exited(self) -> bool:
        return self.haproxy is not None and self.haproxy.popen.poll() is not None


def _redis_db(url: str, index: int) -> str:
    """Return ``url`` with its logical database moved by ``index`` (one per region)."""
    head, _, db = url.rpartition("/")
    base = int(db) if db.isdigit() else 0
    return f"{head}/{(base + index) % 16}" if db.isdigit() else f"{url}/{index}"


def _manage(argv: list[str], env: dict[str, str], log: Path) -> None:
    with log.open("wb") as out:
        done = subprocess.run(
            [sys.executable, "manage.py", *argv],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"manage.py {argv[0]} failed:\n{log.read_text()[-2000:]}")


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return False
    return True


# -- the load ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as its client saw it (times in seconds on the drill's clock)."""

    start: float
    end: float
    ok: bool
    region: str  # the region the final event names; "" when it failed
    ttft_s: float | None
    status: int  # HTTP status of a refusal, 0 for a broken connection or stream


async def _one(client: Any, clock0: float) -> Sample:
    import openai

    start = time.monotonic() - clock0
    ttft = None
    region = ""
    try:
        stream = await client.chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "Tell me about regions."}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if ttft is None and chunk.choices:
                ttft = time.monotonic() - clock0 - start
            extra = chunk.model_extra or {}
            if extra.get("region"):
                region = str(extra["region"])
    except openai.APIStatusError as exc:
        return _failed(start, clock0, exc.status_code)
    except (openai.APIError, httpx.HTTPError):
        return _failed(start, clock0, 0)
    # A stream cut before its final event did not finish.
    end = time.monotonic() - clock0
    return Sample(start, end, ok=bool(region), region=region, ttft_s=ttft, status=0)


def _failed(start: float, clock0: float, status: int) -> Sample:
    end = time.monotonic() - clock0
    return Sample(start, end, ok=False, region="", ttft_s=None, status=status)


async def _load(
    entry: str,
    key: str,
    *,
    streams: int,
    stop: threading.Event,
    clock0: float,
    samples: list[Sample],
) -> None:
    import openai

    async with openai.AsyncOpenAI(
        base_url=f"{entry}/v1", api_key=key, max_retries=0, timeout=30
    ) as client:

        async def worker() -> None:
            while not stop.is_set():
                samples.append(await _one(client, clock0))

        await asyncio.gather(*(worker() for _ in range(streams)))


@contextlib.contextmanager
def run_load(
    entry: str, key: str, *, streams: int, clock0: float
) -> Iterator[list[Sample]]:
    """Send ``streams`` concurrent streams to ``entry`` in a thread until the
    block ends; the list gets each request's sample as it ends (appends are
    atomic, so the caller may read it meanwhile)."""
    stop = threading.Event()
    result: list[Sample] = []

    def main() -> None:
        asyncio.run(
            _load(entry, key, streams=streams, stop=stop, clock0=clock0, samples=result)
        )

    thread = threading.Thread(target=main, name="failover-load", daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join(60)


# -- the drill -----------------------------------------------------------------------


def report_of(
    samples: list[Sample],
    *,
    lost: str,
    loss_at: float,
    back_at: float | None,
    check: HealthCheck,
    returned_after_s: float | None,
    scenario: dict[str, object],
) -> FailoverReport:
    """Judge what the clients saw: times from the loss."""
    failed = [s for s in samples if not s.ok]
    after_loss = [s for s in failed if s.end >= loss_at]
    errors_stop = max((s.end - loss_at for s in after_loss), default=None)
    in_flight = sum(1 for s in after_loss if s.start < loss_at)
    sent = sum(1 for s in after_loss if s.start >= loss_at)
    shift_end = loss_at + check.window_s + 10.0
    if back_at is not None:
        shift_end = min(shift_end, back_at)
    before = [s.ttft_s for s in samples if s.ttft_s is not None and s.start < loss_at]
    shift = [
        s.ttft_s
        for s in samples
        if s.ttft_s is not None and loss_at <= s.start < shift_end
    ]
    refused = [s for s in failed if s.status in (429, 503) and s.start >= loss_at]
    series = []
    end = max((s.end for s in samples), default=loss_at)
    step = 1.0
    at = -loss_at
    while at < end - loss_at:
        window = [s for s in samples if at <= s.end - loss_at < at + step]
        ttfts = [s.ttft_s for s in window if s.ttft_s is not None]
        regions: dict[str, int] = {}
        for s in window:
            if s.ok:
                regions[s.region] = regions.get(s.region, 0) + 1
        series.append(
            SeriesPoint(
                at=round(at, 3),
                errors=sum(1 for s in window if not s.ok),
                interactive_ttft_p95_s=percentile(ttfts, 0.95),
                replicas=regions,  # answers by region that served them, this second
                batch_tokens_s=0.0,
                hit_rate=None,
            )
        )
        at += step
    report = FailoverReport(
        mode="live",
        window_s=check.window_s,
        errors_stop_s=None if errors_stop is None else round(errors_stop, 3),
        requests_total=len(samples),
        requests_failed=len(failed),
        failed_by_cause={
            "in_flight_on_lost": in_flight,
            "sent_to_lost": sent,
            "before_the_loss": len(failed) - len(after_loss),
        },
        rate_limited=sum(1 for s in failed if s.status == 429),
        interactive_ttft_p50_before_s=percentile(before, 0.5),
        interactive_ttft_p95_before_s=percentile(before, 0.95),
        interactive_ttft_p50_shift_s=percentile(shift, 0.5),
        interactive_ttft_p95_shift_s=percentile(shift, 0.95),
        interactive_shed_inside=len(refused),
        inside_rate_limited=sum(1 for s in refused if s.status == 429),
        interactive_shed_outside=0,
        batch_tokens_shift=None,
        batch_tokens_baseline=None,
        batch_shed=0,
        pools=(),
        series=tuple(series),
        checks=(),
        scenario={
            **scenario,
            "lost_region": lost,
            "loss_at_s": loss_at,
            "back_at_s": back_at,
            "returned_after_s": returned_after_s,
            "check_inter_s": check.inter_s,
            "check_fall": check.fall,
            "client_retries": 0,
        },
    )
    checks: tuple[Check, ...] = judge(report)
    home = Check(
        "traffic_returns_home",
        returned_after_s is not None,
        "no answer from the lost region after it came back"
        if returned_after_s is None
        else f"answers came from {lost} again {returned_after_s:.1f} s after its "
        "gateway was back",
    )
    return replace(report, checks=(*checks, home))


def run_live(
    *,
    loss_at: float | None = None,
    duration: float | None = None,
    check_inter: float | None = None,
    check_fall: int | None = None,
    streams: int = 8,
    **_options: Any,
) -> FailoverReport:
    """Run the game day at small scale; return what the clients saw.

    ``duration`` seconds of load through region A's frontend; A's gateway is killed
    at ``loss_at`` and restarted halfway between the loss and the end.
    """
    loss_at = 10.0 if loss_at is None else loss_at
    duration = 30.0 if duration is None else duration
    if not 0 < loss_at < duration:
        raise ValueError("--loss-at must fall inside --duration")
    check = HealthCheck(
        inter_s=check_inter or LIVE_CHECK.inter_s,
        fall=check_fall or LIVE_CHECK.fall,
        rise=LIVE_CHECK.rise,
    )
    redis_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    for name in ("httpx", "httpx2"):  # a line a request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    with (
        tempfile.TemporaryDirectory(prefix="failover-") as tmp,
        TwoRegions(Path(tmp), redis_url=redis_url, check=check) as platform,
    ):
        lost, survivor = platform.names
        entry = platform.regions[lost].entry
        clock0 = time.monotonic()

        def now() -> float:
            return time.monotonic() - clock0

        with run_load(entry, platform.team_key, streams=streams, clock0=clock0) as got:
            wait_until(lambda: now() >= loss_at, timeout_s=loss_at + 5, message="peak")
            platform.kill_gateway(lost)
            back_at = loss_at + (duration - loss_at) / 2
            wait_until(lambda: now() >= back_at, timeout_s=duration, message="return")
            platform.start_gateway(lost)
            back_at = now()
            wait_until(lambda: now() >= duration, timeout_s=duration, message="end")
        home = sorted(
            s.end for s in got if s.ok and s.region == lost and s.start >= back_at
        )
        returned = None if not home else round(home[0] - back_at, 3)
        return report_of(
            list(got),
            lost=lost,
            loss_at=loss_at,
            back_at=back_at,
            check=check,
            returned_after_s=returned,
            scenario={
                "duration_s": duration,
                "streams": streams,
                "regions": list(platform.names),
                "survivor": survivor,
                "after_loss_s": duration - loss_at,
                "pools": {
                    "chat": {"replicas": 2, "profile": "simulated"},
                    "reasoning": {"replicas": 1, "profile": "simulated"},
                },
            },
        )
