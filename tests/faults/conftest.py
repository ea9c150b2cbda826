"""The fault suite's platform, started once for every case of the package.

Network namespaces need root and iproute2: where they cannot be made the suite
is skipped with the reason (the root conftest's ``network_namespaces``), and
with ``REQUIRE_SERVICES=1`` (CI) or ``REQUIRE_NETNS=1`` that is a failure. Each
case's figures are printed at the end of the run (from the reports'
``user_properties``, so they come back from pytest-xdist's workers too) and
written to ``.local/faults/``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from tests.faults.harness import FaultPlatform, Figures, start_fault_platform
from tests.faults.netns import remove_stale


@pytest.fixture(scope="package")
def fault_platform(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server_binary: str,
    network_namespaces: None,
) -> Iterator[FaultPlatform]:
    remove_stale()
    with start_fault_platform(
        tmp_path_factory.mktemp("faults"), redis_server_binary
    ) as platform:
        yield platform


@pytest.fixture
def record_figures(
    record_property: Callable[[str, object], None],
) -> Iterator[list[Figures]]:
    """Append a case's ``Figures`` here: they are written and reported, pass or fail."""
    figures: list[Figures] = []
    yield figures
    for item in figures:
        item.write()
        record_property("fault_figures", item.line())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        for name, value in getattr(report, "user_properties", [])
        if name == "fault_figures"
    ]
    if lines:
        terminalreporter.section("fault suite figures")
        for line in dict.fromkeys(lines):
            case = json.loads(line)
            terminalreporter.write_line(
                f"{case['case']}: answers {case['answers']}, hung {case['hung']}, "
                f"recovery {case['recovery_s']} s, healthz not ready "
                f"{case['healthz_not_ready']}/{case['healthz_samples']}, usage told "
                f"{case['usage_told']} rows {case['usage_rows']}"
                + (f", {case['extra']}" if case["extra"] else "")
            )
