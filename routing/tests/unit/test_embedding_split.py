"""When an embeddings request is split across replicas, and where it is cut."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from routing.domain.embedding_split import DEFAULT_SPLIT_RULE, SplitRule, split_inputs

RULE = SplitRule(min_inputs=8, min_chunk_tokens=100, max_chunks=4)


def test_a_request_under_min_inputs_goes_whole() -> None:
    assert split_inputs([500] * 7, 4, RULE) == [range(7)]


def test_a_request_goes_whole_without_two_idle_replicas() -> None:
    assert split_inputs([50] * 64, 1, RULE) == [range(64)]
    assert split_inputs([50] * 64, 0, RULE) == [range(64)]


def test_chunks_are_never_under_min_chunk_tokens() -> None:
    # 199 tokens cannot make two chunks of 100: whole.
    assert split_inputs([1] * 199, 4, RULE) == [range(199)]
    # 300 make three at most, though four replicas are idle.
    assert len(split_inputs([1] * 300, 4, RULE)) == 3


def test_even_inputs_split_evenly_over_the_idle_replicas() -> None:
    assert split_inputs([10] * 64, 2, RULE) == [range(32), range(32, 64)]
    assert split_inputs([10] * 64, 4, RULE) == [
        range(16),
        range(16, 32),
        range(32, 48),
        range(48, 64),
    ]


def test_no_more_chunks_than_the_rules_cap() -> None:
    assert len(split_inputs([10] * 1024, 16, RULE)) == 4


def test_cuts_follow_the_tokens_not_the_count() -> None:
    # A long first half: its chunk holds fewer inputs.
    tokens = [30] * 10 + [10] * 30
    assert split_inputs(tokens, 2, RULE) == [range(10), range(10, 40)]


def test_the_default_rule_splits_2048_short_texts_and_not_16() -> None:
    assert len(split_inputs([8] * 2048, 4, DEFAULT_SPLIT_RULE)) == 4
    assert split_inputs([8] * 16, 4, DEFAULT_SPLIT_RULE) == [range(16)]


@given(
    tokens=st.lists(st.integers(min_value=1, max_value=300), max_size=200),
    idle=st.integers(min_value=0, max_value=8),
)
def test_chunks_cover_every_input_once_in_order(tokens: list[int], idle: int) -> None:
    chunks = split_inputs(tokens, idle, RULE)
    assert [i for chunk in chunks for i in chunk] == list(range(len(tokens)))
    assert all(len(chunk) > 0 for chunk in chunks) or tokens == []
    assert len(chunks) <= max(1, min(idle, RULE.max_chunks))
