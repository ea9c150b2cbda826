"""The seed's "capacity per version" procedure: the rule that judges a step, the
search over steps, and the replay of a trace; one code for the live load-test
gate (``control.load_test``) and the modelled one
(``drills.domain.capacity_test``).

Public surface: the rule and the search, ``CapacityCriteria``, ``CapacityStep``,
``CapacityAnswer``, ``step_rates``, ``judge_step``, ``check_search``,
``next_rate``, ``capacity_answer``, ``search_capacity``; the replay,
``ReplayRequest``, ``ReplayTurn``, ``parse_replay_lines``, ``read_replay_trace``,
``replay_tag``, ``replay_turns``, ``arrival_times``, ``mean_output_tokens``.

"Replay logged prompts at a fixed arrival rate and raise the rate step by step.
The highest output tokens per second at which p95 TTFT stays under 1 second and
streams keep 30 tokens per second replaces the assumed 2,500."

**One rule, two measurements.** A step is judged by ``judge_step`` from what was
measured at one arrival rate, wherever it was measured: output tokens/s produced
in the window, p95 TTFT of the requests that arrived in it, and each finished
stream's token rate (``1 / TPOT``: output tokens after the first over the time
they took). A step *holds* when p95 TTFT < ``ttft_p95_max_s``, the
``stream_quantile`` of stream rates is at least ``stream_min_tokens_per_s`` and
every request got its first token before the drain ran out. The steps are chosen
by ``next_rate`` (sorted rates, stopping after ``stop_after_failures`` failures in
a row: past the knee the queue only grows) and summed up by ``capacity_answer``
(the highest output tokens/s of a step that holds). ``search_capacity`` is that
loop for a synchronous measurement; the live load-test gate
(``control.load_test``) runs the same two functions around its
asynchronous one, so the modelled and the live answers cannot drift apart.

``stream_quantile`` 0.5 (the default) asks the median stream to keep 30 tokens/s,
the reading under which the profiles were calibrated (83 streams at 33 ms TPOT);
0.05 asks it of 95% of streams, a stricter answer reported alongside.

**The replay of a trace** (the gate's input, and ``run_trace_capacity_test``'s).
A trace line needs text, since a replica is sent it: ``messages`` (or a
``prompt``, sent as one user message), ``t``, ``max_tokens`` (and optionally
``output_tokens``, the answer's length), ``conversation``, ``team``, ``tier``.
A step at rate ``r`` takes the trace's requests in time order, cycling
(``replay_turns``), at the arrival times of ``arrival_times``: a fixed rate,
exactly, in the step's warm-up and in its window (``r x warmup`` and ``r x
duration`` arrivals, a Poisson process conditioned on those counts: uniform and
sorted in each), then Poisson arrivals at ``r`` while the step drains. Without
that condition a 40-second window's count alone varies by ±5%, as much as the
steps are apart, and short steps judge the dice more than the replica. The times
are seeded by the seed and the rate, so a step is the same whichever other
rates run, in the live gate or in the model. Every replayed request carries a
tag at the start of its conversation's first user message (``replay_tag``: the
conversation, the rate and the lap), after the system prompt: the turns of one
conversation keep their shared prefix, conversations share only what the trace
gave them (the system prompt), and a later lap or another step never hits the KV
blocks of an earlier one (a replica would otherwise serve a repeated prompt from
its cache). Tags have a fixed width, so every tag gives the same token counts
(``parse_replay_lines`` counts them once). A turn's shared history is the whole
previous prompt of its conversation when it extends it (else it starts afresh).
Logged answers are text the replica never generated, so a replica hits the
previous *prompt*, never the previous answer: the modelled stream of a
conversation holds prompts only (``stream_tokens`` = prompt). A prefix that
different conversations share (a common system prompt: ``preamble_tokens``) is
computed once on a replica and served from its cache ever after; the fleet's
synthetic block hashes are per conversation and cannot share it, so the model
leaves its whole blocks out of the prompts (no prefill, no KV memory) and counts
them as hits. The modelled ``tokens_in_flight`` then lacks them (one 16-token
block per request for the shipped trace, about 2%).

**A recorded trace** (``manage.py export_traffic`` or ``make_recorded_trace``:
a stand-in ``prompt`` per line, one token per word, and its ``prefix_blocks``)
replays the same way, with two differences. Its tag goes after the whole blocks
its conversation's first turn shares with another conversation's first turn (as
the hashes show: a shared system prompt or document), not at the text's start,
so conversations keep sharing what they shared (``tag_at``). And a turn whose
text extends its previous turn's (the export makes it so where the hashes do)
keeps as history the tokens it shares with the previous prompt: all of it but
the previous prompt's closing chat markers (the modelled stream may then hit the
one block that holds them: at most 16 tokens a turn).

The modelled measurement, a fresh one-replica ``FleetSim`` per step, is
``drills.domain.capacity_test``.

Pure: the standard library and ``engine_nodes.domain`` only (the replay counts
tokens with the engine's tokenizer).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from simengine.domain import tokens as tokenizer
from simengine.domain.percentiles import percentile

__all__ = [
    "CapacityAnswer",
    "CapacityCriteria",
    "CapacityStep",
    "ReplayRequest",
    "ReplayTurn",
    "arrival_times",
    "capacity_answer",
    "check_search",
    "judge_step",
    "mean_output_tokens",
    "next_rate",
    "parse_replay_lines",
    "read_replay_trace",
    "replay_tag",
    "replay_turns",
    "search_capacity",
    "step_rates",
]


# -- the rule and the search ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CapacityCriteria:
    """What a step must hold to count (the seed's: p95 TTFT < 1 s, 30 tokens/s)."""

    ttft_p95_max_s: float = 1.0
    stream_min_tokens_per_s: float = 30.0
    stream_quantile: float = 0.5

    def __post_init__(self) -> None:
        if self.ttft_p95_max_s <= 0 or self.stream_min_tokens_per_s <= 0:
            raise ValueError("the TTFT bound and the stream rate must be positive")
        if not 0.0 < self.stream_quantile <= 1.0:
            raise ValueError("stream_quantile must be in (0, 1]")

    def as_dict(self) -> dict[str, float]:
        return {
            "ttft_p95_max_s": self.ttft_p95_max_s,
            "stream_min_tokens_per_s": self.stream_min_tokens_per_s,
            "stream_quantile": self.stream_quantile,
        }


@dataclass(frozen=True, slots=True)
class CapacityStep:
    """One arrival rate's measurements and whether they hold.

    The optional figures are what a measurement could see: ``prefix_hit_rate``
    (prompt tokens served from the prefix cache over prompt tokens, as vLLM's
    ``prefix_cache_hits / prefix_cache_queries``), ``tokens_in_flight`` (the
    gateway's load measure, prompt + ``max_tokens`` - generated over the requests
    in flight, mean over the window) and ``kv_tokens_in_use`` (KV blocks in use x
    block size from the replica's ``/metrics``, mean over the window; live only).
    """

    arrival_rate: float
    offered_tokens_per_s: float
    requests: int
    output_tokens_per_s: float
    ttft_p95_s: float | None
    stream_tokens_per_s_p50: float | None
    stream_tokens_per_s_p5: float | None
    stream_tokens_per_s: float | None  # at the criteria's quantile
    not_started: int
    holds: bool
    holds_strict: bool  # with 95% of streams at the minimum rate
    reasons: tuple[str, ...]
    prefix_hit_rate: float | None = None
    tokens_in_flight: float | None = None
    kv_tokens_in_use: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "arrival_rate": self.arrival_rate,
            "offered_tokens_per_s": self.offered_tokens_per_s,
            "requests": self.requests,
            "output_tokens_per_s": self.output_tokens_per_s,
            "ttft_p95_s": self.ttft_p95_s,
            "stream_tokens_per_s_p50": self.stream_tokens_per_s_p50,
            "stream_tokens_per_s_p5": self.stream_tokens_per_s_p5,
            "stream_tokens_per_s": self.stream_tokens_per_s,
            "not_started": self.not_started,
            "holds": self.holds,
            "holds_strict": self.holds_strict,
            "reasons": list(self.reasons),
            "prefix_hit_rate": self.prefix_hit_rate,
            "tokens_in_flight": self.tokens_in_flight,
            "kv_tokens_in_use": self.kv_tokens_in_use,
        }


