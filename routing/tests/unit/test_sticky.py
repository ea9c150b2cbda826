"""A conversation keeps its version through a rollout (``routing.domain.sticky``)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from routing.domain.resolve import resolve
from routing.domain.routing_key import stable_fraction
from routing.domain.snapshot import ModelRecord
from routing.domain.sticky import (
    Remembered,
    figure_role,
    first_choice,
    in_baseline_band,
    needs_memory,
    routable_versions,
    stick,
)

LIVE = ModelRecord(
    model="chat-7b",
    live_version="v1",
    canary_version=None,
    canary_percent=0.0,
    shadow_version=None,
    shadow_percent=0.0,
)
VERSIONS = {("chat-7b", "v1"), ("chat-7b", "v2")}


def canary(percent: float) -> ModelRecord:
    return replace(LIVE, canary_version="v2", canary_percent=percent)


def turn(
    record: ModelRecord, key: str, memory: dict[str, Remembered], *, first: bool
) -> str:
    """One turn through resolve, the memory and stick, as the gateway does."""
    resolution = resolve("chat-7b", {"chat-7b": record}, VERSIONS, key, 0.5)
    if not needs_memory(record):
        return resolution.version
    remembered = memory.get(key)
    if remembered is None or remembered.version not in routable_versions(record):
        remembered = first_choice(resolution, record, first_turn=first, routing_key=key)
    memory[key] = remembered
    return stick(resolution, remembered, record).version


keys = st.lists(
    st.text(min_size=1, max_size=12).map(lambda t: f"conv:{t}"),
    min_size=1,
    max_size=40,
    unique=True,
)
shares = st.lists(st.floats(1.0, 100.0), min_size=1, max_size=4).map(sorted)


@given(keys, shares)
def test_no_conversation_changes_version_while_the_share_rises(
    conversations: list[str], steps: list[float]
) -> None:
    memory: dict[str, Remembered] = {}
    pending = replace(LIVE, rollout_pending=True)
    first_seen = {key: turn(pending, key, memory, first=False) for key in conversations}
    assert set(first_seen.values()) == {"v1"}  # under way: stays on live
    for percent in steps:
        record = replace(canary(percent), rollout_pending=True)
        for key in conversations:
            assert turn(record, key, memory, first=False) == first_seen[key]


@given(keys, st.floats(1.0, 100.0))
def test_new_conversations_split_by_the_hash_and_keep_it_after_promotion(
    conversations: list[str], percent: float
) -> None:
    memory: dict[str, Remembered] = {}
    record = replace(canary(percent), rollout_pending=True)
    chosen = {key: turn(record, key, memory, first=True) for key in conversations}
    for key, version in chosen.items():
        fraction = stable_fraction(key, salt="canary:chat-7b")
        assert version == ("v2" if fraction * 100 < percent else "v1")
    promoted = replace(
        LIVE, live_version="v2", retained_version="v1", rollout_pending=False
    )
    for key in conversations:
        assert turn(promoted, key, memory, first=False) == chosen[key]
    # Once v1 is retired, its conversations go on to the live version.
    retired = replace(promoted, retained_version=None)
    assert needs_memory(retired) is False
    for key in conversations:
        assert turn(retired, key, memory, first=False) == "v2"


@given(keys, st.floats(1.0, 100.0))
def test_a_rollback_sends_canary_conversations_back_to_live(
    conversations: list[str], percent: float
) -> None:
    memory: dict[str, Remembered] = {}
    record = replace(canary(percent), rollout_pending=True)
    for key in conversations:
        turn(record, key, memory, first=True)
    rolled_back = replace(LIVE, rollout_pending=False)
    assert needs_memory(rolled_back) is False
    for key in conversations:
        assert turn(rolled_back, key, memory, first=False) == "v1"


@given(st.floats(0.0, 0.999999), st.floats(0.5, 100.0))
def test_the_baseline_band_is_as_wide_as_the_canary_and_never_inside_it(
    fraction: float, percent: float
) -> None:
    inside = in_baseline_band(fraction, percent)
    if inside:
        assert fraction * 100 >= percent  # never a canary conversation
        assert 50.0 <= fraction * 100 < 50.0 + percent
    if percent <= 50.0 and 50.0 <= fraction * 100 < 50.0 + percent:
        assert inside


def test_roles_of_the_guards() -> None:
    record = replace(canary(10.0), rollout_pending=True)
    resolution = resolve("chat-7b", {"chat-7b": record}, VERSIONS, "conv:x", 0.5)
    live_resolution = replace(resolution, version="v1", is_canary=False)
    canary_resolution = replace(resolution, version="v2", is_canary=True)
    assert figure_role(canary_resolution, Remembered("v2"), record) == "canary"
    assert figure_role(live_resolution, Remembered("v1", baseline=True), record) == (
        "baseline"
    )
    assert figure_role(live_resolution, Remembered("v1"), record) == "live"
    pinned = replace(live_resolution, is_pinned=True)
    assert figure_role(pinned, None, record) is None
    assert figure_role(live_resolution, None, LIVE) is None  # no rollout on
    promoted = replace(LIVE, live_version="v2", retained_version="v1")
    assert figure_role(live_resolution, Remembered("v1"), promoted) is None


def test_remembered_round_trips_and_refuses_garbage() -> None:
    for value in (Remembered("v1"), Remembered("v12", baseline=True)):
        assert Remembered.decode(value.encode()) == value
    for text in ("", "v1", "v1|x", "|b"):
        assert Remembered.decode(text) is None
