"""The traffic twin's live window (``manage.py twin_check``): real processes, recorded.

Public surface: ``TwinPlan``, ``LiveWindow``, ``run_live_window``, ``MODEL``,
``PROFILE``, ``TEAM``.

``run_live_window`` registers a scratch model (``twin-chat``: one pool, min to
max replicas, its version's load-tested capacity set small so a few streams
move the autoscaler), turns traffic recording on for the pool (share 1.0), and
starts a node agent (simulated replicas) and a gateway under uvicorn as real
processes (``localrun.processes``, as the other live drills and the end-to-end
tests start them). While a load generator plays ``drills.domain.twin_check``'s
day of conversations through the gateway over HTTP (httpx, streaming; TTFT and
cached tokens measured client-side), a thread ticks the platform's own
autoscaler (``control.autoscaling.autoscale_region``, what Celery beat runs)
every ``interval_s`` and samples the pool each second: replicas serving (their
rows), the size asked for (``Pool.desired_replicas``) and the gateway's tokens in
flight (its live-load share in Redis). Probes measure the gateway's own
overhead (TTFT through the gateway less TTFT of a like request sent straight to
a replica, in pairs): before the load, at idle, and a pair a second during it,
from the load's event loop (what the client adds is in it too); the records of
the probes during the load leave the trace. Idle probes of the load's prompt
size sent straight to a replica read its time beyond its profile
(``measure_replica_residual``). Then the window is exported as ``export_traffic`` does
(``routing.traffic.read_traffic``, ``routing.domain.traffic.trace_lines``), and
everything it created is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import redis
from django.conf import settings
from django.db import connection
from django.utils import timezone

from accounts.models import Team
from control.autoscaling import autoscale_region, read_load_shares, set_pool_autoscaling
from drills.domain.twin_check import (
    PlannedTurn,
    ReplicaPoint,
    Served,
    TwinLoad,
    decision_row,
    plan_turns,
    start_delay_s,
    system_text,
    user_text,
)
from drills.twin_probes import (
    Probe,
    measure_overhead,
    measure_replica_residual,
    probe_conversation,
    probe_during,
    stream_chat,
)
from engine_nodes.domain.load_shares import sum_pool_load
from engine_nodes.models import Replica, ScalingDecision
from localrun.processes import (
    drill_env,
    serving_replicas,
    start_agent,
    start_gateway,
    wait_until,
)
from localrun.seeding import (
    LimitSeed,
    ModelSeed,
    PlatformSeed,
    TeamSeed,
    VersionSeed,
    digest,
    remove_scratch_model,
    seed_platform,
)
from models_registry import pool_traffic
from models_registry.models import ModelVersion, Pool
from routing.domain.routing_key import routing_key
from routing.domain.traffic import salted_id, trace_lines
from routing.traffic import read_traffic, stream_key, traffic_salt

logger = logging.getLogger(__name__)

__all__ = ["MODEL", "PROFILE", "TEAM", "LiveWindow", "TwinPlan", "run_live_window"]

MODEL = "twin-chat"
TEAM = "twin-team"
PROFILE = "a100-8b"  # what the seeded fp16 one-GPU version's replicas run
_BODY = {
    "weights_uri": "s3://models/twin-chat/drill/",
    "weights_hash": digest("twin-chat drill weights"),
    "tokenizer_hash": digest("twin-chat drill tokenizer"),
    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "precision": "fp16",
    "gpus_per_replica": 1,
    "engine_config": {"sim_profile": PROFILE, "max_model_len": 8192},
}


@dataclass(frozen=True)
class TwinPlan:
    """The live window: its load, the pool's size and autoscaling settings."""

    load: TwinLoad = field(default_factory=TwinLoad)
    min_replicas: int = 1
    max_replicas: int = 3
    replica_tokens_in_flight: int = 1000
    interval_s: float = 2.0
    target_utilisation: float = 0.7
    scale_down_utilisation: float = 0.35
    stable_window_s: float = 20.0
    panic_window_s: float = 4.0
    scale_down_interval_s: float = 10.0

    def scaling_changes(self) -> dict[str, Any]:
        """The pool's autoscaling settings, as the control-plane API takes them."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_utilisation": self.target_utilisation,
            "scale_down_utilisation": self.scale_down_utilisation,
            "stable_window_s": self.stable_window_s,
            "panic_window_s": self.panic_window_s,
            "scale_down_interval_s": self.scale_down_interval_s,
        }


@dataclass
class LiveWindow:
    """What the live window measured, and its exported trace."""

    served: list[Served]
    failed: dict[str, int]  # why -> requests (an HTTP status, "no token", ...)
    replicas: list[ReplicaPoint]
    gateway_tokens_in_flight: list[tuple[float, int]]
    decisions: list[dict[str, Any]]
    ticks: list[float]  # the autoscaler's, on the window's clock
    trace: list[dict[str, Any]]
    trace_skipped: int
    window_s: float
    gateway_overhead_s: float  # at idle, before the load
    gateway_overhead_load_s: float | None  # during it (None: no probe answered)
    load_probes: int
    replica_residual_s: float  # beyond the profile, at idle, at the load's prompt
    replica_start_s: float | None
    wall_s: float


# -- the load generator ------------------------------------------------------------------


class _Conversations:
    """The live side of the plan: each conversation's messages so far, its turns
    sent one after another (a turn waits for the previous answer)."""

    def __init__(self, load: TwinLoad) -> None:
        self.load = load
        self.messages: dict[str, list[dict[str, str]]] = {}
        self.busy: dict[str, asyncio.Lock] = {}

    def lock(self, conversation: str) -> asyncio.Lock:
        return self.busy.setdefault(conversation, asyncio.Lock())

    def ask(self, turn: PlannedTurn) -> list[dict[str, str]]:
        history = self.messages.setdefault(
            turn.conversation,
            [{"role": "system", "content": system_text(self.load, turn)}],
        )
        history.append({"role": "user", "content": user_text(self.load, turn)})
        return list(history)

    def answered(self, turn: PlannedTurn, text: str | None) -> None:
        """Keep the answer; an unanswered question (None) leaves the history as
        it was, as a client that gave up on it would."""
        history = self.messages[turn.conversation]
        if text is None:
            history.pop()
        else:
            history.append({"role": "assistant", "content": text})


async def _play(
    url: str, key: str, load: TwinLoad, probe: Probe
) -> tuple[list[Served], dict[str, int], float, float, tuple[list[float], int]]:
    """Play the plan against the gateway while probing its overhead; return what
    was served (times from the first send), how many failed, the window's start
    and end (unix) and the probes' differences."""
    turns = plan_turns(load)
    conversations = _Conversations(load)
    served: list[Served] = []
    failed: dict[str, int] = {}
    endpoint = f"{url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        clock0 = time.perf_counter()
        wall0 = time.time()

        async def one(turn: PlannedTurn) -> None:
            await asyncio.sleep(max(0.0, clock0 + turn.at - time.perf_counter()))
            async with conversations.lock(turn.conversation):
                messages = conversations.ask(turn)
                sent = time.perf_counter()
                try:
                    ttft, text, usage, status = await stream_chat(
                        client,
                        endpoint,
                        {
                            "Authorization": f"Bearer {key}",
                            "x-conversation-id": turn.conversation,
                        },
                        {
                            "model": MODEL,
                            "messages": messages,
                            "max_tokens": turn.max_tokens,
                            "stream": True,
                            "stream_options": {"include_usage": True},
                        },
                    )
                except httpx.HTTPError:
                    ttft, text, usage, status = None, "", None, 599
                ended = time.perf_counter()
                is_answered = status == 200 and ttft is not None
                conversations.answered(turn, text if is_answered else None)
            if status != 200 or ttft is None or usage is None:
                why = (
                    f"{status} {text}".strip()
                    if status != 200
                    else ("no token" if ttft is None else "no usage")
                )
                failed[why] = failed.get(why, 0) + 1
                return
            details = usage.get("prompt_tokens_details") or {}
            served.append(
                Served(
                    at=sent - clock0,
                    ended_at=ended - clock0,
                    ttft_s=ttft,
                    prompt_tokens=int(usage["prompt_tokens"]),
                    cached_tokens=int(details.get("cached_tokens") or 0),
                    max_tokens=turn.max_tokens,
                    output_tokens=int(usage.get("completion_tokens") or 0),
                    conversation=turn.conversation,  # salted once the window ends
                )
            )

        done = asyncio.Event()
        probing = asyncio.create_task(probe_during(probe, done))
        await asyncio.gather(*(one(turn) for turn in turns))
        done.set()
        probed = await probing
        wall1 = time.time()
    served.sort(key=lambda s: s.at)
    return served, failed, wall0, wall1, probed