@dataclass(frozen=True, slots=True)
class CapacityAnswer:
    """Every step run, and the replica's capacity under the criteria."""

    steps: tuple[CapacityStep, ...]
    criteria: CapacityCriteria
    tokens_per_s: float | None
    arrival_rate: float | None
    strict_tokens_per_s: float | None  # 95% of streams at the minimum rate

    @property
    def best_step(self) -> CapacityStep | None:
        """The step the answer comes from (None when no step held)."""
        held = [s for s in self.steps if s.holds]
        return max(held, key=lambda s: s.output_tokens_per_s, default=None)


def step_rates(
    *,
    start_tokens_per_s: float,
    step_tokens_per_s: float,
    max_tokens_per_s: float,
    answer_tokens: float,
) -> list[float]:
    """Return arrival rates (requests/s) offering ``start``, ``start + step``, ...
    up to ``max`` output tokens/s for answers of ``answer_tokens`` (a mean)."""
    if start_tokens_per_s <= 0 or step_tokens_per_s <= 0 or answer_tokens < 1:
        raise ValueError("start, step and answer tokens must be positive")
    rates = []
    offered = start_tokens_per_s
    while offered <= max_tokens_per_s + 1e-9:
        rates.append(offered / answer_tokens)
        offered += step_tokens_per_s
    return rates


