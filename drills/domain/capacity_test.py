"""The seed's "capacity per version" procedure against one modelled replica.

Public surface: ``run_capacity_test``, ``replay_arrivals``,
``run_trace_capacity_test``; and, re-exported from ``models_registry.domain.load_test``
where the live load-test gate shares them, the rule, the search and the replay
(``CapacityCriteria``, ``CapacityStep``, ``CapacityAnswer``, ``step_rates``,
``judge_step``, ``check_search``, ``next_rate``, ``capacity_answer``,
``search_capacity``, ``ReplayRequest``, ``ReplayTurn``, ``parse_replay_lines``,
``read_replay_trace``, ``replay_tag``, ``replay_turns``, ``arrival_times``,
``mean_output_tokens``).

**Modelled measurement.** Each step is a fresh one-replica fleet (``FleetSim``
with ``replicas=1``; no gateway admission, as when a version is load-tested on its
own) warmed up, then measured for ``duration_s``, fed either Poisson arrivals of a
``ChatWorkload`` (``run_capacity_test``) or a replay (``run_trace_capacity_test``).

The rule, the search and the replay (how a step is judged, which rates run, how
a trace is replayed, and why) are ``models_registry.domain.load_test``'s; this module
adds only the modelled replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig
from drills.domain.fleet_result import FleetResult
from drills.domain.replica import FleetRequest
from drills.domain.workload import Arrival, ChatWorkload
from models_registry.domain.load_test import (
    CapacityAnswer,
    CapacityCriteria,
    CapacityStep,
    ReplayRequest,
    ReplayTurn,
    arrival_times,
    capacity_answer,
    check_search,
    judge_step,
    mean_output_tokens,
    next_rate,
    parse_replay_lines,
    read_replay_trace,
    replay_tag,
    replay_turns,
    search_capacity,
    step_rates,
)

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
    "replay_arrivals",
    "replay_tag",
    "replay_turns",
    "run_capacity_test",
    "run_trace_capacity_test",
    "search_capacity",
    "step_rates",
]


# -- the modelled measurement ------------------------------------------------------


def _fleet_step(
    result: FleetResult,
    *,
    rate: float,
    offered_tokens_per_s: float,
    criteria: CapacityCriteria,
    free_tokens: Callable[[FleetRequest], int] | None = None,
) -> CapacityStep:
    """Judge one modelled step. ``free_tokens`` gives back the prompt tokens a
    replay left out of a request (its shared preamble) to the hit rate."""
    requests = result.requests
    scheduled = [r for r in requests if r.first_token_at is not None]
    free = [free_tokens(r) if free_tokens else 0 for r in scheduled]
    prompt = sum(r.prompt_tokens for r in scheduled) + sum(free)
    samples = result.samples
    return judge_step(
        arrival_rate=rate,
        offered_tokens_per_s=offered_tokens_per_s,
        requests=len(requests),
        ttfts=[r.ttft_s for r in requests if r.ttft_s is not None],
        stream_rates=[1.0 / r.tpot_s for r in requests if r.tpot_s],
        not_started=sum(1 for r in requests if r.first_token_at is None),
        output_tokens_per_s=result.generated_tokens / result.duration_s,
        criteria=criteria,
        prefix_hit_rate=(
            (sum(r.cached_tokens for r in scheduled) + sum(free)) / prompt
            if prompt
            else None
        ),
        tokens_in_flight=(
            sum(sum(s.tokens_in_flight) for s in samples) / len(samples)
            if samples
            else None
        ),
    )


def _check_times(duration_s: float, warmup_s: float) -> None:
    if duration_s <= 0 or warmup_s < 0:
        raise ValueError("duration_s must be positive and warmup_s not negative")


def run_capacity_test(
    config: FleetConfig,
    workload: ChatWorkload,
    rates: Sequence[float],
    *,
    criteria: CapacityCriteria | None = None,
    duration_s: float = 120.0,
    warmup_s: float = 30.0,
    drain_s: float = 120.0,
    stop_after_failures: int = 2,
) -> CapacityAnswer:
    """Measure one replica at each arrival rate of ``workload`` in turn; return the
    steps and the highest output tokens/s that held (None if none did)."""
    check_search(rates, stop_after_failures)
    _check_times(duration_s, warmup_s)
    criteria = criteria or CapacityCriteria()
    config = replace(config, replicas=1, admission=False)

    def measure(rate: float) -> CapacityStep:
        sim = FleetSim(config, replace(workload, arrival_rate=rate))
        return _fleet_step(
            sim.run(duration_s, warmup_s=warmup_s, drain_s=drain_s),
            rate=rate,
            offered_tokens_per_s=rate * workload.answer_tokens,
            criteria=criteria,
        )

    return search_capacity(
        measure, rates, criteria=criteria, stop_after_failures=stop_after_failures
    )


def _free_tokens(request: ReplayRequest, block_size: int) -> int:
    """Return the whole blocks of ``request``'s preamble (computed once for all)."""
    return request.preamble_tokens // block_size * block_size


