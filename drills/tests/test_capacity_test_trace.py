"""The load-test gate's trace: ``make_load_trace`` writes the shipped file, and
``capacity_test --sim --trace`` replays it."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from drills.domain.capacity_test import read_replay_trace
from drills.management.commands.make_load_trace import (
    DEFAULT_OUT,
    TraceShape,
    build_trace,
    trace_figures,
)
from localrun.processes import ROOT

SHIPPED = ROOT / DEFAULT_OUT


def run(name: str, *args: str) -> str:
    out = StringIO()
    call_command(name, *args, stdout=out)
    return out.getvalue()


def test_make_load_trace_writes_the_shipped_trace_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    text = run("make_load_trace", f"--out={out}")
    assert out.read_bytes() == SHIPPED.read_bytes()
    assert "640 requests" in text and "mean prompt 650.0 tokens" in text


def test_the_shipped_trace_has_the_calibration_shape_with_shared_prefixes() -> None:
    lines = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    figures = trace_figures(lines)
    assert figures["requests"] == 640
    assert abs(figures["mean_prompt_tokens"] - 650) < 1
    assert {line["max_tokens"] for line in lines} == {250}
    assert 0.05 < figures["later_turn_share"] < 0.12
    # The system prompt's block and later turns' previous prompts, about 9%.
    assert 0.07 < figures["shared_prefix_share"] < 0.12
    assert SHIPPED.stat().st_size < 2_000_000
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)


def test_a_later_turn_carries_its_conversation_as_logged() -> None:
    trace = read_replay_trace(SHIPPED)
    later = next(r for r in trace if not r.starts_stream)
    first = next(
        r for r in trace if r.conversation == later.conversation and r.starts_stream
    )
    assert later.messages[: len(first.messages)] == first.messages
    assert later.history_tokens == first.prompt_tokens
    assert [m["role"] for m in later.messages[-3:]] == ["user", "assistant", "user"]


def test_build_trace_depends_on_its_seed() -> None:
    small = TraceShape(requests=40)
    assert build_trace(small) == build_trace(small)
    assert build_trace(small) != build_trace(TraceShape(requests=40, seed=1))


def test_make_load_trace_refuses_an_impossible_shape(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="too small"):
        run("make_load_trace", f"--out={tmp_path / 't.jsonl'}", "--prompt-tokens=30")


def test_capacity_test_replays_a_trace(tmp_path: Path) -> None:
    data = json.loads(
        run(
            "capacity_test",
            "--sim",
            f"--trace={SHIPPED}",
            "--rates=9.5,11",
            "--step-seconds=40",
            "--warmup-seconds=10",
            "--drain-seconds=30",
            "--json",
            f"--plot={tmp_path / 'p.png'}",
        )
    )
    assert data["scenario"]["trace_requests"] == 640
    assert data["scenario"]["block_size"] == 16
    assert [step["holds"] for step in data["steps"]] == [True, False]
    assert 2_200 < data["tokens_per_s"] < 2_600
    assert 0.05 < data["steps"][0]["prefix_hit_rate"] < 0.10


def test_capacity_test_names_a_trace_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="cannot read trace"):
        run("capacity_test", "--sim", f"--trace={tmp_path / 'missing.jsonl'}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "max_tokens": 5}\n')
    with pytest.raises(CommandError, match="trace line 1"):
        run("capacity_test", "--sim", f"--trace={bad}")
