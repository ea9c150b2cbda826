"""``rollout_drill``: JSON, the table, the plot and the exit status at small scale
(200 streams, a plan of 60 s steps)."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

PNG = b"\x89PNG\r\n\x1a\n"
SHORT_PLAN = {
    "steps": [
        {
            "stage": stage,
            "percent": percent,
            "min_duration_s": 60,
            "min_requests": 20,
            "min_conversations": 5,
        }
        for stage, percent in (("shadow", 25), ("canary", 10), ("canary", 50))
    ]
}
# Four replicas, not the plan's three for 20 requests/s: at its knee a 5-minute window
# cycled makes the good version's p95 too noisy to decide within the short plan.
SMALL = ("--streams=200", "--replicas=4", "--window-minutes=5", "--seed=1")


def run(*args: str) -> tuple[str, CommandError | None]:
    """Run the command; return what it printed and the error it ended with."""
    out = StringIO()
    try:
        call_command("rollout_drill", *args, stdout=out)
    except CommandError as exc:
        return out.getvalue(), exc
    return out.getvalue(), None


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rollout") / "plan.json"
    path.write_text(json.dumps(SHORT_PLAN), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def drill(
    tmp_path_factory: pytest.TempPathFactory, plan: Path
) -> tuple[str, CommandError | None, dict[str, Any], Path]:
    folder = tmp_path_factory.mktemp("rollout")
    plot, report = folder / "drill.png", folder / "drill.json"
    text, error = run(*SMALL, f"--plan={plan}", f"--json={report}", f"--plot={plot}")
    data = json.loads(report.read_text(encoding="utf-8"))
    return text, error, data, plot


def test_json_reports_every_scenario_with_the_issues_figures(
    drill: tuple[str, CommandError | None, dict[str, Any], Path],
) -> None:
    _, error, data, plot = drill
    # It exits non-zero exactly when a target is missed.
    assert (error is None) == data["passed"]
    assert not data["passed"] or all(c["passed"] for c in data["checks"])
    rows = {row["scenario"]: row for row in data["scenarios"]}
    assert list(rows) == ["bad", "bad_shadow", "good", "slow"]
    bad = rows["bad"]
    assert (bad["decision"], bad["stage"], bad["percent"]) == (
        "rolled_back",
        "canary",
        10.0,
    )
    assert 0 < bad["detection_s"] <= 2 * data["settings"]["guard_period_s"]
    assert bad["detection_guard_periods"] == pytest.approx(
        bad["detection_s"] / data["settings"]["guard_period_s"]
    )
    assert 0 < bad["conversations_saw"] <= bad["requests_saw"]
    assert {g["name"] for g in bad["tripped"]} >= {"output_length", "refusal_rate"}
    good = rows["good"]
    assert good["decision"] == "promoted" and good["tripped"] == []
    # Three 60 s steps, each held until every guard says not worse: at 20
    # requests/s the error guard's 0.5-point margin takes minutes of evidence
    # (the fixed test passed in 3 to 5 minutes by calling "not shown worse" a pass).
    assert 180.0 <= good["promotion_s"] <= 1800.0
    assert {t["action"] for t in good["ticks"]} <= {"advance", "continue", "hold"}
    assert [s["step"] for s in good["steps"]] == [
        "shadow 25%",
        "canary 10%",
        "canary 50%",
    ]
    slow = rows["slow"]
    assert "p95_ttft" in {g["name"] for g in slow["tripped"]}
    assert "refusal_rate" not in {g["name"] for g in slow["tripped"]}
    for row in rows.values():
        assert row["mid_chat_moves"]["other"] == 0
        assert row["ticks"], row["scenario"]
        for tick in row["ticks"]:
            assert set(tick["guards"]) == {
                "error_rate",
                "p95_ttft",
                "output_length",
                "refusal_rate",
            }
    traffic = data["traffic"]
    assert traffic["streams"] == 200 and traffic["replicas"] == 4
    assert traffic["arrival_rate"] == pytest.approx(20.0)
    assert traffic["window_s"] == 300.0 and traffic["cycles"] >= 2
    assert data["settings"]["plan"]["steps"][0]["stage"] == "shadow"
    assert data["wall_s"] > 0 and data["plot"] == str(plot)
    assert plot.read_bytes()[:8] == PNG


def test_the_table_names_every_scenario_and_the_checks(
    drill: tuple[str, CommandError | None, dict[str, Any], Path],
) -> None:
    text, _, data, _ = drill
    assert "Rollout drill (simulated): 200 streams = 20 requests/s" in text
    assert "replayed in" in text  # the 5-minute window cycles
    for name in ("bad", "bad_shadow", "good", "slow"):
        assert any(line.startswith(f"{name} ") for line in text.splitlines()), name
    for check in data["checks"]:
        verdict = "PASS" if check["passed"] else "FAIL"
        assert f"{verdict} {check['name']}:" in text


def test_json_without_a_path_prints_it(plan: Path, tmp_path: Path) -> None:
    text, error = run(
        *SMALL,
        f"--plan={plan}",
        "--scenario=good",
        "--json",
        f"--plot={tmp_path / 'good.png'}",
    )
    data = json.loads(text)
    assert [row["scenario"] for row in data["scenarios"]] == ["good"]
    assert (error is None) == data["passed"]


def test_bad_options_are_refused(plan: Path, tmp_path: Path) -> None:
    _, error = run(*SMALL, "--scenario=worse")
    assert error is not None and "--scenario takes" in str(error)
    broken = tmp_path / "plan.json"
    broken.write_text(json.dumps({"steps": [{"stage": "shadow"}]}), encoding="utf-8")
    _, error = run(*SMALL, f"--plan={broken}")
    assert error is not None and "steps[0].percent" in str(error)
    _, error = run(*SMALL, f"--plan={tmp_path / 'missing.json'}")
    assert error is not None and "--plan" in str(error)


def test_sequential_check_prints_writes_and_fails_on_a_miss(tmp_path: Path) -> None:
    """A quarter hour is too short to promote a good version anywhere: the
    command writes its JSON and plot, prints the table, and fails."""
    out = tmp_path / "seq.json"
    text, error = run(
        "--sequential-check",
        "--seeds=1",
        "--horizon-hours=0.25",
        f"--json={out}",
        f"--plot={tmp_path / 'seq.png'}",
    )
    assert error is not None and "good_promoted" in str(error)
    data = json.loads(out.read_text())
    assert [c["pool"] for c in data["cells"]][::4] == ["7b-100", "7b-1000", "70b-peak"]
    assert {c["version"] for c in data["cells"]} == {
        "refuses",
        "worse",
        "good",
        "subtle",
    }
    checks = {c["name"]: c["passed"] for c in data["checks"]}
    assert checks["70b-peak_refuses_rolled_back_within_3_periods"]
    assert not checks["7b-100_good_promoted_19_of_20"]
    assert (tmp_path / "seq.png").exists()
    assert "Sequential guards (issue 38)" in text
