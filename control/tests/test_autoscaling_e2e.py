"""Autoscaling end to end: doubling the load adds replicas, its fall removes them.

Real processes: the gateway, the node agent and its simulated replicas, a Celery
worker with beat running the autoscaler's tick (``control.autoscale_pools``),
PostgreSQL, Redis, the load generator (``bench/loadgen.py``) and ``openai`` SDK
clients. Each replica carries a small measured capacity (``C`` tokens in flight,
about six requests), so that a handful of streams moves the autoscaler.

The load is batch tier from team alpha (the load generator: batch waits in the
admission queue while the pool is past its batch ceiling, never refused) and
interactive streams from team beta, whose guaranteed share covers them (queued,
never refused, when the pool is full): so a full pool queues and no client is
refused. Every SDK stream is checked (all its tokens, its usage, no error), and
so is every load-generator answer.

GIVEN a pool of one replica (min 1, max 4), WHEN the load comes (six streams,
past 70% of one replica and past its batch ceiling: a queue forms), THEN the
autoscaler adds one replica, it serves, the gateway routes to it and the queue
drains; WHEN the load doubles (twelve streams: a queue again), THEN it adds one
more, and the queue drains again; WHEN the load falls to two streams, THEN the
replicas leave one at a time (one decision row per replica, a scale-down
interval apart, never two draining at once), each drained before it stops, and
no client saw an error.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest
from django.utils import timezone

from control.autoscaling import pool_state
from engine_nodes.models import Replica, ScalingDecision
from localrun.processes import ROOT, wait_until
from models_registry.models import Pool
from tests.live import LivePlatform, extra_of, start_platform, usage_of

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

logger = logging.getLogger(__name__)

MAX_TOKENS = 100
# C, one replica's measured tokens in flight: six requests of about 130 tokens
# (prompt plus MAX_TOKENS). The test checks the arithmetic on the charge it sees.
REPLICA_TOKENS_IN_FLIGHT = 800
# Per load step: the load generator's users and the SDK streams checked.
LOADGEN_USERS = 5
SDK_STREAMS = 1
POOL_SETTINGS: dict[str, Any] = {
    "min_replicas": 1,
    "max_replicas": 4,
    "target_utilisation": 0.7,
    "scale_down_utilisation": 0.5,
    # After a replica joins, the queue trigger (``decide``, rule 3) waits a short
    # window: longer than the gateways take to count the new replica (a beat and
    # an exchange, about 2-3 s here), so the queue its start left drains first.
    "stable_window_s": 6.0,
    "panic_window_s": 5.0,
    "scale_down_interval_s": 3.0,
}
# The first load generator runs this long; the second stops with it.
LOAD_S = 24.0
# Ticks in a row that must see no queue for it to count as drained.
DRAINED_TICKS = 3
UP_REASONS = {"utilisation", "queue", "panic"}


@pytest.fixture
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("autoscaling")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 1},
            # A slower stand-in (about 55 tokens a second per stream) keeps this
            # machine's cores for the platform's own processes.
            engine_config={"sim_profile": "h100-70b-tp4"},
            replica_tokens_in_flight=REPLICA_TOKENS_IN_FLIGHT,
            pool_settings=POOL_SETTINGS,
            guaranteed_shares={"beta": 1.0},
            autoscaler=True,
            PLATFORM_AUTOSCALE_INTERVAL_S="0.5",
            # Queued batch waits out a replica's start instead of being shed.
            PLATFORM_ADMISSION_MAX_WAIT_S="120",
            # A drained replica's streams finish long before this.
            PLATFORM_DRAIN_TIMEOUT_S="60",
        ) as live,
    ):
        yield live


# -- what the test watches ---------------------------------------------------------


@dataclass
class Observer:
    """Polls the pool and its replicas; keeps what a scenario's checks need.

    Every wait of the test calls ``observe``, so no replica state lasting longer
    than a poll (a drain lasts seconds) goes unseen.
    """

    region: str
    started: float = field(default_factory=time.monotonic)
    desired: int = 0
    states: dict[str, str] = field(default_factory=dict)
    # Every state each replica was seen in, in order.
    history: dict[str, list[str]] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    max_draining: int = 0
    # The autoscaler's ticks: (tick time, queue depth it saw), each tick once.
    ticks: list[tuple[str, int]] = field(default_factory=list)
    demand: int = 0  # tokens in flight and queued at the last tick
    timeline: list[str] = field(default_factory=list)

    def observe(self) -> Observer:
        pool = Pool.objects.get(region=self.region)
        states = dict(
            Replica.objects.filter(region=self.region).values_list(
                "replica_id", "state"
            )
        )
        last = (pool.autoscaler_state or {}).get("last") or {}
        if last.get("at") and (not self.ticks or self.ticks[-1][0] != last["at"]):
            signals = last.get("signals", {})
            self.ticks.append((last["at"], int(signals.get("queue_depth", 0))))
            self.demand = int(
                signals.get("tokens_in_flight", 0) + signals.get("queued_tokens", 0)
            )
        for replica_id, state in states.items():
            seen = self.history.setdefault(replica_id, [])
            if not seen or seen[-1] != state:
                seen.append(state)
        self.removed += [r for r in self.states if r not in states]
        self.max_draining = max(
            self.max_draining, sum(s == "draining" for s in states.values())
        )
        if states != self.states or pool.target_replicas != self.desired:
            counts = {
                s: list(states.values()).count(s) for s in sorted(set(states.values()))
            }
            self.timeline.append(
                f"{time.monotonic() - self.started:6.1f} s desired "
                f"{pool.target_replicas} replicas {counts} queue "
                f"{self.ticks[-1][1] if self.ticks else '-'} demand {self.demand}"
            )
        self.states, self.desired = states, pool.target_replicas
        return self

    def note(self, event: str) -> None:
        self.timeline.append(f"{time.monotonic() - self.started:6.1f} s {event}")

    def serving(self) -> list[str]:
        return sorted(r for r, s in self.states.items() if s == "serving")

    def queue_seen_since(self, tick: int) -> bool:
        """True once a tick after the ``tick``-th saw requests queued."""
        return any(depth > 0 for _, depth in self.ticks[tick:])

    def queue_drained(self) -> bool:
        """True when the last ``DRAINED_TICKS`` ticks saw no queue."""
        recent = self.ticks[-DRAINED_TICKS:]
        return len(recent) == DRAINED_TICKS and all(d == 0 for _, d in recent)

    def wait(self, condition: Any, *, timeout_s: float, message: str) -> None:
        wait_until(
            lambda: condition(self.observe()),
            timeout_s=timeout_s,
            interval_s=0.1,
            message=f"{message}; seen so far:\n" + "\n".join(self.timeline),
        )


@dataclass
class Streams:
    """SDK clients (team beta, interactive) streaming one answer after another.

    Each answer's outcome is kept: its replica, its tokens, its usage or error.
    """

    platform: LivePlatform
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def add(self, count: int) -> None:
        for _ in range(count):
            index = len(self.threads)
            thread = threading.Thread(target=self._run, args=(index,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _run(self, index: int) -> None:
        client = self.platform.client("beta", timeout=60)
        sent = 0
        while not self.stop.is_set():
            sent += 1
            outcome: dict[str, Any] = {"client": index, "tokens": 0}
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="chat-7b",
                    messages=[
                        {"role": "user", "content": prompt(f"sdk-{index}-{sent}")}
                    ],
                    max_tokens=MAX_TOKENS,
                    stream=True,
                    extra_body={"ignore_eos": True},
                    extra_headers={
                        "x-priority": "interactive",
                        "x-conversation-id": f"autoscaling-{index}-{sent}",
                    },
                )
                outcome["replica_id"] = raw.headers.get("x-replica-id")
                for chunk in raw.parse():
                    if chunk.choices and chunk.choices[0].delta.content:
                        outcome["tokens"] += 1
                    if chunk.usage is not None:
                        outcome["usage"] = usage_of(chunk)
            except openai.APIError as exc:
                outcome["error"] = repr(exc)
            self.outcomes.append(outcome)

    def finish(self) -> list[dict[str, Any]]:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in self.threads), "a stream never ended"
        return list(self.outcomes)


def prompt(tag: str) -> str:
    """Return a prompt as long as the load generator's (so charges are alike)."""
    return f"Request bench-{tag}: tell me a long story about streams."


