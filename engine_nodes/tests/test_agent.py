"""The node agent with real simulated replica processes, real Redis and the database."""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import redis
import zmq
from django.db import OperationalError, connections
from django.utils import timezone
from pytest_django import Settings

from engine_nodes import services
from engine_nodes.actuators import LocalProcessActuator
from engine_nodes.agent import BeatSink, NodeAgent, spec_builder
from engine_nodes.domain.beats import ReplicaBeat
from engine_nodes.heartbeats import RedisBeatStore
from engine_nodes.models import Node, Replica
from engine_nodes.warm_pool import WarmPool
from localrun.processes import free_port, wait_until
from models_registry import services as registry
from models_registry.models import Model, ModelVersion, Pool
from tests.factories import version_body

pytestmark = [pytest.mark.django_db, pytest.mark.e2e, pytest.mark.slow]

T = TypeVar("T")


@pytest.fixture
def beat_store(redis_url: str) -> Iterator[RedisBeatStore]:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    store = RedisBeatStore(redis.Redis.from_url(redis_url), prefix=prefix, ttl_s=3.0)
    yield store
    for key in store.client.scan_iter(f"{prefix}:*"):
        store.client.delete(key)


@pytest.fixture
def pool(chat_v1: ModelVersion) -> Pool:
    return Pool.objects.create(
        model_id="chat-7b",
        version=chat_v1,
        region="test",
        min_replicas=1,
        max_replicas=4,
    )


def make_agent(
    tmp_path: Path,
    sink: BeatSink | None = None,
    *,
    gpus: int = 4,
    db_every_s: float = 0.0,
    **kwargs: Any,
) -> NodeAgent:
    first = free_port()
    warm_pool = WarmPool(
        kind="sim",
        cache_dir=tmp_path / "cache",
        storage_roots=[f"file://{tmp_path}/", "s3://models/"],
    )
    # The engine on each replica: a fast profile keeps the tests short.
    return NodeAgent(
        node="node-a",
        region="test",
        actuator=LocalProcessActuator(kind="sim", log_dir=tmp_path / "logs"),
        spec_for=spec_builder(warm_pool=warm_pool),
        warm_pool=warm_pool,
        gpus=gpus,
        ports=(first, first + 40),
        sink=sink,
        start_timeout_s=30,
        db_every_s=db_every_s,
        **kwargs,
    )


def tick_until(
    agent: NodeAgent, condition: Callable[[], T], message: str, timeout_s: float = 30.0
) -> T:
    def step() -> T:
        agent.tick(now=timezone.now())
        return condition()

    return wait_until(step, timeout_s=timeout_s, interval_s=0.05, message=message)


def states() -> dict[str, str]:
    return dict(Replica.objects.values_list("replica_id", "state"))


def test_agent_starts_replicas_that_serve_and_beat_to_redis(
    tmp_path: Path, pool: Pool, beat_store: RedisBeatStore
) -> None:
    pool.min_replicas = 2
    pool.save()
    agent = make_agent(tmp_path, sink=beat_store)
    try:
        tick_until(
            agent,
            lambda: list(states().values()) == ["serving", "serving"],
            "two serving replicas",
        )
        for replica in Replica.objects.all():
            assert httpx.get(f"{replica.url}/health").status_code == 200
            assert replica.last_heartbeat is not None
        beats = tick_until(
            agent, lambda: beat_store.read_region("test"), "beats in Redis"
        )
        assert {b.replica_id for b in beats} == set(states())
        assert {b.state for b in beats} == {"serving"}
        ttl_ms = beat_store.client.pttl(
            f"{beat_store.prefix}:beat:{beats[0].replica_id}"
        )
        assert 0 < ttl_ms <= 3000
    finally:
        agent.shutdown(grace_s=5)
    assert Replica.objects.count() == 0
    assert beat_store.read_region("test") == []


