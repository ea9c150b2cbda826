"""Run the eval gate: ask the candidate, the live version and the judge, then judge.

Public surface: ``Target``, ``PrecisionSides``, ``EvalReport``, ``EvalRunError``,
``run_eval``,
``DEFAULT_FLOORS``, ``MAX_TOKENS``, ``max_tokens_for``, ``backoff_delay_s``,
``retry_after_s``.

The arithmetic is ``models_registry.domain.eval_gate``; the judge's prompt is
``models_registry.domain.judge``. This module does the asking. No ORM: it runs
from a task with the eval set already parsed and the clients already built.

**Asking.** Every version answers through the platform itself: a ``Target`` is
an ``openai.AsyncOpenAI`` client on the gateway, a pinned model name
(``chat-7b@v2``) and extra headers (``{"x-priority": "batch"}``, so that only idle
capacity is used). Answers are asked with temperature 0 and ``max_tokens`` sized
per category (``max_tokens_for``), at most ``concurrency`` at a time per target.
The batch tier is the first to be shed under load, so a 429 or 503 is expected:
it is retried after the ``Retry-After`` the gateway sent, else after a backoff
with jitter (``backoff_delay_s``), until ``patience_s`` have passed since that
request's first refusal; then the run gives up and the report says why. A
connection failure is retried three times. Any other error fails the run at
once. Prompt text and answers are never logged.

**Scoring.** Each answer gets its task metric (``score_answer``). With a live
version the two are compared per category (``eval_verdict``); the judge is
checked first on the eval set's labelled pairs (``judge_trust``), or by people's
labels of its earlier verdicts when there are enough (``human_trust``), and, trusted,
then compares every item whose two answers differ (identical answers tie without
asking). Each judge prompt shows its pair in an order drawn per item
(``judge.is_swapped``), recorded in the report as ``candidate_side``. The gate
fails closed, saying why, when the judge cannot be reached, it answers nothing
readable (or more than a tenth of the comparisons unreadably), or it is not
trusted. The judge's comparisons come back with their text (``judged_pairs``,
never in the JSON) for people to label; a judge the eval set's pairs do not
trust still compares ``label_sample`` items for that alone. With no judge at all
(``judge=None``: the model's gate settings name none), the task metrics alone
decide.

**A change of precision** (``precision``, a ``PrecisionSides``, whose candidate
differs from live's): the versions of the model's other precisions are asked the
same items too (their errors are noted, not fatal: they are for comparison), and
the report gains a side-by-side table of every precision's score per category
with the candidate's drops and the verdict
(``models_registry.domain.precision_gate``); a category that fails leads the
reasons with the precisions named.

**A model's first version** has no live version: the candidate is scored alone
against a floor per category (``DEFAULT_FLOORS``, or ``floors``): its share of
right answers may fall no more than the category's threshold below the floor
(``floor_verdict``). The judge is not needed then, and not asked.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import openai

from models_registry.domain import judge as judging
from models_registry.domain.eval_gate import (
    CATEGORIES,
    CategoryResult,
    EvalItem,
    GateVerdict,
    JudgeTrust,
    eval_verdict,
    floor_verdict,
    judge_trust,
)
from models_registry.domain.eval_gate import score_answer as task_score
from models_registry.domain.judge_agreement import JudgedPair, sample_for_labels
from models_registry.domain.precision_gate import (
    PrecisionColumn,
    PrecisionReport,
    category_means,
    is_precision_change,
    precision_report,
)

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

__all__ = [
    "DEFAULT_FLOORS",
    "MAX_TOKENS",
    "EvalReport",
    "EvalRunError",
    "PrecisionSides",
    "Target",
    "backoff_delay_s",
    "max_tokens_for",
    "retry_after_s",
    "run_eval",
]

logger = logging.getLogger(__name__)

# A first version's least share of right answers per category. Long outputs and
# plain instructions are the easy part; reasoning and maths may be harder for a
# small model, but a model that fails half of them is no chat model to ship.
DEFAULT_FLOORS: Mapping[str, float] = {
    "reasoning": 0.5,
    "maths": 0.5,
    "long_output": 0.7,
    "general": 0.7,
}
# Room for a short answer, a short reasoning, and a long output (which also gets
# twice its reference's words, see max_tokens_for).
MAX_TOKENS: Mapping[str, int] = {
    "reasoning": 128,
    "maths": 64,
    "long_output": 256,
    "general": 64,
}
_JUDGE_MAX_TOKENS = 16
_RETRIED_STATUSES = frozenset({429, 503})
_CONNECTION_RETRIES = 3
_BACKOFF_BASE_S = 0.25
_BACKOFF_CAP_S = 10.0
_RETRY_AFTER_CAP_S = 60.0
_MAX_UNREADABLE_SHARE = 0.1
_WORST_ITEMS = 10

Progress = Callable[[str, int, int], None]


class EvalRunError(Exception):
    """A request of the run failed for good: the message says who and why."""


@dataclass(frozen=True, slots=True)
class Target:
    """A model to ask: a client on the gateway, a pinned name, extra headers."""

    client: openai.AsyncOpenAI
    model: str
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PrecisionSides:
    """The precisions of a run: the candidate's, live's, and the other ones'.

    ``others`` maps a precision to a version of it to ask (a ``Target``);
    ``missing`` maps a precision registered for the model but not asked to why
    (no version of it is ready, say).
    """

    candidate: str
    live: str
    others: Mapping[str, Target] = field(default_factory=dict)
    missing: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Reply:
    text: str
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class EvalReport:
    """The outcome of one eval run, as the JSON report holds it (``as_dict``).

    ``reasons`` are sentences for people: what failed, or on a pass what each
    category showed. ``items`` has each item's scores and the judge's verdict
    (never the prompt or the answers); ``worst`` the ids of each category's
    items where the candidate did worst against live (or the floor).
    """

    passed: bool
    reasons: tuple[str, ...]
    mode: str  # compare | floor
    candidate: str
    live: str | None
    judge_model: str | None
    judge_prompt: str
    categories: tuple[CategoryResult, ...]
    judge: JudgeTrust | None
    thresholds: Mapping[str, float]
    floors: Mapping[str, float] | None
    counts: Mapping[str, int]
    timings_s: Mapping[str, float]
    items: tuple[Mapping[str, Any], ...]
    worst: Mapping[str, tuple[str, ...]]
    finished_at: str
    precision: PrecisionReport | None = None
    # The judge's comparisons with their text, for human labels
    # (``models_registry.judge_labels``); never in the JSON report.
    judged_pairs: tuple[JudgedPair, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "reasons": list(self.reasons),
            "mode": self.mode,
            "candidate": self.candidate,
            "live": self.live,
            "judge_model": self.judge_model,
            "judge_prompt": self.judge_prompt,
            "categories": [r.as_dict() for r in self.categories],
            "judge": self.judge.as_dict() if self.judge is not None else None,
            "thresholds": dict(self.thresholds),
            "floors": dict(self.floors) if self.floors is not None else None,
            "counts": dict(self.counts),
            "timings_s": dict(self.timings_s),
            "items": [dict(i) for i in self.items],
            "worst": {k: list(v) for k, v in self.worst.items()},
            "finished_at": self.finished_at,
            "precision": (
                self.precision.as_dict() if self.precision is not None else None
            ),
        }


def max_tokens_for(item: EvalItem) -> int:
    """Return the ``max_tokens`` to ask ``item`` with (``MAX_TOKENS``).

    A long output gets at least twice its reference's words and 64 tokens more:
    a real tokenizer spends about 1.3 tokens a word, so only an answer that runs
    on far past the reference is cut (and then scores 0, not finished).
    """
    tokens = MAX_TOKENS[item.category]
    if item.category == "long_output":
        tokens = max(tokens, 2 * len(item.reference.split()) + 64)
    return tokens


def retry_after_s(headers: Mapping[str, str] | None) -> float | None:
    """Return the seconds a ``Retry-After`` header asks for (capped), or None.

    Only the delay-seconds form is read; the gateway sends no dates.
    """
    if not headers:
        return None
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, _RETRY_AFTER_CAP_S)


def backoff_delay_s(
    attempt: int, retry_after: float | None, rng: random.Random
) -> float:
    """Return how long to wait before retry number ``attempt`` (0 first).

    ``Retry-After`` is honoured as the least wait, plus up to a tenth more so that
    the clients it was sent to do not all come back at once. Without it: an
    exponential backoff from 0.25 s, capped at 10 s, of which the upper half is
    drawn at random ("equal jitter").
    """
    if retry_after is not None:
        return retry_after * (1.0 + 0.1 * rng.random())
    ceiling = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2.0**attempt)
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


class _Asker:
    """Sends one target's requests: a concurrency bound and the retry policy."""

    def __init__(
        self,
        target: Target,
        *,
        concurrency: int,
        patience_s: float,
        timeout_s: float,
        rng: random.Random,
    ) -> None:
        # The retry policy is ours (Retry-After, patience), not the SDK's.
        self.client = target.client.with_options(max_retries=0, timeout=timeout_s)
        self.model = target.model
        self.headers = dict(target.headers)
        self.slots = asyncio.Semaphore(concurrency)
        self.patience_s = patience_s
        self.rng = rng
        self.retries = 0
        self.calls = 0

    async def ask(
        self, messages: Sequence[Mapping[str, str]], max_tokens: int
    ) -> _Reply:
        async with self.slots:
            return await self._ask(messages, max_tokens)

    async def _ask(
        self, messages: Sequence[Mapping[str, str]], max_tokens: int
    ) -> _Reply:
        first_refusal: float | None = None
        attempt = 0
        connection_failures = 0
        while True:
            self.calls += 1
            try:
                completion = await self.client.chat.completions.create(
                    model=self.model,
                    messages=cast(
                        "list[ChatCompletionMessageParam]", [dict(m) for m in messages]
                    ),
                    temperature=0,
                    max_tokens=max_tokens,
                    extra_headers=self.headers,
                )
            except openai.APIStatusError as exc:
                status = exc.status_code
                if status not in _RETRIED_STATUSES:
                    raise EvalRunError(
                        f"{self.model} answered HTTP {status}: {_short(exc.message)}"
                    ) from None
                now = time.monotonic()
                first_refusal = now if first_refusal is None else first_refusal
                delay = backoff_delay_s(
                    attempt, retry_after_s(exc.response.headers), self.rng
                )
                if now + delay - first_refusal > self.patience_s:
                    raise EvalRunError(
                        f"{self.model} kept answering HTTP {status} (the batch tier "
                        f"is shed first under load) for {now - first_refusal:.1f} s; "
                        f"gave up after {self.patience_s:g} s"
                    ) from None
                logger.info(
                    "eval: %s answered %d, retrying in %.2f s",
                    self.model,
                    status,
                    delay,
                )
            except openai.APIConnectionError as exc:
                connection_failures += 1
                if connection_failures > _CONNECTION_RETRIES:
                    raise EvalRunError(
                        f"{self.model} could not be reached ({type(exc).__name__}, "
                        f"{connection_failures} tries)"
                    ) from None
                delay = backoff_delay_s(attempt, None, self.rng)
                logger.info(
                    "eval: %s unreachable (%s), retrying in %.2f s",
                    self.model,
                    type(exc).__name__,
                    delay,
                )
            else:
                if not completion.choices:
                    raise EvalRunError(f"{self.model} answered with no choice")
                choice = completion.choices[0]
                return _Reply(choice.message.content or "", choice.finish_reason)
            self.retries += 1
            attempt += 1
            await asyncio.sleep(delay)


