"""Per-version live figures for the rollout guards: one bucket of time, summed.

Public surface: ``VersionFigures``, ``Role``, ``ERROR_KINDS``, ``TTFT_BOUNDS_S``,
``OUTPUT_BOUNDS``, ``ttft_bucket``, ``output_bucket``, ``ttft_value``,
``output_value``, ``one_request``, ``one_judgement``, ``JUDGE_OUTCOMES``.

The gateway adds one request's figures at its end (one Redis script, as usage);
the flusher writes each bucket's totals to PostgreSQL; the guards sum buckets over
a window and compare a canary (or shadow) with the live version. Latency and output
length are kept as histograms, not averages, so that a guard can test whole
distributions (Mann-Whitney U) and read a p95 from the same counts.

The buckets are log-spaced: each bound is 10% above the one below it, so a p95
read from the counts is within 10% of the exact one, finer than the +20% TTFT
guard. A histogram is a mapping of bucket index to count; the last index holds
everything above the last bound.

Roles: ``canary`` counts requests the canary split sent to the canary; ``baseline``
those the alias sent to the live version from conversations that began while the
rollout ran (the same kind of traffic as the canary's, which only takes new
conversations: ``routing.domain.sticky``); ``live`` the alias's other requests to
the live version; ``shadow`` the copies sent to a shadow version. Pinned requests
are left out: a team pinning a version chose it. A canary is compared with the
baseline, a shadow with live and baseline together (its copies sample both).

``pool`` is no side of a comparison: it counts every request a pool (version and
region) served, pinned or not, under a rollout or not, so that a pool's live
figures (p95/p99 TTFT, time per output token, prefix hit rate) are always there.
The guards never read it. Only its requests carry the prompt and cached tokens and
the time-per-output-token histogram (``tpot``, on the TTFT bounds).
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "ERROR_KINDS",
    "GUARD_ROLES",
    "JUDGE_OUTCOMES",
    "OUTPUT_BOUNDS",
    "TTFT_BOUNDS_S",
    "Role",
    "VersionFigures",
    "one_judgement",
    "one_request",
    "output_bucket",
    "output_value",
    "tpot_bucket",
    "ttft_bucket",
    "ttft_value",
]


class Role(enum.StrEnum):
    """Which side of a comparison a request counts for."""

    LIVE = "live"
    BASELINE = "baseline"
    CANARY = "canary"
    SHADOW = "shadow"
    POOL = "pool"


# The roles a rollout guard compares (``pool`` is the pools' live figures).
GUARD_ROLES: tuple[Role, ...] = (Role.LIVE, Role.BASELINE, Role.CANARY, Role.SHADOW)


# How a request failed, as the guards count it: ``upstream`` (no replica could
# start an answer: 503 no_replica_available after retries), ``broken`` (the answer
# broke after its first token), ``timeout`` (no first token in time, every retry
# spent), ``error`` (anything else the platform caused). Refusals by limits
# (429, shed) and the client's own errors (4xx) are no error of the version.
ERROR_KINDS: tuple[str, ...] = ("upstream", "broken", "timeout", "error")

# A live-answer judge's verdict on one pair, from the candidate's side: it won,
# lost or tied against the live version's answer to the same request, or the
# judge's reply was unreadable (counted, never for either side).
JUDGE_OUTCOMES: tuple[str, ...] = ("win", "loss", "tie", "unreadable")

_RATIO = 1.1


def _bounds(low: float, high: float) -> tuple[float, ...]:
    count = math.ceil(math.log(high / low) / math.log(_RATIO)) + 1
    return tuple(low * _RATIO**i for i in range(count))


# Upper bounds (inclusive) of the TTFT buckets, 2 ms to about 2 minutes.
TTFT_BOUNDS_S: tuple[float, ...] = _bounds(0.002, 120.0)
# Upper bounds (inclusive) of the output-length buckets, 1 to about 131k tokens;
# below 16 tokens each count has its own bucket (refusals are short).
OUTPUT_BOUNDS: tuple[float, ...] = tuple(
    sorted({float(n) for n in range(1, 17)} | set(_bounds(16.0, 131072.0)))
)


def ttft_bucket(seconds: float) -> int:
    """Return the index of the TTFT bucket holding ``seconds``."""
    return bisect.bisect_left(TTFT_BOUNDS_S, max(0.0, seconds))


def tpot_bucket(seconds: float) -> int:
    """Return the index of the time-per-output-token bucket holding ``seconds``."""
    return ttft_bucket(seconds)


def _quantile(hist: Mapping[int, int], q: float) -> float | None:
    """The ``q`` quantile of a histogram on the TTFT bounds: its bucket's upper
    bound (never below the truth by more than a bucket); None without samples."""
    total = sum(hist.values())
    if not total:
        return None
    rank = q * total
    seen = 0
    for index in sorted(hist):
        seen += hist[index]
        if seen >= rank and index < len(TTFT_BOUNDS_S):
            return TTFT_BOUNDS_S[index]
        if seen >= rank:
            break
    return TTFT_BOUNDS_S[-1] * _RATIO


def output_bucket(tokens: int) -> int:
    """Return the index of the output-length bucket holding ``tokens``."""
    return bisect.bisect_left(OUTPUT_BOUNDS, max(0, tokens))


def _value(bounds: tuple[float, ...], index: int) -> float:
    """A bucket's representative value: the geometric middle of its bounds."""
    if index <= 0:
        return bounds[0]
    if index >= len(bounds):
        return bounds[-1] * _RATIO
    return math.sqrt(bounds[index - 1] * bounds[index])


