"""The judge's agreement with human labels: kappa, its interval, and the floor."""

from __future__ import annotations

import math

import pytest

from models_registry.domain.judge_agreement import (
    estimate_kappa,
    judge_agreement,
    sample_for_labels,
)

C, L, T = "candidate", "live", "tie"


def test_estimate_kappa_matches_the_large_sample_formula_by_hand() -> None:
    # 10 items, 8 agree; each rater says each side 5 times: p_o 0.8, p_e 0.5.
    judge = [C] * 5 + [L] * 5
    human = [C] * 4 + [L] + [L] * 4 + [C]
    est = estimate_kappa(judge, human)
    assert est.n == 10
    assert est.agreed == 8
    assert est.kappa == pytest.approx(0.6)
    se = math.sqrt(0.8 * 0.2 / (10 * 0.5**2))  # 0.2530
    assert est.low == pytest.approx(0.6 - 1.959964 * se, abs=1e-6)
    assert est.high == 1.0  # 1.096 clipped


def test_estimate_kappa_interval_narrows_with_more_labels() -> None:
    judge = [C] * 5 + [L] * 5
    human = [C] * 4 + [L] + [L] * 4 + [C]
    few = estimate_kappa(judge, human)
    many = estimate_kappa(judge * 10, human * 10)
    assert many.kappa == pytest.approx(few.kappa)
    assert many.high - many.low < few.high - few.low
    assert many.low == pytest.approx(0.6 - 1.959964 * math.sqrt(0.064 / 10))


def test_estimate_kappa_one_label_throughout_is_full_but_uncertain() -> None:
    est = estimate_kappa([T, T, T], [T, T, T])
    assert est.kappa == 1.0
    assert (est.low, est.high) == (-1.0, 1.0)


def test_estimate_kappa_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="equally long"):
        estimate_kappa([C], [])
    with pytest.raises(ValueError, match="confidence"):
        estimate_kappa([C], [C], confidence=1.0)


def test_judge_below_its_floor_with_enough_labels_cannot_gate() -> None:
    # 20 labels, 12 agree, balanced sides: kappa 0.2, under the 0.6 floor.
    pairs = [(C, C)] * 6 + [(L, L)] * 6 + [(C, L)] * 4 + [(L, C)] * 4
    agreement = judge_agreement("reason-70b@v1", pairs, min_kappa=0.6, min_labels=20)
    assert agreement.kappa == pytest.approx(0.2)
    assert agreement.decides
    assert not agreement.can_gate
    assert "cannot gate" in agreement.reason
    assert "below its floor 0.60" in agreement.reason
    assert agreement.as_dict()["can_gate"] is False


def test_judge_below_its_floor_with_too_few_labels_does_not_decide() -> None:
    pairs = [(C, C)] * 6 + [(L, L)] * 5 + [(C, L)] * 4 + [(L, C)] * 4
    agreement = judge_agreement("reason-70b@v1", pairs, min_kappa=0.6, min_labels=20)
    assert not agreement.decides
    assert agreement.can_gate  # the eval set's labelled pairs decide instead
    assert "at least 20 are needed" in agreement.reason


def test_judge_at_its_floor_can_gate() -> None:
    pairs = [(C, C)] * 8 + [(L, L)] * 8 + [(C, L)] * 2 + [(L, C)] * 2
    agreement = judge_agreement("j@v1", pairs, min_kappa=0.6, min_labels=20)
    assert agreement.kappa == pytest.approx(0.6)
    assert agreement.can_gate
    assert "agrees with people" in agreement.reason


def test_judge_without_labels_has_no_kappa() -> None:
    agreement = judge_agreement("j@v1", [], min_kappa=0.6, min_labels=20)
    assert agreement.kappa is None
    assert agreement.can_gate
    assert agreement.as_dict()["interval"] is None


def test_judge_agreement_rejects_unknown_labels() -> None:
    with pytest.raises(ValueError, match="one of"):
        judge_agreement("j@v1", [("a", C)], min_kappa=0.6, min_labels=1)


def test_sample_for_labels_is_stable_and_bounded() -> None:
    keys = [f"item-{n}" for n in range(50)]
    first = sample_for_labels(keys, 10, seed="run-1")
    assert first == sample_for_labels(list(reversed(keys)), 10, seed="run-1")
    assert len(set(first)) == 10
    assert first != sample_for_labels(keys, 10, seed="run-2")
    assert sample_for_labels(keys, 0, seed="run-1") == []
    assert sorted(sample_for_labels(keys[:3], 10, seed="x")) == keys[:3]
