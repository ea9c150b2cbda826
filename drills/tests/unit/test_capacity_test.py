"""The capacity test's pure parts: the rule, the search, the replay of a trace."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from drills.domain.capacity_test import (
    CapacityCriteria,
    CapacityStep,
    arrival_times,
    capacity_answer,
    judge_step,
    next_rate,
    parse_replay_lines,
    replay_arrivals,
    replay_tag,
    replay_turns,
    run_trace_capacity_test,
    search_capacity,
)
from drills.domain.fleet_config import FleetConfig
from simengine.domain import tokens

CRITERIA = CapacityCriteria()
SYSTEM = {"role": "system", "content": "You are the support assistant of Acme."}


def judged(rate: float, **overrides: object) -> CapacityStep:
    values: dict[str, object] = {
        "arrival_rate": rate,
        "offered_tokens_per_s": rate * 250,
        "requests": 4,
        "ttfts": [0.1, 0.2, 0.3, 0.4],
        "stream_rates": [40.0, 35.0, 31.0, 29.0],
        "not_started": 0,
        "output_tokens_per_s": rate * 250,
        "criteria": CRITERIA,
    }
    values.update(overrides)
    return judge_step(**values)  # type: ignore[arg-type]


def step(rate: float, *, holds: bool, output: float | None = None) -> CapacityStep:
    streams = [40.0, 35.0] if holds else [20.0, 25.0]
    return judged(rate, stream_rates=streams, output_tokens_per_s=output or rate * 250)


# -- the rule ---------------------------------------------------------------------------


def test_judge_step_holds_with_fast_streams_and_first_tokens() -> None:
    held = judged(10.0)
    assert held.holds and held.reasons == ()
    assert held.ttft_p95_s == 0.4
    assert held.stream_tokens_per_s == 31.0  # the median, nearest rank
    assert held.stream_tokens_per_s_p5 == 29.0
    assert not held.holds_strict  # a stream under 30 tokens/s


def test_judge_step_names_every_reason_it_fails() -> None:
    failed = judged(10.0, ttfts=[0.5, 1.5], stream_rates=[20.0, 25.0], not_started=1)
    assert not failed.holds
    assert failed.reasons == ("p95 TTFT", "requests never started", "stream rate")


def test_judge_step_fails_without_any_measurement() -> None:
    empty = judged(10.0, ttfts=[], stream_rates=[], requests=0)
    assert not empty.holds
    assert empty.reasons == ("p95 TTFT", "stream rate")


def test_judge_step_stricter_quantile_reads_the_slow_streams() -> None:
    strict = judged(10.0, criteria=CapacityCriteria(stream_quantile=0.05))
    assert strict.stream_tokens_per_s == 29.0 and not strict.holds


# -- the search --------------------------------------------------------------------------


def test_next_rate_goes_up_in_order_and_stops_after_failures_in_a_row() -> None:
    rates = [3.0, 1.0, 2.0, 4.0, 5.0]
    assert next_rate(rates, [], 2) == 1.0
    steps = [step(1.0, holds=True), step(2.0, holds=False)]
    assert next_rate(rates, steps, 2) == 3.0
    steps.append(step(3.0, holds=True))  # a pass resets the count
    steps.append(step(4.0, holds=False))
    assert next_rate(rates, steps, 2) == 5.0
    steps.append(step(5.0, holds=False))
    assert next_rate(rates, steps, 2) is None
    assert next_rate(rates, steps[:2], 1) is None


def test_next_rate_ends_with_the_rates() -> None:
    assert next_rate([1.0], [step(1.0, holds=True)], 2) is None


def test_capacity_answer_is_the_highest_output_that_held() -> None:
    steps = [
        step(1.0, holds=True, output=260.0),
        step(2.0, holds=True, output=240.0),  # noisier window, lower output
        step(3.0, holds=False, output=700.0),
    ]
    answer = capacity_answer(steps, CRITERIA)
    assert answer.tokens_per_s == 260.0 and answer.arrival_rate == 1.0
    assert answer.best_step is steps[0]
    assert capacity_answer(steps[2:], CRITERIA).tokens_per_s is None


def test_search_capacity_measures_each_rate_once_until_it_stops() -> None:
    measured: list[float] = []

    def measure(rate: float) -> CapacityStep:
        measured.append(rate)
        return step(rate, holds=rate <= 2.0)

    answer = search_capacity(
        measure, [4.0, 1.0, 3.0, 2.0, 5.0], criteria=CRITERIA, stop_after_failures=2
    )
    assert measured == [1.0, 2.0, 3.0, 4.0]
    assert answer.tokens_per_s == 500.0 and answer.arrival_rate == 2.0


@pytest.mark.parametrize(("rates", "stop"), [([], 2), ([1.0, 0.0], 2), ([1.0], 0)])
def test_search_capacity_refuses_what_cannot_run(rates: list[float], stop: int) -> None:
    with pytest.raises(ValueError):
        search_capacity(
            lambda rate: step(rate, holds=True),
            rates,
            criteria=CRITERIA,
            stop_after_failures=stop,
        )


# -- the replay ----------------------------------------------------------------------


def test_arrival_times_hold_the_rate_exactly_in_warmup_and_window() -> None:
    times = arrival_times(10.0, 0, warmup_s=5.0, duration_s=20.0)
    first = [next(times) for _ in range(250)]
    assert first == sorted(first)
    assert sum(1 for at in first if at < 5.0) == 50
    assert sum(1 for at in first if 5.0 <= at < 25.0) == 200
    after = [next(times) for _ in range(100)]
    assert all(at >= 25.0 for at in after) and after == sorted(after)


def test_arrival_times_depend_on_the_seed_and_the_rate_only() -> None:
    def head(rate: float, seed: int) -> list[float]:
        times = arrival_times(rate, seed, warmup_s=2.0, duration_s=8.0)
        return [next(times) for _ in range(20)]

    assert head(10.0, 0) == head(10.0, 0)
    assert head(10.0, 0) != head(10.0, 1)
    assert head(10.0, 0) != head(10.5, 0)


def line(t: float, conversation: str, messages: list[dict[str, str]]) -> str:
    return json.dumps(
        {"t": t, "conversation": conversation, "max_tokens": 50, "messages": messages}
    )


def conversation_lines() -> list[str]:
    first = [SYSTEM, {"role": "user", "content": "How do I reset my key?"}]
    second = [
        *first,
        {"role": "assistant", "content": "Open the console and reset it."},
        {"role": "user", "content": "And the old one?"},
    ]
    other = [SYSTEM, {"role": "user", "content": "Why is my bill so high?"}]
    edited = [SYSTEM, {"role": "user", "content": "How do I rotate my key?"}]
    return [
        line(2.0, "a", second),
        line(0.0, "a", first),
        "",
        line(1.0, "b", other),
        line(3.0, "a", edited),
    ]


def test_parse_replay_lines_sorts_by_time_and_counts_shared_history() -> None:
    first, other, second, edited = parse_replay_lines(conversation_lines())
    assert [r.conversation for r in (first, other, second, edited)] == [
        "a",
        "b",
        "a",
        "a",
    ]
    assert first.history_tokens == 0 and first.starts_stream
    # A later turn extends the whole previous prompt: that is its history.
    assert second.history_tokens == first.prompt_tokens and not second.starts_stream
    # An edited history shares less: it starts afresh.
    assert edited.history_tokens == 0 and edited.starts_stream
    assert other.conversation_index == 1 and first.conversation_index == 0
    tagged = tokens.count_chat_tokens(next(replay_turns([second], 3.0)).messages)
    assert second.prompt_tokens == tagged
    # The system prompt (and the chat marker after it) is what conversations share.
    system_tokens = tokens.count_chat_tokens([SYSTEM]) - 2
    assert system_tokens < other.preamble_tokens <= system_tokens + 3
    assert first.output_tokens == 50


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "not a JSON object"),
        ("{nope", "not JSON"),
        ('{"t": 0, "max_tokens": 5}', "give messages or a prompt"),
        ('{"t": -1, "max_tokens": 5, "prompt": "hi"}', "t must be >= 0"),
        ('{"t": 0, "max_tokens": 0, "prompt": "hi"}', "max_tokens must be"),
        ('{"t": 0, "max_tokens": 5, "messages": [{"content": "x"}]}', "roles"),
    ],
)
def test_parse_replay_lines_names_the_bad_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_replay_lines([line(0.0, "a", [SYSTEM]), text])
    assert "trace line 2" in str(caught.value)


def test_a_prompt_line_is_sent_as_one_user_message() -> None:
    (request,) = parse_replay_lines(['{"t": 0, "max_tokens": 5, "prompt": "hi"}'])
    assert request.messages == ({"role": "user", "content": "hi"},)


def test_replay_tags_have_one_width_and_part_conversations_after_the_system() -> None:
    base = [SYSTEM, {"role": "user", "content": "Hello there"}]

    def ids(rate: float, lap: int, conversation: int) -> list[int]:
        tag = replay_tag(rate, lap, conversation)
        messages = [SYSTEM, {"role": "user", "content": tag + "Hello there"}]
        return tokens.encode(tokens.render_chat(messages))

    counts = {len(ids(r, lap, c)) for r, lap, c in [(0, 0, 0), (12.3, 999, 4321)]}
    assert len(counts) == 1
    system = len(tokens.encode(tokens.render_chat(base[:1]))) - 2
    a, b = ids(10.0, 0, 1), ids(10.0, 0, 2)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    # The system message, the user marker, its newline and the tag's bracket.
    assert shared == system + 3


def test_replay_turns_cycle_through_the_trace_tagging_each_lap() -> None:
    trace = parse_replay_lines(conversation_lines())
    turns = replay_turns(trace, 10.0)
    taken = [next(turns) for _ in range(2 * len(trace))]
    assert [t.lap for t in taken] == [0] * len(trace) + [1] * len(trace)
    assert [t.request for t in taken] == trace + trace
    first_user = [
        next(m["content"] for m in t.messages if m["role"] == "user") for t in taken
    ]
    assert first_user[0].startswith(replay_tag(10.0, 0, 0))
    assert first_user[len(trace)].startswith(replay_tag(10.0, 1, 0))
    # The trace's own messages are left as they were.
    assert trace[0].messages[1]["content"] == "How do I reset my key?"


def test_replay_arrivals_keep_a_conversation_on_one_stream_per_lap() -> None:
    trace = parse_replay_lines(conversation_lines())
    arrivals = replay_arrivals(
        trace, 4.0, 0, warmup_s=1.0, duration_s=1.0, block_size=16
    )
    a0, b0, a1, a2, a0_next_lap, *_ = (next(arrivals) for _ in range(8))
    assert a0.conversation == a1.conversation  # the later turn extends it
    assert len({a0.conversation, b0.conversation, a2.conversation}) == 3
    assert a0_next_lap.conversation not in {a0.conversation, b0.conversation}
    # Logged answers are not the replica's: only prompts lie on the stream.
    assert a1.stream_tokens == a1.prompt_tokens
    free = trace[0].preamble_tokens // 16 * 16
    assert a0.prompt_tokens == trace[0].prompt_tokens - free
    assert a1.history_tokens == trace[2].history_tokens - free


def test_run_trace_capacity_test_finds_the_knee_of_a_small_replay() -> None:
    # 1,500-token prompts: prefill alone fills the replica at about 9 req/s.
    long_text = " ".join(["word"] * 1500)
    trace = parse_replay_lines(
        line(
            float(i), f"c{i}", [SYSTEM, {"role": "user", "content": f"{i} {long_text}"}]
        )
        for i in range(20)
    )
    answer = run_trace_capacity_test(
        replace(FleetConfig(replicas=1), block_size=16),
        trace,
        [1.0, 20.0, 40.0],
        duration_s=10.0,
        warmup_s=5.0,
        drain_s=20.0,
    )
    assert [s.holds for s in answer.steps] == [True, False, False]
    assert answer.tokens_per_s == answer.steps[0].output_tokens_per_s
    hit_rate = answer.steps[0].prefix_hit_rate
    # Only the system prompt's block is shared.
    assert hit_rate is not None and 0.0 < hit_rate < 0.02
