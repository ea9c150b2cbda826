"""An embedding version's load test: the rule that judges a step, the search over
concurrencies as a generator of effects, the requests it sends, and the
modelled replica it can be run against in virtual time.

Public surface: ``DEFAULT_LATENCY_TARGET_MS``, ``latency_target_ms_for``,
``EmbeddingLoadSettings``, ``EmbeddingStep``, ``EmbeddingAnswer``,
``MeasureStep``, ``EmbeddingBatch``, ``embedding_batches``,
``judge_embedding_step``, ``embedding_search``, ``embedding_answer``,
``run_embedding_search``, ``ModelledEmbeddingReplica``.

An embedding replica makes no output tokens: what it sells is **input tokens per
second**, at a latency its callers can wait for. The load mimics RAG ingestion:
closed-loop clients, each sending a request of ``texts_per_request`` short texts
(``text_words`` words each) as soon as its last one answered. A step runs
``concurrency`` such clients for ``warmup_s`` and then a window of ``duration_s``;
the requests sent in the window are judged (``judge_embedding_step``): a step
*holds* when every one of them answered and their p95 latency is under the
version's target (``latency_target_ms_for``: ``engine_config["latency_target_ms"]``,
else ``DEFAULT_LATENCY_TARGET_MS``). Its throughput is the input tokens the
replica embedded in the window (the answers' ``usage.prompt_tokens``) over the
window, and its tokens in flight the mean input tokens the replica held (Little's
law: throughput x mean latency), what the gateway's admission counts.

**The search** (``embedding_search``) doubles the concurrency from 1 while steps
hold, and stops after ``stop_after_failures`` failing steps in a row or at
``max_concurrency``: a generator that yields ``MeasureStep`` effects and is sent
each measured ``EmbeddingStep``; it returns the ``EmbeddingAnswer`` (the step
that held with the most input tokens/s, the most clients among those within 5%
of it: ``embedding_answer``). ``control.embedding_gates`` interprets
the effects against a live replica over HTTP; ``run_embedding_search`` with a
``ModelledEmbeddingReplica`` (the simulated replica's batcher: a batch of the
waiting requests takes a fixed time plus a time per input token) interprets them
in virtual time. One search, two interpreters.

Pure: the standard library and ``simengine.domain`` only.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simengine.domain import tokens as tokenizer
from simengine.domain.percentiles import percentile

__all__ = [
    "DEFAULT_LATENCY_TARGET_MS",
    "EmbeddingAnswer",
    "EmbeddingBatch",
    "EmbeddingLoadSettings",
    "EmbeddingStep",
    "MeasureStep",
    "ModelledEmbeddingReplica",
    "embedding_answer",
    "embedding_batches",
    "embedding_search",
    "judge_embedding_step",
    "latency_target_ms_for",
    "run_embedding_search",
]

# p95 request latency of an embedding request of 16-64 texts: RAG ingestion
# waits on it in bulk, a query embedding is a small share of a chat turn's time.
DEFAULT_LATENCY_TARGET_MS = 500.0


def latency_target_ms_for(engine_config: Mapping[str, Any]) -> float:
    """Return the version's p95 latency target in ms: ``latency_target_ms`` in its
    engine config, else ``DEFAULT_LATENCY_TARGET_MS``.

    Raises:
        ValueError: a target that is not a positive number.
    """
    value = engine_config.get("latency_target_ms", DEFAULT_LATENCY_TARGET_MS)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(
            f"engine_config latency_target_ms must be a positive number of ms, "
            f"not {value!r}"
        )
    return float(value)


@dataclass(frozen=True, slots=True)
class EmbeddingLoadSettings:
    """How the embedding load test steps (defaults: a GPU, half a minute a step).

    ``overrides`` of ``Model.gate_config.load_test`` that apply: ``warmup_s``,
    ``duration_s``, ``stop_after_failures`` (``from_overrides``).
    """

    latency_target_ms: float = DEFAULT_LATENCY_TARGET_MS
    warmup_s: float = 5.0
    duration_s: float = 30.0
    max_concurrency: int = 256
    stop_after_failures: int = 1
    texts_per_request: tuple[int, int] = (16, 64)
    text_words: tuple[int, int] = (20, 60)
    request_timeout_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.latency_target_ms <= 0 or self.duration_s <= 0 or self.warmup_s < 0:
            raise ValueError("the target and duration_s must be positive")
        if self.max_concurrency < 1 or self.stop_after_failures < 1:
            raise ValueError("max_concurrency and stop_after_failures must be >= 1")
        for low, high in (self.texts_per_request, self.text_words):
            if not 1 <= low <= high:
                raise ValueError("a (low, high) range must have 1 <= low <= high")

    @classmethod
    def from_overrides(
        cls, overrides: Mapping[str, float], *, latency_target_ms: float
    ) -> EmbeddingLoadSettings:
        """Return the defaults at ``latency_target_ms`` with the overrides that
        apply to embeddings (the chat test's rates do not)."""
        base = cls(latency_target_ms=latency_target_ms)
        return cls(
            latency_target_ms=latency_target_ms,
            warmup_s=float(overrides.get("warmup_s", base.warmup_s)),
            duration_s=float(overrides.get("duration_s", base.duration_s)),
            stop_after_failures=int(
                overrides.get("stop_after_failures", base.stop_after_failures)
            ),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "latency_target_ms": self.latency_target_ms,
            "warmup_s": self.warmup_s,
            "duration_s": self.duration_s,
            "max_concurrency": self.max_concurrency,
            "stop_after_failures": self.stop_after_failures,
            "texts_per_request": list(self.texts_per_request),
            "text_words": list(self.text_words),
            "seed": self.seed,
        }


@dataclass(frozen=True, slots=True)
class EmbeddingStep:
    """One concurrency's measurements and whether they hold."""

    concurrency: int
    requests: int
    unanswered: int
    input_tokens_per_s: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    tokens_in_flight: float
    holds: bool
    reasons: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "unanswered": self.unanswered,
            "input_tokens_per_s": self.input_tokens_per_s,
            "latency_p50_s": self.latency_p50_s,
            "latency_p95_s": self.latency_p95_s,
            "tokens_in_flight": self.tokens_in_flight,
            "holds": self.holds,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True, slots=True)
