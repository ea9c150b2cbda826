"""The snapshot file a gateway restarted while the database is down serves from
(routing.domain.snapshot_file, routing.snapshots)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from routing.domain.readiness import judge_readiness
from routing.domain.snapshot import (
    BudgetRecord,
    ConfigSnapshot,
    EntitlementRecord,
    KeyRecord,
    LimitRecord,
    ModelRecord,
    ReplicaRecord,
    VersionRecord,
)
from routing.domain.snapshot_file import (
    SnapshotFileError,
    decode_file,
    encode_file,
    file_key,
    snapshot_from_dict,
    snapshot_to_dict,
)
from routing.prompt_tokens import VersionCounters
from routing.snapshots import SnapshotFile, SnapshotHolder

SECRET = "sk-team-alpha-very-secret"
KEY = file_key("test secret key")


def snapshot(region: str = "eu") -> ConfigSnapshot:
    return ConfigSnapshot(
        built_at=1_700_000_000.25,
        region=region,
        keys={
            hashlib.sha256(SECRET.encode()).hexdigest(): KeyRecord(7, "alpha"),
            hashlib.sha256(b"sk-batch").hexdigest(): KeyRecord(8, "alpha", True),
        },
        teams=frozenset({"alpha", "beta"}),
        limits={("alpha", "chat-7b"): LimitRecord("alpha", "chat-7b", 1000, 4, 0.25)},
        entitlements={
            ("alpha", "chat-7b"): EntitlementRecord("alpha", "chat-7b", ("batch",))
        },
        budgets={
            ("alpha", ""): BudgetRecord(
                "alpha", "", 100.0, 0.8, 1.0, "2026-12", 12.5, 3.25
            )
        },
        models={
            "chat-7b": ModelRecord(
                "chat-7b", "v1", "v2", 5.0, None, 0.0, rollout_pending=True
            ),
            "embed-1": ModelRecord(
                "embed-1",
                "v1",
                None,
                0.0,
                None,
                0.0,
                kind="embedding",
                dimensions=384,
                max_input_tokens=512,
            ),
        },
        versions={
            ("chat-7b", "v1"): VersionRecord(
                "chat-7b", "v1", "live", 8192, 4000, chat_template="{{ x }}"
            )
        },
        replicas=(
            ReplicaRecord(
                "r1", "chat-7b", "v1", region, "http://h:1", "serving", 2, 30, 0.5, None
            ),
            ReplicaRecord(
                "r2", "chat-7b", "v1", region, "http://h:2", "serving", 0, 0, 0.0, 1.5
            ),
        ),
    )


def test_a_snapshot_survives_the_round_trip_whole() -> None:
    original = snapshot()
    assert snapshot_from_dict(json.loads(json.dumps(snapshot_to_dict(original)))) == (
        original
    )
    decoded, written_at = decode_file(
        encode_file(original, key=KEY, written_at=1_700_000_001.5),
        key=KEY,
        region="eu",
    )
    assert decoded == original
    assert written_at == 1_700_000_001.5


def test_the_file_holds_key_hashes_never_secrets() -> None:
    raw = encode_file(snapshot(), key=KEY, written_at=1.0)
    assert SECRET.encode() not in raw
    assert b"sk-batch" not in raw
    assert hashlib.sha256(SECRET.encode()).hexdigest().encode() in raw
    assert set(json.loads(raw)) == {
        "format",
        "region",
        "written_at",
        "digest",
        "snapshot",
    }


@pytest.mark.parametrize(
    "edit",
    [
        lambda doc: doc["snapshot"]["teams"].append("mallory"),
        lambda doc: doc.update(written_at=doc["written_at"] + 3600),
        lambda doc: doc.update(region="us"),
        lambda doc: doc.update(digest="0" * 64),
    ],
    ids=["content", "written_at", "region", "digest"],
)
def test_an_edited_file_is_refused(edit: object) -> None:
    doc = json.loads(encode_file(snapshot(), key=KEY, written_at=1.0))
    edit(doc)  # type: ignore[operator]
    with pytest.raises(SnapshotFileError) as refused:
        decode_file(json.dumps(doc).encode(), key=KEY, region="eu")
    assert refused.value.reason == "digest"


def test_a_corrupt_file_or_another_key_is_refused() -> None:
    raw = encode_file(snapshot(), key=KEY, written_at=1.0)
    with pytest.raises(SnapshotFileError) as corrupt:
        decode_file(raw[: len(raw) // 2], key=KEY, region="eu")
    assert corrupt.value.reason == "malformed"
    with pytest.raises(SnapshotFileError) as other_key:
        decode_file(raw, key=file_key("another secret"), region="eu")
    assert other_key.value.reason == "digest"


def test_another_regions_file_is_refused() -> None:
    raw = encode_file(snapshot("us"), key=KEY, written_at=1.0)
    with pytest.raises(SnapshotFileError) as refused:
        decode_file(raw, key=KEY, region="eu")
    assert refused.value.reason == "region"


def test_the_file_is_written_mode_600_in_a_mode_700_folder(tmp_path: Path) -> None:
    path = tmp_path / "snapshots" / "eu.json"
    file = SnapshotFile(path, key=KEY, region="eu")
    file.write(snapshot(), written_at=2.0)
    file.write(snapshot(), written_at=3.0)  # replaces the first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert os.listdir(path.parent) == ["eu.json"]  # no temporary file left over
    assert file.read() == (snapshot(), 3.0)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    file = SnapshotFile(tmp_path / "eu.json", key=KEY, region="eu")
    file.write(snapshot(), written_at=2.0)
    file.path.chmod(mode)
    with pytest.raises(SnapshotFileError) as refused:
        file.read()
    assert refused.value.reason == "mode"


def test_a_missing_file_says_missing(tmp_path: Path) -> None:
    with pytest.raises(SnapshotFileError) as refused:
        SnapshotFile(tmp_path / "eu.json", key=KEY, region="eu").read()
    assert refused.value.reason == "missing"


class Clocks:
    def __init__(self) -> None:
        self.mono = 100.0
        self.wall = 1_700_000_000.25 + 30.0  # 30 s after snapshot() was built


def holder(load: object, file: SnapshotFile, clocks: Clocks) -> SnapshotHolder:
    return SnapshotHolder(
        load,  # type: ignore[arg-type]
        prompt_counters=VersionCounters(),
        clock=lambda: clocks.mono,
        wall_clock=lambda: clocks.wall,
        file=file,
        persist_s=10.0,
    )


def test_a_holder_persists_and_a_restarted_one_serves_the_file(
    tmp_path: Path,
) -> None:
    clocks = Clocks()
    file = SnapshotFile(tmp_path / "eu.json", key=KEY, region="eu")
    loads = [snapshot()]

    async def up() -> ConfigSnapshot:
        return loads[-1]

    async def down() -> ConfigSnapshot:
        raise ConnectionError("database down")

    first = holder(up, file, clocks)
    asyncio.run(first.refresh())
    assert file.read()[0] == snapshot()  # the first load is always written
    changed = ConfigSnapshot(built_at=5.0, region="eu")
    loads.append(changed)
    clocks.mono += 5.0
    asyncio.run(first.refresh())
    assert file.read()[0] == snapshot()  # not within persist_s
    clocks.mono += 5.0
    asyncio.run(first.refresh())
    assert file.read()[0] == changed
    loads.pop()
    clocks.mono += 10.0
    asyncio.run(first.refresh())

    restarted = holder(down, file, clocks)
    asyncio.run(restarted.refresh())
    assert restarted.current == snapshot()
    assert restarted.source == "disk"
    assert restarted.control_plane_up is False
    assert restarted.age_s() == pytest.approx(30.0)

    restarted._load = up
    asyncio.run(restarted.refresh())
    assert (restarted.source, restarted.control_plane_up) == ("database", True)
    assert restarted.age_s() == 0.0


def test_a_holder_refuses_a_loose_file_and_serves_nothing(tmp_path: Path) -> None:
    clocks = Clocks()
    file = SnapshotFile(tmp_path / "eu.json", key=KEY, region="eu")
    file.write(snapshot(), written_at=1.0)
    file.path.chmod(0o644)

    async def down() -> ConfigSnapshot:
        raise ConnectionError("database down")

    restarted = holder(down, file, clocks)
    asyncio.run(restarted.refresh())
    assert (restarted.current, restarted.source) == (None, None)
    assert restarted.age_s() is None


def test_a_file_older_than_the_maximum_age_is_refused(tmp_path: Path) -> None:
    clocks = Clocks()
    file = SnapshotFile(tmp_path / "eu.json", key=KEY, region="eu")
    file.write(snapshot(), written_at=1.0)

    async def down() -> ConfigSnapshot:
        raise ConnectionError("database down")

    old = SnapshotHolder(
        down,
        prompt_counters=VersionCounters(),
        clock=lambda: clocks.mono,
        wall_clock=lambda: clocks.wall,
        file=file,
        max_file_age_s=29.0,  # the snapshot was built 30 s ago
    )
    asyncio.run(old.refresh())
    assert old.current is None
    fresh = holder(down, file, clocks)  # a day's maximum
    asyncio.run(fresh.refresh())
    assert fresh.current == snapshot()


def test_a_file_missing_at_the_start_is_read_once_it_appears(tmp_path: Path) -> None:
    clocks = Clocks()
    file = SnapshotFile(tmp_path / "eu.json", key=KEY, region="eu")

    async def down() -> ConfigSnapshot:
        raise ConnectionError("database down")

    restarted = holder(down, file, clocks)
    asyncio.run(restarted.refresh())
    assert restarted.current is None
    file.write(snapshot(), written_at=1.0)  # another process of the region wrote it
    asyncio.run(restarted.refresh())
    assert (restarted.current, restarted.source) == (snapshot(), "disk")


def test_a_refresh_that_waits_too_long_is_the_control_plane_down_not_stuck() -> None:
    """GIVEN a holder with a fresh snapshot
    WHEN its next refresh waits on a database that answers nothing (blackholed)
    THEN after ``answer_within_s`` it reports the control plane down, so /healthz
    calls the old snapshot stale (still ready), not a stuck refresh (503)
    AND once the refresh fails or succeeds the holder says so again.
    """
    clocks = Clocks()
    gate: asyncio.Event | None = None

    async def load() -> ConfigSnapshot:
        if gate is not None:
            await gate.wait()
        return snapshot()

    async def scenario() -> None:
        nonlocal gate
        held = SnapshotHolder(
            load,
            prompt_counters=VersionCounters(),
            clock=lambda: clocks.mono,
            wall_clock=lambda: clocks.wall,
            answer_within_s=3.0,
        )
        await held.refresh()
        assert held.control_plane_up
        gate = asyncio.Event()
        waiting = asyncio.create_task(held.refresh())
        await asyncio.sleep(0)  # the refresh starts and waits on the gate
        clocks.mono += 2.0
        assert held.control_plane_up  # a slow answer is not yet no answer
        clocks.mono += 20.0
        assert not held.control_plane_up
        age = held.age_s()
        assert age is not None
        verdict = judge_readiness(
            has_snapshot=True,
            snapshot_age_s=age,
            control_plane_up=held.control_plane_up,
            max_snapshot_age_s=10.0,
            redis="up",
            serving={"chat-7b@v1": 1},
        )
        assert verdict.ready and verdict.snapshot == "stale"
        gate.set()
        await waiting
        assert held.control_plane_up and held.age_s() == 0.0

    asyncio.run(scenario())