# -- the control loop and the samples ----------------------------------------------------


class _Pool:
    """Tick the autoscaler every ``interval_s`` and sample the pool every second,
    in a thread of its own, until stopped."""

    def __init__(self, plan: TwinPlan, region: str, prefix: str) -> None:
        self.plan = plan
        self.region = region
        self.prefix = prefix
        self.points: list[ReplicaPoint] = []
        self.in_flight: list[tuple[float, int]] = []
        # When each autoscaler tick read the pool, on the window's clock.
        self.ticks: list[float] = []
        self.errors: list[str] = []
        self.clock0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="twin-pool", daemon=True)

    def start(self, clock0: float) -> None:
        self.clock0 = clock0
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        next_tick = time.perf_counter()
        try:
            with redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5) as client:
                while not self._stop.is_set():
                    now = time.perf_counter()
                    if now >= next_tick:
                        self.ticks.append(now - self.clock0)
                        autoscale_region(
                            region=self.region, now=timezone.now(), redis_client=client
                        )
                        next_tick = now + self.plan.interval_s
                    self._sample(client, now - self.clock0)
                    # The sampling period: the drill's clock, not a wait for a
                    # condition.
                    self._stop.wait(1.0)
        except Exception as exc:  # reported with the window, never swallowed
            self.errors.append(f"{type(exc).__name__}: {exc}")
            logger.exception("twin pool loop failed")
        finally:
            connection.close()

    def _sample(self, client: redis.Redis, at: float) -> None:
        pool = Pool.objects.get(region=self.region, model_id=MODEL)
        serving = Replica.objects.filter(region=self.region, state="serving").count()
        self.points.append(ReplicaPoint(at, serving, pool.target_replicas))
        shares = read_load_shares(client, prefix=self.prefix, region=self.region)
        load = sum_pool_load(shares.values(), MODEL, "v1")
        self.in_flight.append((at, load.tokens_in_flight))


