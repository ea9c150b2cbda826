"""The warm pool: weights pulled and verified ahead of need, in a thread of its own,
from the agent's region's copy of them."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from pytest_django import Settings

from engine_nodes import warm_pool as warm_pool_module
from engine_nodes.agent import weights_ref
from engine_nodes.tests.test_agent import file_version, make_agent, states, tick_until
from engine_nodes.warm_pool import Readiness, WarmPool, WeightsRef
from engine_nodes.weights import WeightsError, copy_weights, tree_digest
from models_registry import services as registry
from models_registry.domain.gates import RegionState
from models_registry.models import Model, ModelVersion, Pool, VersionRegion
from tests.factories import ReplicaFactory, version_body

FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "model.safetensors": bytes(range(256)) * 64,
}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    directory = tmp_path / "store" / "chat-7b" / "v1"
    directory.mkdir(parents=True)
    for name, data in FILES.items():
        (directory / name).write_bytes(data)
    return directory


@pytest.fixture
def ref(source: Path) -> WeightsRef:
    return WeightsRef(
        version_id=7, weights_uri=f"file://{source}/", weights_hash=tree_digest(source)
    )


class Gate:
    """Holds every pull at its start until opened; counts the pulls."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.calls = 0


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    gate = Gate()
    real = warm_pool_module.pull_weights

    def pull(*args: Any, **kwargs: Any) -> Path:
        gate.calls += 1
        assert gate.opened.wait(timeout=30), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(warm_pool_module, "pull_weights", pull)
    yield gate
    gate.opened.set()


def make_pool(
    tmp_path: Path, clock: list[float] | None = None, **kwargs: Any
) -> WarmPool:
    now = clock if clock is not None else [0.0]
    return WarmPool(
        cache_dir=tmp_path / "cache",
        storage_roots=[f"file://{tmp_path}/store/", "s3://models/"],
        clock=lambda: now[0],
        **{"kind": "sim", **kwargs},
    )


def test_hold_returns_at_once_and_the_pull_warms_the_version_in_the_background(
    tmp_path: Path, ref: WeightsRef, gate: Gate
) -> None:
    pool = make_pool(tmp_path)
    try:
        assert pool.hold([ref]) == frozenset()
        # The pull is held at its start, yet hold() has returned: off the caller.
        assert pool.readiness(ref) == (Readiness.PULLING, "")
        assert pool.warm_version_ids() == frozenset()
        gate.opened.set()
        assert pool.wait_idle(timeout_s=30)
        assert pool.readiness(ref) == (Readiness.READY, "")
        assert pool.warm_version_ids() == {7}
        cached = tmp_path / "cache" / ref.weights_hash / "model.safetensors"
        assert cached.read_bytes() == FILES["model.safetensors"]
        assert gate.calls == 1
    finally:
        pool.close()


def test_a_start_on_a_warm_node_reads_no_weights_again(
    tmp_path: Path, ref: WeightsRef, gate: Gate
) -> None:
    gate.opened.set()
    pool = make_pool(tmp_path)
    try:
        pool.hold([ref])
        assert pool.wait_idle(timeout_s=30)
        path = pool.local_dir(ref)
        assert path == tmp_path / "cache" / ref.weights_hash
        assert pool.local_dir(ref) == path
        assert gate.calls == 1  # the prefetch; the starts trusted the fingerprint
    finally:
        pool.close()


def test_a_warm_tree_changed_on_disk_is_verified_and_pulled_again_before_a_start(
    tmp_path: Path, ref: WeightsRef, gate: Gate
) -> None:
    gate.opened.set()
    pool = make_pool(tmp_path)
    try:
        pool.hold([ref])
        assert pool.wait_idle(timeout_s=30)
        cached = tmp_path / "cache" / ref.weights_hash / "model.safetensors"
        cached.write_bytes(b"tampered")
        path = pool.local_dir(ref)
        assert path is not None
        assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
        assert gate.calls == 2
    finally:
        pool.close()