def _precision_table(
    items: Sequence[EvalItem],
    sides: PrecisionSides,
    scores: Mapping[str, Mapping[str, float]],
    others: Mapping[str, tuple[dict[str, _Reply], EvalRunError | None]],
    *,
    refs: Mapping[str, str | None],
) -> list[PrecisionColumn]:
    """Return a column per precision: the candidate, live, the others asked, and
    those registered but not asked (with why)."""
    by_id = {i.id: i for i in items}
    columns = [
        PrecisionColumn(
            sides.candidate,
            refs["candidate"],
            "candidate",
            category_means(items, scores.get("candidate", {})),
        ),
        PrecisionColumn(
            sides.live,
            refs["live"],
            "live",
            category_means(items, scores.get("live", {})),
        ),
    ]
    for name, (replies, error) in others.items():
        target = sides.others[name]
        if error is not None:
            columns.append(
                PrecisionColumn(
                    name, target.model, "other", {}, f"could not be asked: {error}"
                )
            )
            continue
        own = {
            key: task_score(by_id[key], r.text, finish_reason=r.finish_reason)
            for key, r in replies.items()
        }
        columns.append(
            PrecisionColumn(name, target.model, "other", category_means(items, own))
        )
    seen = {c.precision for c in columns}
    columns += [
        PrecisionColumn(name, None, "other", {}, why)
        for name, why in sides.missing.items()
        if name not in seen
    ]
    return columns


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _worst(
    items: Sequence[EvalItem],
    candidate: Mapping[str, float],
    baseline: Mapping[str, float],
    verdicts: Mapping[str, str],
) -> dict[str, tuple[str, ...]]:
    """Return per category the ids where the candidate did worst, worst first."""
    worst: dict[str, tuple[str, ...]] = {}
    for category in CATEGORIES:
        losing = [
            (candidate[i.id] - baseline[i.id], verdicts.get(i.id) != "live", i.id)
            for i in items
            if i.category == category
            and i.id in candidate
            and (candidate[i.id] < baseline[i.id] or verdicts.get(i.id) == "live")
        ]
        if losing:
            worst[category] = tuple(key for *_, key in sorted(losing)[:_WORST_ITEMS])
    return worst


