"""The pure parts of ``bench/embeddings.py``: the summary's medians, the gateway's
share of direct's throughput and issue 36's check, on made-up runs (no
processes started), and its skip where real vLLM or MiniLM is missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import embeddings


def run(target: str, level: int, repeat: int, tokens_per_s: float) -> dict[str, Any]:
    return {
        "target": target,
        "concurrency": level,
        "repeat": repeat,
        "input_tokens_per_s": tokens_per_s,
        "requests_per_s": tokens_per_s / 300,
        "p50_ms": 100.0,
        "p95_ms": 150.0,
        "errors": {},
        "gateway_cpu_s_per_1k_requests": 20.0 if target == "gateway" else None,
    }


def test_the_share_is_of_the_medians_and_of_the_pairs() -> None:
    # Repeat 1 is slow for both targets (a busy box): the pairs see 0.9, 0.95
    # and 0.96; the medians 3000 over 3100.
    runs = [
        run("direct", 32, 0, 3000.0),
        run("gateway", 32, 0, 2700.0),
        run("direct", 32, 1, 2000.0),
        run("gateway", 32, 1, 1900.0),
        run("direct", 32, 2, 3100.0),
        run("gateway", 32, 2, 2976.0),
    ]
    summary = embeddings.summarize(runs, [32])
    overhead = summary["32"]["overhead"]
    assert overhead["throughput_share"] == round(2700.0 / 3000.0, 3)
    assert overhead["throughput_share_paired"] == 0.95
    assert overhead["throughput_ratio"] == round(3000.0 / 2700.0, 3)
    check = embeddings.checks(summary)["gateway_share_at_32_at_least_0.95"]
    assert check == {"share": 0.9, "paired": 0.95, "ok": False}


def test_the_check_passes_at_95_percent_and_is_null_without_32_clients() -> None:
    runs = [run("direct", 32, 0, 1000.0), run("gateway", 32, 0, 950.0)]
    check = embeddings.checks(embeddings.summarize(runs, [32]))
    assert check["gateway_share_at_32_at_least_0.95"]["ok"] is True
    other = [run("direct", 16, 0, 1000.0), run("gateway", 16, 0, 500.0)]
    summary = embeddings.summarize(other, [16])
    assert embeddings.checks(summary)["gateway_share_at_32_at_least_0.95"] == {
        "share": None,
        "paired": None,
        "ok": None,
    }
    # A repeat with one target only (interrupted) pairs with nothing.
    assert embeddings._pairs([run("direct", 16, 1, 1000.0), *other], 16) == [
        (other[0], other[1])
    ]


def test_the_vllm_engine_skips_without_minilm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(embeddings, "unavailable_reason", lambda: None)
    monkeypatch.setattr(embeddings, "MINILM_MODEL", tmp_path / "minilm")
    assert "make minilm" in str(embeddings.skip_reason("vllm"))
    assert embeddings.skip_reason("sim") is None
    (tmp_path / "minilm").mkdir()
    (tmp_path / "minilm" / "config.json").write_text("{}")
    assert embeddings.skip_reason("vllm") is None
    monkeypatch.setattr(embeddings, "unavailable_reason", lambda: "no .vllm")
    assert embeddings.skip_reason("vllm") == "no .vllm"
