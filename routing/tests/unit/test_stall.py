"""The gateway's stall rule (routing.domain.stall), on a moved clock."""

from __future__ import annotations

import pytest

from routing.domain.stall import WaitingStream, stalled_replicas


def waiting(replica: str, sent_at: float) -> WaitingStream:
    return WaitingStream(replica, sent_at, answered_at=None, has_first_token=False)


def streaming(replica: str, answered_at: float) -> WaitingStream:
    return WaitingStream(replica, 0.0, answered_at=answered_at, has_first_token=True)


def test_a_replica_silent_to_a_waiting_request_for_the_rule_is_stalled() -> None:
    streams = [waiting("a", 10.0), waiting("b", 14.0)]
    assert stalled_replicas(streams, now=14.9, after_s=5.0) == {}
    assert stalled_replicas(streams, now=15.0, after_s=5.0) == {"a": 5.0}


def test_new_requests_sent_to_a_silent_replica_do_not_restart_its_clock() -> None:
    streams = [waiting("a", 10.0), waiting("a", 14.5), waiting("a", 14.9)]
    assert stalled_replicas(streams, now=15.0, after_s=5.0) == {"a": 5.0}


def test_a_replica_that_streams_to_anyone_here_is_slow_not_stalled() -> None:
    # A long prefill waits behind streams that move: the clock runs from the
    # last byte of answer, not from the oldest wait.
    streams = [waiting("a", 10.0), streaming("a", 14.0)]
    assert stalled_replicas(streams, now=18.9, after_s=5.0) == {}
    assert stalled_replicas(streams, now=19.0, after_s=5.0) == {"a": 5.0}


def test_streams_alone_never_make_a_stall_only_waiting_requests_do() -> None:
    # Silent streams past their first token are the inter-token timeout's.
    assert stalled_replicas([streaming("a", 0.0)], now=100.0, after_s=5.0) == {}
    assert stalled_replicas([], now=100.0, after_s=5.0) == {}


def test_the_rule_needs_a_positive_time() -> None:
    with pytest.raises(ValueError):
        stalled_replicas([], now=0.0, after_s=0.0)


def test_a_request_answered_whole_never_waits_but_its_answer_is_a_sign_of_life() -> (
    None
):
    # An embeddings request computes in silence: never a stall by this rule.
    whole = WaitingStream(
        "a", 10.0, answered_at=None, has_first_token=False, answers_whole=True
    )
    assert stalled_replicas([whole], now=100.0, after_s=5.0) == {}
    # Once answered, its bytes restart the clock of a stream waiting beside it.
    answered = WaitingStream(
        "a", 10.0, answered_at=14.0, has_first_token=False, answers_whole=True
    )
    streams = [waiting("a", 10.0), answered]
    assert stalled_replicas(streams, now=18.9, after_s=5.0) == {}
    assert stalled_replicas(streams, now=19.0, after_s=5.0) == {"a": 5.0}