class _Progress:
    """Counts answers per phase and tells ``on_progress``."""

    def __init__(self, on_progress: Progress | None) -> None:
        self.on_progress = on_progress
        self.totals: dict[str, int] = {}
        self.done: dict[str, int] = {}

    def start(self, phase: str, total: int) -> None:
        self.totals[phase] = total
        self.done[phase] = 0

    def step(self, phase: str) -> None:
        self.done[phase] += 1
        if self.on_progress is not None:
            self.on_progress(phase, self.done[phase], self.totals[phase])


async def _ask_all(
    asker: _Asker,
    requests: Sequence[tuple[str, Sequence[Mapping[str, str]], int]],
    *,
    phase: str,
    progress: _Progress,
) -> tuple[dict[str, _Reply], EvalRunError | None]:
    """Ask every ``(key, messages, max_tokens)``; the first failure stops the rest."""
    replies: dict[str, _Reply] = {}

    async def one(key: str, messages: Sequence[Mapping[str, str]], tokens: int) -> None:
        replies[key] = await asker.ask(messages, tokens)
        progress.step(phase)

    try:
        async with asyncio.TaskGroup() as group:
            for key, messages, tokens in requests:
                group.create_task(one(key, messages, tokens))
    except BaseExceptionGroup as group:
        error = _first_error(group)
        if error is None:
            raise
        return {}, error
    return replies, None


