"""The embedding gates' pure parts: the probe verdict, the load test's rule and
its search, run against the modelled replica in virtual time."""

from __future__ import annotations

import math

import pytest

from models_registry.domain.embedding_eval import (
    EmbeddingProbe,
    judge_embeddings,
    parse_probe_set,
    probe_texts,
)
from models_registry.domain.embedding_load_test import (
    DEFAULT_LATENCY_TARGET_MS,
    EmbeddingLoadSettings,
    EmbeddingStep,
    MeasureStep,
    ModelledEmbeddingReplica,
    embedding_answer,
    embedding_batches,
    embedding_search,
    judge_embedding_step,
    latency_target_ms_for,
    run_embedding_search,
)
from models_registry.domain.eval_gate import EvalSetError
from models_registry.domain.gates import parse_gate_config

PROBES = [
    EmbeddingProbe("a", "q1", "r1", "u1"),
    EmbeddingProbe("b", "q2", "r2", "u2"),
]


def unit(*values: float) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


def vectors(*, swap_b: bool = False) -> dict[str, list[float]]:
    good = {
        "q1": unit(1, 0, 0),
        "r1": unit(1, 0.1, 0),
        "u1": unit(0, 1, 0),
        "q2": unit(0, 0, 1),
        "r2": unit(0, 0.1, 1),
        "u2": unit(1, 0, 0),
    }
    if swap_b:
        good["r2"], good["u2"] = good["u2"], good["r2"]
    return good


def test_probes_pass_when_related_texts_rank_first() -> None:
    report = judge_embeddings(
        PROBES, vectors(), dimensions=3, is_normalized=True, min_accuracy=0.9
    )
    assert (report.passed, report.accuracy, report.reasons) == (True, 1.0, ())


def test_a_misranked_probe_drops_accuracy_under_the_floor() -> None:
    report = judge_embeddings(
        PROBES, vectors(swap_b=True), dimensions=3, is_normalized=True, min_accuracy=0.9
    )
    assert not report.passed
    assert report.failed_probes == ("b",)
    assert report.reasons == (
        "retrieval accuracy 0.50 is under 0.90 (1 of 2 probes ranked the related "
        "text first)",
    )
    lenient = judge_embeddings(
        PROBES, vectors(swap_b=True), dimensions=3, is_normalized=True, min_accuracy=0.5
    )
    assert lenient.passed


@pytest.mark.parametrize(
    ("change", "dimensions", "why"),
    [
        ({}, 4, "a vector has 3 values, the model's dimensions are 4"),
        ({"q1": [math.nan, 0.0, 0.0]}, 3, "a vector holds a value that is not finite"),
        ({"q1": [2.0, 0.0, 0.0]}, 3, "a vector's length is 2.0000, not 1"),
    ],
)
def test_unsound_vectors_fail_whatever_they_rank(
    change: dict[str, list[float]], dimensions: int, why: str
) -> None:
    report = judge_embeddings(
        PROBES,
        {**vectors(), **change},
        dimensions=dimensions,
        is_normalized=True,
        min_accuracy=0.5,
    )
    assert not report.passed
    assert report.reasons[0].startswith(why)
    assert report.passed_probes == 0


def test_unnormalized_vectors_pass_when_the_model_says_so() -> None:
    long = {k: [2 * x for x in v] for k, v in vectors().items()}
    report = judge_embeddings(
        PROBES, long, dimensions=3, is_normalized=False, min_accuracy=0.9
    )
    assert report.passed


def test_probe_set_lines_are_checked_naming_the_line() -> None:
    good = '{"id": "a", "query": "q", "related": "r", "unrelated": "u"}'
    assert parse_probe_set([good, ""], source="s")[0] == EmbeddingProbe(
        "a", "q", "r", "u"
    )
    assert probe_texts(parse_probe_set([good], source="s")) == ["q", "r", "u"]
    with pytest.raises(EvalSetError, match="s, line 2: related must be"):
        parse_probe_set(
            [good, '{"id": "b", "query": "q", "unrelated": "u"}'], source="s"
        )
    with pytest.raises(EvalSetError, match="appears twice"):
        parse_probe_set([good, good], source="s")
    with pytest.raises(EvalSetError, match="no probes"):
        parse_probe_set([], source="s")


def test_the_latency_target_comes_from_the_engine_config() -> None:
    assert latency_target_ms_for({}) == DEFAULT_LATENCY_TARGET_MS == 500.0
    assert latency_target_ms_for({"latency_target_ms": 250}) == 250.0
    for bad in (0, -1, "fast", True):
        with pytest.raises(ValueError, match="latency_target_ms"):
            latency_target_ms_for({"latency_target_ms": bad})