def judge_step(
    *,
    arrival_rate: float,
    offered_tokens_per_s: float,
    requests: int,
    ttfts: Sequence[float],
    stream_rates: Sequence[float],
    not_started: int,
    output_tokens_per_s: float,
    criteria: CapacityCriteria,
    prefix_hit_rate: float | None = None,
    tokens_in_flight: float | None = None,
    kv_tokens_in_use: float | None = None,
) -> CapacityStep:
    """Return the step measured at ``arrival_rate``, judged by ``criteria``.

    ``ttfts`` are those of the requests that arrived in the window and started;
    ``stream_rates`` the token rates of those that finished; ``not_started`` how
    many of them had no first token when the drain ran out.
    """
    ttft_p95 = percentile(ttfts, 0.95)
    p50 = percentile(stream_rates, 0.5)
    p5 = percentile(stream_rates, 0.05)
    judged = percentile(stream_rates, criteria.stream_quantile)
    reasons = []
    if ttft_p95 is None or ttft_p95 >= criteria.ttft_p95_max_s:
        reasons.append("p95 TTFT")
    if not_started:
        reasons.append("requests never started")

    def slow(value: float | None) -> bool:
        return value is None or value < criteria.stream_min_tokens_per_s

    return CapacityStep(
        arrival_rate=arrival_rate,
        offered_tokens_per_s=offered_tokens_per_s,
        requests=requests,
        output_tokens_per_s=output_tokens_per_s,
        ttft_p95_s=ttft_p95,
        stream_tokens_per_s_p50=p50,
        stream_tokens_per_s_p5=p5,
        stream_tokens_per_s=judged,
        not_started=not_started,
        holds=not reasons and not slow(judged),
        holds_strict=not reasons and not slow(p5),
        reasons=(*reasons, *(["stream rate"] if slow(judged) else [])),
        prefix_hit_rate=prefix_hit_rate,
        tokens_in_flight=tokens_in_flight,
        kv_tokens_in_use=kv_tokens_in_use,
    )


def check_search(rates: Sequence[float], stop_after_failures: int) -> None:
    """Raise ValueError for a search that cannot run."""
    if not rates or any(rate <= 0 for rate in rates):
        raise ValueError("give at least one positive arrival rate")
    if stop_after_failures < 1:
        raise ValueError("stop_after_failures must be at least 1")


def next_rate(
    rates: Sequence[float], steps: Sequence[CapacityStep], stop_after_failures: int
) -> float | None:
    """Return the next arrival rate to measure after ``steps``, or None when done.

    Rates run in increasing order; the search ends when they run out or after
    ``stop_after_failures`` steps in a row that failed.
    """
    failures = 0
    for step in steps:
        failures = 0 if step.holds else failures + 1
    ordered = sorted(rates)
    if failures >= stop_after_failures or len(steps) >= len(ordered):
        return None
    return ordered[len(steps)]