def _first_error(error: BaseException) -> EvalRunError | None:
    if isinstance(error, EvalRunError):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _first_error(inner)
            if found is not None:
                return found
    return None


@dataclass(frozen=True, slots=True)
class _Judged:
    """What the judge said: its trust, its verdicts, and why it failed the gate.

    ``verdicts`` is None when the judge's preference cannot enter the verdict at
    all (none given, unreachable, unreadable): ``failures`` says why. An empty
    dict with an untrusted ``trust`` lets ``eval_verdict`` say it is not trusted.
    """

    failures: tuple[str, ...]
    trust: JudgeTrust | None = None
    verdicts: Mapping[str, str] | None = None
    sides: Mapping[str, str] = field(default_factory=dict)
    counts: Mapping[str, int] = field(default_factory=dict)
    # An untrusted judge's comparisons, asked only for people to label.
    for_labels: tuple[JudgedPair, ...] = ()


async def _calibrate(
    asker: _Asker,
    items: Sequence[EvalItem],
    *,
    judge_prompt: str,
    min_kappa: float,
    min_labels: int,
    progress: _Progress,
) -> tuple[JudgeTrust | None, EvalRunError | None]:
    """Ask the judge about every labelled pair and measure it against the labels."""
    labelled = [i for i in items if i.labelled_pair is not None]
    swapped = {
        i.id: judging.is_swapped(f"{i.id}/labelled", judge_prompt) for i in labelled
    }
    requests = []
    for i in labelled:
        first, second = i.labelled_pair or ("", "")
        shown = judging.present_pair(first, second, swapped=swapped[i.id])
        messages = judging.judge_messages(i.messages, *shown, judge_prompt)
        requests.append((i.id, messages, _JUDGE_MAX_TOKENS))
    progress.start("calibration", len(requests))
    replies, error = await _ask_all(
        asker, requests, phase="calibration", progress=progress
    )
    if error is not None:
        return None, error
    pairs = [
        (
            judging.unswap_verdict(
                judging.parse_judge_reply(replies[i.id].text), swapped=swapped[i.id]
            ),
            i.human_label or "",
        )
        for i in labelled
    ]
    return judge_trust(pairs, min_kappa=min_kappa, min_labels=min_labels), None


