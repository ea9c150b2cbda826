"""The failover drill in the fleet simulator, on small fleets: failures only inside
the load balancer's window, the survivor scaling up with cold caches and batch
held back, and targets that fail when the survivor is too small."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import pytest

from drills.domain.failover_drill import (
    FailoverReport,
    FailoverScenario,
    ShiftedLoad,
    judge,
    run_failover_sim,
    small_scenario,
)
from drills.domain.fleet_config import FleetConfig
from drills.domain.replica import FleetRequest
from drills.domain.workload import Arrival, ChatWorkload, TeamSpec


def _run(**changes: Any) -> FailoverReport:
    return run_failover_sim(FleetConfig(seed=1), replace(small_scenario(), **changes))


@pytest.fixture(scope="module")
def report() -> FailoverReport:
    return _run()


def test_failures_come_only_from_the_lost_region_inside_the_window(
    report: FailoverReport,
) -> None:
    assert report.window_s == 4.0
    causes = report.failed_by_cause
    assert causes["in_flight_on_lost"] > 0
    assert causes["sent_to_lost"] > 0
    assert causes["on_survivor"] == 0
    assert report.requests_failed == sum(causes.values())
    assert report.errors_stop_s is not None
    assert 0.0 <= report.errors_stop_s <= report.window_s
    # The series agrees: errors only in the steps from the loss to detection.
    erroring = [p.at for p in report.series if p.errors]
    assert erroring and min(erroring) >= 0.0 and max(erroring) < report.window_s
    assert sum(p.errors for p in report.series) == report.requests_failed
    assert report.passed, [c.detail for c in report.checks if not c.passed]


def test_survivor_scales_up_with_cold_caches_and_holds_batch_back(
    report: FailoverReport,
) -> None:
    chat = report.pools[0]
    assert chat.pool == "chat"
    assert chat.replicas_before == 2
    assert chat.replicas_peak > chat.replicas_before
    assert chat.first_new_serving_s is not None and chat.first_new_serving_s > 0
    # A's conversations arrive with history no cache of B's holds.
    assert chat.hit_rate_before is not None and chat.hit_rate_shift is not None
    assert chat.hit_rate_shift < chat.hit_rate_before - 0.1
    # Batch is shed and slowed, interactive inside its guarantee is not.
    assert report.batch_shed > 0
    delayed = report.batch_tokens_delayed
    assert delayed is not None and delayed > 0
    assert report.interactive_shed_inside == 0
    assert report.interactive_ttft_p95_shift_s is not None


def test_a_longer_window_fails_more_requests_and_errors_last_longer(
    report: FailoverReport,
) -> None:
    slow = _run(check_inter_s=5.0, check_fall=3)
    assert slow.window_s == 15.0
    assert (
        slow.failed_by_cause["sent_to_lost"]
        > 2 * report.failed_by_cause["sent_to_lost"]
    )
    assert slow.errors_stop_s is not None
    assert report.window_s < slow.errors_stop_s <= slow.window_s


def test_a_survivor_too_small_for_the_shift_refuses_guaranteed_interactive() -> None:
    tiny = _run(chat_replicas=1, reasoning_replicas=0, peak_rps=30.0, max_factor=1.0)
    assert tiny.pools[0].replicas_peak == 1  # nowhere to scale to
    assert tiny.interactive_shed_inside > 0
    names = {c.name: c.passed for c in tiny.checks}
    assert names["survivor_sheds_no_interactive_inside_guarantee"] is False
    assert not tiny.passed


def test_errors_after_the_window_fail_the_first_target(report: FailoverReport) -> None:
    late = replace(report, errors_stop_s=report.window_s + 0.5)
    checks = {c.name: c.passed for c in judge(late)}
    assert checks["errors_stop_within_window"] is False
    assert checks["survivor_sheds_no_interactive_inside_guarantee"] is True


def test_the_shifted_users_carry_history_the_survivor_never_saw() -> None:
    workload = ChatWorkload(arrival_rate=5.0, teams=(TeamSpec("chat"),))
    shift = ShiftedLoad(workload, start_at=10.0, seed=0)
    sent: list[Arrival] = []

    def send(arrival: Arrival) -> FleetRequest:
        sent.append(arrival)
        return cast(FleetRequest, arrival)  # the source ignores what comes back

    assert shift.tick(0.0, send) == pytest.approx(shift.start_at, abs=5.0)
    assert not sent
    now = shift.start_at
    for _ in range(20):
        now = shift.tick(max(now, shift.start_at + 1e-9), send) or now
    assert sent
    assert all(a.history_tokens == workload.history_tokens for a in sent)
    assert all(a.conversation >= 1 << 42 for a in sent)


def test_the_window_must_end_inside_the_run() -> None:
    with pytest.raises(ValueError, match="duration"):
        FailoverScenario(loss_at_s=100.0, duration_s=102.0)
    with pytest.raises(ValueError, match="check_fall"):
        FailoverScenario(check_fall=0)


def test_detection_follows_the_load_balancer_and_readiness_rules() -> None:
    s = replace(small_scenario(), check_inter_s=1.5, check_fall=3)
    # The check at the loss passed; the region's /healthz fails from the next
    # one on (no serving replica), and the third failure in a row takes it out.
    assert s.lost_region_readiness(0.0).ready
    after = s.lost_region_readiness(s.check_inter_s)
    assert not after.ready
    assert "no serving replica for chat" in after.reasons
    assert s.detect_s == 3 * 1.5 == s.window_s
    assert s.detect_t == s.loss_t + 4.5
    # The default is the rendered haproxy.cfg's: inter 2s fall 2.
    assert FailoverScenario().detect_s == 4.0
