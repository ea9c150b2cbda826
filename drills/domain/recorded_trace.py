"""Recorded-shaped traces: a workload's arrivals as the traffic twin records them,
and a recorded trace replayed at another scale.

Public surface: ``RECORDED_WORKLOAD``, ``records_of``, ``scale_trace``,
``trace_hit_rate``, ``TraceWorkload``, ``trace_workload``.

**Generated, not live.** ``records_of`` turns a ``ChatWorkload``'s arrivals
(``drills.domain.routing_ab.generate_arrivals``) into
``routing.domain.traffic.TrafficRecord`` values as a gateway would record them:
each arrival gets stand-in token ids (its shared prefix's, then its
conversation's stream, then its own new text; ids are a pure function of the
prefix, conversation or request number and the position), hashed into the
chain of salted block hashes the twin keeps. ``trace_lines`` then exports them
exactly as ``manage.py export_traffic`` exports real records, stand-in text
included. ``RECORDED_WORKLOAD`` is the shipped trace's workload (chats that grow
turn after turn behind eight shared prefixes: a system prompt or a RAG document,
Zipf-popular), so the trace has a production-like prefix structure; it is not a
recording of anyone's traffic (the live twin run records real requests).

**Scaling a recorded trace** (``scale_trace``, "what if traffic doubles"): a
factor ``x`` keeps every conversation and adds ``x - 1`` clones of each (the
fractional part: that share of conversations, drawn by a seeded coin). A clone
is a new conversation: its own blocks (those of the trace that only its
original conversation has) are re-hashed with the clone's number, so its
history is its own, while blocks that several conversations of the trace share
(a system prompt, a document) stay as they are and are shared by the clones as
by the originals. Each clone arrives ``offset`` seconds later, drawn per clone
uniformly within one mean gap between a conversation's turns, so the day's shape
is kept and clones do not arrive in lockstep with their originals. ``x < 1``
keeps that share of the conversations. Compressing the timeline instead would
double the rate but also halve the time between a conversation's turns (a
cache holds a conversation's history half as long): the clone keeps the prefix
structure honest.

``trace_hit_rate`` is the share of prompt tokens an unbounded prefix cache
would serve (whole blocks whose hash an earlier line produced, prompt and
answer: ``drills.domain.workload.trace_arrivals``), the trace's own measure of
its prefix structure.

**A plan's workload from a trace** (``trace_workload``, ``capacity_plan
--trace``): the peak arrival rate (the busiest ``window_s`` of the trace, times
the rate scale), the mean prompt and answer, the mean cacheable prefix (whole
blocks an earlier line produced: what a replica that holds everything would
serve) and, where the trace has the replicas' own hits (an export's
``cached_tokens``), the measured share of that prefix the fleet served: the
plan's ``prefix_hit_rate``; the mean time between a conversation's turns is its
``message_interval_s`` (how long a replica must hold a history). A generated trace has no measured hits; the plan
keeps its own figure then.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from drills.domain.workload import Arrival, ChatWorkload, TraceRequest, trace_arrivals
from routing.domain.traffic import TrafficRecord, block_chain

__all__ = [
    "RECORDED_WORKLOAD",
    "TraceWorkload",
    "records_of",
    "scale_trace",
    "trace_hit_rate",
    "trace_workload",
]

# The shipped recorded-shaped trace's workload: growing chats (150 new tokens a
# turn, 250-token answers, 3 turns) behind 8 shared prefixes of 150-350 tokens.
RECORDED_WORKLOAD = ChatWorkload(
    arrival_rate=5.0,
    message_interval_s=30.0,
    mode="growing",
    prompt_tokens=400,
    history_tokens=250,
    answer_tokens=250,
    max_tokens=250,
    conversation_turns=3,
    max_context_tokens=4096,
    shared_prefixes=8,
    shared_prefix_tokens=(150, 350),
)

_PREFIX_BASE = 0x1000_0000
_STREAM_STRIDE = 1_000_003  # odd: conversation c's position i is c * stride + i
_OWN_BASE = 0x8000_0000
_MASK32 = 0xFFFF_FFFF


def _prompt_ids(arrival: Arrival, number: int) -> list[int]:
    prefix = arrival.prefix_tokens
    group = arrival.prefix_group
    ids = [_PREFIX_BASE + (group << 16) + i for i in range(prefix)]
    on_stream = max(0, min(arrival.prompt_tokens, arrival.stream_tokens) - prefix)
    base = arrival.conversation * _STREAM_STRIDE
    ids.extend((base + i) & _MASK32 for i in range(on_stream))
    own = arrival.prompt_tokens - len(ids)
    start = number * _STREAM_STRIDE
    ids.extend(_OWN_BASE | ((start + i) & 0x7FFF_FFFF) for i in range(own))
    return ids


def records_of(
    arrivals: Iterable[Arrival],
    *,
    salt: bytes,
    start: float = 0.0,
    block_size: int = 16,
    model: str = "chat",
    version: str = "generated",
) -> list[TrafficRecord]:
    """Return the traffic twin's records of ``arrivals`` (see the module)."""
    records = []
    for number, arrival in enumerate(arrivals):
        ids = _prompt_ids(arrival, number)
        records.append(
            TrafficRecord(
                at=start + arrival.at,
                team=arrival.team,
                tier=arrival.tier,
                model=model,
                version=version,
                surface="chat",
                prompt_tokens=arrival.prompt_tokens,
                max_tokens=arrival.max_tokens,
                output_tokens=arrival.output_tokens,
                cached_tokens=0,
                key=f"conversation-{arrival.conversation}",
                replica="",
                outcome="ok",
                block_size=block_size,
                blocks=tuple(block_chain(ids, block_size=block_size, salt=salt)),
            )
        )
    return records