def test_a_failed_pull_is_refused_until_the_retry_delay_has_passed(
    tmp_path: Path, ref: WeightsRef, gate: Gate
) -> None:
    gate.opened.set()
    clock = [100.0]
    pool = make_pool(tmp_path, clock, retry_after_s=60.0)
    wrong = WeightsRef(version_id=8, weights_uri=ref.weights_uri, weights_hash="0" * 64)
    try:
        pool.hold([wrong])
        assert pool.wait_idle(timeout_s=30)
        readiness, why = pool.readiness(wrong)
        assert readiness == Readiness.FAILED
        assert "does not match" in why
        assert pool.hold([wrong, ref]) == {8}
        assert pool.wait_idle(timeout_s=30)
        assert gate.calls == 2  # the failed one, and ref; not the failed one again
        assert pool.warm_version_ids() == {7}
        clock[0] = 160.0
        assert pool.readiness(wrong)[0] == Readiness.PULLING
        assert pool.wait_idle(timeout_s=30)
        assert gate.calls == 3
        assert not any((tmp_path / "cache").glob(f"{'0' * 64}*"))
    finally:
        pool.close()


def test_simulated_replicas_need_no_remote_weights(
    tmp_path: Path, ref: WeightsRef, gate: Gate
) -> None:
    remote = WeightsRef(
        version_id=9, weights_uri="s3://models/chat/", weights_hash="a" * 64
    )
    sim = make_pool(tmp_path)
    vllm = make_pool(tmp_path, kind="vllm")
    try:
        assert sim.readiness(remote) == (Readiness.READY, "")
        assert sim.local_dir(remote) is None
        assert sim.warm_version_ids() == frozenset()
        # A real engine loads them: the pull is needed (and queued).
        assert vllm.readiness(remote)[0] == Readiness.PULLING
        gate.opened.set()
        assert vllm.wait_idle(timeout_s=30)
        assert gate.calls == 1
    finally:
        sim.close()
        vllm.close()


def test_a_warm_tree_deleted_from_disk_is_pulled_again(
    tmp_path: Path, ref: WeightsRef, gate: Gate
) -> None:
    gate.opened.set()
    pool = make_pool(tmp_path)
    try:
        pool.hold([ref])
        assert pool.wait_idle(timeout_s=30)
        path = pool.local_dir(ref)
        assert path is not None
        for child in path.iterdir():
            child.unlink()
        path.rmdir()
        assert pool.readiness(ref)[0] == Readiness.PULLING
        assert pool.wait_idle(timeout_s=30)
        assert (path / "config.json").is_file()
    finally:
        pool.close()


def test_a_refused_ref_pulls_nothing_and_fails_until_a_ready_ref_comes(
    tmp_path: Path, ref: WeightsRef, gate: Gate
) -> None:
    """GIVEN a version warm on this node whose region copy then fails
    THEN the pool answers FAILED with the reason, pulls nothing, refuses a start
    and no longer counts it warm; WHEN its copy is ready again, it is READY at
    once (no retry delay: the refusal is the database's, asked every beat).
    """
    gate.opened.set()
    pool = make_pool(tmp_path, retry_after_s=3600.0)
    refused = WeightsRef(
        version_id=7,
        weights_uri=ref.weights_uri,
        weights_hash=ref.weights_hash,
        refusal="chat-7b@v1's weights copy in region test failed: digest differs",
    )
    try:
        pool.hold([ref])
        assert pool.wait_idle(timeout_s=30)
        assert pool.warm_version_ids() == {7}
        assert pool.hold([refused]) == {7}
        assert pool.readiness(refused) == (Readiness.FAILED, refused.refusal)
        assert pool.warm_version_ids() == frozenset()
        with pytest.raises(WeightsError, match="digest differs"):
            pool.local_dir(refused)
        assert pool.wait_idle(timeout_s=30)
        assert gate.calls == 1
        assert pool.readiness(ref) == (Readiness.READY, "")
        assert pool.warm_version_ids() == {7}
    finally:
        pool.close()


def test_a_simulated_replica_is_refused_too_when_its_region_copy_is_not_ready(
    tmp_path: Path, gate: Gate
) -> None:
    remote = WeightsRef(
        version_id=9,
        weights_uri="s3://models/chat/",
        weights_hash="a" * 64,
        refusal="chat-7b@v1's weights copy in region test is not ready (copying)",
    )
    pool = make_pool(tmp_path)
    try:
        assert pool.readiness(remote) == (Readiness.FAILED, remote.refusal)
        assert gate.calls == 0
    finally:
        pool.close()


# -- the agent's warm pool and its region's copy (database, real sim processes) ------


def region_copy(tmp_path: Path, version: ModelVersion) -> str:
    """Copy the version's weights to the test region's root, as the weights gate does."""
    return copy_weights(
        version.weights_uri,
        version.weights_hash,
        f"file://{tmp_path}/region-test/",
        storage_roots=[f"file://{tmp_path}/"],
    )


def remove_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    root.rmdir()