def start_loadgen(
    platform: LivePlatform, tmp: Path, name: str, *, duration_s: float
) -> subprocess.Popen[bytes]:
    """Start ``bench/loadgen.py`` (batch tier, team alpha) against the gateway."""
    argv = [sys.executable, "bench/loadgen.py", "--url", platform.url]
    argv += ["-c", str(LOADGEN_USERS), "--key", platform.keys["alpha"]]
    argv += ["--max-tokens", str(MAX_TOKENS), "--priority", "batch"]
    argv += ["--ramp-s", "0.5", "--warmup-s", "0", "--duration-s", str(duration_s)]
    with (tmp / f"{name}.out").open("wb") as out:
        return subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def loadgen_result(tmp: Path, name: str) -> dict[str, Any]:
    lines = (tmp / f"{name}.out").read_text().strip().splitlines()
    assert lines, f"{name} printed nothing"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def route_to(platform: LivePlatform, replica_id: str) -> int:
    """Return how many conversations it took until the gateway sent one to
    ``replica_id`` (it is in the ring); fail after 300."""
    client = platform.client("beta", timeout=30)
    for n in range(300):
        answer = client.chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "ping"}],
            max_tokens=1,
            extra_headers={
                "x-priority": "interactive",
                "x-conversation-id": f"ring-{replica_id}-{n}",
            },
        )
        if extra_of(answer)["replica_id"] == replica_id:
            return n + 1
    raise AssertionError(f"300 conversations never reached {replica_id}")