def scale_trace(
    trace: Sequence[TraceRequest], factor: float, *, seed: int = 0
) -> list[TraceRequest]:
    """Return ``trace`` at ``factor`` times its conversations (see the module).

    Raises:
        ValueError: ``factor`` is not positive.
    """
    if not factor > 0:
        raise ValueError("the trace's rate scale must be positive")
    if factor == 1.0:
        return list(trace)
    rng = random.Random(f"scale-trace:{seed}")
    owners: dict[str, set[str]] = {}
    turns: dict[str, list[TraceRequest]] = {}
    for request in trace:
        turns.setdefault(request.conversation, []).append(request)
        for block in request.prefix_blocks:
            owners.setdefault(block, set()).add(request.conversation)
    gap = _mean_turn_gap(turns.values())
    whole, fraction = divmod(factor, 1.0)
    out: list[TraceRequest] = []
    for lines in turns.values():
        copies = int(whole) + (rng.random() < fraction)
        for copy in range(copies):
            if copy == 0:
                out.extend(lines)
                continue
            offset = rng.uniform(0.0, gap)
            out.extend(
                _clone(line, copy, offset, lambda b: len(owners[b]) > 1)
                for line in lines
            )
    out.sort(key=lambda r: r.t)
    return out


def _mean_turn_gap(conversations: Iterable[list[TraceRequest]]) -> float:
    gaps = [b.t - a.t for lines in conversations for a, b in itertools.pairwise(lines)]
    return statistics.fmean(gaps) if gaps else 1.0


def _clone(
    line: TraceRequest, copy: int, offset: float, shared: Callable[[str], bool]
) -> TraceRequest:
    blocks = tuple(
        block if shared(block) else _rehash(block, copy) for block in line.prefix_blocks
    )
    return replace(
        line,
        t=line.t + offset,
        conversation=f"{line.conversation}~{copy}",
        prefix_blocks=blocks,
    )


def _rehash(block: str, copy: int) -> str:
    return hashlib.blake2b(f"{copy}:{block}".encode(), digest_size=8).hexdigest()


def trace_hit_rate(trace: Sequence[TraceRequest]) -> float | None:
    """Return the share of prompt tokens an unbounded prefix cache would serve
    (whole blocks, below the last prompt token), or None for an empty trace."""
    prompt = cached = 0
    for arrival in trace_arrivals(trace):
        size = arrival.block_keys_size or 1
        limit = (arrival.prompt_tokens - 1) // size * size
        cached += min(arrival.history_tokens, limit)
        prompt += arrival.prompt_tokens
    return cached / prompt if prompt else None