def capacity_answer(
    steps: Sequence[CapacityStep], criteria: CapacityCriteria
) -> CapacityAnswer:
    """Return the answer of a search: the highest output tokens/s that held."""
    held = [s for s in steps if s.holds]
    best = max(held, key=lambda s: s.output_tokens_per_s, default=None)
    strict = [s.output_tokens_per_s for s in steps if s.holds_strict]
    return CapacityAnswer(
        steps=tuple(steps),
        criteria=criteria,
        tokens_per_s=best.output_tokens_per_s if best else None,
        arrival_rate=best.arrival_rate if best else None,
        strict_tokens_per_s=max(strict, default=None),
    )


def search_capacity(
    measure: Callable[[float], CapacityStep],
    rates: Sequence[float],
    *,
    criteria: CapacityCriteria,
    stop_after_failures: int = 2,
) -> CapacityAnswer:
    """Measure step after step as ``next_rate`` says; return the answer."""
    check_search(rates, stop_after_failures)
    steps: list[CapacityStep] = []
    while (rate := next_rate(rates, steps, stop_after_failures)) is not None:
        steps.append(measure(rate))
    return capacity_answer(steps, criteria)


# -- the replay of a trace ---------------------------------------------------------

Message = Mapping[str, Any]

# Fixed width: every tag is the same pieces of the tokenizer, whatever its numbers.
_TAG_RATE_SCALE = 1000  # the rate in thousandths of a request per second
_TAG_RATE_MOD = 10**7
_TAG_LAP_MOD = 10**3
_TAG_CONVERSATION_MOD = 10**5


def replay_tag(rate: float, lap: int, conversation: int) -> str:
    """Return the text put before a replayed conversation's first user message.

    It names the conversation first, its digits backwards (so that the tag's
    first piece already differs between conversations, and two of them share no
    more than the trace gave them: their system prompt), and then the step's rate
    and the lap, so that nothing is shared across steps and laps.
    """
    code = round(rate * _TAG_RATE_SCALE) % _TAG_RATE_MOD
    number = f"{conversation % _TAG_CONVERSATION_MOD:05d}"[::-1]
    return f"[{number}.{code:07d}.{lap % _TAG_LAP_MOD:03d}] "


