"""Completions bodies checked as OpenAI checks them, naming the param."""

from __future__ import annotations

from typing import Any

import pytest

from config.json_body import BodyError
from routing.domain.completion_body import (
    MAX_PROMPTS,
    CompletionBody,
    check_completion_body,
)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "chat-7b", "prompt": "Once upon", **fields}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": "x"}, "model", None),
        ({"model": "chat-7b"}, "prompt", None),
        (completion(prompt=[]), "prompt", None),
        (completion(prompt=""), "prompt", None),
        (completion(prompt=7), "prompt", None),
        (completion(prompt=[1, -2]), "prompt", None),
        (completion(prompt=[1, 2**31]), "prompt", None),
        (completion(prompt=["a", 3.5]), "prompt.1", None),
        (completion(prompt=["a", []]), "prompt.1", None),
        (completion(prompt=["a", ""]), "prompt.1", None),
        (completion(prompt=["a", [1, "b"]]), "prompt.1", None),
        (completion(prompt=["a"] * (MAX_PROMPTS + 1)), "prompt", None),
        (completion(max_tokens=0), "max_tokens", None),
        (completion(max_tokens=1.5), "max_tokens", None),
        (completion(n=9), "n", None),
        (completion(echo="yes"), "echo", None),
        (completion(logprobs=6), "logprobs", None),
        (completion(logprobs=True), "logprobs", None),
        (completion(suffix="end"), "suffix", "unsupported_parameter"),
        (completion(suffix=3), "suffix", None),
        (completion(best_of=2), "best_of", "unsupported_parameter"),
        (completion(temperature=3), "temperature", None),
        (completion(stream_options={"include_usage": True}), "stream_options", None),
    ],
)
def test_invalid_completion_bodies_name_the_param(
    body: dict[str, Any], param: str, code: str | None
) -> None:
    with pytest.raises(BodyError) as refused:
        check_completion_body(body)
    assert (refused.value.param, refused.value.code) == (param, code)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (completion(), CompletionBody("chat-7b", ["Once upon"], False, None, True)),
        (
            completion(prompt=[5, 6, 7], max_tokens=4, n=2, echo=True),
            CompletionBody("chat-7b", [[5, 6, 7]], False, 4, True, n=2, echo=True),
        ),
        (
            completion(prompt=["a", [1, 2]], stream=True, logprobs=5, best_of=1),
            CompletionBody("chat-7b", ["a", [1, 2]], True, None, True),
        ),
        (
            completion(stream=True, stream_options={"include_usage": False}),
            CompletionBody("chat-7b", ["Once upon"], True, None, False),
        ),
    ],
)
def test_valid_completion_bodies_give_what_the_gateway_needs(
    body: dict[str, Any], expected: CompletionBody
) -> None:
    assert check_completion_body(body) == expected
