"""Embeddings bodies checked as OpenAI checks them, naming the param."""

from __future__ import annotations

from typing import Any

import pytest

from config.json_body import BodyError
from routing.domain.embedding_body import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingBody,
    check_embedding_body,
)


def embedding(**fields: Any) -> dict[str, Any]:
    return {"model": "embed-1", "input": "hello", **fields}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": "x"}, "model", None),
        ({"model": "embed-1"}, "input", None),
        (embedding(input=""), "input", None),
        (embedding(input=[]), "input", None),
        (embedding(input=7), "input", None),
        (embedding(input={"text": "x"}), "input", None),
        (embedding(input=[1, -2]), "input", None),
        (embedding(input=[1, 2**31]), "input", None),
        (embedding(input=["a", ""]), "input.1", None),
        (embedding(input=["a", []]), "input.1", None),
        (embedding(input=["a", 3.5]), "input.1", None),
        (embedding(input=[[1], [1, "b"]]), "input.1", None),
        (embedding(input=["a"] * (MAX_EMBEDDING_INPUTS + 1)), "input", None),
        (embedding(encoding_format="int8"), "encoding_format", None),
        (embedding(encoding_format=1), "encoding_format", None),
        (embedding(dimensions=0), "dimensions", None),
        (embedding(dimensions=1.5), "dimensions", None),
        (embedding(dimensions=True), "dimensions", None),
        (embedding(user=7), "user", None),
        (embedding(stream=True), "stream", "unsupported_parameter"),
    ],
)
def test_bad_bodies_name_their_field(
    body: dict[str, Any], param: str, code: str | None
) -> None:
    with pytest.raises(BodyError) as caught:
        check_embedding_body(body)
    assert (caught.value.param, caught.value.code) == (param, code)


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        (["a", [4, 5]], ["a", [4, 5]]),
        (["a"] * MAX_EMBEDDING_INPUTS, ["a"] * MAX_EMBEDDING_INPUTS),
    ],
)
def test_every_input_shape_comes_back_as_a_list(given: Any, inputs: Any) -> None:
    assert check_embedding_body(embedding(input=given)).inputs == inputs


def test_defaults_and_the_clients_choices() -> None:
    assert check_embedding_body(embedding()) == EmbeddingBody(
        model="embed-1", inputs=["hello"], encoding_format="float", dimensions=None
    )
    checked = check_embedding_body(
        embedding(encoding_format="base64", dimensions=64, user="u-1", stream=False)
    )
    assert (checked.encoding_format, checked.dimensions) == ("base64", 64)