async def _compare(
    asker: _Asker,
    items: Sequence[EvalItem],
    answers: Mapping[str, Mapping[str, _Reply]],
    *,
    judge_prompt: str,
    progress: _Progress,
) -> tuple[dict[str, str], dict[str, str], int, int, EvalRunError | None]:
    """Ask the judge which of the two answers wins, where they differ.

    Returns the verdicts by item (candidate, live or tie), the side the
    candidate was shown on, the comparisons asked, the unreadable replies, and
    the error that stopped them.
    """
    verdicts: dict[str, str] = {}
    sides: dict[str, str] = {}
    requests = []
    for i in items:
        mine, theirs = answers["candidate"][i.id].text, answers["live"][i.id].text
        if mine.strip() == theirs.strip():
            verdicts[i.id] = "tie"  # the same answer: nothing to prefer
            continue
        swapped = judging.is_swapped(i.id, judge_prompt)
        sides[i.id] = "b" if swapped else "a"
        shown = judging.present_pair(mine, theirs, swapped=swapped)
        messages = judging.judge_messages(i.messages, *shown, judge_prompt)
        requests.append((i.id, messages, _JUDGE_MAX_TOKENS))
    progress.start("comparison", len(requests))
    replies, error = await _ask_all(
        asker, requests, phase="comparison", progress=progress
    )
    unreadable = 0
    for key, reply in replies.items():
        winner = judging.candidate_verdict(
            judging.unswap_verdict(
                judging.parse_judge_reply(reply.text), swapped=sides[key] == "b"
            )
        )
        if winner is None:
            unreadable += 1
        else:
            verdicts[key] = winner
    return verdicts, sides, len(requests), unreadable, error


