"""The fleet replica: step times from the engine's model, the prefix cache, segments,
and agreement with the exact engine on the same arrivals."""

from __future__ import annotations

import dataclasses
import random

import pytest

from drills.domain.replica import FleetReplica, FleetRequest
from simengine.domain.engine import Engine, EngineConfig, SimRequest
from simengine.domain.percentiles import percentile
from simengine.domain.perf import PROFILES, PerfProfile, step_time_from_totals_ms

PROFILE = PROFILES["a100-8b"]

# (arrived at, conversation, turn in the conversation)
Arrivals = list[tuple[float, int, int]]
# (TTFTs, TPOTs, cached tokens, generated tokens, makespan)
Run = tuple[list[float], list[float], int, int, float]


def request(
    rid: int,
    *,
    conversation: int = 0,
    prompt: int = 1200,
    output: int = 300,
    history: int = 0,
    stream: int = 800,
) -> FleetRequest:
    return FleetRequest(
        rid,
        team="t",
        tier="standard",
        conversation=conversation,
        prompt_tokens=prompt,
        output_tokens=output,
        max_tokens=output,
        history_tokens=history,
        stream_tokens=stream,
        arrived_at=0.0,
    )


def run_alone(
    replica: FleetReplica, now: float = 0.0
) -> tuple[list[FleetRequest], list[FleetRequest], float]:
    """Run the replica until idle; return (first-token events, finished) in order,
    and when it went idle."""
    firsts: list[FleetRequest] = []
    finished: list[FleetRequest] = []
    end = replica.plan(now)
    while end is not None:
        first, done = replica.complete(end)
        firsts += first
        finished += done
        now = end
        end = replica.plan(now)
    return firsts, finished, now


def test_a_lone_request_takes_one_prefill_step_then_one_decode_step_per_token() -> None:
    replica = FleetReplica("r", PROFILE, block_size=16, jitter_cv=0)
    req = request(1, prompt=1000, output=5, stream=0)
    replica.add(req)
    firsts, finished, end = run_alone(replica)
    prefill_ms = step_time_from_totals_ms(
        PROFILE,
        decode_seqs=0,
        kv_tokens=0,
        prefill_tokens=1000,
        prefill_work=1000 * 500,
    )
    decode_ms = [
        step_time_from_totals_ms(
            PROFILE, decode_seqs=1, kv_tokens=1000 + k, prefill_tokens=0, prefill_work=0
        )
        for k in range(1, 5)
    ]
    assert firsts == [req] and finished == [req]
    assert req.first_token_at == pytest.approx(prefill_ms / 1000)
    assert end == pytest.approx((prefill_ms + sum(decode_ms)) / 1000)
    assert replica.generated_tokens == 5
    assert replica.tokens_in_flight() == 0
    assert replica.pool.num_free_blocks == replica.pool.num_blocks - 1


def test_a_later_turn_hits_the_history_its_conversation_left_in_cache() -> None:
    replica = FleetReplica("r", PROFILE, block_size=16, jitter_cv=0)
    first = request(1, conversation=7, history=0, stream=800)
    replica.add(first)
    run_alone(replica)
    second = request(2, conversation=7, history=800, stream=800)
    other = request(3, conversation=8, history=800, stream=800)
    replica.add(second)
    replica.add(other)
    run_alone(replica, now=100.0)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 800  # 50 whole blocks of history
    assert other.cached_tokens == 0  # another conversation's blocks never match


def test_tokens_in_flight_counts_prompt_and_max_tokens_less_generated_as_steps_pass() -> (
    None
):
    replica = FleetReplica("r", PROFILE, block_size=16, jitter_cv=0)
    a, b = request(1, prompt=100, output=50), request(2, prompt=200, output=80)
    replica.add(a)
    replica.add(b)
    assert replica.tokens_in_flight() == 100 + 50 + 200 + 80
    end = replica.plan(0.0)
    assert end is not None
    replica.complete(end)  # both prompts prefilled: one token each
    assert replica.tokens_in_flight() == 430 - 2
    end = replica.plan(end)
    assert end is not None
    segment = replica.segment
    assert segment is not None and segment.steps == 49  # until a's last token
    midway = segment.started_at + segment.elapsed_s(10) + 1e-9
    assert replica.tokens_in_flight(midway) == 430 - 2 - 2 * 10
    replica.complete(end)
    assert replica.tokens_in_flight() == 200 + 80 - 50  # a gone, b made 50 of 80


