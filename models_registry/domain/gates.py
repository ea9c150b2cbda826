"""The version gates' rules: their order, the statuses they move a version through,
which statuses may take traffic, and a model's gate settings.

Public surface: ``GateKind``, ``GATE_ORDER``, ``GateState``, ``RegionState``,
``TRAFFIC_STATUSES``, ``traffic_refusal``, ``rerun_refusal``, ``status_for_gate``,
``GateConfig``, ``parse_gate_config``, ``DEFAULT_JUDGE_MODEL``,
``DEFAULT_THRESHOLDS``.

Pure: no Django, no I/O.

A version moves ``registered -> evaluating -> load_testing -> ready``, or to
``rejected`` with the reason as soon as one gate fails; ``live`` while the alias
points at it and ``retired`` later. The gates run in ``GATE_ORDER``: the weights are
copied to every region and verified first (nothing can be served, evaluated or
load-tested from weights that are not there), then the eval gate, then the
load-test gate. Only ``ready`` and ``live`` versions take alias, canary or shadow
traffic (``traffic_refusal``); an admin may override that for one change, and the
override is recorded with who and why.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from models_registry.domain.embedding_eval import DEFAULT_MIN_RETRIEVAL_ACCURACY
from models_registry.domain.eval_gate import CATEGORIES
from models_registry.domain.identity import VersionStatus, is_valid_model_name

__all__ = [
    "DEFAULT_JUDGE_MODEL",
    "DEFAULT_THRESHOLDS",
    "GATE_ORDER",
    "GATING_STATUSES",
    "TRAFFIC_STATUSES",
    "GateConfig",
    "GateKind",
    "GateState",
    "RegionState",
    "parse_gate_config",
    "rerun_refusal",
    "status_for_gate",
    "traffic_refusal",
]


class GateKind(enum.StrEnum):
    """One gate a version must pass."""

    WEIGHTS = "weights"
    EVAL = "eval"
    LOAD_TEST = "load_test"


GATE_ORDER: tuple[GateKind, ...] = (GateKind.WEIGHTS, GateKind.EVAL, GateKind.LOAD_TEST)


class GateState(enum.StrEnum):
    """Where one gate of one attempt is."""

    PENDING = "pending"
    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"  # an earlier gate failed


class RegionState(enum.StrEnum):
    """Whether a region's copy of a version's weights can be served from."""

    COPYING = "copying"
    READY = "ready"
    FAILED = "failed"


TRAFFIC_STATUSES = frozenset({VersionStatus.READY, VersionStatus.LIVE})
# The statuses the gates move a version between; any other (ready by an admin's
# acceptance, live by an override) is not theirs to change.
GATING_STATUSES = frozenset(
    {VersionStatus.REGISTERED, VersionStatus.EVALUATING, VersionStatus.LOAD_TESTING}
)

# The status a version shows while a gate runs.
_RUNNING_STATUS = {
    GateKind.WEIGHTS: VersionStatus.EVALUATING,
    GateKind.EVAL: VersionStatus.EVALUATING,
    GateKind.LOAD_TEST: VersionStatus.LOAD_TESTING,
}


def status_for_gate(kind: GateKind) -> VersionStatus:
    """Return the version's status while gate ``kind`` runs."""
    return _RUNNING_STATUS[kind]


def traffic_refusal(ref: str, status: str, reason: str = "") -> str | None:
    """Return why version ``ref`` may not take traffic, or None when it may.

    ``reason`` is the version's stored status reason (why it was rejected).
    """
    if status in TRAFFIC_STATUSES:
        return None
    if status == VersionStatus.REJECTED:
        why = f": {reason}" if reason else ""
        return f"{ref} was rejected by its gates{why}"
    if status == VersionStatus.RETIRED:
        return f"{ref} is retired"
    if status in {VersionStatus.EVALUATING, VersionStatus.LOAD_TESTING}:
        return f"{ref} is still {status.replace('_', ' ')}: it is not ready yet"
    return f"{ref} is {status}: its gates have not passed"


def rerun_refusal(ref: str, status: str, *, running: bool) -> str | None:
    """Return why the gates of ``ref`` may not run again now, or None."""
    if running:
        return f"the gates of {ref} are running"
    if status == VersionStatus.LIVE:
        return f"{ref} is live; gate a new version instead"
    if status == VersionStatus.RETIRED:
        return f"{ref} is retired"
    return None


DEFAULT_JUDGE_MODEL = "reason-70b"
# The largest drop of a category's mean score, candidate minus live, that the gate
# accepts (the CI's low end must stay above -threshold). 0.05 is five points of
# accuracy: what a precision change may cost before a team notices (the seed: "no
# real drop").
DEFAULT_THRESHOLDS: Mapping[str, float] = dict.fromkeys(CATEGORIES, 0.05)