@pytest.mark.django_db(transaction=True)
def test_agent_beats_to_redis_while_the_database_is_down(
    tmp_path: Path,
    pool: Pool,
    beat_store: RedisBeatStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gateways route by these beats: serving must outlive the control plane."""
    agent = make_agent(tmp_path, sink=beat_store)
    try:
        tick_until(agent, lambda: list(states().values()) == ["serving"], "serving")
        agent.tick(now=timezone.now())
        [before] = beat_store.read_region("test")

        def unreachable(**kwargs: Any) -> None:
            raise OperationalError("connection refused")

        monkeypatch.setattr(services, "pool_versions", unreachable)

        def newer_beats() -> list[ReplicaBeat]:
            agent.step(now=timezone.now())
            return [
                b for b in beat_store.read_region("test") if b.beat_at > before.beat_at
            ]

        beats = wait_until(
            newer_beats,
            interval_s=0.05,
            message="a beat after the database went down",
        )
        assert [(b.replica_id, b.state) for b in beats] == [
            (before.replica_id, "serving")
        ]
    finally:
        monkeypatch.undo()
        agent.shutdown(grace_s=5)


class _RecordingSink:
    """A beat sink that keeps when each beat was published (and passes them on)."""

    def __init__(self, store: RedisBeatStore) -> None:
        self.store = store
        self.published_at: list[float] = []

    def publish(self, beats: list[ReplicaBeat]) -> int:
        self.published_at.append(time.monotonic())
        return self.store.publish(beats)

    def forget(self, replica_id: str, region: str) -> None:
        self.store.forget(replica_id, region)


@pytest.mark.django_db(transaction=True)
def test_a_pass_held_by_the_database_does_not_hold_the_beats(
    tmp_path: Path,
    pool: Pool,
    beat_store: RedisBeatStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GIVEN an agent running its loop (0.2 s beats) with a serving replica
    WHEN its database pass blocks (a blackholed database answers nothing)
    THEN it beats the replica to Redis every beat all the same, as serving
    AND once the database answers, the pass ends and reconciling goes on.
    """
    sink = _RecordingSink(beat_store)
    agent = make_agent(tmp_path, sink=sink)
    beat_s = 0.2
    stop = threading.Event()
    blackhole = threading.Event()
    released = threading.Event()
    real_pool_versions = services.pool_versions

    def pool_versions(**kwargs: Any) -> Any:
        if blackhole.is_set():
            released.wait(timeout=60)
        return real_pool_versions(**kwargs)

    monkeypatch.setattr(services, "pool_versions", pool_versions)

    def run() -> None:
        try:
            agent.run(stop, beat_s=beat_s)
        finally:
            connections.close_all()  # this thread's, before the database is dropped

    loop = threading.Thread(target=run)
    loop.start()
    try:
        wait_until(
            lambda: [b.state for b in beat_store.read_region("test")] == ["serving"],
            timeout_s=30,
            message="a serving replica beating",
        )
        blackhole.set()
        blocked_from = time.monotonic()
        # The pass now in flight (or the next) blocks; beats must go on meanwhile.
        wait_until(
            lambda: len([t for t in sink.published_at if t > blocked_from + 1.0]) >= 8,
            timeout_s=10,
            message="beats while the pass is blocked",
        )
        during = [t for t in sink.published_at if t > blocked_from + 1.0]
        gaps = [b - a for a, b in itertools.pairwise(during)]
        # Every beat (a scrape takes part of one), never the 3-beat window missed.
        assert max(gaps) < 3 * beat_s, gaps
        [beat] = beat_store.read_region("test")
        assert beat.state == "serving"
        assert time.time() - beat.beat_at < 3 * beat_s
        released.set()
        before = Replica.objects.get().last_heartbeat
        wait_until(
            lambda: Replica.objects.get().last_heartbeat != before,
            timeout_s=10,
            message="the database hearing beats again",
        )
    finally:
        released.set()
        stop.set()
        loop.join(timeout=30)
    assert not loop.is_alive()
    assert Replica.objects.count() == 0  # shut down: its replicas stopped


def test_shrinking_three_to_one_drains_one_at_a_time_and_streams_complete(
    tmp_path: Path, pool: Pool
) -> None:
    """GIVEN three serving replicas, each streaming one answer, their loads apart
    (prompts of different lengths)
    WHEN the pool's target falls to one
    THEN the least loaded replica drains first, then the next; never two at once;
    each stays while its engine holds its answer, and every answer completes.
    """
    pool.min_replicas = 3
    pool.save()
    agent = make_agent(tmp_path, drain_settle_s=0.5)
    try:
        tick_until(
            agent,
            lambda: list(states().values()) == ["serving"] * 3,
            "three serving replicas",
        )
        replicas = list(Replica.objects.order_by("created_at", "replica_id"))
        # Tokens in flight count the prompt: the oldest is the lightest, so neither
        # "newest first" nor "oldest first" is what least-loaded-first does.
        lightest, heaviest, middle = (r.replica_id for r in replicas)
        words = {lightest: 5, heaviest: 400, middle: 200}
        results: dict[str, Any] = {}
        done_at: dict[str, float] = {}

        def answer(replica: Replica) -> None:
            results[replica.replica_id] = httpx.post(
                f"{replica.url}/v1/chat/completions",
                timeout=60,
                json={
                    "model": "chat-7b",
                    "messages": [
                        {"role": "user", "content": "x " * words[replica.replica_id]}
                    ],
                    "max_tokens": 400,
                    "ignore_eos": True,
                },
            ).json()
            done_at[replica.replica_id] = time.monotonic()

        threads = [threading.Thread(target=answer, args=(r,)) for r in replicas]
        for thread in threads:
            thread.start()
        wait_until(
            lambda: all(_running(r.url) == 1 for r in replicas),
            message="the three answers to start",
        )
        agent.tick(now=timezone.now())  # the database hears the loads
        Pool.objects.filter(pk=pool.pk).update(min_replicas=1, desired_replicas=1)
        drained: list[str] = []
        drained_at: dict[str, float] = {}
        removed_at: dict[str, float] = {}

        def step() -> bool:
            agent.tick(now=timezone.now())
            now, seen = time.monotonic(), states()
            draining = [r for r, state in seen.items() if state == "draining"]
            assert len(draining) <= 1, seen
            for replica_id in draining:
                if replica_id not in drained:
                    drained.append(replica_id)
                    drained_at[replica_id] = now
            for replica_id in words:
                if replica_id not in seen:
                    removed_at.setdefault(replica_id, now)
            return len(seen) == 1 and not draining

        wait_until(step, timeout_s=60, interval_s=0.05, message="one replica left")
        for thread in threads:
            thread.join(timeout=30)
        assert drained == [lightest, middle]
        assert list(states()) == [heaviest]
        for replica_id in words:
            assert results[replica_id]["usage"]["completion_tokens"] == 400
        # The first drained replica was draining while it streamed, and stayed
        # until its answer was done.
        assert drained_at[lightest] < done_at[lightest] <= removed_at[lightest]
        assert removed_at[lightest] < removed_at[middle]
    finally:
        agent.shutdown(grace_s=5)


def _running(url: str) -> int:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_killed_replica_is_reaped_after_three_missed_beats_and_replaced(
    tmp_path: Path, pool: Pool, settings: Settings
) -> None:
    settings.PLATFORM_HEARTBEAT_S = 1.0
    settings.PLATFORM_HEARTBEAT_DB_S = 1.0
    settings.PLATFORM_MISSED_BEATS = 3
    agent = make_agent(tmp_path)
    try:
        tick_until(agent, lambda: list(states().values()) == ["serving"], "a replica")
        victim = Replica.objects.get()
        os.killpg(agent.running[victim.replica_id].handle.pid, signal.SIGKILL)
        tick_until(
            agent,
            lambda: victim.replica_id not in agent.running,
            "the agent to notice the dead process",
        )
        last_beat = Replica.objects.get(pk=victim.replica_id).last_heartbeat
        assert last_beat is not None
        agent.tick(now=timezone.now())
        # No beat was written for the dead replica.
        assert Replica.objects.get(pk=victim.replica_id).last_heartbeat == last_beat
        assert (
            services.reap_silent_replicas(now=last_beat + timedelta(seconds=2.9)) == []
        )
        assert services.reap_silent_replicas(
            now=last_beat + timedelta(seconds=3.1)
        ) == [victim.replica_id]
        tick_until(
            agent,
            lambda: (
                victim.replica_id not in states()
                and list(states().values()) == ["serving"]
            ),
            "a replacement replica",
        )
    finally:
        agent.shutdown(grace_s=5)


def test_a_restarted_agent_replaces_what_its_killed_self_left_running(
    tmp_path: Path, pool: Pool
) -> None:
    # GIVEN an agent serving a replica, then killed outright: nothing stops the
    # replica, which runs on in its own session
    killed = make_agent(tmp_path)
    tick_until(killed, lambda: list(states().values()) == ["serving"], "a replica")
    (old,) = killed.running.values()
    # WHEN the next agent of the node starts (same log folder, so same pid files)
    agent = make_agent(tmp_path)
    try:
        agent.forget_previous_life(grace_s=5)
        # THEN the old replica is stopped and its row marked gone, and the next
        # passes start one replacement: one replica process, not two
        assert old.handle.process.wait(10) is not None
        assert list(states().values()) == ["gone"]
        tick_until(
            agent,
            lambda: (
                list(states().values()) == ["serving"]
                and old.handle.replica_id not in states()
            ),
            "a replacement replica",
        )
        assert len(agent.running) == 1
    finally:
        agent.shutdown(grace_s=5)
        killed.actuator.stop(old.handle, grace_s=0)


def test_a_replica_slow_to_answer_metrics_beats_on_within_the_grace(
    tmp_path: Path, pool: Pool
) -> None:
    """GIVEN a serving replica whose /metrics stops answering (its process frozen)
    THEN a tick still ends within the scrape timeout and beats with the last scrape,
    until the grace has passed; after that the replica misses its beats.
    """
    clock = [0.0]
    agent = make_agent(
        tmp_path, scrape_timeout_s=0.2, scrape_grace_s=5.0, clock=lambda: clock[0]
    )
    try:
        tick_until(agent, lambda: list(states().values()) == ["serving"], "a replica")
        agent.tick(now=timezone.now())
        replica = Replica.objects.get()
        pid = agent.running[replica.replica_id].handle.pid
        os.killpg(pid, signal.SIGSTOP)
        try:
            beat_at = timezone.now()
            started = time.monotonic()
            agent.tick(now=beat_at)
            assert time.monotonic() - started < 1.0
            assert Replica.objects.get().last_heartbeat == beat_at
            clock[0] = 6.0
            agent.tick(now=timezone.now())
            assert Replica.objects.get().last_heartbeat == beat_at
        finally:
            os.killpg(pid, signal.SIGCONT)
    finally:
        agent.shutdown(grace_s=5)


def test_weights_with_wrong_hash_are_refused(
    tmp_path: Path, chat_model: Model, settings: Settings
) -> None:
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    weights = tmp_path / "weights" / "chat"
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(b"not the registered weights")
    version = registry.register_version(
        model_id="chat-7b",
        **version_body(
            weights_uri=f"file://{weights}/",
            weights_hash=hashlib.sha256(b"other").hexdigest(),
        ),
    )
    Pool.objects.create(model_id="chat-7b", version=version, region="test")
    agent = make_agent(tmp_path)
    try:
        # The pull runs in the warm pool's thread; the replica waits, starting.
        tick_until(agent, lambda: "gone" in states().values(), "a refused replica")
        assert agent.running == {}
        assert not any((tmp_path / "cache").glob("*/model.safetensors"))
        # The refused version is not tried again on this node at every beat.
        agent.tick(now=timezone.now())
        agent.tick(now=timezone.now())
        assert states() == {}
        assert agent.warm_pool.warm_version_ids() == frozenset()
    finally:
        agent.shutdown(grace_s=5)


def test_agent_fills_only_the_gpus_it_has(
    tmp_path: Path, chat_v1: ModelVersion
) -> None:
    Pool.objects.create(
        model_id="chat-7b",
        version=chat_v1,
        region="test",
        min_replicas=3,
        max_replicas=3,
    )
    agent = make_agent(tmp_path, gpus=2)
    try:
        agent.tick(now=timezone.now())
        assert len(states()) == 2
        agent.tick(now=timezone.now())
        assert len(states()) == 2
    finally:
        agent.shutdown(grace_s=5)


def test_weights_with_the_registered_hash_are_pulled_then_served(
    tmp_path: Path, chat_model: Model, settings: Settings
) -> None:
    from engine_nodes.weights import tree_digest

    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    weights = tmp_path / "weights" / "chat"
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(b"registered weights")
    version = registry.register_version(
        model_id="chat-7b",
        **version_body(
            weights_uri=f"file://{weights}/", weights_hash=tree_digest(weights)
        ),
    )
    Pool.objects.create(model_id="chat-7b", version=version, region="test")
    agent = make_agent(tmp_path)
    try:
        tick_until(agent, lambda: list(states().values()) == ["serving"], "a replica")
        cached = tmp_path / "cache" / version.weights_hash / "model.safetensors"
        assert cached.read_bytes() == b"registered weights"
    finally:
        agent.shutdown(grace_s=5)


def test_database_hears_beats_at_its_own_rate(
    tmp_path: Path, pool: Pool, beat_store: RedisBeatStore
) -> None:
    now = [0.0]
    agent = make_agent(tmp_path, sink=beat_store, db_every_s=5.0)
    try:
        tick_until(agent, lambda: list(states().values()) == ["serving"], "a replica")
        first = Replica.objects.get().last_heartbeat
        assert first is not None
        agent.clock = lambda: now[0]
        agent._db_written_at = 0.0
        now[0] = 1.0
        agent.tick(now=timezone.now())
        assert Replica.objects.get().last_heartbeat == first  # Redis only
        assert beat_store.read_region("test")
        now[0] = 5.0
        agent.tick(now=timezone.now())
        later = Replica.objects.get().last_heartbeat
        assert later is not None
        assert later > first
    finally:
        agent.clock = time.monotonic
        agent.shutdown(grace_s=5)


def test_a_replica_that_stalls_under_a_stream_is_stalled_until_it_moves(
    tmp_path: Path, pool: Pool, beat_store: RedisBeatStore
) -> None:
    """GIVEN a serving replica streaming an answer
    WHEN its engine stalls (the simulator's fault) and later the client leaves
    THEN once its figures have been flat for ``stall_after_s`` (on the agent's
    clock) the agent marks it stalled and beats it so, which routers skip; it
    stays stalled while the hung engine holds the request, and serves again once
    the stall ends.
    """
    now = [0.0]
    agent = make_agent(tmp_path, sink=beat_store, stall_after_s=5.0)
    try:
        tick_until(agent, lambda: list(states().values()) == ["serving"], "a replica")
        replica = Replica.objects.get()
        agent.clock = lambda: now[0]
        with (
            httpx.Client(timeout=60) as http,
            http.stream(
                "POST",
                f"{replica.url}/v1/chat/completions",
                json={
                    "model": "chat-7b",
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 3000,
                    "stream": True,
                    "ignore_eos": True,
                },
            ) as response,
        ):
            # Keep the line iterator: a discarded one closes the stream, and the
            # replica would see the client leave before the stall.
            lines = response.iter_lines()
            assert '"role":"assistant"' in next(x for x in lines if x)
            faults = http.post(f"{replica.url}/sim/faults", json={"stall": True})
            faults.raise_for_status()
            agent.tick(now=timezone.now())  # flat from 0 s
            now[0] = 4.9
            agent.tick(now=timezone.now())
            assert states() == {replica.replica_id: "serving"}
            now[0] = 5.0
            agent.tick(now=timezone.now())
            assert states() == {replica.replica_id: "stalled"}
            assert [b.state for b in beat_store.read_region("test")] == ["stalled"]
        wait_until(
            lambda: httpx.get(f"{replica.url}/sim/state").json()["held_aborts"] == 1,
            message="the replica to notice that the client left",
        )
        now[0] = 60.0
        agent.tick(now=timezone.now())
        assert states() == {replica.replica_id: "stalled"}
        httpx.post(
            f"{replica.url}/sim/faults", json={"stall": False}
        ).raise_for_status()
        now[0] = 61.0
        agent.tick(now=timezone.now())
        assert states() == {replica.replica_id: "serving"}
        assert [b.state for b in beat_store.read_region("test")] == ["serving"]
    finally:
        agent.clock = time.monotonic
        agent.shutdown(grace_s=5)


def file_version(
    tmp_path: Path, content: bytes = b"registered weights"
) -> ModelVersion:
    """Register chat-7b@v1 with weights in a file:// storage root under tmp_path."""
    from engine_nodes.weights import tree_digest

    weights = tmp_path / "weights" / "chat"
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(content)
    return registry.register_version(
        model_id="chat-7b",
        **version_body(
            weights_uri=f"file://{weights}/", weights_hash=tree_digest(weights)
        ),
    )


def test_the_agent_prefetches_its_regions_versions_so_a_start_is_warm(
    tmp_path: Path, chat_model: Model, settings: Settings
) -> None:
    """GIVEN a pool of a version (weights on a file:// root) with no replica yet
    THEN the agent pulls its weights without being asked to start one and records
    the version warm in its node's row; WHEN the pool then wants a replica, it
    starts in the very next beat, with no pull to wait for.
    """
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    version = file_version(tmp_path)
    pool = Pool.objects.create(
        model_id="chat-7b", version=version, region="test", min_replicas=0
    )
    agent = make_agent(tmp_path)
    try:
        tick_until(
            agent,
            lambda: (
                list(
                    Node.objects.filter(name="node-a", region="test").values_list(
                        "warm_versions", flat=True
                    )
                )
                == [version.pk]
            ),
            "the version warm on node-a",
        )
        assert states() == {}
        cached = tmp_path / "cache" / version.weights_hash / "model.safetensors"
        assert cached.read_bytes() == b"registered weights"
        # A row deleted in the console comes back with what is warm.
        Node.objects.all().delete()
        agent.tick(now=timezone.now())
        agent.tick(now=timezone.now())
        assert list(Node.objects.get().warm_versions.all()) == [version]
        Pool.objects.filter(pk=pool.pk).update(min_replicas=1)
        agent.tick(now=timezone.now())
        assert list(states().values()) == ["loading"]
    finally:
        agent.shutdown(grace_s=5)
    assert not Node.objects.filter(name="node-a").exists()


def test_a_replica_waits_starting_for_its_weights_and_is_not_reaped(
    tmp_path: Path,
    chat_model: Model,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GIVEN a pull that takes long (held at its start)
    THEN the replica waits ``starting`` while the agent's beats go on (for it and
    for the node), and it starts once its weights are in.
    """
    from engine_nodes import warm_pool

    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    settings.PLATFORM_HEARTBEAT_DB_S = 1.0
    settings.PLATFORM_MISSED_BEATS = 3
    opened = threading.Event()
    real = warm_pool.pull_weights

    def slow_pull(*args: Any, **kwargs: Any) -> Path:
        assert opened.wait(timeout=30), "the test never let the pull go"
        return real(*args, **kwargs)

    monkeypatch.setattr(warm_pool, "pull_weights", slow_pull)
    version = file_version(tmp_path)
    Pool.objects.create(model_id="chat-7b", version=version, region="test")
    agent = make_agent(tmp_path)
    try:
        for _ in range(3):
            started = time.monotonic()
            agent.tick(now=timezone.now())
            assert time.monotonic() - started < 1.0  # the pull is not in the tick
        replica = Replica.objects.get()
        assert replica.state == "starting"
        assert replica.last_heartbeat is not None
        later = timezone.now()
        agent.tick(now=later)
        # The agent vouches for it every beat, so the reaper leaves it.
        assert Replica.objects.get().last_heartbeat == later
        assert Node.objects.get(name="node-a").last_beat is not None
        opened.set()
        tick_until(agent, lambda: list(states().values()) == ["serving"], "a replica")
    finally:
        opened.set()
        agent.shutdown(grace_s=5)
        agent.warm_pool.close()


def test_a_replica_of_a_version_with_kv_events_publishes_where_its_row_says(
    tmp_path: Path, chat_model: Model
) -> None:
    """GIVEN a pool of a version with ``"kv_events": true``
    WHEN the agent starts its replica
    THEN the row's kv_events_url is a ZMQ endpoint on the agent's host where a
    SUB receives the replica's KV event batches, topic ``kv@<replica id>@model``."""
    from localrun.seeding import VERSION_BODY
    from simengine.domain.kv_events import unpack_frames

    version = registry.register_version(
        model_id="chat-7b",
        **version_body(
            engine_config={**VERSION_BODY["engine_config"], "kv_events": True}
        ),
    )
    Pool.objects.create(
        model_id="chat-7b", version=version, region="test", min_replicas=1
    )
    agent = make_agent(tmp_path)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    try:
        tick_until(agent, lambda: list(states().values()) == ["serving"], "serving")
        replica = Replica.objects.get()
        assert replica.kv_events_url.startswith("tcp://127.0.0.1:")
        assert replica.kv_events_url != replica.url.replace("http", "tcp")
        sub.connect(replica.kv_events_url)
        # A PUB drops batches until the subscription reaches it: send distinct
        # prompts until one batch arrives.
        deadline = time.monotonic() + 20
        frames: list[bytes] = []
        attempt = 0
        while not frames:
            assert time.monotonic() < deadline, "no KV event batch"
            attempt += 1
            words = " ".join(f"kv{attempt}w{i}" for i in range(40))
            httpx.post(
                f"{replica.url}/v1/chat/completions",
                json={
                    "model": "chat-7b",
                    "messages": [{"role": "user", "content": words}],
                    "max_tokens": 1,
                },
                timeout=10,
            ).raise_for_status()
            if sub.poll(1000):
                frames = sub.recv_multipart()
        topic, _, batch = unpack_frames(frames)
        assert topic == f"kv@{replica.replica_id}@chat-7b"
        assert batch.events
    finally:
        sub.close()
        context.term()
        agent.shutdown(grace_s=5)