# -- the run -----------------------------------------------------------------------------


def run_live_window(
    plan: TwinPlan, *, log: Callable[[str], None] = print
) -> LiveWindow:
    """Run the live window against fresh processes; return what it measured."""
    wall0 = time.monotonic()
    region = f"twin-{secrets.token_hex(3)}"
    # The in-process autoscaler reads the gateways' live load under this
    # process's prefix: the processes share it (the region is the run's own).
    prefix = settings.REDIS_KEY_PREFIX
    engine_key = f"engine-{secrets.token_urlsafe(16)}"
    key = _register(plan, region)
    env = drill_env(
        region=region,
        prefix=prefix,
        PLATFORM_ENGINE_API_KEY=engine_key,
        PLATFORM_TRAFFIC_FLUSH_S="0.5",
    )
    tmp = Path(tempfile.mkdtemp(prefix="twin-check-"))
    agent = start_agent(
        env, tmp, region=region, node="twin-node", gpus=plan.max_replicas
    )
    gateway = None
    pool: _Pool | None = None
    with redis.Redis.from_url(settings.REDIS_URL) as client:
        client.delete(stream_key(prefix, MODEL))
        try:
            wait_until(
                lambda: (
                    serving_replicas(region) >= plan.min_replicas
                    or agent.popen.poll() is not None
                ),
                timeout_s=60,
                message="the twin pool's first replicas",
            )
            if agent.popen.poll() is not None:
                raise RuntimeError(f"the node agent exited:\n{agent.log()}")
            gateway = start_gateway(env, tmp, name="twin-gateway")
            replica = Replica.objects.filter(model_id=MODEL, state="serving").first()
            if replica is None:
                raise RuntimeError("no serving replica to probe")
            probe = Probe(MODEL, PROFILE, gateway.url, key, replica.url, engine_key)
            overhead = measure_overhead(probe)
            log(f"gateway overhead at idle: {overhead * 1000:.1f} ms (median TTFT)")
            residual = measure_replica_residual(probe)
            log(f"replica time beyond its profile: {residual * 1000:.1f} ms")
            started = timezone.now()
            pool = _Pool(plan, region, prefix)
            pool.start(time.perf_counter())
            served, failed, since, until, (differences, probes) = asyncio.run(
                _play(gateway.url, key, plan.load, probe)
            )
            pool.stop()
            if pool.errors:
                raise RuntimeError(f"the autoscaler's loop failed: {pool.errors[0]}")
            records = _recorded(
                client, prefix, since, until, expected=len(served) + len(differences)
            )
            salt = traffic_salt()
            probed = {
                salted_id(routing_key(probe_conversation(i), []), salt)
                for i in range(probes)
            }
            # Named as the trace names them, so each lines up with its line.
            served = [
                replace(
                    s, conversation=salted_id(routing_key(s.conversation, []), salt)
                )
                for s in served
            ]
            lines, skipped = trace_lines(records, salt=salt, stand_in_text=False)
            lines = [line for line in lines if line["conversation"] not in probed]
            decisions = [
                decision_row(
                    at_s=(row.decided_at - started).total_seconds(),
                    current=row.from_replicas,
                    desired=row.to_replicas,
                    reason=row.reason,
                    utilisation=row.utilisation,
                    signals=row.signals or {},
                )
                for row in ScalingDecision.objects.filter(region=region).order_by(
                    "decided_at"
                )
            ]
            return LiveWindow(
                served=served,
                failed=failed,
                replicas=pool.points,
                gateway_tokens_in_flight=pool.in_flight,
                decisions=decisions,
                ticks=list(pool.ticks),
                trace=lines,
                trace_skipped=skipped,
                window_s=until - since,
                gateway_overhead_s=overhead,
                # At least 0, as the idle reading is.
                gateway_overhead_load_s=(
                    max(0.0, statistics.median(differences)) if differences else None
                ),
                load_probes=len(differences),
                replica_residual_s=residual,
                replica_start_s=start_delay_s(pool.points),
                wall_s=time.monotonic() - wall0,
            )
        finally:
            if pool is not None:
                pool.stop()
            if gateway is not None:
                gateway.stop()
            agent.stop(grace_s=20)
            client.delete(stream_key(prefix, MODEL))
            remove_scratch_model(MODEL, region=region, team_id=TEAM)