async def _judge(
    asker: _Asker,
    items: Sequence[EvalItem],
    answers: Mapping[str, Mapping[str, _Reply]],
    *,
    judge_prompt: str,
    min_kappa: float,
    min_labels: int,
    progress: _Progress,
    human_trust: JudgeTrust | None = None,
    label_sample: int = 0,
) -> _Judged:
    """Calibrate the judge; if it is trusted, let it compare (module docstring).

    ``human_trust``, the judge's agreement with enough human labels, takes the
    place of the eval set's labelled pairs: no calibration is asked. A judge the
    eval set's pairs do not trust still compares ``label_sample`` items, for
    people to label only (its verdicts count for nothing here): so a judge that
    no labelled pair vouches for can earn trust from people.
    """
    failed = "so the gate fails closed"
    trust: JudgeTrust | None
    if human_trust is not None:
        trust, error = human_trust, None
    else:
        trust, error = await _calibrate(
            asker,
            items,
            judge_prompt=judge_prompt,
            min_kappa=min_kappa,
            min_labels=min_labels,
            progress=progress,
        )
    if error is not None or trust is None:
        return _Judged((f"the judge could not be asked, {failed}: {error}",))
    counts = {"judge_unreadable_labelled": trust.unparsed}
    if trust.labelled and trust.unparsed == trust.labelled:
        return _Judged(
            (
                f"the judge {asker.model} answered nothing readable "
                f"({trust.labelled} replies), {failed}",
            ),
            trust=trust,
            counts=counts,
        )
    if not trust.trusted:
        # An untrusted judge's preferences count for nothing in the verdict.
        if label_sample <= 0 or human_trust is not None:
            return _Judged((), trust=trust, verdicts={}, counts=counts)
        return await _judge_for_labels(
            asker,
            items,
            answers,
            judge_prompt=judge_prompt,
            progress=progress,
            judged=_Judged((), trust=trust, verdicts={}, counts=counts),
            label_sample=label_sample,
        )
    verdicts, sides, asked, unreadable, error = await _compare(
        asker, items, answers, judge_prompt=judge_prompt, progress=progress
    )
    counts |= {
        "judge_comparisons": asked,
        "identical_answers": len(items) - asked,
        "judge_unreadable_comparisons": unreadable,
    }
    if error is not None:
        return _Judged(
            (f"the judge could not be asked, {failed}: {error}",),
            trust=trust,
            counts=counts,
        )
    if asked and unreadable > _MAX_UNREADABLE_SHARE * asked:
        return _Judged(
            (
                f"the judge's replies to {unreadable} of {asked} comparisons "
                f"could not be read, {failed}",
            ),
            trust=trust,
            sides=sides,
            counts=counts,
        )
    return _Judged((), trust=trust, verdicts=verdicts, sides=sides, counts=counts)


async def _judge_for_labels(
    asker: _Asker,
    items: Sequence[EvalItem],
    answers: Mapping[str, Mapping[str, _Reply]],
    *,
    judge_prompt: str,
    progress: _Progress,
    judged: _Judged,
    label_sample: int,
) -> _Judged:
    """Ask the untrusted judge about a sample of differing items, for people."""
    differing = [
        i.id
        for i in items
        if answers["candidate"][i.id].text.strip() != answers["live"][i.id].text.strip()
    ]
    sample = set(sample_for_labels(differing, label_sample, seed=judge_prompt))
    subset = [i for i in items if i.id in sample]
    verdicts, sides, asked, _, error = await _compare(
        asker, subset, answers, judge_prompt=judge_prompt, progress=progress
    )
    asked_for = _Judged((), verdicts=verdicts, sides=sides)
    return replace(
        judged,
        counts={**judged.counts, "judge_label_comparisons": asked},
        # A failure here fails nothing: the gate has failed on trust already.
        for_labels=() if error else _judged_pairs(subset, asked_for, answers),
    )


@dataclass(frozen=True, slots=True)
class _Run:
    """What a run was asked to do, for its report."""

    items: Sequence[EvalItem]
    candidate: str
    live: str | None
    judge: str | None
    judge_prompt: str
    thresholds: Mapping[str, float]
    floors: Mapping[str, float]


def _report(
    run: _Run,
    verdict: GateVerdict | None,
    judged: _Judged,
    *,
    scores: Mapping[str, Mapping[str, float]],
    counts: Mapping[str, int],
    timings_s: Mapping[str, float],
    precision: PrecisionReport | None = None,
    answers: Mapping[str, Mapping[str, _Reply]] | None = None,
) -> EvalReport:
    """Assemble the report: failures first, else every category's reason."""
    reasons = list(judged.failures)
    if precision is not None and not precision.passed:
        reasons.append(precision.reason)
    if verdict is not None and not verdict.passed:
        reasons += [r for r in verdict.reasons if r not in reasons]
    passed = verdict is not None and not reasons
    if passed and verdict is not None:
        reasons = list(verdict.reasons)
        if precision is not None:
            reasons.insert(0, precision.reason)
    candidate = scores.get("candidate", {})
    live = scores.get("live", {})
    verdicts = judged.verdicts or {}
    baseline = live or {i.id: run.floors[i.category] for i in run.items}
    rows: list[dict[str, Any]] = []
    for i in run.items:
        row: dict[str, Any] = {"id": i.id, "category": i.category}
        for name, value in (
            ("candidate", candidate.get(i.id)),
            ("live", live.get(i.id)),
            ("judge", verdicts.get(i.id)),
            ("candidate_side", judged.sides.get(i.id)),
        ):
            if value is not None:
                row[name] = value
        rows.append(row)
    return EvalReport(
        passed=passed,
        reasons=tuple(reasons),
        mode="compare" if run.live is not None else "floor",
        candidate=run.candidate,
        live=run.live,
        judge_model=run.judge,
        judge_prompt=run.judge_prompt,
        categories=verdict.results if verdict is not None else (),
        judge=judged.trust,
        thresholds=dict(run.thresholds),
        floors=dict(run.floors) if run.live is None else None,
        counts={**counts, **judged.counts},
        timings_s={k: round(v, 3) for k, v in timings_s.items()},
        items=tuple(rows),
        worst=_worst(run.items, candidate, baseline, verdicts) if verdict else {},
        finished_at=datetime.now(tz=UTC).isoformat(timespec="seconds"),
        precision=precision,
        judged_pairs=judged.for_labels
        or _judged_pairs(run.items, judged, answers or {}),
    )