def ttft_value(index: int) -> float:
    """Return the TTFT (seconds) that bucket ``index`` stands for."""
    return _value(TTFT_BOUNDS_S, index)


def output_value(index: int) -> float:
    """Return the output length (tokens) that bucket ``index`` stands for."""
    if 0 <= index < 16:
        return OUTPUT_BOUNDS[index]  # one count per bucket: exact
    return _value(OUTPUT_BOUNDS, index)


def _add_maps(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0) + value
    return out


def _add_hist(a: Mapping[int, int], b: Mapping[int, int]) -> dict[int, int]:
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0) + value
    return out


@dataclass(frozen=True, slots=True)
class VersionFigures:
    """What one version did for one role over some buckets of time.

    ``requests`` counts every request that reached the version (answered or
    failed); ``answered`` those with a complete answer, which alone have an
    output length, a refusal verdict and (with ``ttft``) a first token. A stream
    that broke mid-way counts its TTFT but no length. ``conversations`` is the sum
    of each bucket's distinct conversations (a conversation active in two buckets
    counts twice): an upper bound, used only as a stage's minimum.
    ``prompt_tokens``, ``cached_tokens`` (of answered requests) and ``tpot`` (time
    per output token after the first, seconds, on the TTFT bounds) are counted for
    the ``pool`` role only.
    """

    requests: int = 0
    answered: int = 0
    refusals: int = 0
    output_tokens: int = 0
    conversations: int = 0
    errors: Mapping[str, int] = field(default_factory=dict)
    ttft: Mapping[int, int] = field(default_factory=dict)
    output: Mapping[int, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tpot: Mapping[int, int] = field(default_factory=dict)
    # Pairs the live-answer judge compared, by the candidate's side of the
    # verdict (``JUDGE_OUTCOMES``): counted on the candidate's own figures, never
    # as requests (``rollouts.domain.guards``' judge guard reads them).
    judged: Mapping[str, int] = field(default_factory=dict)

    def __add__(self, other: VersionFigures) -> VersionFigures:
        return VersionFigures(
            requests=self.requests + other.requests,
            answered=self.answered + other.answered,
            refusals=self.refusals + other.refusals,
            output_tokens=self.output_tokens + other.output_tokens,
            conversations=self.conversations + other.conversations,
            errors=_add_maps(self.errors, other.errors),
            ttft=_add_hist(self.ttft, other.ttft),
            output=_add_hist(self.output, other.output),
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            tpot=_add_hist(self.tpot, other.tpot),
            judged=_add_maps(self.judged, other.judged),
        )

    @property
    def prefix_hit_rate(self) -> float | None:
        """Cached over prompt tokens (None without prompt tokens)."""
        if not self.prompt_tokens:
            return None
        return min(self.cached_tokens, self.prompt_tokens) / self.prompt_tokens

    def tpot_quantile(self, q: float) -> float | None:
        """Return the ``q`` quantile of time per output token in seconds, read
        from the buckets as ``ttft_quantile`` reads TTFT; None without samples."""
        return _quantile(self.tpot, q)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def error_rate(self) -> float | None:
        """Errors over requests (None without requests)."""
        return self.error_count / self.requests if self.requests else None

    @property
    def refusal_rate(self) -> float | None:
        """Refusals over answered requests (None without answers)."""
        return self.refusals / self.answered if self.answered else None

    @property
    def mean_output_tokens(self) -> float | None:
        """Average output tokens of an answered request (None without answers)."""
        return self.output_tokens / self.answered if self.answered else None

    @property
    def ttft_count(self) -> int:
        return sum(self.ttft.values())

    def ttft_quantile(self, q: float) -> float | None:
        """Return the ``q`` quantile of TTFT in seconds, read from the buckets.

        The bucket's upper bound (its lower bound's 10% above), so a reading is
        never below the truth by more than a bucket; None without samples.
        """
        return _quantile(self.ttft, q)

    def to_fields(self) -> dict[str, int]:
        """Return the figures as flat counters (a Redis hash; zeros left out).

        ``requests``, ``answered``, ``refusals``, ``output_tokens``,
        ``conversations``, ``prompt_tokens``, ``cached_tokens``, ``e:<kind>``,
        ``t:<bucket>``, ``o:<bucket>``, ``p:<bucket>`` (time per output token)
        and ``j:<outcome>`` (judged pairs).
        """
        fields_: dict[str, int] = {}
        for name in (
            "requests",
            "answered",
            "refusals",
            "output_tokens",
            "prompt_tokens",
            "cached_tokens",
        ):
            if value := getattr(self, name):
                fields_[name] = value
        if self.conversations:
            fields_["conversations"] = self.conversations
        for head, counts in (
            ("e", self.errors),
            ("t", self.ttft),
            ("o", self.output),
            ("p", self.tpot),
            ("j", self.judged),
        ):
            for label, count in counts.items():
                if count:
                    fields_[f"{head}:{label}"] = count
        return fields_

    @classmethod
    def from_fields(cls, fields_: Mapping[str, int | str]) -> VersionFigures:
        """Return the figures of flat counters (``to_fields``); unknown names are
        ignored, and a counter that is not a non-negative integer raises ValueError.
        """
        plain: dict[str, int] = {}
        errors: dict[str, int] = {}
        ttft: dict[int, int] = {}
        output: dict[int, int] = {}
        tpot: dict[int, int] = {}
        judged: dict[str, int] = {}
        for name, raw in fields_.items():
            value = int(raw)
            if value < 0:
                raise ValueError(f"figure {name!r} is negative: {value}")
            head, _, tail = name.partition(":")
            if not tail:
                plain[head] = value
            elif head == "e":
                errors[tail] = value
            elif head == "t" and tail.isdigit():
                ttft[int(tail)] = value
            elif head == "o" and tail.isdigit():
                output[int(tail)] = value
            elif head == "p" and tail.isdigit():
                tpot[int(tail)] = value
            elif head == "j" and tail in JUDGE_OUTCOMES:
                judged[tail] = value
        return cls(
            requests=plain.get("requests", 0),
            answered=plain.get("answered", 0),
            refusals=plain.get("refusals", 0),
            output_tokens=plain.get("output_tokens", 0),
            conversations=plain.get("conversations", 0),
            errors=errors,
            ttft=ttft,
            output=output,
            prompt_tokens=plain.get("prompt_tokens", 0),
            cached_tokens=plain.get("cached_tokens", 0),
            tpot=tpot,
            judged=judged,
        )

    def to_json(self) -> dict[str, object]:
        """Return the figures as JSON (histograms with string keys)."""
        return {
            "requests": self.requests,
            "answered": self.answered,
            "refusals": self.refusals,
            "output_tokens": self.output_tokens,
            "conversations": self.conversations,
            "errors": dict(self.errors),
            "ttft": {str(k): v for k, v in sorted(self.ttft.items())},
            "output": {str(k): v for k, v in sorted(self.output.items())},
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "tpot": {str(k): v for k, v in sorted(self.tpot.items())},
            "judged": dict(self.judged),
        }


def one_request(
    *,
    ttft_s: float | None,
    output_tokens: int | None,
    error_kind: str | None = None,
    refused: bool = False,
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    tpot_s: float | None = None,
) -> VersionFigures:
    """Return the figures of one request.

    ``ttft_s`` None: no first token. ``output_tokens`` None: no complete answer
    (failed or broken); a complete answer counts as answered with its length and
    refusal verdict. ``error_kind`` one of ``ERROR_KINDS`` for a failed request.
    ``prompt_tokens``, ``cached_tokens`` and ``tpot_s`` (time per output token
    after the first; None: fewer than two tokens) are the pool role's: given only
    for an answer.

    Raises:
        ValueError: an unknown error kind, or an answer that is also an error.
    """
    if error_kind is not None and error_kind not in ERROR_KINDS:
        raise ValueError(f"unknown error kind {error_kind!r}")
    if error_kind is not None and output_tokens is not None:
        raise ValueError("a request with an answer is no error")
    answered = output_tokens is not None
    return VersionFigures(
        requests=1,
        answered=int(answered),
        refusals=int(answered and refused),
        output_tokens=output_tokens or 0,
        errors={error_kind: 1} if error_kind else {},
        ttft={ttft_bucket(ttft_s): 1} if ttft_s is not None else {},
        output={output_bucket(output_tokens): 1} if output_tokens is not None else {},
        prompt_tokens=max(0, prompt_tokens) if answered else 0,
        cached_tokens=max(0, min(cached_tokens, prompt_tokens)) if answered else 0,
        tpot={tpot_bucket(tpot_s): 1} if answered and tpot_s is not None else {},
    )


def one_judgement(outcome: str) -> VersionFigures:
    """Return the figures of one judged pair: the candidate's ``outcome``
    (``JUDGE_OUTCOMES``) and nothing else; it is no request.

    Raises:
        ValueError: an unknown outcome.
    """
    if outcome not in JUDGE_OUTCOMES:
        raise ValueError(f"unknown judge outcome {outcome!r}")
    return VersionFigures(judged={outcome: 1})
