"""The version gates' rules: statuses that take traffic, re-runs, gate settings."""

from __future__ import annotations

import pytest

from models_registry.domain.gates import (
    DEFAULT_THRESHOLDS,
    GATE_ORDER,
    GateKind,
    parse_gate_config,
    rerun_refusal,
    status_for_gate,
    traffic_refusal,
)
from models_registry.domain.identity import VersionStatus


def test_only_ready_and_live_versions_take_traffic() -> None:
    takes = {s for s in VersionStatus if traffic_refusal("m@v2", s) is None}
    assert takes == {VersionStatus.READY, VersionStatus.LIVE}


@pytest.mark.parametrize(
    ("status", "reason", "says"),
    [
        ("registered", "", "m@v2 is registered: its gates have not passed"),
        ("evaluating", "", "m@v2 is still evaluating: it is not ready yet"),
        ("load_testing", "", "m@v2 is still load testing: it is not ready yet"),
        (
            "rejected",
            "eval gate: maths drops 0.3",
            "m@v2 was rejected by its gates: eval gate: maths drops 0.3",
        ),
        ("retired", "", "m@v2 is retired"),
    ],
)
def test_a_refusal_says_why(status: str, reason: str, says: str) -> None:
    assert traffic_refusal("m@v2", status, reason) == says


def test_gates_run_weights_then_eval_then_load_test() -> None:
    assert GATE_ORDER == (GateKind.WEIGHTS, GateKind.EVAL, GateKind.LOAD_TEST)
    assert [status_for_gate(k) for k in GATE_ORDER] == [
        VersionStatus.EVALUATING,
        VersionStatus.EVALUATING,
        VersionStatus.LOAD_TESTING,
    ]


def test_gates_may_run_again_unless_running_live_or_retired() -> None:
    assert rerun_refusal("m@v2", "rejected", running=False) is None
    assert rerun_refusal("m@v2", "ready", running=False) is None
    assert (
        rerun_refusal("m@v2", "ready", running=True) == "the gates of m@v2 are running"
    )
    assert "live" in (rerun_refusal("m@v2", "live", running=False) or "")
    assert "retired" in (rerun_refusal("m@v2", "retired", running=False) or "")


def test_an_empty_gate_config_is_the_defaults() -> None:
    config, problems = parse_gate_config({})
    assert problems == []
    assert config.judge_model == "reason-70b"
    assert dict(config.thresholds) == dict(DEFAULT_THRESHOLDS)
    assert config.min_kappa == 0.6
    assert config.min_labels == 20


def test_a_gate_config_overrides_what_it_names() -> None:
    config, problems = parse_gate_config(
        {
            "judge_model": "",
            "thresholds": {"maths": 0.02},
            "min_kappa": 0.7,
            "load_test": {"start_tokens_per_s": 2000, "duration_s": 20},
        }
    )
    assert problems == []
    assert config.judge_model == ""
    assert config.thresholds["maths"] == 0.02
    assert config.thresholds["reasoning"] == DEFAULT_THRESHOLDS["reasoning"]
    assert config.min_kappa == 0.7
    assert dict(config.load_test) == {"start_tokens_per_s": 2000.0, "duration_s": 20.0}


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ([], "gate_config: must be a JSON object"),
        ({"judge": "x"}, "judge: unknown setting"),
        ({"judge_model": "Not A Name"}, "judge_model: must be a model name"),
        ({"thresholds": {"poetry": 0.1}}, "thresholds: 'poetry' is not a category"),
        (
            {"thresholds": {"maths": 1.5}},
            "thresholds: maths must be a number in [0, 1)",
        ),
        ({"thresholds": {"maths": True}}, "thresholds: maths must be a number"),
        ({"thresholds": []}, "thresholds: must map categories to numbers"),
        ({"min_kappa": 2}, "min_kappa: must be a number in [-1, 1]"),
        ({"min_labels": 1}, "min_labels: must be a whole number of at least 2"),
        ({"min_labels": 2.5}, "min_labels: must be a whole number"),
        ({"load_test": {"rps": 1}}, "load_test: 'rps' is not a load-test setting"),
        (
            {"load_test": {"duration_s": -1}},
            "load_test: duration_s must be a positive number",
        ),
        (
            {"load_test": {"duration_s": float("nan")}},
            "duration_s must be a positive number",
        ),
        ({"eval_set_uri": 3}, "eval_set_uri: must be a string"),
    ],
)
def test_a_bad_gate_config_names_the_field(raw: object, problem: str) -> None:
    _, problems = parse_gate_config(raw)
    assert any(problem in p for p in problems), problems
