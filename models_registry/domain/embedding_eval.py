"""An embedding version's eval gate: retrieval probes and the vectors' shape.

Public surface: ``EmbeddingProbe``, ``parse_probe_set``, ``EmbeddingEvalReport``,
``judge_embeddings``, ``probe_texts``, ``DEFAULT_MIN_RETRIEVAL_ACCURACY``.

A probe set is JSON lines of ``{"id", "query", "related", "unrelated"}``: a
query, a text that answers or restates it, and one about something else. The
version embeds every text once; a probe passes when the query's cosine
similarity to the related text is above its similarity to the unrelated one.
The gate holds when the share of probes passed (retrieval accuracy) reaches the
model's ``min_retrieval_accuracy`` and every vector is sound: as long as the
model's ``dimensions``, every value finite, and of unit length (within 1e-3)
when the model says its vectors are normalized (``embedding_normalized``, on by
default: vLLM's pooling normalizes). A chance-level model scores about 0.5.

Pure: no Django, no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from models_registry.domain.eval_gate import EvalSetError

__all__ = [
    "DEFAULT_MIN_RETRIEVAL_ACCURACY",
    "EmbeddingEvalReport",
    "EmbeddingProbe",
    "judge_embeddings",
    "parse_probe_set",
    "probe_texts",
]

DEFAULT_MIN_RETRIEVAL_ACCURACY = 0.9
_NORM_TOLERANCE = 1e-3
_FIELDS = ("query", "related", "unrelated")


@dataclass(frozen=True, slots=True)
class EmbeddingProbe:
    """A query, a text related to it and one that is not."""

    id: str
    query: str
    related: str
    unrelated: str


def parse_probe_set(lines: Iterable[str], *, source: str) -> list[EmbeddingProbe]:
    """Return the probes of a JSONL probe set (blank lines skipped).

    Raises:
        EvalSetError: a line that is no probe, or a set without probes.
    """
    probes: list[EmbeddingProbe] = []
    seen: set[str] = set()
    number = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalSetError(source, number, f"not JSON ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise EvalSetError(source, number, "not a JSON object")
        probe_id = raw.get("id")
        if not isinstance(probe_id, str) or not probe_id:
            raise EvalSetError(source, number, "id must be a non-empty string")
        if probe_id in seen:
            raise EvalSetError(source, number, f"id {probe_id!r} appears twice")
        seen.add(probe_id)
        texts = [raw.get(name) for name in _FIELDS]
        for name, text in zip(_FIELDS, texts, strict=True):
            if not isinstance(text, str) or not text.strip():
                raise EvalSetError(
                    source,
                    number,
                    f"{name} must be a non-empty string (an embedding probe has "
                    "query, related and unrelated)",
                )
        probes.append(EmbeddingProbe(probe_id, *(str(t) for t in texts)))
    if not probes:
        raise EvalSetError(source, max(number, 1), "the probe set has no probes")
    return probes


def probe_texts(probes: Sequence[EmbeddingProbe]) -> list[str]:
    """Return every text to embed, in order: each probe's query, related, unrelated."""
    return [text for p in probes for text in (p.query, p.related, p.unrelated)]


@dataclass(frozen=True, slots=True)
class EmbeddingEvalReport:
    """What the probes found, and whether the gate holds (``reasons`` if not)."""

    probes: int
    passed_probes: int
    accuracy: float
    min_accuracy: float
    dimensions: int
    shape_problems: tuple[str, ...]
    failed_probes: tuple[str, ...]
    passed: bool
    reasons: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "probes": self.probes,
            "passed_probes": self.passed_probes,
            "retrieval_accuracy": self.accuracy,
            "min_retrieval_accuracy": self.min_accuracy,
            "dimensions": self.dimensions,
            "shape_problems": list(self.shape_problems),
            "failed_probes": list(self.failed_probes),
            "passed": self.passed,
            "reasons": list(self.reasons),
        }


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norms if norms > 0 else 0.0


def _shape_problem(
    vector: Sequence[float], *, dimensions: int, is_normalized: bool
) -> str | None:
    if len(vector) != dimensions:
        return f"a vector has {len(vector)} values, the model's dimensions are {dimensions}"
    if not all(math.isfinite(x) for x in vector):
        return "a vector holds a value that is not finite"
    norm = math.sqrt(sum(x * x for x in vector))
    if is_normalized and abs(norm - 1.0) > _NORM_TOLERANCE:
        return f"a vector's length is {norm:.4f}, not 1 (the model says normalized)"
    return None


def judge_embeddings(
    probes: Sequence[EmbeddingProbe],
    vectors: Mapping[str, Sequence[float]],
    *,
    dimensions: int,
    is_normalized: bool,
    min_accuracy: float,
) -> EmbeddingEvalReport:
    """Return the verdict on ``vectors`` (text -> its vector, every probe text)."""
    problems: list[str] = []
    for text in dict.fromkeys(probe_texts(probes)):
        problem = _shape_problem(
            vectors[text], dimensions=dimensions, is_normalized=is_normalized
        )
        if problem is not None and problem not in problems:
            problems.append(problem)
    failed = []
    if not problems:
        for probe in probes:
            query = vectors[probe.query]
            related = _cosine(query, vectors[probe.related])
            if not related > _cosine(query, vectors[probe.unrelated]):
                failed.append(probe.id)
    passed_probes = 0 if problems else len(probes) - len(failed)
    accuracy = passed_probes / len(probes)
    reasons = list(problems)
    if not problems and accuracy < min_accuracy:
        reasons.append(
            f"retrieval accuracy {accuracy:.2f} is under {min_accuracy:.2f} "
            f"({passed_probes} of {len(probes)} probes ranked the related text first)"
        )
    return EmbeddingEvalReport(
        probes=len(probes),
        passed_probes=passed_probes,
        accuracy=accuracy,
        min_accuracy=min_accuracy,
        dimensions=dimensions,
        shape_problems=tuple(problems),
        failed_probes=tuple(failed),
        passed=not reasons,
        reasons=tuple(reasons),
    )