def test_gate_config_reads_the_embedding_settings() -> None:
    config, problems = parse_gate_config(
        {"min_retrieval_accuracy": 0.75, "embedding_normalized": False}
    )
    assert problems == []
    assert (config.min_retrieval_accuracy, config.embedding_normalized) == (0.75, False)
    _, problems = parse_gate_config(
        {"min_retrieval_accuracy": 1.5, "embedding_normalized": "yes"}
    )
    assert problems == [
        "min_retrieval_accuracy: must be a number in (0, 1]",
        "embedding_normalized: must be true or false",
    ]


def test_a_step_holds_under_the_target_with_every_request_answered() -> None:
    step = judge_embedding_step(
        concurrency=2,
        latencies_s=[0.1] * 19 + [0.3],
        input_tokens=10_000,
        unanswered=0,
        window_s=10.0,
        latency_target_ms=400.0,
    )
    assert step.holds
    assert step.input_tokens_per_s == 1000.0
    # Little's law: 1,000 tokens/s held for a mean 0.11 s.
    assert step.tokens_in_flight == pytest.approx(110.0)
    late = judge_embedding_step(
        concurrency=2,
        latencies_s=[0.5] * 20,
        input_tokens=1,
        unanswered=1,
        window_s=1.0,
        latency_target_ms=400.0,
    )
    assert late.reasons == ("p95 latency", "requests unanswered")


def step(concurrency: int, tokens_per_s: float, *, holds: bool) -> EmbeddingStep:
    return EmbeddingStep(
        concurrency=concurrency,
        requests=10,
        unanswered=0,
        input_tokens_per_s=tokens_per_s,
        latency_p50_s=0.1,
        latency_p95_s=0.2,
        tokens_in_flight=tokens_per_s * 0.1,
        holds=holds,
        reasons=() if holds else ("p95 latency",),
    )


def test_the_search_doubles_until_a_step_fails_and_keeps_the_best() -> None:
    search = embedding_search(EmbeddingLoadSettings(max_concurrency=64))
    asked = [next(search)]
    measured = {1: step(1, 100, holds=True), 2: step(2, 180, holds=True)}
    measured[4] = step(4, 200, holds=False)
    with pytest.raises(StopIteration) as done:
        while True:
            asked.append(search.send(measured[asked[-1].concurrency]))
    assert asked == [MeasureStep(1), MeasureStep(2), MeasureStep(4)]
    answer = done.value.value
    assert (answer.input_tokens_per_s, answer.tokens_in_flight) == (180, 18)


def test_steps_of_about_the_same_throughput_answer_with_the_most_clients() -> None:
    steps = [
        step(1, 2900, holds=True),
        step(2, 3110, holds=True),
        step(4, 3000, holds=True),
        step(8, 3200, holds=False),
    ]
    answer = embedding_answer(steps, 500.0)
    assert answer.best is steps[2]  # within 5% of 3,110
    assert embedding_answer(steps[:2], 500.0).best is steps[1]
    # A step well above the others is the answer, whatever its clients.
    uneven = [step(1, 2000, holds=True), step(2, 1500, holds=True)]
    assert embedding_answer(uneven, 500.0).best is uneven[0]
    assert embedding_answer([steps[3]], 500.0).best is None


def test_the_requests_are_rag_ingestion_batches_and_repeatable() -> None:
    settings = EmbeddingLoadSettings()
    batches = embedding_batches(settings, client=0, concurrency=4)
    first = [next(batches) for _ in range(20)]
    again = embedding_batches(settings, client=0, concurrency=4)
    assert [next(again) for _ in range(20)] == first
    assert all(16 <= len(b.texts) <= 64 for b in first)
    texts = [t for b in first for t in b.texts]
    assert len(set(texts)) == len(texts)
    assert all(20 <= len(t.split()) - 1 <= 60 for t in texts)


def test_the_modelled_replica_finds_the_knee_at_the_target() -> None:
    """GIVEN the simulated replica's batcher (9 ms + 0.32 ms a token) WHEN the
    search runs at a 3 s target THEN concurrency adds little throughput (a batch
    costs per token) but latency grows with it until a step passes the target,
    and the answer is the best throughput of the steps under it."""
    replica = ModelledEmbeddingReplica(base_s=0.009, per_token_s=0.00032)
    settings = EmbeddingLoadSettings(
        latency_target_ms=3000.0, warmup_s=5.0, duration_s=60.0
    )
    answer = run_embedding_search(settings, replica.measure)
    steps = answer.steps
    assert [s.concurrency for s in steps] == [2**i for i in range(len(steps))]
    assert not steps[-1].holds and all(s.holds for s in steps[:-1])
    assert len(steps) == 4  # 1, 2 and 4 clients hold; 8 wait about 6 s
    # Flat past the knee: the last step that held, nearest the target.
    assert answer.best is steps[-2]
    p95s = [s.latency_p95_s or 0.0 for s in steps]
    assert p95s == sorted(p95s)
    # Per-token cost dominates: about 1 / 0.32 ms = 3,125 tokens/s at any batch.
    assert answer.input_tokens_per_s == pytest.approx(3125, rel=0.05)