@dataclass(frozen=True, slots=True)
class GateConfig:
    """A model's gate settings (``Model.gate_config``), with the defaults.

    ``eval_set_uri`` empty means the platform's default set
    (``PLATFORM_DEFAULT_EVAL_SET``); ``judge_model`` empty means no judge (task
    metrics only). ``load_test`` overrides the load-test gate's step settings
    (``start_tokens_per_s``, ``step_tokens_per_s``, ``max_tokens_per_s``,
    ``warmup_s``, ``duration_s``, ``drain_s``, ``stop_after_failures``), as
    positive numbers. An embedding model's gates read ``min_retrieval_accuracy``
    (the share of retrieval probes its eval must pass) and
    ``embedding_normalized`` (whether its vectors must be of unit length), and of
    ``load_test`` only ``warmup_s``, ``duration_s`` and ``stop_after_failures``.
    """

    eval_set_uri: str = ""
    judge_model: str = DEFAULT_JUDGE_MODEL
    thresholds: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_THRESHOLDS)
    )
    min_kappa: float = 0.6
    min_labels: int = 20
    load_test: Mapping[str, float] = field(default_factory=dict)
    min_retrieval_accuracy: float = DEFAULT_MIN_RETRIEVAL_ACCURACY
    embedding_normalized: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {
            "eval_set_uri": self.eval_set_uri,
            "judge_model": self.judge_model,
            "thresholds": dict(self.thresholds),
            "min_kappa": self.min_kappa,
            "min_labels": self.min_labels,
            "load_test": dict(self.load_test),
            "min_retrieval_accuracy": self.min_retrieval_accuracy,
            "embedding_normalized": self.embedding_normalized,
        }


LOAD_TEST_KEYS = frozenset(
    {
        "start_tokens_per_s",
        "step_tokens_per_s",
        "max_tokens_per_s",
        "warmup_s",
        "duration_s",
        "drain_s",
        "stop_after_failures",
    }
)
_KEYS = frozenset(
    {"eval_set_uri", "judge_model", "thresholds", "min_kappa", "min_labels"}
    | {"load_test", "min_retrieval_accuracy", "embedding_normalized"}
)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def parse_gate_config(raw: object) -> tuple[GateConfig, list[str]]:
    """Return the settings in ``raw`` (a JSON object) over the defaults, and the
    problems found as ``"field: why"`` strings (the config is unusable if any)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return GateConfig(), ["gate_config: must be a JSON object"]
    problems = [f"{key}: unknown setting" for key in sorted(set(raw) - _KEYS)]
    base = GateConfig()
    eval_set_uri = raw.get("eval_set_uri", base.eval_set_uri)
    if not isinstance(eval_set_uri, str):
        problems.append("eval_set_uri: must be a string")
        eval_set_uri = ""
    judge = raw.get("judge_model", base.judge_model)
    if judge is None:
        judge = ""
    if not isinstance(judge, str) or (judge and not is_valid_model_name(judge)):
        problems.append("judge_model: must be a model name, or empty for no judge")
        judge = base.judge_model
    thresholds = dict(base.thresholds)
    given = raw.get("thresholds", {})
    if not isinstance(given, dict):
        problems.append("thresholds: must map categories to numbers")
        given = {}
    for category, value in given.items():
        number = _number(value)
        if category not in thresholds:
            problems.append(
                f"thresholds: {category!r} is not a category ({', '.join(CATEGORIES)})"
            )
        elif number is None or not 0.0 <= number < 1.0:
            problems.append(f"thresholds: {category} must be a number in [0, 1)")
        else:
            thresholds[category] = number
    kappa = _number(raw.get("min_kappa", base.min_kappa))
    if kappa is None or not -1.0 <= kappa <= 1.0:
        problems.append("min_kappa: must be a number in [-1, 1]")
        kappa = base.min_kappa
    labels = raw.get("min_labels", base.min_labels)
    if isinstance(labels, bool) or not isinstance(labels, int) or labels < 2:
        problems.append("min_labels: must be a whole number of at least 2")
        labels = base.min_labels
    load_test: dict[str, float] = {}
    given_lt = raw.get("load_test", {})
    if not isinstance(given_lt, dict):
        problems.append("load_test: must be a JSON object")
        given_lt = {}
    for key, value in given_lt.items():
        number = _number(value)
        if key not in LOAD_TEST_KEYS:
            problems.append(f"load_test: {key!r} is not a load-test setting")
        elif number is None or number <= 0:
            problems.append(f"load_test: {key} must be a positive number")
        else:
            load_test[key] = number
    accuracy = _number(raw.get("min_retrieval_accuracy", base.min_retrieval_accuracy))
    if accuracy is None or not 0.0 < accuracy <= 1.0:
        problems.append("min_retrieval_accuracy: must be a number in (0, 1]")
        accuracy = base.min_retrieval_accuracy
    normalized = raw.get("embedding_normalized", base.embedding_normalized)
    if not isinstance(normalized, bool):
        problems.append("embedding_normalized: must be true or false")
        normalized = base.embedding_normalized
    config = GateConfig(
        eval_set_uri=eval_set_uri,
        judge_model=judge,
        thresholds=thresholds,
        min_kappa=kappa,
        min_labels=labels,
        load_test=load_test,
        min_retrieval_accuracy=accuracy,
        embedding_normalized=normalized,
    )
    return config, problems
