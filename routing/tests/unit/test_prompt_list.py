"""One prompt-list check for a completion's ``prompt`` and an embedding's
``input``: the same shapes, each field's own name and cap in its errors."""

from __future__ import annotations

from typing import Any

import pytest

from config.json_body import BodyError
from routing.domain.prompt_list import MAX_TOKEN_ID, check_prompt_list


@pytest.mark.parametrize("name", ["prompt", "input"])
@pytest.mark.parametrize(
    ("value", "entry", "message"),
    [
        (None, None, "{name} is required"),
        ("", None, "{name} must not be empty"),
        ([], None, "{name} must be a string, a list of strings, a list of token "
         "ids or a list of lists of token ids, and not empty"),
        ([1, MAX_TOKEN_ID + 1], None,
         f"token ids must be integers from 0 to {MAX_TOKEN_ID}"),
        (["a", "b", "c", "d"], None, "{name} may hold at most 3 entries"),
        (["a", ""], 1, "each {name} of a list must be a non-empty string or a "
         "non-empty list of token ids"),
        ([[1], [-1]], 1, f"token ids must be integers from 0 to {MAX_TOKEN_ID}"),
    ],
)  # fmt: skip
def test_a_refusal_names_the_field_its_entry_and_its_cap(
    name: str, value: Any, entry: int | None, message: str
) -> None:
    with pytest.raises(BodyError) as caught:
        check_prompt_list(value, name=name, cap=3)
    param = name if entry is None else f"{name}.{entry}"
    assert (caught.value.param, caught.value.message) == (
        param,
        message.format(name=name),
    )


@pytest.mark.parametrize(
    ("value", "prompts"),
    [
        ("hi", ["hi"]),
        ([5, 6, 7, 8], [[5, 6, 7, 8]]),  # one prompt of ids: the cap is of prompts
        (["a", [1, 2], "b"], ["a", [1, 2], "b"]),
        ([0, MAX_TOKEN_ID], [[0, MAX_TOKEN_ID]]),
    ],
)
def test_every_shape_comes_back_one_entry_per_prompt(
    value: Any, prompts: list[Any]
) -> None:
    assert check_prompt_list(value, name="prompt", cap=3) == prompts
