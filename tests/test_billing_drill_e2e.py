"""The billing drill at small scale on two regions of the test's own: 20 streams
(some cut by the client, some refused) and a bill equal to what the clients were
told, per region and in total, in the usage rows, the CSV report and
``/v1/organization/usage``; USD per region as the cost model says.

The platform is the failover test's (``drills.failover_live.TwoRegions``): it
runs no workers, so the test flushes each region's usage the way their beat would.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from drills.billing_live import platform_from_local, run_live
from drills.failover_live import TwoRegions

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("haproxy_binary")]

FLUSH = "from metering.tasks import flush_usage; flush_usage()"


def test_the_bill_equals_what_clients_were_told_per_region(
    tmp_path: Path, redis_url: str
) -> None:
    with TwoRegions(tmp_path, redis_url=redis_url) as two:

        def flush() -> None:
            for region in two.regions.values():
                subprocess.run(
                    [sys.executable, "manage.py", "shell", "-c", FLUSH],
                    env=region.env,
                    check=True,
                    capture_output=True,
                )

        report, _ = run_live(
            platform_from_local(tmp_path),
            streams=20,
            concurrency=20,
            settle_s=60,
            log=lambda _: None,
            flush=flush,
        )

    assert report.passed, report.as_dict()
    by_region = {line.region: line for line in report.lines}
    assert set(by_region) == {*two.names, "total"}
    for name in two.names:
        assert by_region[name].sources["rows"].requests > 0
    assert report.streams.get("cut", 0) > 0
    assert report.streams.get("refused", 0) > 0
    assert {c.region for c in report.costs} >= set(two.names)
