"""``manage.py embedding_drill`` at a small scale: the autoscaler sizes an embedding
pool on input tokens/s through a RAG ingestion burst; JSON, table and plot."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from drills.domain.embedding_drill import EmbeddingScenario, run_embedding_drill
from simengine.domain.embedding_perf import EMBEDDING_PROFILES

PNG = b"\x89PNG\r\n\x1a\n"
# 12 ingestion requests/s of 32 x 256 tokens: 98,304 input tokens/s, two
# replicas at 70% of 80,000 each.
SMALL = (
    "--duration=1200",
    "--burst-at=120",
    "--burst=480",
    "--ingest-rps=12",
    "--query-rps=5",
)


def run(*args: str) -> str:
    out = StringIO()
    call_command("embedding_drill", *args, stdout=out)
    return out.getvalue()


def test_embedding_drill_json_scales_up_on_the_burst_and_back(tmp_path: Path) -> None:
    plot = tmp_path / "embedding.png"
    data = json.loads(run(*SMALL, "--json", f"--plot={plot}"))

    assert data["passed"] is True, data["checks"]
    assert data["scenario"]["needed_at_burst"] == 2
    decisions = data["decisions"]
    ups = [d for d in decisions if d["to"] > d["from"]]
    downs = [d for d in decisions if d["to"] < d["from"]]
    assert ups and all(120 <= d["at"] < 600 for d in ups)
    assert ups[0]["admitted_tokens_per_s"] > 50_000  # sized on the burst's rate
    assert downs and downs[-1]["to"] == 1
    assert all(d["reason"] == "scale_down" and d["at"] >= 600 for d in downs)
    assert data["peak_desired"] >= 2 and data["back_to_floor_s"] is not None
    assert data["gpu_hours"] < data["fixed_gpu_hours"]
    assert {c["name"] for c in data["checks"]} >= {
        "measures_input_tokens_per_s",
        "settles_between_the_thresholds",
    }
    assert plot.read_bytes()[:8] == PNG


def test_embedding_drill_table_names_its_units_and_checks(tmp_path: Path) -> None:
    text = run(*SMALL, f"--plot={tmp_path / 'e.png'}")

    assert "offered/s" in text and "measured/s" in text and "p95 (s)" in text
    assert "input tokens/s" in text
    assert "decisions:" in text and "scale_down" in text
    assert "measures_input_tokens_per_s" in text


def test_embedding_drill_fails_when_the_region_cannot_hold_the_burst(
    tmp_path: Path,
) -> None:
    # 200 requests/s need 30 replicas; the chat pools leave GPUs for 16.
    with pytest.raises(CommandError, match="targets missed"):
        run(
            "--duration=900",
            "--burst-at=60",
            "--burst=600",
            "--ingest-rps=200",
            "--query-rps=5",
            f"--plot={tmp_path / 'e.png'}",
        )


def test_embedding_drill_is_deterministic_for_a_seed() -> None:
    scenario = EmbeddingScenario(
        duration_s=600.0, burst_at_s=60.0, burst_s=240.0, ingest_rps=12.0
    )
    first, second = run_embedding_drill(scenario), run_embedding_drill(scenario)
    assert first.as_dict() == second.as_dict()
    assert all(
        d.signals["replica_tokens_per_s"] == scenario.replica_tokens_per_s
        for d in first.decisions
    )


def test_embedding_drill_on_the_a100_profile_carries_the_burst_at_its_floor(
    tmp_path: Path,
) -> None:
    """At the A100 estimate one replica carries the seed's burst (60 requests/s
    of 32 x 256 tokens): the pool never leaves its floor, as the capacity plan
    says, and the checks hold."""
    profile = EMBEDDING_PROFILES["a100-minilm"]
    data = json.loads(
        run(
            "--duration=900",
            "--burst-at=120",
            "--burst=480",
            "--embedding-profile=a100-minilm",
            "--json",
            f"--plot={tmp_path / 'e.png'}",
        )
    )
    assert data["passed"] is True, data["checks"]
    assert data["scenario"]["replica_tokens_per_s"] == pytest.approx(
        profile.full_batch_tokens_per_s
    )
    assert data["scenario"]["needed_at_burst"] == 1
    assert data["peak_desired"] == 1
    assert data["decisions"] == []
