"""The routing A/B's workloads: the seed's chat unchanged, shared prefixes (RAG,
few-shot) and agent loops; their shapes, their determinism per seed, and the
synthetic block hashes that make a shared prefix shared."""

from __future__ import annotations

from collections import Counter

import pytest

from drills.domain.replica import request_block_hashes
from drills.domain.routing_ab import generate_arrivals
from drills.domain.workload import (
    WORKLOADS,
    ChatWorkload,
    prefix_tokens_of,
    workload_preset,
)

BS = 64


def test_presets_are_the_named_workloads() -> None:
    assert WORKLOADS == ("seed", "shared", "agent")
    assert workload_preset("seed") == ChatWorkload()
    assert workload_preset("shared", arrival_rate=7).arrival_rate == 7
    with pytest.raises(ValueError, match="seed, shared, agent"):
        workload_preset("batch")


def test_seed_chat_has_no_shared_prefix_and_keeps_its_draws() -> None:
    arrivals = generate_arrivals(ChatWorkload(arrival_rate=20), 30, seed=1)
    assert {(a.prefix_group, a.prefix_tokens) for a in arrivals} == {(-1, 0)}
    assert {a.prompt_tokens for a in arrivals} == {1200}


def test_arrivals_are_deterministic_per_seed() -> None:
    for name in WORKLOADS:
        workload = workload_preset(name, arrival_rate=20)
        one = generate_arrivals(workload, 30, seed=5)
        assert one == generate_arrivals(workload, 30, seed=5)
        assert one != generate_arrivals(workload, 30, seed=6)


def test_shared_prefix_leads_every_prompt_and_counts_as_history() -> None:
    workload = workload_preset("shared", arrival_rate=50)
    arrivals = generate_arrivals(workload, 120, seed=2)
    groups: dict[int, int] = {}
    for a in arrivals:
        assert 0 <= a.prefix_group < 16
        assert a.prefix_tokens == prefix_tokens_of(workload, a.prefix_group)
        assert 1500 <= a.prefix_tokens <= 3000
        assert a.prompt_tokens == a.prefix_tokens + 1200
        assert a.stream_tokens == a.prefix_tokens + 800
        # The prefix is history from the first turn on; later turns add 800.
        assert a.history_tokens in (a.prefix_tokens, a.prefix_tokens + 800)
        # A conversation keeps the prefix it was bound to at its start.
        assert groups.setdefault(a.conversation, a.prefix_group) == a.prefix_group
    popularity = Counter(groups.values())
    assert popularity[0] == max(popularity.values())  # Zipf: prefix 0 leads
    assert len(popularity) >= 12


def test_agent_contexts_grow_in_tool_sized_steps_up_to_32k() -> None:
    workload = workload_preset("agent", arrival_rate=20)
    arrivals = generate_arrivals(workload, 600, seed=0)
    last: dict[int, int] = {}
    turns: Counter[int] = Counter()
    for a in arrivals:
        assert a.output_tokens == 100 and a.prompt_tokens + a.max_tokens <= 32_768
        previous = last.get(a.conversation)
        if previous is not None:
            # The last prompt, its 100-token answer and a 1,000-token tool result.
            assert a.prompt_tokens == previous + 100 + 1000
            assert a.history_tokens == previous + 100
        last[a.conversation] = a.prompt_tokens
        turns[a.conversation] += 1
    assert max(last.values()) > 30_000
    assert max(turns.values()) >= 25  # long tool-call loops


def test_shared_prefix_blocks_are_shared_across_conversations_not_groups() -> None:
    a = request_block_hashes(1, 40, BS, prefix_group=3, prefix_tokens=1000)
    b = request_block_hashes(2, 40, BS, prefix_group=3, prefix_tokens=1000)
    c = request_block_hashes(1, 40, BS, prefix_group=4, prefix_tokens=1000)
    whole = 1000 // BS  # 15 whole blocks; the 16th straddles into the conversation
    assert a[:whole] == b[:whole]
    assert not set(a[whole:]) & set(b[whole:])
    assert not set(a[:whole]) & set(c[:whole])
    plain = request_block_hashes(1, 40, BS)  # no prefix: the stream's from block 0
    assert not set(plain) & set(a[:whole])
