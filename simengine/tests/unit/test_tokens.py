"""Tests for the deterministic tokenizer and chat template."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from simengine.domain.tokens import (
    OUTPUT_WORDS,
    SPECIAL_TOKEN_IDS,
    count_chat_tokens,
    decode_token,
    encode,
    output_text,
    output_token_id,
    output_token_ids,
    render_chat,
    request_seed,
)

ENGLISH = (
    "Large language models are served on clusters of GPUs. Each replica batches "
    "requests continuously, and its scheduler decides which tokens to compute in "
    "every step. Prefix caching lets requests that share a system prompt reuse the "
    "key and value blocks computed for an earlier request, so the time to the first "
    "token falls when a router sends related conversations to the same replica."
)
ROOT = Path(__file__).resolve().parents[3]
HISTORY = [
    {"role": "system", "content": "You are a terse assistant. Answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_render_chat_uses_the_template() -> None:
    text = render_chat(HISTORY)

    assert text == (
        "<|system|>\nYou are a terse assistant. Answer in one line.<|end|>\n"
        "<|user|>\nWhat is the capital of France?<|end|>\n"
        "<|assistant|>\n"
    )


def test_encode_is_deterministic_and_in_range() -> None:
    ids = encode(ENGLISH)

    assert ids == encode(ENGLISH)
    assert all(1000 <= token_id < 128_000 for token_id in ids)


def test_encode_is_stable_across_processes() -> None:
    """Hash randomisation must not leak in: ids come from crc32, not hash()."""
    code = (
        f"from simengine.domain.tokens import encode; print(encode({ENGLISH[:80]!r}))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)},
        ).stdout
        for seed in ("1", "2")
    }

    assert outputs == {f"{encode(ENGLISH[:80])}\n"}


def test_special_markers_have_fixed_small_ids() -> None:
    assert encode("<|system|><|user|><|assistant|><|end|>") == [1, 2, 3, 4]
    assert SPECIAL_TOKEN_IDS["<|assistant|>"] == 3


def test_marker_after_a_space_is_still_a_marker() -> None:
    assert encode("hi <|end|>")[-1] == SPECIAL_TOKEN_IDS["<|end|>"]


def test_pieces_are_at_most_four_letters_with_leading_space() -> None:
    assert encode(" hello") == encode(" hell") + encode("o")
    assert len(encode("a, b")) == 3


def test_english_is_about_four_characters_per_token() -> None:
    chars_per_token = len(ENGLISH) / len(encode(ENGLISH))

    assert 3.0 <= chars_per_token <= 5.0


def test_shared_history_forms_a_token_prefix() -> None:
    first_turn = encode(render_chat(HISTORY))
    reply = "".join(output_text(7, 30))
    second_turn = encode(
        render_chat(
            [
                *HISTORY,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "And of Italy?"},
            ]
        )
    )

    assert second_turn[: len(first_turn)] == first_turn
    assert second_turn[len(first_turn) : len(first_turn) + 30] == output_token_ids(
        7, 0, 30
    )


def test_count_chat_tokens_counts_the_rendered_prompt() -> None:
    assert count_chat_tokens(HISTORY) == len(encode(render_chat(HISTORY)))


def test_output_text_is_deterministic_per_seed() -> None:
    assert output_text(42, 50) == output_text(42, 50)
    assert output_text(42, 50) != output_text(43, 50)
    assert output_text(42, 20) == output_text(42, 50)[:20]


def test_output_text_reencodes_to_one_token_per_piece() -> None:
    pieces = output_text(request_seed("req-1"), 200)

    assert encode("".join(pieces)) == output_token_ids(request_seed("req-1"), 0, 200)


def test_output_token_ids_slices_agree_with_single_ids() -> None:
    seed = request_seed("abc")

    assert output_token_ids(seed, 5, 40) == [
        output_token_id(seed, i) for i in range(5, 40)
    ]
    assert output_token_ids(seed, 9, 9) == []


def test_output_vocabulary_has_distinct_single_token_words() -> None:
    assert len(OUTPUT_WORDS) == 256
    assert len({encode(word)[0] for word in OUTPUT_WORDS}) == 256
    assert all(len(encode(word)) == 1 for word in OUTPUT_WORDS)


def test_decode_token_inverts_markers_and_output_words() -> None:
    seed = request_seed("x")

    assert decode_token(3) == "<|assistant|>"
    assert [decode_token(t) for t in output_token_ids(seed, 0, 10)] == output_text(
        seed, 10
    )
    assert decode_token(encode(" zzzz")[0]) in OUTPUT_WORDS  # a stand-in word


def test_request_seed_is_stable() -> None:
    assert request_seed("req-1") == request_seed("req-1")
    assert request_seed("req-1") != request_seed("req-2")


def test_message_text_joins_text_parts_and_counts_like_a_string() -> None:
    from simengine.domain.tokens import count_chat_tokens, message_text

    parts = [
        {"type": "text", "text": "Hello "},
        {"type": "image_url", "image_url": {}},
        {"type": "text", "text": "there"},
    ]
    assert message_text(parts) == "Hello there"
    assert message_text(None) == ""
    as_parts = [{"role": "user", "content": parts}]
    as_text = [{"role": "user", "content": "Hello there"}]
    assert count_chat_tokens(as_parts) == count_chat_tokens(as_text)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_render_chat_without_tools_is_unchanged() -> None:
    assert render_chat(HISTORY, None) == render_chat(HISTORY)
    assert render_chat(HISTORY, []) == render_chat(HISTORY)


def test_count_chat_tokens_counts_the_tools_block() -> None:
    with_tools = count_chat_tokens(HISTORY, [WEATHER_TOOL])
    assert with_tools > count_chat_tokens(HISTORY)
    assert render_chat(HISTORY, [WEATHER_TOOL]).startswith("<|system|>\n[{")


def test_tool_turns_keep_the_prompt_prefix_stable() -> None:
    first = [{"role": "user", "content": "weather in Paris?"}]
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}
    before = encode(render_chat(first, [WEATHER_TOOL]))
    after = encode(render_chat([*first, call, result], [WEATHER_TOOL]))
    assert after[: len(before) - 2] == before[:-2]
    assert "get_weather" in render_chat([call])


def test_split_pieces_joins_back_and_counts_as_encode() -> None:
    from simengine.domain.tokens import split_pieces

    text = '{"city": "Paris", "days": [1, 2], "note": "a_b <|end|>"}'
    assert "".join(split_pieces(text)) == text
    assert len(split_pieces(text)) == len(encode(text))
