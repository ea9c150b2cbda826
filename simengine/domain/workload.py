"""A closed-loop load driver for the engine, in virtual time (benchmarks and tests).

Public surface: ``LoadResult``, ``run_closed_loop``.

``streams`` clients each send a request, wait for its last token and send the next one
at once (zero think time), the shape of ``vllm bench serve --max-concurrency``. All
clients start at t = 0, but each one's first request has a random length in
``[1, output_tokens]``, so finishes, and thus arrivals, are spread out from the start.
Time is virtual: the driver jumps from step end to step end, so a minute of replica
time costs about a second of CPU. Only what happens after ``warmup_s`` is measured.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from simengine.domain.engine import Engine, FinishedRequest, SimRequest
from simengine.domain.percentiles import percentile
from simengine.domain.perf import PerfProfile

__all__ = ["LoadResult", "run_closed_loop"]

_FIRST_ID = 1000
_ID_SPAN = 127_000


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What a closed-loop run measured in its window: from the first step that
    starts after ``warmup_s`` to the end of the step that crosses ``warmup_s +
    duration_s`` (``duration_s`` here is that window's actual length).

    Requests count when they finish inside the window with the full ``output_tokens``
    (the shortened first requests never count). ``mean_tpot_ms`` is the mean
    over those requests of ``(finished - first token) / (output - 1)``; TTFT is from
    arrival at the engine to the first token (no frontend time).
    """

    streams: int
    duration_s: float
    output_tokens_per_s: float
    mean_tpot_ms: float
    mean_ttft_ms: float
    p95_ttft_ms: float
    requests_completed: int
    steps: int
    prefix_hit_rate: float
    num_preemptions: int
    simulated_output_tokens: int  # whole run, warmup included (for speed benchmarks)
    simulated_prompt_tokens: int  # prefill tokens computed, whole run


def _prompt(number: int, prompt_tokens: int, shared: list[int]) -> list[int]:
    """Return a prompt whose first non-shared token is unique to request ``number``
    (for fewer than 127,000 requests), so nothing past the shared prefix can hit."""
    unique_len = prompt_tokens - len(shared)
    first = _FIRST_ID + number % _ID_SPAN
    start = _FIRST_ID + (number * 7919) % (_ID_SPAN - unique_len)
    return [*shared, first, *range(start, start + unique_len - 1)]


def run_closed_loop(
    profile: PerfProfile,
    *,
    streams: int,
    prompt_tokens: int,
    output_tokens: int,
    duration_s: float,
    warmup_s: float,
    seed: int = 0,
    shared_prefix_tokens: int = 0,
) -> LoadResult:
    """Drive one engine with ``streams`` closed-loop clients and measure it.

    Every prompt has ``prompt_tokens`` tokens: the first ``shared_prefix_tokens`` are
    the same for all requests (a system prompt), the rest unique per request, so only
    the shared prefix can hit the cache. Every request generates exactly
    ``output_tokens`` tokens (``ignore_eos``).
    """
    if streams < 1 or output_tokens < 1 or duration_s <= 0 or warmup_s < 0:
        raise ValueError("streams, output_tokens and duration_s must be positive")
    if not 0 <= shared_prefix_tokens < prompt_tokens:
        raise ValueError("shared_prefix_tokens must be in [0, prompt_tokens)")
    rng = random.Random(seed)
    shared = [
        rng.randrange(_FIRST_ID, _FIRST_ID + _ID_SPAN)
        for _ in range(shared_prefix_tokens)
    ]
    engine = Engine(profile, seed=seed)
    end_s = warmup_s + duration_s
    number = 0

    def submit(now: float, output_len: int = output_tokens) -> None:
        nonlocal number
        request = SimRequest(
            request_id=f"req-{number}",
            prompt_token_ids=_prompt(number, prompt_tokens, shared),
            output_len=output_len,
        )
        number += 1
        engine.add_request(request, now)

    # Each stream's first request is cut to a random length, as if the clients had
    # been running before t = 0: equal requests started together would otherwise
    # finish together and arrive in lock-step prefill waves for the whole run.
    for _ in range(streams):
        submit(0.0, rng.randint(1, output_tokens))
    now = window_start_s = 0.0
    steps = 0
    measuring = False
    base_tokens = base_queries = base_hits = base_preemptions = 0
    done: list[FinishedRequest] = []
    while now < end_s:
        if not measuring and now >= warmup_s:
            # The window opens at the first step that starts after the warmup.
            measuring = True
            window_start_s = now
            base_tokens = engine.generation_tokens
            base_queries = engine.prefix_cache_queries
            base_hits = engine.prefix_cache_hits
            base_preemptions = engine.num_preemptions
        duration = engine.begin_step(now)
        if duration is None:  # cannot happen in a closed loop; guard the loop anyway
            break
        now += duration
        output = engine.end_step(now)
        if measuring:
            steps += 1
            done.extend(r for r in output.finished if r.output_tokens == output_tokens)
        for _ in output.finished:
            submit(now)

    window_s = now - window_start_s if measuring else 0.0
    tokens = engine.generation_tokens - base_tokens
    queries = engine.prefix_cache_queries - base_queries
    hits = engine.prefix_cache_hits - base_hits
    ttfts_ms = sorted(
        (r.first_token_at - r.arrived_at) * 1000.0
        for r in done
        if r.first_token_at is not None
    )
    tpots_ms = [
        (r.finished_at - r.first_token_at) * 1000.0 / (r.output_tokens - 1)
        for r in done
        if r.first_token_at is not None and r.output_tokens > 1
    ]
    p95_ttft_ms = percentile(ttfts_ms, 0.95)
    return LoadResult(
        streams=streams,
        duration_s=window_s,
        output_tokens_per_s=tokens / window_s if window_s > 0 else 0.0,
        mean_tpot_ms=sum(tpots_ms) / len(tpots_ms) if tpots_ms else math.nan,
        mean_ttft_ms=sum(ttfts_ms) / len(ttfts_ms) if ttfts_ms else math.nan,
        p95_ttft_ms=math.nan if p95_ttft_ms is None else p95_ttft_ms,
        requests_completed=len(done),
        steps=steps,
        prefix_hit_rate=hits / queries if queries else 0.0,
        num_preemptions=engine.num_preemptions - base_preemptions,
        simulated_output_tokens=engine.generation_tokens,
        simulated_prompt_tokens=engine.prompt_tokens_computed,
    )