def charge_of(platform: LivePlatform) -> int:
    """Return the tokens admission charges a request of the scenario."""
    answer = platform.client("beta").chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": prompt("xxxxxx-0-1")}],
        max_tokens=1,
        extra_headers={"x-priority": "interactive"},
    )
    return usage_of(answer).prompt_tokens + MAX_TOKENS


# -- the scenario ------------------------------------------------------------------


def test_autoscaler_adds_replicas_as_load_doubles_and_removes_them_one_at_a_time(
    platform: LivePlatform,
    django_db_blocker: DjangoDbBlocker,
    tmp_path: Path,
) -> None:
    with django_db_blocker.unblock():
        run_scenario(platform, tmp_path)


def run_scenario(platform: LivePlatform, tmp: Path) -> None:
    region = platform.region
    capacity = REPLICA_TOKENS_IN_FLIGHT
    charge = charge_of(platform)
    step = (LOADGEN_USERS + SDK_STREAMS) * charge
    # The arithmetic the scenario rests on. A step of load is past the batch
    # ceiling of one replica (0.9 C: a queue forms) and needs two at 70% (0.7 C <
    # step <= 1.4 C); two steps are past the ceiling of two replicas, and need
    # three (1.4 C < 2 step <= 2.1 C), under whose ceiling they fit; the two
    # streams left stay under half of one replica (the scale-down threshold).
    assert 0.9 * capacity < step <= 1.05 * capacity, (charge, step)
    assert 2 * SDK_STREAMS * charge < 0.5 * capacity, charge

    watch = Observer(region).observe()
    (first,) = watch.serving()
    assert watch.desired == 1
    streams = Streams(platform)
    loadgens: dict[str, subprocess.Popen[bytes]] = {}
    try:
        # WHEN the load comes: past 70% of one replica, and past its batch ceiling.
        load_started = time.monotonic()
        ticks_before = len(watch.ticks)
        streams.add(SDK_STREAMS)
        loadgens["first"] = start_loadgen(platform, tmp, "first", duration_s=LOAD_S)
        watch.wait(
            lambda w: w.queue_seen_since(ticks_before),
            timeout_s=15,
            message="a queue to form on one replica",
        )
        watch.wait(lambda w: w.desired >= 2, timeout_s=15, message="a scale-up")
        watch.wait(
            lambda w: len(w.serving()) == 2, timeout_s=30, message="a second replica"
        )
        (second,) = set(watch.serving()) - {first}
        probes = {second: route_to(platform, second)}
        watch.wait(
            lambda w: w.queue_drained(), timeout_s=15, message="the queue to drain"
        )
        assert watch.desired == 2, watch.timeline

        # WHEN the load doubles: past 70% of two replicas, and a queue again.
        ticks_before = len(watch.ticks)
        remaining_s = LOAD_S - (time.monotonic() - load_started)
        assert remaining_s > 10, f"the first step took {LOAD_S - remaining_s:.0f} s"
        streams.add(SDK_STREAMS)
        loadgens["second"] = start_loadgen(
            platform, tmp, "second", duration_s=remaining_s
        )
        watch.wait(
            lambda w: w.queue_seen_since(ticks_before),
            timeout_s=10,
            message="a queue to form on two replicas",
        )
        watch.wait(lambda w: w.desired >= 3, timeout_s=15, message="a second scale-up")
        watch.wait(
            lambda w: len(w.serving()) == 3, timeout_s=30, message="a third replica"
        )
        (third,) = set(watch.serving()) - {first, second}
        probes[third] = route_to(platform, third)
        watch.wait(
            lambda w: w.queue_drained(), timeout_s=15, message="the queue to drain"
        )
        assert watch.desired == 3, watch.timeline
        # All of it under the doubled load, as the pool state shows it.
        assert all(p.poll() is None for p in loadgens.values()), "the load ended"
        (entry,) = pool_state(model_id="chat-7b", now=timezone.now(), region=region)[
            "pools"
        ]
        assert (entry["desired_replicas"], entry["serving_replicas"]) == (3, 3)
        assert entry["replica_tokens_in_flight"] == capacity
        assert not entry["capacity_is_assumed"]
        assert (
            entry["decisions"][0]["from_replicas"],
            entry["decisions"][0]["to_replicas"],
        ) == (2, 3)
        peak_at = time.time()

        # WHEN the load falls (the load generators end): two streams go on.
        for name, popen in loadgens.items():
            watch.wait(
                lambda w, p=popen: p.poll() is not None,
                timeout_s=LOAD_S + 30,
                message=f"loadgen {name} to end",
            )
        fell_at = time.time()
        watch.note("the load generators ended")
        watch.wait(
            lambda w: w.desired == 1 and list(w.states.values()) == ["serving"],
            timeout_s=60,
            message="the pool back to one replica",
        )
    finally:
        outcomes = streams.finish()
        for popen in loadgens.values():
            if popen.poll() is None:
                popen.kill()
                popen.wait()

    logger.info("timeline:\n%s", "\n".join(watch.timeline))
    # THEN every answer was whole: no client saw an error.
    for name in loadgens:
        result = loadgen_result(tmp, name)
        logger.info(
            "loadgen %s: %d answers, %d errors",
            name,
            result["requests_completed"],
            result["errors"],
        )
        assert result["errors"] == 0, result
        assert result["requests_completed"] > 0, result
    assert outcomes, "no SDK stream ran"
    broken = [o for o in outcomes if "error" in o or "usage" not in o]
    assert not broken, broken
    assert all(o["usage"].completion_tokens == MAX_TOKENS for o in outcomes)
    assert all(o["tokens"] == MAX_TOKENS for o in outcomes)
    logger.info(
        "sdk: %d streams over replicas %s; ring probes %s",
        len(outcomes),
        sorted({str(o["replica_id"]) for o in outcomes}),
        probes,
    )

    # THEN the decisions: up one replica per load step, down one at a time.
    rows = list(
        ScalingDecision.objects.filter(region=region).order_by("decided_at", "id")
    )
    logger.info(
        "decisions:\n%s",
        "\n".join(
            f"{r.decided_at:%H:%M:%S.%f} {r.from_replicas} -> {r.to_replicas} "
            f"{r.reason} utilisation {r.utilisation} queue "
            f"{r.signals.get('queue_depth')}"
            for r in rows
        ),
    )
    ups = [r for r in rows if r.to_replicas > r.from_replicas]
    downs = [r for r in rows if r.to_replicas < r.from_replicas]
    assert [(r.from_replicas, r.to_replicas) for r in ups] == [(1, 2), (2, 3)], rows
    assert all(r.reason in UP_REASONS for r in ups), rows
    assert [(r.from_replicas, r.to_replicas) for r in downs] == [(3, 2), (2, 1)], rows
    assert all(r.reason == "scale_down" for r in downs), rows
    assert all(r.decided_at.timestamp() >= fell_at for r in downs), rows
    assert all(r.decided_at.timestamp() <= peak_at for r in ups), rows
    gap_s = (downs[1].decided_at - downs[0].decided_at).total_seconds()
    assert gap_s >= POOL_SETTINGS["scale_down_interval_s"], gap_s

    # THEN the replicas left one at a time, each drained before it stopped.
    assert watch.max_draining == 1, watch.timeline
    (kept,) = watch.states
    assert sorted(watch.removed) == sorted({first, second, third} - {kept})
    for replica_id in watch.removed:
        assert watch.history[replica_id][-2:] == ["serving", "draining"], watch.history
    log = platform.agent.log()
    assert "drain deadline" not in log
    assert all(f"replica {r} drained in" in log for r in watch.removed), log[-4000:]
