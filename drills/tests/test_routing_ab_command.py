"""``manage.py routing_ab``: the table, the JSON and the plot."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from drills.domain.cache_sweep import plan_scenario_for
from drills.domain.capacity_plan import plan
from drills.domain.fleet_config import FleetConfig
from drills.domain.workload import ChatWorkload


def test_json_has_one_row_per_policy_and_writes_the_plot(tmp_path: Path) -> None:
    out = StringIO()
    plot = tmp_path / "ab.png"
    call_command(
        "routing_ab",
        "--replicas=3",
        "--minutes=1",
        "--warmup-minutes=0.5",
        "--rate=12",
        "--json",
        f"--plot={plot}",
        stdout=out,
    )
    data = json.loads(out.getvalue())
    assert [row["policy"] for row in data["policies"]] == [
        "round_robin",
        "least_tokens",
        "prefix_affinity",
        "cache_aware",
    ]
    for row in data["policies"]:
        assert set(row) >= {
            "prefix_hit_rate",
            "ttft_p95_s",
            "imbalance_mean",
            "imbalance_peak",
            "uncached_prefill_tokens_per_s",
        }
    assert data["scenario"]["replicas"] == 3
    assert data["scenario"]["replicas_source"] == "--replicas 3"
    assert data["scenario"]["arrival_rate"] == 12
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cache_aware_finds_more_shared_prefixes_than_affinity(tmp_path: Path) -> None:
    """GIVEN 16 shared prefixes over 3 replicas, mostly first turns
    WHEN the four policies replay the same minute
    THEN cache-aware routing sends a prompt where its prefix already is, so it
    hits more than conversation affinity, which computes each prefix once per
    replica its conversations hash to (measured: 6-8 points over seeds 0-2)."""
    out = StringIO()
    call_command(
        "routing_ab",
        "--workload=shared",
        "--replicas=3",
        "--rate=6",
        "--minutes=1",
        "--warmup-minutes=0",
        "--json",
        f"--plot={tmp_path / 'shared.png'}",
        stdout=out,
    )
    data = json.loads(out.getvalue())
    rows = {row["policy"]: row for row in data["policies"]}
    assert list(rows) == [
        "round_robin",
        "least_tokens",
        "prefix_affinity",
        "cache_aware",
    ]
    assert data["scenario"]["workload"] == "shared"
    assert data["scenario"]["shared_prefixes"] == 16
    assert (
        rows["cache_aware"]["prefix_hit_rate"]
        > rows["prefix_affinity"]["prefix_hit_rate"] + 0.03
    )
    assert all(row["unfinished"] == 0 for row in rows.values())


def test_the_fleet_defaults_to_the_plans_for_the_replayed_workload(
    tmp_path: Path,
) -> None:
    # One region carries the whole 12 requests/s (the seed's regions_lost): the
    # plan sizes it for the seed's chat at that rate, not at 12 replicas.
    capacity = plan(plan_scenario_for(ChatWorkload(arrival_rate=12.0), FleetConfig()))
    replicas = capacity["chat_replicas_per_region_with_prefill"]
    out = StringIO()
    call_command(
        "routing_ab",
        "--minutes=0.5",
        "--warmup-minutes=0",
        "--rate=12",
        "--policies=round_robin",
        "--json",
        f"--plot={tmp_path / 'p.png'}",
        stdout=out,
    )
    scenario = json.loads(out.getvalue())["scenario"]
    assert scenario["replicas"] == replicas != 12
    assert scenario["replicas_source"] == (
        f"the capacity plan's {replicas} for the seed workload at 12 req/s"
    )


def test_table_names_units(tmp_path: Path) -> None:
    out = StringIO()
    call_command(
        "routing_ab",
        "--replicas=2",
        "--minutes=0.5",
        "--warmup-minutes=0",
        "--rate=5",
        f"--plot={tmp_path / 'p.png'}",
        stdout=out,
    )
    text = out.getvalue()
    assert "prefix_affinity" in text and "tokens/s" in text and "hit rate" in text


def test_a_missing_trace_is_a_command_error(tmp_path: Path) -> None:
    with pytest.raises(CommandError):
        call_command("routing_ab", f"--trace={tmp_path / 'none.jsonl'}")


def test_a_malformed_trace_is_a_command_error_naming_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"t": 0, "prompt_tokens": null, "max_tokens": 5}\n')
    with pytest.raises(CommandError, match="trace line 1"):
        call_command("routing_ab", f"--trace={trace}")


def test_cache_sweep_json_has_a_point_per_fleet_and_offload(tmp_path: Path) -> None:
    out = StringIO()
    plot = tmp_path / "sweep.png"
    call_command(
        "routing_ab",
        "--sweep-replicas=2,3",
        "--sweep-offload=0,8",
        "--minutes=1",
        "--warmup-minutes=0.5",
        "--rate=12",
        "--json",
        f"--plot={plot}",
        stdout=out,
    )
    data = json.loads(out.getvalue())
    points = data["points"]
    assert [(p["replicas"], p["host_offload_gib"]) for p in points] == [
        (2, 0),
        (2, 8),
        (3, 0),
        (3, 8),
    ]
    for point in points:
        assert point["prefix_hit_rate"] is not None
        assert isinstance(point["carried"], bool)
        # No offload, no host hits; the plan's estimate rides along.
        if point["host_offload_gib"] == 0:
            assert point["host_hit_rate"] == 0
        assert "plan_step_ms" in point
    assert set(data["plan"]) == {"0", "8"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cache_sweep_refuses_an_empty_fleet(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="at least one replica"):
        call_command(
            "routing_ab",
            "--sweep-replicas=0,2",
            f"--plot={tmp_path / 'p.png'}",
            stdout=StringIO(),
        )


def test_cache_sweep_refuses_bad_lists(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="comma-separated numbers"):
        call_command(
            "routing_ab",
            "--sweep-replicas=two",
            f"--plot={tmp_path / 'p.png'}",
            stdout=StringIO(),
        )


def test_compare_engines_replays_one_workload_on_both_caches(tmp_path: Path) -> None:
    """GIVEN a small fleet and two routing policies
    WHEN routing_ab runs with --compare-engines
    THEN the JSON has a row per engine and policy, vLLM's first, both engines saw
    the same requests, SGLang's hit rate is counted to the token (its two hit rates
    agree) and the table names both engines."""
    out = StringIO()
    plot = tmp_path / "engines.png"
    args = (
        "routing_ab",
        "--compare-engines",
        "--policies=round_robin,prefix_affinity",
        "--block-size=16",
        "--replicas=3",
        "--minutes=1",
        "--warmup-minutes=0.5",
        "--rate=12",
        f"--plot={plot}",
    )
    call_command(*args, "--json", stdout=out)
    data = json.loads(out.getvalue())
    rows = data["policies"]
    assert [(r["engine"], r["policy"]) for r in rows] == [
        ("vllm", "round_robin"),
        ("vllm", "prefix_affinity"),
        ("sglang", "round_robin"),
        ("sglang", "prefix_affinity"),
    ]
    assert rows[0]["requests"] == rows[2]["requests"] > 0
    assert rows[1]["requests"] == rows[3]["requests"]
    for row in rows[2:]:
        assert row["history_hit_rate"] == pytest.approx(row["prefix_hit_rate"])
    assert rows[3]["history_hit_rate"] >= rows[1]["history_hit_rate"] - 0.02
    assert data["scenario"]["engines"] == ["vllm", "sglang"]
    assert data["scenario"]["block_size"] == 16
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = StringIO()
    call_command(*args, "--policies=prefix_affinity", stdout=table)
    text = table.getvalue()
    assert "sglang radix cache" in text and "vllm 16-token blocks" in text
    assert "hist hits" in text


def test_engine_sglang_refuses_the_host_tier(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="hierarchical"):
        call_command(
            "routing_ab",
            "--engine=sglang",
            "--host-offload-gib=8",
            f"--plot={tmp_path / 'p.png'}",
            stdout=StringIO(),
        )
    with pytest.raises(CommandError, match="hierarchical"):
        call_command(
            "routing_ab",
            "--compare-engines",
            "--host-offload-gib=8",
            f"--plot={tmp_path / 'p.png'}",
            stdout=StringIO(),
        )


def test_an_unknown_policy_is_a_command_error(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="expected some of"):
        call_command(
            "routing_ab",
            "--policies=prefix_affinity,random",
            f"--plot={tmp_path / 'p.png'}",
            stdout=StringIO(),
        )
