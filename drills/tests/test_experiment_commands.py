"""``isolation_test --sim``, ``overload_drill`` and ``capacity_test --sim``: JSON,
tables and plots on small fleets."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from drills.domain.capacity_plan import Scenario, plan

PNG = b"\x89PNG\r\n\x1a\n"

SMALL_ISOLATION = (
    "--sim",
    "--replicas=2",
    "--teams=3",
    "--rate=6",
    "--minutes=3",
    "--warmup-minutes=0.5",
)
SMALL_OVERLOAD = ("--replicas=2", "--minutes=4", "--warmup-minutes=0.5")
SHORT_CAPACITY = (
    "--sim",
    "--start=500",
    "--step=250",
    "--max=4000",
    "--step-seconds=60",
    "--warmup-seconds=15",
)


# Three regions, one of which may be lost, at 240 streams: a region carries 12
# requests/s, and the capacity plan sizes it at a few replicas (not 12).
SMALL_SCENARIO = "peak_streams: 240\nregions: 3\n"


@pytest.fixture
def small_scenario(tmp_path: Path) -> tuple[Path, int]:
    """The small scenario's file and the plan's chat replicas for one region."""
    path = tmp_path / "small.yaml"
    path.write_text(SMALL_SCENARIO, encoding="utf-8")
    capacity = plan(Scenario(peak_streams=240, regions=3))
    return path, int(capacity["chat_replicas_per_region_with_prefill"])


def run(name: str, *args: str) -> str:
    out = StringIO()
    call_command(name, *args, stdout=out)
    return out.getvalue()


def test_isolation_sim_json_passes_and_writes_the_plot(tmp_path: Path) -> None:
    plot = tmp_path / "iso.png"
    data = json.loads(
        run("isolation_test", *SMALL_ISOLATION, "--json", f"--plot={plot}")
    )
    assert data["passed"] is True and data["reasons"] == []
    assert [row["team"] for row in data["teams"]] == ["team-1", "team-2", "noisy"]
    noisy = data["teams"][-1]
    assert noisy["role"] == "noisy" and noisy["rate_limited_noisy"] > 0
    for row in data["teams"][:-1]:
        assert row["rate_limited_noisy"] == 0
        assert set(row) >= {"ttft_p95_ms_baseline", "ttft_p95_ms_noisy"}
    assert data["scenario"]["replicas"] == 2 and data["scenario"]["admission"]
    assert data["scenario"]["replicas_source"] == "--replicas 2"
    assert plot.read_bytes()[:8] == PNG


def test_isolation_sim_fleet_defaults_to_the_capacity_plans(
    tmp_path: Path, small_scenario: tuple[Path, int]
) -> None:
    path, replicas = small_scenario
    args = [a for a in SMALL_ISOLATION if not a.startswith("--replicas")]
    data = json.loads(
        run(
            "isolation_test",
            *args,
            f"--scenario={path}",
            "--json",
            f"--plot={tmp_path / 'p.png'}",
        )
    )
    assert data["scenario"]["replicas"] == replicas != 12
    assert data["scenario"]["replicas_source"] == (
        f"the capacity plan's {replicas} for {path}"
    )


def test_isolation_sim_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    args = (*SMALL_ISOLATION, "--minutes=1", "--json", f"--plot={tmp_path / 'p.png'}")
    first = json.loads(run("isolation_test", *args, "--seed=4"))
    again = json.loads(run("isolation_test", *args, "--seed=4"))
    assert first["teams"] == again["teams"]


def test_isolation_sim_without_limits_fails(tmp_path: Path) -> None:
    out = StringIO()
    with pytest.raises(CommandError):
        call_command(
            "isolation_test",
            *SMALL_ISOLATION,
            "--no-limits",
            f"--plot={tmp_path / 'p.png'}",
            stdout=out,
        )
    assert "FAIL" in out.getvalue() and "p95 TTFT" in out.getvalue()


def test_isolation_sim_table_names_units(tmp_path: Path) -> None:
    text = run("isolation_test", *SMALL_ISOLATION, f"--plot={tmp_path / 'p.png'}")
    assert "PASS" in text and "tok/min" in text and "noise ms" in text


def test_overload_drill_json_reports_tiers_bins_and_checks(tmp_path: Path) -> None:
    plot = tmp_path / "overload.png"
    data = json.loads(
        run("overload_drill", *SMALL_OVERLOAD, "--json", f"--plot={plot}")
    )
    assert data["passed"] is True
    assert {check["name"] for check in data["checks"]} == {
        "batch_pauses_first",
        "over_share_429_before_standard_queues",
        "standard_shed_after_batch",
        "interactive_inside_guarantee_never_shed",
    }
    assert [row["tier"] for row in data["tiers"]] == [
        "interactive",
        "standard",
        "batch",
    ]
    for row in data["tiers"]:
        assert set(row) >= {"shed", "rate_limited", "ttft_p95_s"}
    bins = data["bins"]
    assert bins["bin_s"] == 10.0 and len(bins["start_s"]) == 24
    assert set(bins["queued_max"]) == {"interactive", "standard", "batch"}
    assert data["scenario"]["capacity_rps"] == pytest.approx(2 * 2500 / 300)
    assert data["scenario"]["replicas_source"] == "--replicas 2"
    assert plot.read_bytes()[:8] == PNG


def test_overload_drill_fleet_and_capacity_default_to_the_plans(
    tmp_path: Path, small_scenario: tuple[Path, int]
) -> None:
    path, replicas = small_scenario
    text = run(
        "overload_drill",
        "--minutes=2",
        "--warmup-minutes=0.5",
        f"--scenario={path}",
        f"--plot={tmp_path / 'p.png'}",
    )
    source = f"the capacity plan's {replicas} for {path}"
    assert f"{replicas} x a100-8b ({source})" in text
    # x1.0 is the peak the plan sized the region for: 12 requests/s.
    assert "x1.0 = 12.0 req/s" in text


def test_overload_drill_table_prints_steps_bins_and_checks(tmp_path: Path) -> None:
    text = run("overload_drill", *SMALL_OVERLOAD, f"--plot={tmp_path / 'p.png'}")
    assert "Per step and tier" in text and "Per 10 s" in text
    assert "PASS batch_pauses_first" in text and "req/s" in text


def test_capacity_test_json_finds_a_sane_number(tmp_path: Path) -> None:
    plot = tmp_path / "capacity.png"
    data = json.loads(run("capacity_test", *SHORT_CAPACITY, "--json", f"--plot={plot}"))
    assert 2000 <= data["tokens_per_s"] <= 2900
    assert data["scenario"]["prompt_tokens"] == 650
    assert data["criteria"]["ttft_p95_max_s"] == 1.0
    assert any(not step["holds"] for step in data["steps"])
    assert plot.read_bytes()[:8] == PNG


def test_capacity_test_prints_the_steps_and_the_answer(tmp_path: Path) -> None:
    text = run("capacity_test", *SHORT_CAPACITY, f"--plot={tmp_path / 'p.png'}")
    assert "Capacity:" in text and "tok/s" in text and "req/s" in text


def test_capacity_test_needs_sim() -> None:
    with pytest.raises(CommandError, match="--sim"):
        call_command("capacity_test")
