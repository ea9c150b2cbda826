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
from models_registry.domain.load_test import parse_replay_lines, replay_turns
from routing.domain.traffic import TrafficRecord, block_chain, trace_lines
from simengine.domain import tokens as tokenizer
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


def test_the_gate_s_stand_in_text_shares_blocks_as_the_hashes_do(
    tmp_path: Path,
) -> None:
    """What a simulated replica hashes (the token ids of the gate's tagged text)
    shares the system prompt's blocks across conversations, a conversation's
    previous prompt across its turns, and nothing across laps."""
    system = list(range(1000, 1000 + 10 * BLOCK))  # 10 shared blocks
    rng = random.Random(3)
    first = [system + [rng.randrange(1000, 9000) for _ in range(70)] for _ in range(3)]
    records = [_record(10.0 * n, f"c{n}", ids, 20) for n, ids in enumerate(first)]
    second = first[0] + list(range(20_000, 20_050)) + list(range(30_000, 30_040))
    records.append(_record(40.0, "c0", second, 20))
    lines, _ = trace_lines(records, salt=SALT)
    replay = parse_replay_lines([json.dumps(line) for line in lines])
    turns = replay_turns(replay, 2.0)
    hashes = [
        hash_full_blocks(
            tokenizer.encode(tokenizer.render_chat(next(turns).messages)), 16
        )
        for _ in range(len(replay) + 1)  # a second lap's first line, too
    ]
    # "<|user|>", "\n", then the 160 shared words (one token each), then the tag.
    shared = (2 + 10 * BLOCK) // BLOCK
    prompt = tokenizer.encode(
        tokenizer.render_chat(next(replay_turns(replay, 2.0)).messages)
    )

    def common(a: list[int], b: list[int]) -> int:
        pairs = zip(a, b, strict=False)
        return next(
            (i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b))
        )

    assert common(hashes[0], hashes[1]) == common(hashes[1], hashes[2]) == shared
    # The second turn holds the first turn's prompt but its 4 closing tokens.
    assert common(hashes[0], hashes[3]) == (len(prompt) - 4) // BLOCK > shared
    # The next lap shares the system prompt only.
    assert common(hashes[0], hashes[4]) == shared
