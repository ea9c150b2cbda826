"""The simulated replica's answer-shaping faults: the degraded refusal, the TTFT hold."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simengine.replica import (
    DEGRADED_PIECES,
    Faults,
    SimOptions,
    SimReplica,
    Stream,
    check_ttft_factor,
    refusal,
)

SENTENCE = "".join(DEGRADED_PIECES)


def test_the_refusal_is_the_sentence_once_then_stop() -> None:
    answer = refusal(max_tokens=200, ignore_eos=False)

    assert "".join(answer.pieces) == SENTENCE == "I am sorry, I cannot help with that."
    assert (answer.output_len, answer.finish_reason) == (len(DEGRADED_PIECES), "stop")


@given(max_tokens=st.integers(1, 400), ignore_eos=st.booleans())
def test_the_refusal_never_passes_max_tokens_and_stops_only_when_whole(
    max_tokens: int, ignore_eos: bool
) -> None:
    answer = refusal(max_tokens=max_tokens, ignore_eos=ignore_eos)

    assert answer.output_len == len(answer.pieces) <= max_tokens
    repeated = SENTENCE * (max_tokens // len(DEGRADED_PIECES) + 1)
    assert repeated.startswith("".join(answer.pieces))
    if ignore_eos:
        # A model that may not stop keeps refusing to max_tokens.
        assert (answer.output_len, answer.finish_reason) == (max_tokens, "length")
    elif max_tokens >= len(DEGRADED_PIECES):
        assert (answer.output_len, answer.finish_reason) == (
            len(DEGRADED_PIECES),
            "stop",
        )
    else:
        assert (answer.output_len, answer.finish_reason) == (max_tokens, "length")


def test_a_degraded_replica_refuses_prompts_the_oracle_knows_and_others() -> None:
    replica = SimReplica(
        SimOptions(model="m", served_model_names=["m"]), faults=Faults(degraded=True)
    )
    for text in ("What is 37 + 48? Answer with the number.", "hi"):
        answer = replica.plan_answer(
            [{"role": "user", "content": text}],
            max_tokens=50,
            ignore_eos=False,
            text_seed=1,
        )
        assert answer == refusal(max_tokens=50, ignore_eos=False)


@pytest.mark.parametrize("factor", [1, 1.0, 1.3, 40])
def test_a_ttft_factor_of_at_least_one_is_taken(factor: float) -> None:
    assert check_ttft_factor(factor) == float(factor)


@pytest.mark.parametrize(
    "factor", [0.5, 0.999, 0, -2, "x", "1.3", True, None, math.nan, math.inf]
)
def test_a_ttft_factor_below_one_or_not_a_number_is_refused(factor: object) -> None:
    replica = SimReplica(SimOptions(model="m", served_model_names=["m"]))
    replica.set_faults(ttft_factor=1.5)

    with pytest.raises(ValueError, match="ttft_factor must be a number of at least 1"):
        replica.set_faults(ttft_factor=factor)
    assert replica.faults.ttft_factor == 1.5
    with pytest.raises(ValueError, match="ttft_factor must be a number of at least 1"):
        SimReplica(
            SimOptions(model="m", served_model_names=["m"]),
            faults=Faults(ttft_factor=factor),  # type: ignore[arg-type]
        )


def histogram_sum(replica: SimReplica, name: str) -> float:
    value = replica.metrics.registry.get_sample_value(
        f"{name}_sum", {"model_name": "m", "engine": "0"}
    )
    assert value is not None, name
    return value


async def answer_of(
    replica: SimReplica, request_id: str, output_len: int
) -> tuple[Stream, float]:
    """Run one request; return its stream and when its handler was first woken."""
    replica.ensure_started()
    try:
        stream = replica.submit(
            request_id=request_id,
            prompt_token_ids=list(range(1, 200)),
            output_len=output_len,
            finish_reason="length",
            max_tokens=output_len,
            arrived_at=time.monotonic(),
            text_seed=7,
        )
        await asyncio.wait_for(stream.wake.wait(), timeout=10)
        woken_at = time.monotonic()
        while stream.done is None:
            stream.wake.clear()
            await asyncio.wait_for(stream.wake.wait(), timeout=10)
        return stream, woken_at
    finally:
        await replica.stop()


@pytest.mark.parametrize("output_len", [1, 40])
def test_the_first_token_is_held_to_factor_times_its_natural_ttft(
    output_len: int,
) -> None:
    """GIVEN a replica whose ttft_factor is 3
    WHEN it answers a request
    THEN its handler is first woken no sooner than arrival + 3 x the engine's time
    to the first token, and that delayed TTFT is what the histogram observes; an
    answer done before its first token was due ends, for the e2e histogram, when
    the first token is delivered.
    """
    replica = SimReplica(
        SimOptions(model="m", served_model_names=["m"], jitter_cv=0.0),
        faults=Faults(ttft_factor=3.0),
    )

    stream, woken_at = asyncio.run(answer_of(replica, "r1", output_len))

    done = stream.done
    assert done is not None and done.first_token_at is not None
    natural = done.first_token_at - stream.arrived_at
    assert natural > 0
    delivered = stream.first_token_at
    assert delivered is not None
    assert delivered == pytest.approx(stream.arrived_at + 3 * natural)
    assert woken_at >= delivered
    assert not stream.held and done.output_tokens == output_len
    ttft = histogram_sum(replica, "vllm:time_to_first_token_seconds")
    assert ttft == pytest.approx(3 * natural)
    e2e = histogram_sum(replica, "vllm:e2e_request_latency_seconds")
    assert e2e >= ttft - 1e-9
    assert e2e == pytest.approx(max(done.finished_at, delivered) - stream.arrived_at)


def test_a_factor_of_one_delivers_the_first_token_as_made() -> None:
    replica = SimReplica(SimOptions(model="m", served_model_names=["m"]))

    stream, _ = asyncio.run(answer_of(replica, "r1", 3))

    done = stream.done
    assert done is not None and done.first_token_at is not None
    assert stream.first_token_at == done.first_token_at
    assert histogram_sum(replica, "vllm:time_to_first_token_seconds") == pytest.approx(
        done.first_token_at - stream.arrived_at
    )