def test_an_arrival_cuts_the_segment_at_the_end_of_the_step_in_progress() -> None:
    replica = FleetReplica("r", PROFILE, block_size=16, jitter_cv=0)
    replica.add(request(1, prompt=100, output=200))
    prefilled = replica.plan(0.0)
    assert prefilled is not None
    replica.complete(prefilled)
    end = replica.plan(1.0)
    segment = replica.segment
    assert end is not None
    assert segment is not None and segment.steps == 199
    now = (
        1.0 + segment.elapsed_s(3) + 0.5 * (segment.elapsed_s(4) - segment.elapsed_s(3))
    )
    replica.add(request(2, prompt=100, output=10))
    cut = replica.interrupt(now)
    assert cut is not None
    assert cut == pytest.approx(1.0 + segment.elapsed_s(4))
    assert cut < end
    first, _ = replica.complete(cut)
    assert first == []
    replica.plan(cut)
    assert replica.segment is not None and replica.segment.chunks  # request 2 prefills


def test_losing_a_replica_returns_every_request_with_what_it_had_produced() -> None:
    replica = FleetReplica("r", PROFILE, block_size=16, jitter_cv=0)
    running, waiting = request(1, prompt=100, output=100), request(2, prompt=100)
    replica.add(running)
    end = replica.plan(0.0)
    assert end is not None
    replica.complete(end)  # the prompt, and the first token
    replica.plan(end)
    segment = replica.segment
    assert segment is not None
    replica.add(waiting)
    lost = replica.fail(end + segment.elapsed_s(10) + 1e-9)
    assert {r.request_id for r in lost} == {1, 2}
    assert running.tokens_at_failure == 1 + 10
    assert waiting.tokens_at_failure == 0
    assert not replica.alive and replica.tokens_in_flight() == 0


def _poisson_arrivals(
    rate: float, duration: float, *, conversations: int, seed: int
) -> Arrivals:
    rng = random.Random(seed)
    arrivals: Arrivals = []
    at = 0.0
    turn: dict[int, int] = {}
    while True:
        at += rng.expovariate(rate)
        if at >= duration:
            return arrivals
        conv = rng.randrange(conversations)
        arrivals.append((at, conv, turn.get(conv, 0)))
        turn[conv] = turn.get(conv, 0) + 1


def _prompt_ids(
    index: int, conv: int, *, history: int = 800, prompt: int = 1200
) -> list[int]:
    shared = [1000 + conv * 10_000 + k for k in range(history)]
    own = [5_000_000 + index * 10_000 + k for k in range(prompt - history)]
    return shared + own


def _run_engine(arrivals: Arrivals, output: int) -> Run:
    engine = Engine(PROFILE, EngineConfig.from_profile(PROFILE), jitter_cv=0)
    ttft: list[float] = []
    tpot: list[float] = []
    cached = 0
    pending = list(enumerate(arrivals))
    t = 0.0
    while pending or engine.has_work():
        if not engine.has_work():
            t = max(t, pending[0][1][0])
        while pending and pending[0][1][0] <= t:
            index, (at, conv, _) = pending.pop(0)
            engine.add_request(
                SimRequest(f"r{index}", _prompt_ids(index, conv), output), at
            )
        duration = engine.begin_step(t)
        if duration is None:
            continue
        t += duration
        while pending and pending[0][1][0] <= t:
            index, (at, conv, _) = pending.pop(0)
            engine.add_request(
                SimRequest(f"r{index}", _prompt_ids(index, conv), output), at
            )
        for done in engine.end_step(t).finished:
            assert done.first_token_at is not None
            ttft.append(done.first_token_at - done.arrived_at)
            tpot.append((done.finished_at - done.first_token_at) / (output - 1))
            cached += done.cached_tokens
    return ttft, tpot, cached, engine.generation_tokens, t


