"""A region cut off from everything (its clients' balancer and the control plane).

GIVEN two regions behind HAProxy (``tests.faults.region``: east's gateway, agent,
replicas and Redis in a network namespace) and three streaming clients of east's
frontend
WHEN east's network drops every packet for ``FAULT_OUTAGE_S`` seconds, then heals
THEN no stream is left hanging (each ends within its deadline); every request
started once the balancer's health-check window has passed is answered in full
(by west); only requests in flight on east when it was cut may fail; east is
ready again within ``RECOVERY_BOUND_S`` of the heal; and the usage rows hold what
the clients were told, plus at most the requests that failed (east may have
counted what it could not deliver), nothing twice.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from localrun.processes import wait_until
from tests.faults.harness import Figures, hold
from tests.faults.load import HealthWatch, Load, outcomes, told_usage
from tests.faults.region import LIVE_CHECK, CutRegions

pytestmark = [
    pytest.mark.slow,
    pytest.mark.soak,
    pytest.mark.usefixtures("haproxy_binary"),
]

OUTAGE_S = float(os.environ.get("FAULT_OUTAGE_S", "5"))
RECOVERY_BOUND_S = 30.0
# The balancer's window for a region that hangs: its checks, each timing out.
WINDOW_S = LIVE_CHECK.window_s + 2 * LIVE_CHECK.fall


@pytest.fixture
def regions(
    tmp_path: Path, redis_server_binary: str, network_namespaces: None
) -> Iterator[CutRegions]:
    with CutRegions(tmp_path, redis_server_binary) as platform:
        yield platform


def usage_rows(platform: CutRegions) -> dict[str, int]:
    url = platform.envs["west"]["DATABASE_URL"]
    with psycopg.connect(url, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(requests), 0), coalesce(sum(prompt_tokens), 0),"
            " coalesce(sum(cached_tokens), 0), coalesce(sum(output_tokens), 0),"
            " coalesce(sum(rate_limited), 0) FROM usage WHERE team_id = 'demo'"
        ).fetchone()
    assert row is not None
    names = ("requests", "prompt_tokens", "cached_tokens", "output_tokens")
    return dict(zip((*names, "rate_limited"), (int(v) for v in row), strict=True))


def test_region_cut_off(regions: CutRegions, record_figures: list[Figures]) -> None:
    assert regions.netns is not None
    load = Load(regions.east_entry, regions.team_key, streams=3)
    with HealthWatch(regions.east_entry) as watch, load:
        wait_until(
            lambda: load.count_ok_since(0) >= 3,
            timeout_s=30,
            message="three answers before the cut",
        )
        cut_at = time.monotonic()
        regions.netns.blackhole()
        try:
            hold(OUTAGE_S)
        finally:
            regions.netns.heal()
        healed_at = time.monotonic()
        recovery_s = None
        with contextlib.suppress(AssertionError):
            wait_until(regions.east_ready, timeout_s=60, interval_s=0.1, message="east")
            recovery_s = round(time.monotonic() - healed_at, 2)
        since = time.monotonic()
        wait_until(
            lambda: load.count_ok_since(since) >= 3,
            timeout_s=30,
            message="three answers after the heal",
        )
    answers = load.snapshot()
    told = told_usage(answers)
    rows: dict[str, int] = {}

    def settled() -> bool:
        nonlocal rows
        regions.flush_usage()
        rows = usage_rows(regions)
        return rows == told

    with contextlib.suppress(AssertionError):
        wait_until(settled, timeout_s=15, interval_s=1)
    failed = [a for a in answers if a.outcome != "ok"]
    late = [a for a in failed if a.started >= cut_at + WINDOW_S]
    figures = Figures(
        case="region_cut_off",
        fault="region east blackholed (gateway, agent, replicas, Redis)",
        outage_s=OUTAGE_S,
        answers=outcomes(answers),
        hung=sum(1 for a in answers if a.outcome == "hung"),
        recovery_s=recovery_s,
        healthz_not_ready=len(watch.not_ready()),
        healthz_samples=len(watch.samples),
        usage_told=told,
        usage_rows=rows,
        extra={"window_s": WINDOW_S, "failed_after_window": len(late)},
    )
    record_figures.append(figures)
    assert figures.hung == 0, figures.line()
    assert not late, figures.line()
    assert recovery_s is not None and recovery_s <= RECOVERY_BOUND_S, figures.line()
    for name in ("requests", "prompt_tokens", "output_tokens"):
        assert told[name] <= rows[name], figures.line()
    assert rows["requests"] - told["requests"] <= len(failed), figures.line()