def _tagged(messages: Sequence[Message], tag: str, at: int = 0) -> list[dict[str, Any]]:
    """Return ``messages`` with ``tag`` before the first user message's text, or
    ``at`` characters into it (a text content only)."""
    out = [dict(m) for m in messages]
    for message in out:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [{"type": "text", "text": tag}, *content]
        else:
            text = tokenizer.message_text(content)
            message["content"] = text[:at] + tag + text[at:]
        break
    return out


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One trace line as a replay sends it.

    ``output_tokens`` is the answer's length (sent as ``max_tokens`` with
    ``ignore_eos``). ``prompt_tokens`` and ``history_tokens`` count the tagged
    prompt (any tag: they all count the same): the prompt, and the leading tokens
    it shares with its conversation's previous turn (0 for a first turn, or for a
    turn that does not extend the previous prompt: ``starts_stream``).
    ``conversation_index`` numbers conversations densely, in order of first turn.
    ``preamble_tokens`` is the prefix it shares with another conversation's
    first turn (a common system prompt), which a replica computes once for all.
    ``tag_at`` is where the replay's tag goes in the first user message's text
    (characters; 0 but for a recorded line, see ``parse_replay_lines``).
    """

    t: float
    conversation: str
    conversation_index: int
    team: str
    tier: str
    messages: tuple[Message, ...]
    output_tokens: int
    prompt_tokens: int
    history_tokens: int
    starts_stream: bool
    preamble_tokens: int = 0
    tag_at: int = 0


def _need_number(number: int, raw: Mapping[str, Any], name: str) -> float:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"trace line {number}: {name} is not a number ({value!r})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"trace line {number}: {name} must be >= 0")
    return float(value)


def _need_count(number: int, raw: Mapping[str, Any], name: str) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"trace line {number}: {name} must be a positive integer ({value!r})"
        )
    return value


def _line_messages(number: int, raw: Mapping[str, Any]) -> list[Message]:
    if "messages" in raw:
        messages = raw["messages"]
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and "role" in m for m in messages)
        ):
            raise ValueError(
                f"trace line {number}: messages is not a list of messages with roles"
            )
        return messages
    if isinstance(raw.get("prompt"), str):
        return [{"role": "user", "content": raw["prompt"]}]
    raise ValueError(
        f"trace line {number}: a replay sends text: give messages or a prompt"
    )


def parse_replay_lines(lines: Iterable[str]) -> list[ReplayRequest]:
    """Return the replay of a JSONL trace's lines (blank ones skipped), sorted by
    ``t`` (stable), with each turn's counts.

    Raises:
        ValueError: a line that is not a JSON object or lacks a field, named.
    """
    parsed: list[tuple[float, int, dict[str, Any], list[Message]]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"trace line {number}: not JSON ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"trace line {number}: not a JSON object")
        at = _need_number(number, raw, "t")
        parsed.append((at, number, raw, _line_messages(number, raw)))
    parsed.sort(key=lambda entry: entry[0])
    tags = _recorded_tag_offsets(parsed)
    indexes: dict[str, int] = {}
    previous: dict[str, list[int]] = {}
    previous_text: dict[str, str] = {}
    first_turns: dict[int, list[int]] = {}
    out = []
    for at, number, raw, messages in parsed:
        max_tokens = _need_count(number, raw, "max_tokens")
        output = (
            _need_count(number, raw, "output_tokens")
            if "output_tokens" in raw
            else max_tokens
        )
        conversation = str(raw.get("conversation", f"line-{number}"))
        index = indexes.setdefault(conversation, len(indexes))
        tag_at = tags.get(conversation, 0)
        # Counted with the conversation's own tag: every tag counts the same, and
        # two conversations' prompts then part where a replay makes them part.
        ids = tokenizer.encode(
            tokenizer.render_chat(_tagged(messages, replay_tag(0.0, 0, index), tag_at))
        )
        first_turns.setdefault(index, ids)
        before = previous.get(conversation)
        # Only a turn that extends the whole previous prompt keeps its history
        # (see the module docstring).
        history = (
            len(before)
            if before is not None and _common_prefix(ids, before) == len(before)
            else 0
        )
        text = raw.get("prompt")
        if (
            not history
            and before is not None
            and conversation in tags
            and isinstance(text, str)
            and text.startswith(previous_text.get(conversation, "\x00"))
        ):
            # A recorded prompt extends the previous one's text; the previous
            # prompt's closing chat markers are all it does not share.
            history = _common_prefix(ids, before)
        previous[conversation] = ids
        if isinstance(text, str):
            previous_text[conversation] = text
        out.append(
            ReplayRequest(
                t=at,
                conversation=conversation,
                conversation_index=index,
                team=str(raw.get("team", "default")),
                tier=str(raw.get("tier", "standard")),
                messages=tuple(messages),
                output_tokens=min(output, max_tokens),
                prompt_tokens=len(ids),
                history_tokens=history,
                starts_stream=history == 0,
                tag_at=tag_at,
            )
        )
    preambles = _preambles(first_turns)
    return [
        replace(
            request,
            preamble_tokens=min(
                preambles[request.conversation_index], request.prompt_tokens - 1
            ),
        )
        for request in out
    ]


def _recorded_tag_offsets(
    parsed: Sequence[tuple[float, int, dict[str, Any], list[Message]]],
) -> dict[str, int]:
    """Return where the tag goes in each recorded conversation's prompt text.

    A recorded line (``routing.domain.traffic.trace_lines``: a stand-in
    ``prompt``, one token per word, with ``prefix_blocks``) has no system
    message to tag after: its tag goes after the whole blocks its conversation's
    first turn shares with another conversation's first turn (a shared system
    prompt, as the hashes show), so conversations keep sharing those blocks and
    nothing else, as with a trace's system prompt.
    """
    firsts: dict[str, tuple[str, tuple[str, ...], int]] = {}
    for _at, number, raw, _messages in parsed:
        blocks, size, prompt = (
            raw.get("prefix_blocks"),
            raw.get("block_size"),
            raw.get("prompt"),
        )
        if (
            "messages" in raw
            or not isinstance(prompt, str)
            or not isinstance(blocks, list)
            or not isinstance(size, int)
            or size < 1
        ):
            continue
        conversation = str(raw.get("conversation", f"line-{number}"))
        firsts.setdefault(conversation, (prompt, tuple(map(str, blocks)), size))
    ordered = sorted(firsts, key=lambda c: firsts[c][1])
    shared = dict.fromkeys(firsts, 0)
    for left, right in itertools.pairwise(ordered):
        common = _common_prefix(firsts[left][1], firsts[right][1])
        shared[left] = max(shared[left], common)
        shared[right] = max(shared[right], common)
    offsets = {}
    for conversation, blocks_shared in shared.items():
        prompt, _blocks, size = firsts[conversation]
        pieces = tokenizer.split_pieces(prompt)[: blocks_shared * size]
        offsets[conversation] = len("".join(pieces))
    return offsets


def _preambles(first_turns: Mapping[int, list[int]]) -> dict[int, int]:
    """Return, per conversation, the longest prefix its first turn shares with
    another conversation's (a neighbour in sorted order has it)."""
    ordered = sorted(first_turns, key=lambda index: first_turns[index])
    shared = dict.fromkeys(first_turns, 0)
    for left, right in itertools.pairwise(ordered):
        common = _common_prefix(first_turns[left], first_turns[right])
        shared[left] = max(shared[left], common)
        shared[right] = max(shared[right], common)
    return shared


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def read_replay_trace(path: Path | str) -> list[ReplayRequest]:
    """Read a JSONL trace for a replay (``parse_replay_lines``).

    Raises:
        OSError: the file cannot be read.
        ValueError: a line that cannot be replayed, named.
    """
    with open(path, encoding="utf-8") as handle:
        return parse_replay_lines(handle)