def _run_fleet_replica(arrivals: Arrivals, output: int) -> Run:
    replica = FleetReplica("r", PROFILE, jitter_cv=0)  # the engine's 16-token blocks
    ttft: list[float] = []
    tpot: list[float] = []
    cached = 0
    pending = list(enumerate(arrivals))
    t = 0.0
    end: float | None = None
    while pending or end is not None:
        if end is None or (pending and pending[0][1][0] < end):
            index, (at, conv, turn) = pending.pop(0)
            req = FleetRequest(
                index,
                team="t",
                tier="standard",
                conversation=conv,
                prompt_tokens=1200,
                output_tokens=output,
                max_tokens=output,
                history_tokens=800 if turn else 0,
                stream_tokens=800,
                arrived_at=at,
            )
            replica.add(req)
            t = at
            cut = replica.plan(t) if end is None else replica.interrupt(t)
            end = cut if cut is not None else end
            continue
        t = end
        _, finished = replica.complete(t)
        for done in finished:
            done.outcome = "ok"
            ttft_s, tpot_s = done.ttft_s, done.tpot_s
            assert ttft_s is not None and tpot_s is not None
            ttft.append(ttft_s)
            tpot.append(tpot_s)
            cached += done.cached_tokens
        end = replica.plan(t)
    return ttft, tpot, cached, replica.generated_tokens, t


@pytest.mark.parametrize("rate", [2.0, 6.0, 12.0])
def test_the_fleet_replica_agrees_with_the_exact_engine_on_the_same_arrivals(
    rate: float,
) -> None:
    arrivals = _poisson_arrivals(rate, 60.0, conversations=40, seed=3)
    exact = _run_engine(arrivals, output=120)
    fast = _run_fleet_replica(arrivals, output=120)
    assert len(exact[0]) == len(fast[0]) == len(arrivals)
    for name, e, f in (
        ("ttft p50", percentile(exact[0], 0.5), percentile(fast[0], 0.5)),
        ("ttft p95", percentile(exact[0], 0.95), percentile(fast[0], 0.95)),
        ("tpot p50", percentile(exact[1], 0.5), percentile(fast[1], 0.5)),
        ("makespan", exact[4], fast[4]),
    ):
        assert f == pytest.approx(e, rel=0.15), name
    assert fast[3] == exact[3]  # every token made, once
    assert fast[2] == pytest.approx(exact[2], rel=0.05)  # the same prefix hits


def _run_both(profile: PerfProfile) -> tuple[float, float]:
    """Run 40 decoding requests on a fleet replica and on the exact engine."""
    replica = FleetReplica("r", profile, block_size=16, jitter_cv=0)
    engine = Engine(
        profile, EngineConfig.from_profile(profile, block_size=16), jitter_cv=0
    )
    for i in range(40):
        replica.add(request(i, prompt=100, output=400, stream=0))
        prompt = list(range(1000 + 100 * i, 1100 + 100 * i))
        engine.add_request(SimRequest(str(i), prompt, output_len=400), 0.0)
    _, finished, end = run_alone(replica)
    now = 0.0
    while (duration := engine.begin_step(now)) is not None:
        now += duration
        engine.end_step(now)
    assert len(finished) == 40
    return end, now


def test_host_bound_steps_take_the_hosts_time_then_the_devices() -> None:
    """GIVEN 40 decodes whose host time (12.4 ms) first exceeds the device's step
    (about 11.7 ms, growing with the KV read) and later falls behind it
    THEN the fleet replica's steps last the longer of the two, as the engine's.
    """
    device_only, _ = _run_both(PROFILE)
    fleet, engine = _run_both(dataclasses.replace(PROFILE, h_ms=0.31))

    assert fleet == pytest.approx(engine, rel=1e-6)
    assert fleet > device_only
