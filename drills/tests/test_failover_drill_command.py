"""``failover_drill``: the simulated drill's JSON, table, plot and exit status on
the small scale, and the live branch through the same report."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import replace
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from drills.domain.failover_drill import run_failover_sim, small_scenario
from drills.domain.fleet_config import FleetConfig

PNG = b"\x89PNG\r\n\x1a\n"


def run(*args: str) -> tuple[str, CommandError | None]:
    """Run the command; return what it printed and the error it ended with."""
    out = StringIO()
    try:
        call_command("failover_drill", *args, stdout=out)
    except CommandError as exc:
        return out.getvalue(), exc
    return out.getvalue(), None


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("failover")
    plot, path = tmp / "failover.png", tmp / "failover.json"
    out, error = run("--sim", "--small", "--seed=1", f"--json={path}", f"--plot={plot}")
    assert error is None, (error, out)
    return out, json.loads(path.read_text()), plot


def test_json_has_the_issue_figures(drill: tuple[str, dict[str, Any], Path]) -> None:
    _out, data, plot = drill
    assert data["mode"] == "sim"
    assert data["passed"] is True
    assert {c["name"] for c in data["checks"]} == {
        "errors_stop_within_window",
        "survivor_sheds_no_interactive_inside_guarantee",
    }
    assert data["window_s"] == 4.0
    assert 0 <= data["errors_stop_s"] <= data["window_s"]
    causes = data["failed_by_cause"]
    assert set(causes) == {"in_flight_on_lost", "sent_to_lost", "on_survivor"}
    assert data["requests_failed"] == sum(causes.values()) > 0
    assert data["requests_total"] > data["requests_failed"]
    for key in (
        "interactive_ttft_p50_before_s",
        "interactive_ttft_p95_before_s",
        "interactive_ttft_p50_shift_s",
        "interactive_ttft_p95_shift_s",
    ):
        assert data[key] > 0, key
    assert data["interactive_shed_inside_guarantee"] == 0
    assert data["batch_tokens_baseline"] > data["batch_tokens_shift"] > 0
    assert data["batch_tokens_delayed"] > 0 and data["batch_delay_s"] > 0
    chat, reasoning = data["pools"]
    assert chat["pool"] == "chat" and reasoning["pool"] == "reasoning"
    assert chat["replicas_peak"] > chat["replicas_before"] == 2
    assert chat["hit_rate_shift"] < chat["hit_rate_before"]
    assert data["series"] and set(data["series"][0]) == {
        "at_s",
        "errors",
        "interactive_ttft_p95_s",
        "replicas",
        "batch_tokens_s",
        "hit_rate",
    }
    assert data["scenario"]["client_retries"] is False
    assert data["plot"] == str(plot)
    assert plot.read_bytes()[:8] == PNG


def test_table_names_the_figures_and_the_json(
    drill: tuple[str, dict[str, Any], Path],
) -> None:
    out, _data, _plot = drill
    assert out.startswith("Failover drill (simulated): two regions of chat 2 x")
    for text in (
        "errors stop after the loss",
        "interactive TTFT p50 / p95 during the shift",
        "batch work delayed",
        "PASS errors_stop_within_window",
        "PASS survivor_sheds_no_interactive_inside_guarantee",
    ):
        assert text in out, text
    assert out.rstrip().splitlines()[-1].startswith("json: ")


def test_json_dash_prints_only_json(tmp_path: Path) -> None:
    out, error = run(
        "--sim",
        "--small",
        "--duration=120",
        "--check-inter=1",
        "--check-fall=3",
        "--warm-nodes=1",
        "--json",
        f"--plot={tmp_path / 'p.png'}",
    )
    assert error is None
    data = json.loads(out)
    assert data["window_s"] == 3.0
    assert data["scenario"]["duration_s"] == 120.0
    assert data["scenario"]["warm_nodes"] == 1


def test_a_loss_after_the_run_is_a_command_error(tmp_path: Path) -> None:
    _out, error = run(
        "--sim", "--small", "--loss-at=200", f"--plot={tmp_path / 'p.png'}"
    )
    assert error is not None and "duration" in str(error)


def test_live_without_the_live_module_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "drills.failover_live", None)
    _out, error = run()
    assert error is not None and "live drill not available" in str(error)


def test_live_report_renders_through_the_same_table_and_exit_status(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    report = run_failover_sim(FleetConfig(seed=1), small_scenario())
    # A live run whose errors went on past the window: the first target fails.
    late = replace(report, mode="live", errors_stop_s=report.window_s + 2.0)
    seen: dict[str, Any] = {}

    def run_live(**options: Any) -> Any:
        from drills.domain.failover_drill import judge

        seen.update(options)
        return replace(late, checks=judge(late))

    module = types.ModuleType("drills.failover_live")
    module.run_live = run_live  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "drills.failover_live", module)
    out, error = run("--check-inter=1", f"--plot={tmp_path / 'live.png'}")
    assert seen["check_inter"] == 1.0 and seen["sim"] is False
    assert out.startswith("Failover drill (live)")
    assert "FAIL errors_stop_within_window" in out
    assert error is not None and "errors_stop_within_window" in str(error)
    assert (tmp_path / "live.png").read_bytes()[:8] == PNG


SHIPPED_TRACE = Path(__file__).resolve().parents[2] / (
    "platform/traces/recorded-generated-chat.jsonl"
)


def test_a_recorded_trace_is_the_chat_traffic(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    out, error = run(
        "--sim",
        "--small",
        f"--trace={SHIPPED_TRACE}",
        "--trace-rate-scale=3",
        f"--json={path}",
        f"--plot={tmp_path / 'trace.png'}",
    )
    assert error is None, (error, out)
    data = json.loads(path.read_text())
    trace = data["scenario"]["chat_trace"]
    lines = sum(1 for line in SHIPPED_TRACE.open() if line.strip())
    # Three times the conversations, split between the regions.
    assert trace["requests"] == pytest.approx(3 * lines, rel=0.05)
    assert 0 < trace["lost_region_requests"] < trace["requests"]
    # The shipped trace is one standard team's: its figures are measured.
    assert data["scenario"]["measured_tiers"] == ["standard"]
    assert len(data["scenario"]["inside_guarantee_teams"]) == 1
    assert data["interactive_ttft_p95_shift_s"] is not None
    assert data["failed_by_cause"]["sent_to_lost"] > 0
    assert "Chat traffic: a recorded trace" in out


def test_a_bad_trace_is_a_command_error(tmp_path: Path) -> None:
    _, error = run("--sim", "--small", f"--trace={tmp_path / 'none.jsonl'}")
    assert error is not None and "cannot read trace" in str(error)
    _, error = run(
        "--sim", "--small", f"--trace={SHIPPED_TRACE}", "--trace-rate-scale=0"
    )
    assert error is not None and "--trace-rate-scale" in str(error)
    _, error = run("--sim", "--small", f"--trace={SHIPPED_TRACE}", "--duration=100000")
    assert error is not None and "must fit inside it" in str(error)