@dataclass(frozen=True, slots=True)
class TraceWorkload:
    """What a trace says of the workload a plan is for (see the module)."""

    requests: int
    span_s: float
    peak_rps: float  # the busiest window's requests/s, times the rate scale
    prompt_tokens: float
    answer_tokens: float
    cached_prefix_tokens: float
    unbounded_hit_rate: float  # cacheable prefix over prompt tokens
    measured_hit_rate: float | None  # the replicas' hits over the cacheable prefix
    prompt_p95_tokens: float
    turn_gap_s: float | None = None  # mean time between a conversation's turns

    def scenario_values(self, stream_tokens_per_s: float) -> dict[str, object]:
        """Return the capacity plan's keys this workload sets: its peak as
        streams (``requests/s x answer / stream speed``), its prompt, answer and
        cacheable prefix, and the measured hit rate where there is one."""
        values: dict[str, object] = {
            "peak_streams": round(
                self.peak_rps * self.answer_tokens / stream_tokens_per_s, 1
            ),
            "answer_tokens": round(self.answer_tokens, 1),
            "prompt_tokens": round(self.prompt_tokens, 1),
            "cached_prefix_tokens": round(
                min(self.cached_prefix_tokens, self.prompt_tokens), 1
            ),
        }
        if self.measured_hit_rate is not None:
            values["prefix_hit_rate"] = round(self.measured_hit_rate, 3)
        if self.turn_gap_s is not None:
            values["message_interval_s"] = round(self.turn_gap_s, 1)
        return values


def trace_workload(
    trace: Sequence[TraceRequest],
    *,
    rate_scale: float = 1.0,
    window_s: float = 60.0,
) -> TraceWorkload:
    """Return the workload ``trace`` shows (its lines' ``cached_tokens`` all zero:
    no hit measured).

    Raises:
        ValueError: an empty trace, or a scale or window that is not positive.
    """
    if not trace:
        raise ValueError("the trace has no requests")
    if not rate_scale > 0 or not window_s > 0:
        raise ValueError("the rate scale and the window must be positive")
    times = sorted(r.t for r in trace)
    span = times[-1] - times[0]
    window = min(window_s, span) if span > 0 else 1.0
    busiest = 0
    start = 0
    for end, at in enumerate(times):
        while at - times[start] >= window:
            start += 1
        busiest = max(busiest, end - start + 1)
    cacheable: list[int] = []
    for arrival in trace_arrivals(trace):
        size = arrival.block_keys_size or 1
        limit = (arrival.prompt_tokens - 1) // size * size
        cacheable.append(min(arrival.history_tokens, limit))
    n = len(trace)
    prompts = sorted(r.prompt_tokens for r in trace)
    measured: float | None = None
    if any(r.cached_tokens for r in trace) and sum(cacheable) > 0:
        served = sum(
            min(r.cached_tokens, most) for r, most in zip(trace, cacheable, strict=True)
        )
        measured = served / sum(cacheable)
    return TraceWorkload(
        requests=n,
        span_s=span,
        peak_rps=busiest / window * rate_scale,
        prompt_tokens=statistics.fmean(prompts),
        answer_tokens=statistics.fmean(r.output_tokens for r in trace),
        cached_prefix_tokens=statistics.fmean(cacheable),
        unbounded_hit_rate=sum(cacheable) / sum(prompts),
        measured_hit_rate=measured,
        prompt_p95_tokens=prompts[min(n - 1, int(0.95 * n))],
        turn_gap_s=_turn_gap(trace),
    )


def _turn_gap(trace: Sequence[TraceRequest]) -> float | None:
    turns: dict[str, list[TraceRequest]] = {}
    for request in trace:
        turns.setdefault(request.conversation, []).append(request)
    if all(len(lines) < 2 for lines in turns.values()):
        return None
    return _mean_turn_gap(turns.values())
