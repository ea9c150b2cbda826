"""What /healthz tells the global load balancer (routing.domain.readiness)."""

from __future__ import annotations

from typing import Any

from routing.domain.readiness import judge_readiness


def judge(**changes: Any) -> Any:
    facts: dict[str, Any] = {
        "has_snapshot": True,
        "snapshot_age_s": 1.0,
        "control_plane_up": True,
        "max_snapshot_age_s": 10.0,
        "redis": "up",
        "serving": {"chat-7b@v1": 2, "reason-70b@v1": 1},
    }
    facts.update(changes)
    return judge_readiness(**facts)


def test_a_region_with_replicas_a_fresh_snapshot_and_redis_is_ready() -> None:
    verdict = judge()
    assert verdict.ready
    assert verdict.reasons == ()
    assert verdict.snapshot == "fresh"


def test_a_pool_with_no_serving_replica_takes_the_region_out() -> None:
    verdict = judge(serving={"chat-7b@v1": 0, "reason-70b@v1": 1})
    assert not verdict.ready
    assert verdict.reasons == ("no serving replica for chat-7b@v1",)


def test_a_stuck_refresh_takes_the_region_out_while_the_control_plane_answers() -> None:
    verdict = judge(snapshot_age_s=30.0)
    assert not verdict.ready
    assert verdict.snapshot == "too old"


def test_a_stale_snapshot_still_serves_while_the_control_plane_is_down() -> None:
    # Every region is as stale: failing them all would stop serving everywhere.
    verdict = judge(snapshot_age_s=3600.0, control_plane_up=False)
    assert verdict.ready
    assert verdict.snapshot == "stale"


def test_no_snapshot_or_no_redis_is_not_ready_and_says_why() -> None:
    none = judge(has_snapshot=False, snapshot_age_s=None, serving={})
    assert not none.ready
    assert none.snapshot == "none"
    assert not judge(redis="unreachable").ready
    assert "Redis" in judge(redis="unreachable").reasons[0]
    assert judge(redis="unused").ready


def test_every_reason_is_listed() -> None:
    verdict = judge(redis="unreachable", serving={"chat-7b@v1": 0})
    assert len(verdict.reasons) == 2
