"""``autoscaling_drill --sim``: JSON, the table, the plot and the exit status on a
small scenario."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from drills.domain.capacity_plan import Scenario, plan

PNG = b"\x89PNG\r\n\x1a\n"

# 12 requests/s at peak: the plan's 2 replicas; one minute before, one at peak.
SMALL = (
    "--sim",
    "--peak-rps=12",
    "--plan-replicas=2",
    "--hold-minutes=1",
    "--before-minutes=1",
    "--warmup-minutes=2",
    "--warm-nodes=2",
    "--seed=3",
)


def run(*args: str) -> tuple[str, CommandError | None]:
    """Run the command; return what it printed and the error it ended with."""
    out = StringIO()
    try:
        call_command("autoscaling_drill", *args, stdout=out)
    except CommandError as exc:
        return out.getvalue(), exc
    return out.getvalue(), None


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    plot = tmp_path_factory.mktemp("autoscaling") / "drill.png"
    text, error = run(*SMALL, "--cases=doubling", "--json", f"--plot={plot}")
    data = json.loads(text)
    # It exits non-zero exactly when a target is missed.
    assert (error is None) == data["passed"]
    return data, plot


def test_json_reports_every_case_with_the_issues_figures(
    drill: tuple[dict[str, Any], Path],
) -> None:
    data, plot = drill
    assert [c["case"] for c in data["cases"]] == [
        "doubling/plan",
        "doubling/fixed",
        "doubling/cold",
        "doubling/warm",
    ]
    for case in data["cases"]:
        assert set(case) >= {
            "first_serving_s",
            "peak_queue_depth",
            "shed",
            "rate_limited",
            "minutes_outside",
            "gpu_hours",
            "minute_ttft_p95_s",
        }
        assert set(case["shed"]) == {"interactive", "standard", "batch"}
        assert case["minutes"] == 3 == len(case["minute_ttft_p95_s"])
        assert 0 <= case["minutes_outside"] <= case["minutes"]
    assert data["scenario"]["plan_replicas"] == 2
    assert data["scenario"]["plan_replicas_source"] == "--plan-replicas 2"
    assert data["scenario"]["autoscaling"]["max_replicas"] == 4
    assert data["cpu_s"] > 0 and data["plot"] == str(plot)
    assert plot.read_bytes()[:8] == PNG


def test_the_figures_are_sane(drill: tuple[dict[str, Any], Path]) -> None:
    data, _ = drill
    cases = {c["fleet"]: c for c in data["cases"]}
    hours = 3 * 60 / 3600  # the measured window: before, doubling, hold
    for fleet, size in (("plan", 2), ("fixed", data["scenario"]["fixed_replicas"])):
        case = cases[fleet]
        assert case["initial_replicas"] == case["peak_replicas"] == size
        assert case["starts"] == 0 and case["first_serving_s"] is None
        assert case["gpu_hours"] == pytest.approx(size * hours)
    assert 2 <= data["scenario"]["fixed_replicas"] <= 4
    for fleet in ("cold", "warm"):
        case = cases[fleet]
        assert case["gpu_hours"] >= case["warm_gpu_hours"] >= 0
        assert case["requests"] == sum(case["tier_requests"].values()) > 0
    # A warm start serves in 44 s at the earliest, a cold one in 312 s.
    # Both autoscaled fleets scale up here (seed 3: 2 starts each).
    warm = cases["warm"]
    assert warm["starts"] > 0
    assert warm["first_serving_s"] >= 44
    assert warm["warm_gpu_hours"] > 0
    cold = cases["cold"]
    assert cold["starts"] > 0
    assert cold["first_serving_s"] >= 312
    arithmetic = data["seed_arithmetic"]
    assert round(arithmetic["utilisation_on_arrival"], 2) == 0.94
    assert arithmetic["passed"] is True
    names = [check["name"] for check in data["checks"]]
    assert names == [
        "seed_arithmetic",
        "doubling_warm_sheds_no_interactive",
        "doubling_warm_ttft_back_within_2_min",
    ]
    assert [check["passed"] for check in data["checks"]] == [True, True, True]
    assert data["passed"] is True


def test_the_plan_fleet_and_peak_default_to_the_capacity_plans(
    tmp_path: Path,
) -> None:
    """GIVEN a scenario of three regions, one of which may be lost, at 240 streams
    WHEN the drill runs without --peak-rps or --plan-replicas
    THEN it replays one region's peak (12 requests/s) on the plan's fleet for it."""
    path = tmp_path / "small.yaml"
    path.write_text("peak_streams: 240\nregions: 3\n", encoding="utf-8")
    planned = plan(Scenario(peak_streams=240, regions=3))
    replicas = planned["chat_replicas_per_region_with_prefill"]
    args = [a for a in SMALL if not a.startswith(("--peak-rps", "--plan-replicas"))]
    text, _ = run(
        *args,
        f"--scenario={path}",
        "--cases=doubling",
        "--fleets=plan",
        "--json",
        f"--plot={tmp_path / 'p.png'}",
    )
    scenario = json.loads(text)["scenario"]
    assert scenario["peak_rps"] == pytest.approx(12.0)
    assert scenario["plan_replicas"] == replicas != 12
    assert scenario["plan_replicas_source"] == (
        f"the capacity plan's {replicas} for {path}"
    )


def test_a_missed_target_says_why_and_exits_non_zero(tmp_path: Path) -> None:
    # Two warm nodes idle all day against a 2-replica fleet: the day cannot save
    # 25% of GPU-hours. With --json PATH the figures go to the file and the
    # table is still printed, as every drill does.
    report = tmp_path / "day.json"
    text, error = run(
        *SMALL,
        "--cases=day",
        "--fleets=fixed,warm",
        "--fixed-replicas=2",
        "--day-hours=0.1",
        f"--plot={tmp_path / 'p.png'}",
        f"--json={report}",
    )
    assert error is not None and "day_warm_saves_25_percent" in str(error)
    assert json.loads(report.read_text(encoding="utf-8"))["passed"] is False
    assert "FAIL day_warm_saves_25_percent:" in text
    assert "GPU-hours (warm pool" in text and "against 0.2 for the fixed 2" in text
    assert "Case: day" in text and "GPU-h" in text


def test_it_needs_sim_and_known_cases() -> None:
    with pytest.raises(CommandError, match="--sim"):
        call_command("autoscaling_drill")
    with pytest.raises(CommandError, match="cases are"):
        call_command("autoscaling_drill", "--sim", "--cases=spike")
