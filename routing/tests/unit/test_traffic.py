"""The traffic twin's pure parts: salted block-hash chains, sampling, the trace."""

from __future__ import annotations

import json

import pytest

from drills.domain.workload import _trace_line, trace_arrivals
from models_registry.domain.load_test import parse_replay_lines
from routing.domain.traffic import (
    TrafficRecord,
    block_chain,
    derive_salt,
    is_sampled,
    salted_id,
    stand_in_prompt,
    text_block_chain,
    trace_lines,
)
from simengine.domain import tokens

SALT = derive_salt("secret one")
SYSTEM = [{"role": "system", "content": "You are the support assistant of Acme."}]


def ids(*messages: dict[str, str]) -> list[int]:
    return tokens.encode(tokens.render_chat(list(messages)))


def test_prompts_that_share_a_prefix_share_its_whole_blocks_hashes() -> None:
    first = ids(*SYSTEM, {"role": "user", "content": "How do I rotate my key? " * 4})
    second = ids(*SYSTEM, {"role": "user", "content": "Why is my bill so high? " * 4})
    a = block_chain(first, block_size=4, salt=SALT)
    b = block_chain(second, block_size=4, salt=SALT)
    shared_tokens = next(
        i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y
    )

    assert len(a) == len(first) // 4
    assert a[: shared_tokens // 4] == b[: shared_tokens // 4]
    # Chained: once the blocks differ, every later hash differs too.
    assert all(
        x != y
        for x, y in zip(a[shared_tokens // 4 :], b[shared_tokens // 4 :], strict=False)
    )


def test_a_conversations_next_turn_extends_its_chain() -> None:
    turn = [*SYSTEM, {"role": "user", "content": "hello there, how are you"}]
    later = [
        *turn,
        {"role": "assistant", "content": "fine"},
        {"role": "user", "content": "ok"},
    ]
    a = block_chain(ids(*turn), block_size=16, salt=SALT)
    b = block_chain(ids(*later), block_size=16, salt=SALT)

    assert b[: len(a)] == a
    assert len(b) > len(a)


def test_a_block_hash_covers_every_block_before_it() -> None:
    base = list(range(64))
    changed = [999, *base[1:]]

    a = block_chain(base, block_size=16, salt=SALT)
    b = block_chain(changed, block_size=16, salt=SALT)

    assert all(x != y for x, y in zip(a, b, strict=True))


def test_another_salt_gives_other_hashes_and_a_partial_block_none() -> None:
    prompt = list(range(40))

    a = block_chain(prompt, block_size=16, salt=SALT)
    b = block_chain(prompt, block_size=16, salt=derive_salt("secret two"))

    assert len(a) == 2  # the last 8 tokens are no whole block
    assert not set(a) & set(b)
    assert salted_id("conv:1", SALT) != salted_id("conv:1", derive_salt("x"))


def test_texts_chain_the_same_way_without_token_ids() -> None:
    a = text_block_chain(["system prompt", "question one"], block_chars=4, salt=SALT)
    b = text_block_chain(["system prompt", "question two"], block_chars=4, salt=SALT)

    assert a[:5] == b[:5] and a[-1] != b[-1]
    with pytest.raises(ValueError):
        block_chain([1], block_size=0, salt=SALT)
    # An id past 32 bits counts by its low 32 bits rather than failing.
    assert block_chain([2**32 + 5] * 4, block_size=4, salt=SALT) == block_chain(
        [5] * 4, block_size=4, salt=SALT
    )


def test_sampling_keeps_whole_conversations_at_about_the_share() -> None:
    keys = [f"conv:{i}" for i in range(4000)]
    picked = [k for k in keys if is_sampled(k, 0.25)]

    assert 0.22 < len(picked) / len(keys) < 0.28
    assert picked == [k for k in keys if is_sampled(k, 0.25)]
    assert not any(is_sampled(k, 0.0) for k in keys)
    assert all(is_sampled(k, 1.0) for k in keys)


def record(at: float, key: str, blocks: tuple[str, ...], **kw: object) -> TrafficRecord:
    fields: dict[str, object] = {
        "at": at,
        "team": "alpha",
        "tier": "standard",
        "model": "chat-7b",
        "version": "v1",
        "surface": "chat",
        "prompt_tokens": len(blocks) * 16 + 5,
        "max_tokens": 64,
        "output_tokens": 30,
        "cached_tokens": 16,
        "key": key,
        "replica": "r1",
        "outcome": "ok",
        "block_size": 16,
        "blocks": blocks,
    }
    fields.update(kw)
    return TrafficRecord(**fields)  # type: ignore[arg-type]


def test_a_record_round_trips_through_its_json_row() -> None:
    one = record(1000.5, "k1", ("aa" * 8, "bb" * 8))

    assert TrafficRecord.from_row(json.loads(json.dumps(one.to_row()))) == one
    with pytest.raises(ValueError):
        TrafficRecord.from_row(one.to_row()[:-1])
    with pytest.raises(ValueError):
        TrafficRecord.from_row([*one.to_row()[:6], "many", *one.to_row()[7:]])


def test_the_trace_replays_in_the_simulator_and_the_load_test_gate() -> None:
    chain = block_chain(list(range(96)), block_size=16, salt=SALT)
    records = [
        record(1010.0, "k1", tuple(chain[:4])),
        record(1000.0, "k1", tuple(chain[:2])),
        record(1005.0, "k2", tuple(chain[:3])),
        # An edited history: shares one block with k2's last prompt.
        record(1020.0, "k2", (chain[0], "ff" * 8)),
        record(1030.0, "k3", (), output_tokens=0, outcome="error"),
    ]

    lines, skipped = trace_lines(records, salt=SALT)

    assert skipped == 1
    assert [line["t"] for line in lines] == [0.0, 5.0, 10.0, 20.0]
    assert lines[0]["team"] == "team-" + salted_id("alpha", SALT)
    assert "history_tokens" not in lines[2]  # extends its previous prompt whole
    assert lines[3]["history_tokens"] == 16
    assert lines[2]["prefix_blocks"] == chain[:4]
    # The stand-in texts share a prefix exactly where the chains do, and a turn's
    # partial last block is its next turn's text: the next turn extends it whole.
    first, third = lines[0]["prompt"].split(), lines[2]["prompt"].split()
    assert len(first) == 37 and first == third[:37]
    second, fourth = lines[1]["prompt"].split(), lines[3]["prompt"].split()
    assert second[:16] == fourth[:16] and second[16:32] != fourth[16:32]
    text = "\n".join(json.dumps(line) for line in lines)
    assert "alpha" not in text
    arrivals = list(
        trace_arrivals(_trace_line(n, line) for n, line in enumerate(lines, 1))
    )
    # Recorded blocks: a turn's history is the blocks an earlier line produced,
    # in any conversation (k1's first turn and its answer's blocks for k2).
    assert [a.history_tokens for a in arrivals] == [0, 48, 64, 16]
    replay = parse_replay_lines(text.splitlines())
    assert [r.output_tokens for r in replay] == [30, 30, 30, 30]


def test_a_stand_in_prompt_is_about_as_long_as_the_prompt() -> None:
    one = record(
        1.0, "k", tuple(block_chain(list(range(64)), block_size=16, salt=SALT))
    )

    assert len(tokens.encode(stand_in_prompt(one))) == one.prompt_tokens
