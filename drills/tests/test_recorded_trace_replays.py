"""A recorded-shaped trace: generated, replayed by the load-test gate (side by side
with the synthetic one) and scaled for the fleet simulator."""

from __future__ import annotations

from dataclasses import replace
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from drills.domain.capacity_test import read_replay_trace
from drills.domain.recorded_trace import scale_trace, trace_hit_rate, trace_workload
from drills.domain.workload import read_trace, trace_arrivals
from drills.management.commands.make_recorded_trace import DEFAULT_OUT
from localrun.processes import ROOT

SHIPPED = ROOT / DEFAULT_OUT
SYNTHETIC = ROOT / "platform/traces/chat-650-250.jsonl"


def run(name: str, *args: str) -> str:
    out = StringIO()
    call_command(name, *args, stdout=out)
    return out.getvalue()


def test_make_recorded_trace_writes_the_shipped_trace_byte_for_byte(
    tmp_path: Path,
) -> None:
    out = tmp_path / "recorded.jsonl"
    text = run("make_recorded_trace", f"--out={out}")
    assert out.read_bytes() == SHIPPED.read_bytes()
    assert "generated from the drill's workload, not live traffic" in text


def test_the_shipped_recorded_trace_has_production_like_sharing() -> None:
    trace = read_trace(SHIPPED)
    assert all(r.prefix_blocks and r.block_size == 16 for r in trace)
    hit = trace_hit_rate(trace)
    assert hit is not None and 0.6 < hit < 0.9
    # The synthetic trace, counted the same way on its text, shares little.
    synthetic = trace_hit_rate(read_trace(SYNTHETIC))
    assert synthetic is not None and synthetic < 0.2


def test_the_gate_keeps_a_recorded_trace_s_shared_prefixes_and_history() -> None:
    replay = read_replay_trace(SHIPPED)
    # The tag goes after the blocks conversations share, not at the start.
    assert sum(r.tag_at > 0 for r in replay) > len(replay) // 2
    assert sum(r.preamble_tokens >= 16 for r in replay) > len(replay) // 2
    later = [r for r in replay if not r.starts_stream]
    assert len(later) > len(replay) // 3
    assert all(0 < r.history_tokens < r.prompt_tokens for r in later)


def test_capacity_test_prints_a_recorded_and_the_synthetic_trace_side_by_side(
    tmp_path: Path,
) -> None:
    text = run(
        "capacity_test",
        "--sim",
        f"--trace={SHIPPED}",
        f"--versus={SYNTHETIC}",
        "--rates=2,4",
        "--step-seconds=30",
        "--warmup-seconds=10",
        f"--plot={tmp_path / 'plot.png'}",
    )
    assert "side by side: A recorded-generated-chat.jsonl" in text
    rows = [
        line for line in text.splitlines() if line.strip().startswith(("500", "1,000"))
    ]
    assert len(rows) == 2
    hits = [float(part.rstrip("%")) for part in rows[0].split("|")[2].split()]
    assert hits[0] > 30 > hits[1]  # recorded shares prefixes, synthetic little
    assert "Capacity A:" in text and "Capacity B:" in text
    with pytest.raises(CommandError, match="give --trace as well"):
        run("capacity_test", "--sim", f"--versus={SYNTHETIC}")


def test_scaling_clones_conversations_keeping_shared_blocks_shared() -> None:
    trace = read_trace(SHIPPED)
    doubled = scale_trace(trace, 2.0, seed=1)
    assert len(doubled) == 2 * len(trace)
    assert len({r.conversation for r in doubled}) == 2 * len(
        {r.conversation for r in trace}
    )
    shared = {b for r in trace for b in r.prefix_blocks}
    clones = [r for r in doubled if "~" in r.conversation]
    # A clone's first block is its shared prefix's (the same hash), its own
    # history re-hashed: nothing of a clone's own lies in the original trace.
    assert all(r.prefix_blocks[0] in shared for r in clones)
    assert any(b not in shared for r in clones for b in r.prefix_blocks)
    hit, doubled_hit = trace_hit_rate(trace), trace_hit_rate(doubled)
    assert hit is not None and doubled_hit is not None
    assert abs(doubled_hit - hit) < 0.05  # the prefix structure is kept
    half = scale_trace(trace, 0.5, seed=1)
    assert 0.35 * len(trace) < len(half) < 0.65 * len(trace)
    with pytest.raises(ValueError, match="must be positive"):
        scale_trace(trace, 0.0)