@pytest.mark.django_db
@pytest.mark.e2e
def test_the_agent_pulls_and_starts_from_its_regions_copy(
    tmp_path: Path, chat_model: Model, settings: Settings
) -> None:
    """GIVEN a version copied to the test region (and failed in another region)
    and its registered weights since deleted
    THEN the agent's warm pool pulls the region's copy and a replica serves.
    """
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    version = file_version(tmp_path)
    uri = region_copy(tmp_path, version)
    VersionRegion.objects.create(
        version=version, region="test", uri=uri, state=RegionState.READY
    )
    VersionRegion.objects.create(
        version=version,
        region="other",
        uri=f"s3://models/{version.weights_hash}/",
        state=RegionState.FAILED,
        detail="weights digest 0 does not match 1",
    )
    remove_tree(tmp_path / "weights" / "chat")
    Pool.objects.create(model_id="chat-7b", version=version, region="test")
    agent = make_agent(tmp_path)
    try:
        tick_until(agent, lambda: list(states().values()) == ["serving"], "a replica")
        assert agent.warm_pool.warm_version_ids() == {version.pk}
        cached = tmp_path / "cache" / version.weights_hash / "model.safetensors"
        assert cached.read_bytes() == b"registered weights"
    finally:
        agent.shutdown(grace_s=5)
        agent.warm_pool.close()


@pytest.mark.django_db
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("region", "state", "detail", "why"),
    [
        ("test", RegionState.FAILED, "digest abc does not match def", "failed: digest"),
        ("test", RegionState.COPYING, "", "not ready (copying)"),
        ("other", RegionState.READY, "", "no copy of its weights in region test"),
    ],
)
def test_the_agent_starts_no_replica_of_a_version_not_ready_in_its_region(
    tmp_path: Path,
    chat_model: Model,
    settings: Settings,
    region: str,
    state: RegionState,
    detail: str,
    why: str,
) -> None:
    """GIVEN a pool in the test region of a version whose copy there is not ready
    THEN the agent plans no replica of it and pulls nothing (even though its
    registered weights are fine); WHEN the copy turns ready, it is pulled at once.
    """
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    version = file_version(tmp_path)
    uri = region_copy(tmp_path, version)
    row = VersionRegion.objects.create(
        version=version, region=region, uri=uri, state=state, detail=detail
    )
    Pool.objects.create(model_id="chat-7b", version=version, region="test")
    agent = make_agent(tmp_path)
    try:
        for _ in range(3):
            agent.tick(now=timezone.now())
        assert states() == {}
        assert agent.warm_pool.wait_idle(timeout_s=30)
        assert not (tmp_path / "cache").exists() or not any(
            (tmp_path / "cache").iterdir()
        )
        readiness, reason = agent.warm_pool.readiness(
            weights_ref(VersionRegion.objects.get(pk=row.pk).version, "test")
        )
        assert readiness == Readiness.FAILED
        assert why in reason
        VersionRegion.objects.filter(pk=row.pk).update(
            region="test", state=RegionState.READY, detail=""
        )
        tick_until(
            agent,
            lambda: agent.warm_pool.warm_version_ids() == {version.pk},
            "the version warm once its region copy is ready",
        )
    finally:
        agent.shutdown(grace_s=5)
        agent.warm_pool.close()


@pytest.mark.django_db
def test_an_agent_tick_reads_region_rows_in_two_queries_however_many_versions(
    tmp_path: Path, chat_model: Model
) -> None:
    """One query for the pools' versions, one for the node's replicas' versions."""
    for n in range(3):
        version = registry.register_version(
            model_id="chat-7b",
            **version_body(weights_hash=hashlib.sha256(b"%d" % n).hexdigest()),
        )
        VersionRegion.objects.create(
            version=version,
            region="test",
            uri=f"s3://models/{version.weights_hash}/",
            state=RegionState.FAILED,
            detail="digest differs",
        )
        Pool.objects.create(
            model_id="chat-7b", version=version, region="test", min_replicas=1
        )
        ReplicaFactory(
            version=version,
            region="test",
            node="node-a",
            state="starting",
            url="http://127.0.0.1:9",
        )
    agent = make_agent(tmp_path)
    try:
        with CaptureQueriesContext(connection) as queries:
            agent.tick(now=timezone.now())
        region_reads = [q for q in queries if "version_regions" in q["sql"]]
        assert len(region_reads) == 2
        # Each starting replica of a refused version was marked gone.
        assert set(states().values()) == {"gone"}
    finally:
        agent.shutdown(grace_s=5)
        agent.warm_pool.close()
