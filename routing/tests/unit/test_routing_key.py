"""Tests for routing keys and stable fractions."""

from __future__ import annotations

import re

import pytest

from routing.domain.routing_key import routing_key, stable_fraction

SYSTEM = {"role": "system", "content": "You are terse."}
FIRST = {"role": "user", "content": "What is a KV cache?"}
REPLY = {"role": "assistant", "content": "Memory for attention keys and values."}
SECOND = {"role": "user", "content": "How big is it for a 7B model?"}


def test_routing_key_uses_conversation_id_when_given() -> None:
    assert routing_key("c-42", [SYSTEM, FIRST]) == "conv:c-42"


def test_routing_key_strips_conversation_id() -> None:
    assert routing_key("  c-42\n", [FIRST]) == "conv:c-42"


@pytest.mark.parametrize("blank", [None, "", "   "])
def test_routing_key_without_conversation_id_hashes_the_opening(
    blank: str | None,
) -> None:
    key = routing_key(blank, [SYSTEM, FIRST])
    assert re.fullmatch(r"open:[0-9a-f]{32}", key)


def test_routing_key_is_stable_across_releases() -> None:
    key = routing_key(None, [{"role": "user", "content": "hi"}])
    assert key == "open:401cc17159a12af4bcacfe4f1c4750c2"


def test_routing_key_is_the_same_for_every_turn_of_a_chat() -> None:
    first_turn = routing_key(None, [SYSTEM, FIRST])
    later_turn = routing_key(None, [SYSTEM, FIRST, REPLY, SECOND])
    assert first_turn == later_turn


def test_routing_key_differs_when_the_first_question_differs() -> None:
    assert routing_key(None, [SYSTEM, FIRST]) != routing_key(None, [SYSTEM, SECOND])


def test_routing_key_differs_when_the_system_prompt_differs() -> None:
    other = {"role": "system", "content": "You are verbose."}
    assert routing_key(None, [SYSTEM, FIRST]) != routing_key(None, [other, FIRST])


def test_routing_key_includes_developer_messages_and_their_role() -> None:
    developer = {"role": "developer", "content": "You are terse."}
    assert routing_key(None, [developer, FIRST]) != routing_key(None, [FIRST])
    assert routing_key(None, [developer, FIRST]) != routing_key(None, [SYSTEM, FIRST])


def test_routing_key_ignores_non_opening_roles_before_the_first_user_message() -> None:
    assert routing_key(None, [REPLY, FIRST]) == routing_key(None, [FIRST])


def test_routing_key_reads_text_parts_like_a_string() -> None:
    parts = {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is a KV cache?"},
            {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
        ],
    }
    assert routing_key(None, [SYSTEM, parts]) == routing_key(None, [SYSTEM, FIRST])


def test_routing_key_tolerates_malformed_messages() -> None:
    messages = ["not a message", {"role": "user", "content": None}, {"content": 3}]
    key = routing_key(None, messages)
    assert key.startswith("open:")
    assert key != routing_key(None, [FIRST])


def test_routing_key_of_no_messages_is_still_a_key() -> None:
    assert routing_key(None, []).startswith("open:")


def test_stable_fraction_is_deterministic_and_in_unit_interval() -> None:
    values = [stable_fraction(f"conv:{i}") for i in range(10_000)]
    assert values == [stable_fraction(f"conv:{i}") for i in range(10_000)]
    assert all(0.0 <= v < 1.0 for v in values)


def test_stable_fraction_is_uniform() -> None:
    values = [
        stable_fraction(f"conv:{i}", salt="canary:chat-7b") for i in range(10_000)
    ]
    for decile in range(10):
        share = sum(decile / 10 <= v < (decile + 1) / 10 for v in values) / 10_000
        assert 0.08 <= share <= 0.12


def test_stable_fraction_salts_are_independent() -> None:
    a = [stable_fraction(f"conv:{i}", salt="canary:a") < 0.5 for i in range(10_000)]
    b = [stable_fraction(f"conv:{i}", salt="canary:b") < 0.5 for i in range(10_000)]
    agree = sum(x == y for x, y in zip(a, b, strict=True)) / 10_000
    assert 0.45 <= agree <= 0.55