def _recorded(
    client: redis.Redis, prefix: str, since: float, until: float, *, expected: int
) -> list[Any]:
    """Read the window's records once the gateway has flushed them all (or its
    last flush is long past)."""
    found: list[Any] = []

    def complete() -> bool:
        found[:] = read_traffic(
            client, prefix=prefix, model=MODEL, since=since, until=until + 1.0
        )
        return sum(1 for r in found if r.output_tokens > 0) >= expected

    with contextlib.suppress(AssertionError):
        wait_until(complete, timeout_s=15, interval_s=0.5, message="the records")
    return found


def _register(plan: TwinPlan, region: str) -> str:
    remove_scratch_model(MODEL, region=region, team_id=TEAM)
    Team.objects.filter(pk=TEAM).delete()
    seeded = seed_platform(
        seed=PlatformSeed(
            region=region,
            teams=(TeamSeed(TEAM),),
            models=(
                ModelSeed(
                    model_id=MODEL,
                    description="traffic twin check",
                    versions=(
                        VersionSeed(
                            "v1",
                            _BODY,
                            min_replicas=plan.min_replicas,
                            max_replicas=plan.max_replicas,
                        ),
                    ),
                ),
            ),
            limits=(
                LimitSeed(
                    team_id=TEAM,
                    model_id=MODEL,
                    tokens_per_minute=10**9,
                    max_concurrency=10_000,
                    # Inside its guarantee: a full pool queues its requests
                    # rather than refusing them (the twin's team says the same).
                    guaranteed_share=1.0,
                ),
            ),
            key_name="twin check",
        ),
        now=timezone.now(),
    )
    ModelVersion.objects.filter(model_id=MODEL).update(
        load_test_tokens_in_flight=plan.replica_tokens_in_flight
    )
    set_pool_autoscaling(
        model_id=MODEL, version="v1", region=region, changes=plan.scaling_changes()
    )
    pool_traffic.set_pool_traffic(
        model_id=MODEL, version="v1", region=region, share=1.0
    )
    return dict(seeded.keys)[TEAM]