def mean_output_tokens(trace: Iterable[ReplayRequest]) -> float:
    """Return the mean answer length of a trace (what a step's rate offers)."""
    lengths = [r.output_tokens for r in trace]
    if not lengths:
        raise ValueError("the trace has no requests")
    return sum(lengths) / len(lengths)


@dataclass(frozen=True, slots=True)
class ReplayTurn:
    """The ``index``-th request of a step: its trace line, lap and tagged messages."""

    index: int
    lap: int
    request: ReplayRequest
    messages: list[dict[str, Any]]


def replay_turns(trace: Sequence[ReplayRequest], rate: float) -> Iterator[ReplayTurn]:
    """Yield a step's requests: the trace in order, cycling, each lap tagged."""
    if not trace:
        raise ValueError("the trace has no requests")
    index = 0
    while True:
        lap, position = divmod(index, len(trace))
        request = trace[position]
        yield ReplayTurn(
            index=index,
            lap=lap,
            request=request,
            messages=_tagged(
                request.messages,
                replay_tag(rate, lap, request.conversation_index),
                request.tag_at,
            ),
        )
        index += 1


def arrival_times(
    rate: float, seed: int, *, warmup_s: float, duration_s: float
) -> Iterator[float]:
    """Yield a step's arrival times (s from its start) at ``rate`` req/s.

    ``round(rate * warmup_s)`` arrivals fall in the warm-up and ``round(rate *
    duration_s)`` in the window, uniform and sorted in each (a Poisson process
    conditioned on those counts); Poisson arrivals follow, for the drain. Seeded
    by ``seed`` and the rate, so a step's arrivals are the same whichever other
    steps run, here or in the live gate.
    """
    if rate <= 0 or duration_s <= 0 or warmup_s < 0:
        raise ValueError("the rate and the window must be positive, warmup_s >= 0")
    rng = random.Random(f"capacity-step:{seed}:{rate!r}")
    start = 0.0
    for span in (warmup_s, duration_s):
        yield from sorted(
            rng.uniform(start, start + span) for _ in range(round(rate * span))
        )
        start += span
    at = start
    while True:
        at += rng.expovariate(rate)
        yield at
