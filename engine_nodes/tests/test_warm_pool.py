"""The warm pool: weights pulled and verified ahead of need, in a thread of its own."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_nodes import warm_pool as warm_pool_module
from engine_nodes.warm_pool import Readiness, WarmPool, WeightsRef
from engine_nodes.weights import tree_digest

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
