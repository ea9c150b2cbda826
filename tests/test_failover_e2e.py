"""Two regions behind a real HAProxy: a region lost, its clients served by the other.

The issue's "done when": region A's gateway killed -> requests succeed through
region B within the health-check window; A back -> traffic returns to it. And the
balancer follows ``/healthz``, not only whether a process answers: a region whose
replicas are gone is taken out while its gateway still runs.

Everything is real and of the test's own: PostgreSQL (``localrun.own_postgres``),
two gateways, two node agents with simulated replicas, HAProxy; the client is the
``openai`` SDK with no retries, so every failure is seen.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from drills.failover_live import Sample, TwoRegions, run_load
from localrun.processes import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("haproxy_binary")]


def answered_by(samples: list[Sample], region: str, *, after: float) -> bool:
    return any(s.ok and s.region == region and s.start >= after for s in samples)


def test_a_lost_region_fails_over_within_the_window_and_traffic_returns(
    tmp_path: Path, redis_url: str
) -> None:
    with TwoRegions(tmp_path, redis_url=redis_url) as platform:
        east, west = platform.names
        window = platform.check.window_s
        clock0 = time.monotonic()

        def now() -> float:
            return time.monotonic() - clock0

        with run_load(
            platform.regions[east].entry, platform.team_key, streams=4, clock0=clock0
        ) as samples:
            # GIVEN clients of east served at home
            wait_until(
                lambda: answered_by(samples, east, after=0.0),
                timeout_s=30,
                message="answers from east",
            )
            assert not any(s.ok and s.region == west for s in samples)

            # WHEN east's gateway is lost
            lost_at = now()
            platform.kill_gateway(east)

            # THEN east's clients are answered by west within the window
            wait_until(
                lambda: answered_by(samples, west, after=lost_at),
                timeout_s=window + 10,
                message="answers from west after the loss",
            )
            settled = lost_at + window
            wait_until(
                lambda: sum(1 for s in samples if s.start >= settled) >= 20,
                timeout_s=30,
                message="requests after the window",
            )
            late = [s for s in samples if s.start >= settled]
            assert all(s.ok for s in late), [s for s in late if not s.ok][:5]
            assert all(s.region == west for s in late)
            failures = [s for s in samples if not s.ok]
            # Only streams in flight on east at the loss may fail: HAProxy resends
            # a request whose connection was refused.
            assert all(s.start < lost_at + window for s in failures), failures
            assert max((s.end for s in failures), default=lost_at) <= settled + 1.0

            # WHEN east is back THEN its clients come home
            platform.start_gateway(east)
            back_at = now()
            wait_until(
                lambda: answered_by(samples, east, after=back_at),
                timeout_s=30,
                message="answers from east once it is back",
            )

            # WHEN east's replicas are gone while its gateway runs THEN /healthz
            # says so and the balancer moves its clients to west
            agent = platform.regions[east].agent
            assert agent is not None
            agent.stop(grace_s=20)
            wait_until(
                lambda: not platform.region_ready(east),
                timeout_s=30,
                message="east's /healthz to say it cannot serve",
            )
            drained_at = now() + window
            wait_until(
                lambda: sum(1 for s in samples if s.start >= drained_at + 0.5) >= 10,
                timeout_s=30,
                message="requests after east was drained",
            )
            after = [s for s in samples if s.start >= drained_at + 0.5]
            assert all(s.ok and s.region == west for s in after), after[:5]