def _judged_pairs(
    items: Sequence[EvalItem],
    judged: _Judged,
    answers: Mapping[str, Mapping[str, _Reply]],
) -> tuple[JudgedPair, ...]:
    """Return the comparisons the judge made (identical answers were not asked)."""
    verdicts = judged.verdicts or {}
    if "candidate" not in answers or "live" not in answers:
        return ()
    return tuple(
        JudgedPair(
            item_id=i.id,
            messages=i.messages,
            candidate_answer=answers["candidate"][i.id].text,
            live_answer=answers["live"][i.id].text,
            verdict=verdicts[i.id],
        )
        for i in items
        if i.id in judged.sides and i.id in verdicts
    )


async def run_eval(
    items: Sequence[EvalItem],
    *,
    candidate: Target,
    live: Target | None,
    judge: Target | None,
    thresholds: Mapping[str, float],
    min_kappa: float,
    min_labels: int,
    judge_prompt: str = judging.DEFAULT_JUDGE_PROMPT,
    concurrency: int = 8,
    on_progress: Progress | None = None,
    floors: Mapping[str, float] = DEFAULT_FLOORS,
    patience_s: float = 300.0,
    request_timeout_s: float = 120.0,
    seed: int = 0,
    precision: PrecisionSides | None = None,
    human_trust: JudgeTrust | None = None,
    label_sample: int = 0,
) -> EvalReport:
    """Run the eval gate over ``items`` and return its report (module docstring).

    ``on_progress(phase, done, total)`` is called after each answer, phase
    ``answers``, ``calibration`` or ``comparison``. ``request_timeout_s`` bounds
    one request (a timeout counts as a connection failure). ``seed`` seeds the
    bootstrap and the retry jitter. ``human_trust``, when given, is the judge's
    agreement with enough human labels: it decides whether the judge is trusted,
    in place of the eval set's labelled pairs. ``label_sample``: how many items
    an untrusted judge still compares, for people to label (``_judge``).
    ``precision``, when its candidate differs from live's (and there is a live
    version), adds the precisions side by side (module docstring). A request
    that fails for good fails the gate, with the reason in the report; nothing
    is raised for it.

    Raises:
        ValueError: no items, an unknown judge prompt, a category without a
            threshold (or floor, for a first version), or ``concurrency < 1``.
    """
    if not items:
        raise ValueError("an eval run needs items")
    if judge_prompt not in judging.JUDGE_PROMPTS:
        raise ValueError(f"unknown judge prompt {judge_prompt!r}")
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    tables = [thresholds] if live is not None else [thresholds, floors]
    for category in sorted({i.category for i in items}):
        if any(category not in table for table in tables):
            raise ValueError(f"no threshold or floor for category {category!r}")
    started = time.monotonic()
    rng = random.Random(seed)
    progress = _Progress(on_progress)
    run = _Run(
        items=items,
        candidate=candidate.model,
        live=live.model if live is not None else None,
        judge=judge.model if judge is not None and live is not None else None,
        judge_prompt=judge_prompt,
        thresholds=thresholds,
        floors=floors,
    )
    logger.info(
        "eval: %d items, candidate %s, live %s, judge %s (%s)",
        len(items),
        run.candidate,
        run.live or "none",
        run.judge or "none",
        judge_prompt,
    )

    def asker(target: Target) -> _Asker:
        return _Asker(
            target,
            concurrency=concurrency,
            patience_s=patience_s,
            timeout_s=request_timeout_s,
            rng=rng,
        )

    askers = {"candidate": asker(candidate)}
    if live is not None:
        askers["live"] = asker(live)
    if precision is not None and not (
        live is not None and is_precision_change(precision.candidate, precision.live)
    ):
        precision = None  # no change of precision: the plain comparison
    others = {p: asker(t) for p, t in (precision.others if precision else {}).items()}
    requests = [(i.id, i.messages, max_tokens_for(i)) for i in items]
    progress.start("answers", len(requests) * (len(askers) + len(others)))
    collected, asked_others = await asyncio.gather(
        asyncio.gather(
            *(
                _ask_all(a, requests, phase="answers", progress=progress)
                for a in askers.values()
            )
        ),
        asyncio.gather(
            *(
                _ask_all(a, requests, phase="answers", progress=progress)
                for a in others.values()
            )
        ),
    )
    timings = {"answers": time.monotonic() - started}
    counts = {
        "items": len(items),
        "labelled": sum(i.labelled_pair is not None for i in items),
        **{f"items_{c}": sum(i.category == c for i in items) for c in CATEGORIES},
    }

    def finish(
        verdict: GateVerdict | None,
        judged: _Judged,
        scores: dict[str, dict[str, float]],
        answers: Mapping[str, Mapping[str, _Reply]] | None = None,
    ) -> EvalReport:
        for side, a in askers.items():
            counts[f"{side}_calls"], counts[f"{side}_retries"] = a.calls, a.retries
        for name, a in others.items():
            counts[f"{name}_calls"], counts[f"{name}_retries"] = a.calls, a.retries
        timings["total"] = time.monotonic() - started
        table = None
        if precision is not None and verdict is not None:
            columns = _precision_table(
                items,
                precision,
                scores,
                dict(zip(others, asked_others, strict=True)),
                refs={"candidate": run.candidate, "live": run.live},
            )
            table = precision_report(columns, verdict.results)
        return _report(
            run,
            verdict,
            judged,
            scores=scores,
            counts=counts,
            timings_s=timings,
            precision=table,
            answers=answers,
        )

    errors = [error for _, error in collected if error is not None]
    if errors:
        return finish(
            None, _Judged((f"could not collect the answers: {errors[0]}",)), {}
        )
    by_id = {i.id: i for i in items}
    answers = {
        side: replies for side, (replies, _) in zip(askers, collected, strict=True)
    }
    scores = {
        side: {
            key: task_score(by_id[key], r.text, finish_reason=r.finish_reason)
            for key, r in replies.items()
        }
        for side, replies in answers.items()
    }
    if live is None:
        verdict = floor_verdict(
            items, scores["candidate"], floors=floors, thresholds=thresholds, seed=seed
        )
        return finish(verdict, _Judged(()), scores)
    if judge is None:
        # The model's gate settings name no judge (``judge_model: ""``): an
        # admin's choice of the task metrics alone. A judge that is named but
        # cannot judge fails the gate closed (below, and in the gates' task).
        judged = _Judged(())
    else:
        judge_asker = asker(judge)
        judge_started = time.monotonic()
        judged = await _judge(
            judge_asker,
            items,
            answers,
            judge_prompt=judge_prompt,
            min_kappa=min_kappa,
            min_labels=min_labels,
            progress=progress,
            human_trust=human_trust,
            label_sample=label_sample,
        )
        timings["judge"] = time.monotonic() - judge_started
        counts["judge_calls"], counts["judge_retries"] = (
            judge_asker.calls,
            judge_asker.retries,
        )
    verdict = eval_verdict(
        items,
        scores["candidate"],
        scores["live"],
        thresholds=thresholds,
        judge_verdicts=judged.verdicts,
        judge=judged.trust,
        seed=seed,
    )
    return finish(verdict, judged, scores, answers)