class EmbeddingAnswer:
    """Every step run and one replica's capacity at the latency target."""

    steps: tuple[EmbeddingStep, ...]
    latency_target_ms: float
    best: EmbeddingStep | None

    @property
    def input_tokens_per_s(self) -> float | None:
        return self.best.input_tokens_per_s if self.best else None

    @property
    def tokens_in_flight(self) -> int | None:
        return round(self.best.tokens_in_flight) if self.best else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "unit": "input_tokens",
            "tokens_per_s": self.input_tokens_per_s,
            "tokens_in_flight": self.tokens_in_flight,
            "latency_target_ms": self.latency_target_ms,
            "concurrency": self.best.concurrency if self.best else None,
            "steps": [step.as_dict() for step in self.steps],
        }


@dataclass(frozen=True, slots=True)
class MeasureStep:
    """The effect: run ``concurrency`` closed-loop clients for one step."""

    concurrency: int


def judge_embedding_step(
    *,
    concurrency: int,
    latencies_s: Sequence[float],
    input_tokens: int,
    unanswered: int,
    window_s: float,
    latency_target_ms: float,
) -> EmbeddingStep:
    """Return the step judged: ``latencies_s`` of the window's answered requests,
    ``input_tokens`` they carried, ``unanswered`` ones that timed out."""
    p95 = percentile(latencies_s, 0.95)
    reasons = []
    if p95 is None or p95 * 1000.0 >= latency_target_ms:
        reasons.append("p95 latency")
    if unanswered:
        reasons.append("requests unanswered")
    tokens_per_s = input_tokens / window_s
    mean_latency = sum(latencies_s) / len(latencies_s) if latencies_s else 0.0
    return EmbeddingStep(
        concurrency=concurrency,
        requests=len(latencies_s) + unanswered,
        unanswered=unanswered,
        input_tokens_per_s=tokens_per_s,
        latency_p50_s=percentile(latencies_s, 0.5),
        latency_p95_s=p95,
        tokens_in_flight=tokens_per_s * mean_latency,
        holds=not reasons,
        reasons=tuple(reasons),
    )


# Holding steps within this share of the best input tokens/s count as equal.
_SAME_THROUGHPUT = 0.05


def embedding_answer(
    steps: Sequence[EmbeddingStep], latency_target_ms: float
) -> EmbeddingAnswer:
    """Return the search's answer: the holding step with the most input tokens/s.

    Past its knee a replica's throughput is flat while clients only add latency,
    so which of those steps measured a few tokens more is noise; steps within 5%
    of the best count as equal, and the one with the most clients, nearest the
    target, is the answer (its tokens in flight are what the replica holds at
    its target, what admission should let it hold).
    """
    held = [s for s in steps if s.holds]
    top = max((s.input_tokens_per_s for s in held), default=0.0)
    equal = [s for s in held if s.input_tokens_per_s >= (1 - _SAME_THROUGHPUT) * top]
    best = max(equal, key=lambda s: s.concurrency, default=None)
    return EmbeddingAnswer(
        steps=tuple(steps), latency_target_ms=latency_target_ms, best=best
    )