def test_capacity_plan_takes_its_workload_from_a_trace() -> None:
    trace = read_trace(SHIPPED)
    text = run("capacity_plan", f"--trace={SHIPPED}", "--trace-rate-scale=20")
    mean_prompt = sum(r.prompt_tokens for r in trace) / len(trace)
    assert f"prompt tokens      {mean_prompt:,.0f} mean" in text
    assert "busiest minute x 20" in text
    assert "none recorded (a generated trace)" in text
    header = next(
        line for line in text.splitlines() if line.startswith("Capacity plan")
    )
    assert f"prompt_tokens={round(mean_prompt, 1):g}" in header
    assert "answer_tokens=250" in header
    with pytest.raises(CommandError, match="cannot read trace"):
        run("capacity_plan", "--trace=/nonexistent.jsonl")


def test_a_trace_with_recorded_hits_sets_the_plan_s_hit_rate() -> None:
    trace = read_trace(SHIPPED)
    workload = trace_workload(trace)
    assert workload.measured_hit_rate is None
    # Half of every cacheable prefix served: the measured rate is about 0.5.
    halves = [
        replace(r, cached_tokens=a.history_tokens // 2)
        for r, a in zip(trace, trace_arrivals(trace), strict=True)
    ]
    measured = trace_workload(halves).measured_hit_rate
    assert measured is not None and 0.45 < measured < 0.51
    assert trace_workload(trace, rate_scale=2).peak_rps == 2 * workload.peak_rps
    assert "prefix_hit_rate" in trace_workload(halves).scenario_values(30)


def test_fleet_drills_replay_a_trace_scaled(tmp_path: Path) -> None:
    text = run(
        "routing_ab",
        f"--trace={SHIPPED}",
        "--trace-rate-scale=2",
        "--replicas=2",
        "--policies=prefix_affinity",
        "--minutes=1",
        "--warmup-minutes=0",
        f"--plot={tmp_path / 'ab.png'}",
    )
    assert "1,170 requests" in text
    with pytest.raises(CommandError, match="not a multiple"):
        run("routing_ab", f"--trace={SHIPPED}", "--block-size=24", "--replicas=1")
    text = run(
        "autoscaling_drill",
        "--sim",
        f"--trace={SHIPPED}",
        "--fleets=plan,warm",
        "--plan-replicas=2",
    )
    rows = [
        line.split() for line in text.splitlines() if line.startswith(("plan", "warm"))
    ]
    assert [row[0] for row in rows] == ["plan", "warm"]
    assert rows[0][1] == rows[0][2] == "2"  # the plan's fleet is pinned
    assert all(row[6].endswith("%") and float(row[6][:-1]) > 30 for row in rows)


def test_make_recorded_trace_splits_conversations_between_teams(
    tmp_path: Path,
) -> None:
    out = tmp_path / "teams.jsonl"
    text = run(
        "make_recorded_trace",
        f"--out={out}",
        "--duration-s=60",
        "--teams=chat:interactive:3,tools:standard:1",
    )
    trace = read_trace(out)
    tiers = {r.tier for r in trace}
    assert tiers == {"interactive", "standard"}
    interactive = sum(r.tier == "interactive" for r in trace)
    assert 0.6 < interactive / len(trace) < 0.9  # three to one, drawn
    assert f"interactive {interactive}" in text
    # Every turn of a conversation is its team's, and a team is one hashed id.
    by_conversation: dict[str, set[tuple[str, str]]] = {}
    for r in trace:
        by_conversation.setdefault(r.conversation, set()).add((r.team, r.tier))
    assert all(len(teams) == 1 for teams in by_conversation.values())
    assert len({r.team for r in trace}) == 2
    assert not {r.team for r in trace} & {"chat", "tools"}  # hashed


@pytest.mark.parametrize(
    ("teams", "message"),
    [
        ("chat:vip:1", "not a valid Tier"),
        ("chat:interactive", "NAME:TIER:WEIGHT"),
        ("chat:interactive:0", "weight must be positive"),
        ("a:standard:1,a:batch:1", "each team once"),
        (":standard:1", "needs a name"),
    ],
)
def test_make_recorded_trace_names_a_bad_team(
    tmp_path: Path, teams: str, message: str
) -> None:
    with pytest.raises(CommandError, match=message):
        run("make_recorded_trace", f"--out={tmp_path / 't.jsonl'}", f"--teams={teams}")