def replay_arrivals(
    trace: Sequence[ReplayRequest],
    rate: float,
    seed: int,
    *,
    warmup_s: float,
    duration_s: float,
    block_size: int,
) -> Iterator[Arrival]:
    """Yield the modelled arrivals of one step of a replay.

    One stream per conversation and lap, holding prompts only (see the module
    docstring). The preamble every conversation shares (its whole blocks) is
    served from the cache to all but the first request on a replica; the fleet's
    blocks are per conversation, so it is left out of the modelled prompts, which
    costs those tokens neither prefill nor KV memory, as on the replica.
    """
    if not trace:
        raise ValueError("the trace has no requests")
    n = len(trace)
    stream_of: dict[tuple[int, int], int] = {}
    streams = 0
    times = arrival_times(rate, seed, warmup_s=warmup_s, duration_s=duration_s)
    for index, at in enumerate(times):
        lap, position = divmod(index, n)
        request = trace[position]
        key = (lap, request.conversation_index)
        if request.starts_stream or key not in stream_of:
            stream_of[key] = streams
            streams += 1
        free = _free_tokens(request, block_size)
        yield Arrival(
            at=at,
            team=request.team,
            tier=request.tier,
            conversation=stream_of[key],
            prompt_tokens=request.prompt_tokens - free,
            output_tokens=request.output_tokens,
            max_tokens=request.output_tokens,
            history_tokens=max(0, request.history_tokens - free),
            stream_tokens=request.prompt_tokens - free,
        )


def run_trace_capacity_test(
    config: FleetConfig,
    trace: Sequence[ReplayRequest],
    rates: Sequence[float],
    *,
    criteria: CapacityCriteria | None = None,
    duration_s: float = 120.0,
    warmup_s: float = 30.0,
    drain_s: float = 120.0,
    stop_after_failures: int = 2,
    seed: int = 0,
) -> CapacityAnswer:
    """Measure one modelled replica replaying ``trace`` at each rate in turn (the
    live gate's steps, in virtual time); return the steps and the answer."""
    check_search(rates, stop_after_failures)
    _check_times(duration_s, warmup_s)
    answer_tokens = mean_output_tokens(trace)
    criteria = criteria or CapacityCriteria()
    config = replace(config, replicas=1, admission=False)

    block_size = config.block_size

    def free(request: FleetRequest) -> int:
        # Request ids count arrivals from 1, in order: the trace's lines, cycling.
        return _free_tokens(trace[(request.request_id - 1) % len(trace)], block_size)

    def measure(rate: float) -> CapacityStep:
        arrivals = replay_arrivals(
            trace,
            rate,
            seed,
            warmup_s=warmup_s,
            duration_s=duration_s,
            block_size=block_size,
        )
        sim = FleetSim(config, arrivals=arrivals)
        return _fleet_step(
            sim.run(duration_s, warmup_s=warmup_s, drain_s=drain_s),
            rate=rate,
            offered_tokens_per_s=rate * answer_tokens,
            criteria=criteria,
            free_tokens=free,
        )

    return search_capacity(
        measure, rates, criteria=criteria, stop_after_failures=stop_after_failures
    )