def embedding_search(
    settings: EmbeddingLoadSettings,
) -> Generator[MeasureStep, EmbeddingStep, EmbeddingAnswer]:
    """Yield the steps to measure, each sent back measured; return the answer."""
    steps: list[EmbeddingStep] = []
    failures = 0
    concurrency = 1
    while concurrency <= settings.max_concurrency:
        step = yield MeasureStep(concurrency=concurrency)
        steps.append(step)
        failures = 0 if step.holds else failures + 1
        if failures >= settings.stop_after_failures:
            break
        concurrency *= 2
    return embedding_answer(steps, settings.latency_target_ms)


@dataclass(frozen=True, slots=True)
class EmbeddingBatch:
    """One request's texts and their count in the stand-in tokenizer."""

    texts: tuple[str, ...]
    tokens: int


_WORDS = tuple(word.strip() for word in tokenizer.OUTPUT_WORDS)


def embedding_batches(
    settings: EmbeddingLoadSettings, client: int, concurrency: int
) -> Iterator[EmbeddingBatch]:
    """Yield client ``client``'s requests of a step, seeded by the seed, the
    concurrency and the client (a step is the same whichever others run).

    Every text starts with its own number, so no two texts are the same and no
    cache of any kind answers one from another.
    """
    rng = random.Random(f"embedding-load:{settings.seed}:{concurrency}:{client}")
    number = 0
    while True:
        texts = []
        for _ in range(rng.randint(*settings.texts_per_request)):
            words = rng.choices(_WORDS, k=rng.randint(*settings.text_words))
            texts.append(f"{client}.{number} " + " ".join(words))
            number += 1
        yield EmbeddingBatch(
            texts=tuple(texts), tokens=sum(len(tokenizer.encode(t)) for t in texts)
        )


@dataclass(frozen=True, slots=True)
class ModelledEmbeddingReplica:
    """The simulated replica's batcher in virtual time: the requests waiting when
    the engine frees up run together (at most ``max_batch``) for ``base_s`` +
    ``per_token_s`` x their input tokens."""

    base_s: float
    per_token_s: float
    max_batch: int = 256

    def measure(
        self, settings: EmbeddingLoadSettings, effect: MeasureStep
    ) -> EmbeddingStep:
        """Return the step ``effect`` asks for, run in virtual time."""
        sources = [
            embedding_batches(settings, client, effect.concurrency)
            for client in range(effect.concurrency)
        ]
        window_start = settings.warmup_s
        window_end = window_start + settings.duration_s
        # (sent_at, client, tokens) of the requests waiting for the engine.
        waiting: list[tuple[float, int, int]] = [
            (0.0, c, next(sources[c]).tokens) for c in range(effect.concurrency)
        ]
        heapq.heapify(waiting)
        now = 0.0
        latencies: list[float] = []
        tokens = 0
        while waiting and now < window_end:
            now = max(now, waiting[0][0])
            batch: list[tuple[float, int, int]] = []
            while waiting and waiting[0][0] <= now and len(batch) < self.max_batch:
                batch.append(heapq.heappop(waiting))
            now += self.base_s + self.per_token_s * sum(t for _, _, t in batch)
            for sent_at, client, n in batch:
                if window_start <= sent_at < window_end:
                    latencies.append(now - sent_at)
                    tokens += n
                heapq.heappush(waiting, (now, client, next(sources[client]).tokens))
        return judge_embedding_step(
            concurrency=effect.concurrency,
            latencies_s=latencies,
            input_tokens=tokens,
            unanswered=0,
            window_s=settings.duration_s,
            latency_target_ms=settings.latency_target_ms,
        )


def run_embedding_search(
    settings: EmbeddingLoadSettings,
    measure: Callable[[EmbeddingLoadSettings, MeasureStep], EmbeddingStep],
) -> EmbeddingAnswer:
    """Drive ``embedding_search`` with a synchronous ``measure`` (the modelled
    replica's); return its answer."""
    search = embedding_search(settings)
    effect = next(search)
    while True:
        try:
            effect = search.send(measure(settings, effect))
        except StopIteration as done:
            answer: EmbeddingAnswer = done.value
            return answer
