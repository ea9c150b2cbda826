"""A recorded trace's hashed prefixes become the fleet simulator's cache hits."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig
from drills.domain.workload import (
    convert_block_keys,
    read_trace,
    recorded_block_key,
    trace_arrivals,
)
from routing.domain.traffic import TrafficRecord, block_chain, trace_lines
from simengine.domain.prefix_cache import hash_full_blocks, max_cache_hit_blocks

SALT = b"k" * 32
BLOCK = 16


def _record(at: float, key: str, ids: list[int], output: int) -> TrafficRecord:
    return TrafficRecord(
        at=at,
        team="team-a",
        tier="standard",
        model="m",
        version="v1",
        surface="chat",
        prompt_tokens=len(ids),
        max_tokens=output,
        output_tokens=output,
        cached_tokens=0,
        key=key,
        replica="r0",
        outcome="ok",
        block_size=BLOCK,
        blocks=tuple(block_chain(ids, block_size=BLOCK, salt=SALT)),
    )


def _write(tmp_path: Path, records: list[TrafficRecord]) -> Path:
    lines, _ = trace_lines(records, salt=SALT, stand_in_text=False)
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _replay(path: Path, block_size: int = BLOCK) -> list[int]:
    """Return each request's cached tokens, in arrival order, on one replica."""
    config = FleetConfig(replicas=1, block_size=block_size, jitter_cv=0.0)
    arrivals = list(trace_arrivals(read_trace(path)))
    result = FleetSim(config, arrivals=arrivals).run(arrivals[-1].at + 1, drain_s=600)
    ordered = sorted(result.requests, key=lambda r: r.arrived_at)
    assert all(r.outcome == "ok" for r in ordered)
    return [r.cached_tokens for r in ordered]


def _system_prompt_records(
    conversations: int, system: list[int], seed: int
) -> list[TrafficRecord]:
    rng = random.Random(seed)
    return [
        _record(
            30.0 * n,
            f"conv-{n}",
            system + [rng.randrange(1000, 9000) for _ in range(100)],
            20,
        )
        for n in range(conversations)
    ]


def test_a_shared_system_prompt_hits_across_conversations(tmp_path: Path) -> None:
    system = list(range(1000, 1000 + 10 * BLOCK))  # 10 full blocks
    hits = _replay(_write(tmp_path, _system_prompt_records(6, system, 1)))
    assert hits[0] == 0
    assert hits[1:] == [10 * BLOCK] * 5


def test_disjoint_prefixes_never_hit(tmp_path: Path) -> None:
    records = [
        _record(30.0 * n, f"conv-{n}", [n * 10_000 + i for i in range(260)], 20)
        for n in range(6)
    ]
    assert _replay(_write(tmp_path, records)) == [0] * 6


def test_a_larger_simulator_block_keeps_the_exact_hits(tmp_path: Path) -> None:
    system = list(range(1000, 1000 + 10 * BLOCK))  # 160 tokens: 2 blocks of 64
    hits = _replay(_write(tmp_path, _system_prompt_records(4, system, 2)), 64)
    assert hits == [0, 128, 128, 128]


def test_block_keys_convert_to_multiples_and_refuse_the_rest() -> None:
    keys = tuple(recorded_block_key(f"{n:016x}") for n in range(8))
    assert convert_block_keys(keys, 16, 64) == (keys[3], keys[7])
    assert convert_block_keys(keys, 16, 16) == keys
    with pytest.raises(ValueError, match="not a multiple"):
        convert_block_keys(keys, 16, 24)
    with pytest.raises(ValueError, match="not a multiple"):
        convert_block_keys(keys, 64, 16)


def test_a_bad_prefix_blocks_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    line = {"t": 0, "prompt_tokens": 40, "max_tokens": 5, "prefix_blocks": ["zz"]}
    path.write_text(json.dumps({**line, "block_size": 16}) + "\n")
    with pytest.raises(ValueError, match="line 1: prefix_blocks is not a list"):
        read_trace(path)
    path.write_text(json.dumps({**line, "prefix_blocks": ["ab"]}) + "\n")
    with pytest.raises(ValueError, match="line 1: prefix_blocks needs a block_size"):
        read_trace(path)


def _reference_hits(prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
    """An unbounded prefix cache on token ids, one request at a time (the engine's
    own chained hashes): each request's hit, then its prompt and answer cached
    (the last answer token's KV is never computed)."""
    cached: set[int] = set()
    hits = []
    for prompt, output in zip(prompts, outputs, strict=True):
        hashes = hash_full_blocks(prompt, BLOCK)
        limit = max_cache_hit_blocks(len(prompt), BLOCK)
        hit = 0
        while hit < limit and hashes[hit] in cached:
            hit += 1
        hits.append(hit * BLOCK)
        # The last answer token's KV is never computed.
        cached.update(hash_full_blocks(prompt + output[:-1], BLOCK))
    return hits


_turn = st.tuples(
    st.integers(0, 3),  # the conversation
    st.integers(1, 60),  # new tokens
    st.integers(1, 40),  # answer tokens
)


@settings(max_examples=25, deadline=None)
@given(
    system=st.integers(0, 5).map(lambda n: list(range(500, 500 + n * 20))),
    turns=st.lists(_turn, min_size=1, max_size=10),
)
def test_hits_from_hashes_equal_hits_from_token_ids(
    system: list[int],
    turns: list[tuple[int, int, int]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Conversations behind a shared system prompt, each turn its prompt, its
    answer and new text: the replay of the hashes hits as a cache on the ids."""
    history: dict[int, list[int]] = {}
    prompts, outputs, records = [], [], []
    counter = 10_000
    for n, (conversation, new, answer) in enumerate(turns):
        fresh = list(range(counter, counter + new))
        counter += new
        prompt = history.get(conversation, system) + fresh
        output = list(range(counter, counter + answer))
        counter += answer
        history[conversation] = prompt + output
        prompts.append(prompt)
        outputs.append(output)
        records.append(_record(30.0 * n, f"c{conversation}", prompt, answer))
    path = _write(tmp_path_factory.mktemp("trace"), records)
    assert _replay(path) == _reference_hits(prompts, outputs)
