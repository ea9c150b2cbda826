"""A list of prompts as OpenAI takes it: a completion's ``prompt``, an
embedding's ``input``.

Public surface: ``Prompt``, ``MAX_TOKEN_ID``, ``check_prompt_list``.

The field is a non-empty string, a list of token ids (one prompt), a list of
non-empty strings or a list of non-empty lists of token ids (mixed too), as
OpenAI and vLLM take it; a list holds at most the API's cap of prompts. Each
prompt comes back as an entry of its own. Messages name the field (and the
entry: ``prompt.3``) and never quote the client's values.
"""

from __future__ import annotations

from typing import Any

from config.json_body import BodyError

__all__ = ["MAX_TOKEN_ID", "Prompt", "check_prompt_list"]

# The largest token id a tokenizer can hand out (a signed 32-bit integer).
MAX_TOKEN_ID = 2**31 - 1

Prompt = str | list[int]


def check_prompt_list(value: Any, *, name: str, cap: int) -> list[Prompt]:
    """Return ``value``, the body's field ``name``, as a list of prompts.

    Raises:
        BodyError: absent, empty (as vLLM refuses it, before it is charged), of
            another shape, more than ``cap`` prompts, or a token id out of range.
    """
    if value is None:
        raise BodyError(f"{name} is required", param=name)
    if isinstance(value, str):
        if not value:
            raise BodyError(f"{name} must not be empty", param=name)
        return [value]
    if not isinstance(value, list) or not value:
        raise BodyError(
            f"{name} must be a string, a list of strings, a list of token ids or a "
            "list of lists of token ids, and not empty",
            param=name,
        )
    if all(_is_int(token) for token in value):
        return [_token_ids(value, name)]
    if len(value) > cap:
        raise BodyError(f"{name} may hold at most {cap} entries", param=name)
    prompts: list[Prompt] = []
    for index, item in enumerate(value):
        if isinstance(item, str) and item:
            prompts.append(item)
        elif isinstance(item, list) and item:
            prompts.append(_token_ids(item, f"{name}.{index}"))
        else:
            raise BodyError(
                f"each {name} of a list must be a non-empty string or a non-empty "
                "list of token ids",
                param=f"{name}.{index}",
            )
    return prompts


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(ids: list[Any], param: str) -> list[int]:
    if not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise BodyError(
            f"token ids must be integers from 0 to {MAX_TOKEN_ID}", param=param
        )
    return ids
