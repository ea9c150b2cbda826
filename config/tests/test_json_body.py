"""Request bodies parsed within bounds: each failure a BodyError naming the param."""

from __future__ import annotations

import json

import pytest

from config.json_body import (
    MAX_DEPTH,
    MAX_INT_DIGITS,
    BodyError,
    parse_json_object,
)

CHAT = '"model":"m","messages":[{"role":"user","content":"x"}]'


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("raw", "param", "words"),
    [
        (f'{{{CHAT},"metadata":{nested(1000)}}}', "metadata", "nested deeper"),
        (f'{{{CHAT},"metadata":{nested(20_000)}}}', "metadata", "nested deeper"),
        (f'{{{CHAT},"metadata":{nested(MAX_DEPTH)}}}', "metadata", "nested deeper"),
        (f'{{{CHAT},"seed":{"1" * 4301}}}', "seed", "digits"),
        (f'{{{CHAT},"seed":-{"9" * (MAX_INT_DIGITS + 1)}}}', "seed", "digits"),
        (f'{{{CHAT},"temperature":NaN}}', "temperature", "not a JSON number"),
        (f'{{{CHAT},"top_p":-Infinity}}', "top_p", "not a JSON number"),
        (f'{{{CHAT},"top_p":1e999}}', "top_p", "finite"),
        (
            '{"model":"m","messages":[{"role":"user","content":"a\\ud800"}]}',
            "messages.0.content",
            "surrogate",
        ),
        ('{"model":"m","stop":["ok","\\uDFFF"]}', "stop.1", "surrogate"),
        ('{"model":"m","\\ud800":1}', "\\ud800", "surrogate"),
        ('{"model":"m","x":{"\\udc00k":1}}', "x.\\udc00k", "surrogate"),
    ],
)
def test_out_of_bounds_bodies_name_the_param(raw: str, param: str, words: str) -> None:
    with pytest.raises(BodyError) as refused:
        parse_json_object(raw.encode())
    assert refused.value.param == param
    assert words in refused.value.message
    # The error must itself be JSON-safe: it is sent back in the error body.
    json.dumps({"param": refused.value.param}).encode("utf-8")


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"{", "not valid JSON"),
        (b"\xff{}", "UTF-8"),
        ('{"a": 1}'.encode("utf-16"), "UTF-8"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (nested(50_000).encode(), "nested deeper"),
    ],
)
def test_bodies_that_are_not_objects_are_refused(raw: bytes, words: str) -> None:
    with pytest.raises(BodyError) as refused:
        parse_json_object(raw)
    assert words in refused.value.message
    assert refused.value.param is None


def test_bodies_within_bounds_parse_as_json_does() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "caf\u00e9 \U0001f600"}],
        "deep": json.loads(nested(MAX_DEPTH - 1)),
        "seed": -(10 ** (MAX_INT_DIGITS - 1)),
        "temperature": 0.5,
    }
    # Escaped as Python's json.dumps sends it (a surrogate pair for the emoji)...
    assert parse_json_object(json.dumps(body).encode()) == body
    # ... and as raw UTF-8.
    assert parse_json_object(json.dumps(body, ensure_ascii=False).encode()) == body


def test_an_escaped_backslash_before_ud800_is_text_not_a_surrogate() -> None:
    assert parse_json_object(b'{"a": "\\\\ud800"}') == {"a": "\\ud800"}
