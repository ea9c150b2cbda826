"""The fields of a ``/v1/completions`` request body, checked as OpenAI checks them.

Public surface: ``CompletionBody``, ``check_completion_body``, and the limits it
checks with (``MAX_PROMPTS``, ``MAX_COMPLETION_LOGPROBS``,
``DEFAULT_COMPLETION_MAX_TOKENS``), which ``routing.openapi`` writes into the
schema.

A prompt is a string, a list of strings, a list of token ids or a list of such
lists (``routing.domain.prompt_list``); each prompt of a list is answered with ``n`` choices of its own, and each
choice is charged ``max_tokens`` up front (16 when absent, OpenAI's and vLLM's
default). The sampling fields are chat's (``routing.domain.chat_body``). What the
platform does not serve is refused clearly, never dropped: ``suffix`` (the models
here do not fill in the middle) and ``best_of`` other than 1. Messages never
quote the client's values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from config.json_body import BodyError
from routing.domain.chat_body import (
    check_model,
    check_n,
    check_sampling,
    check_stream,
)
from routing.domain.prompt_list import Prompt, check_prompt_list

__all__ = [
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "MAX_COMPLETION_LOGPROBS",
    "MAX_PROMPTS",
    "CompletionBody",
    "check_completion_body",
]

DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap
# Prompts in one request: each is a sequence of its own on the engine.
MAX_PROMPTS = 64


@dataclass(frozen=True, slots=True)
class CompletionBody:
    """What the gateway needs of a valid completions body.

    ``prompts`` is the prompt as a list (one entry per prompt, text or token
    ids); ``max_tokens`` the client's, None when absent.
    """

    model: str
    prompts: list[Prompt]
    stream: bool
    max_tokens: int | None
    include_usage: bool
    n: int = 1
    echo: bool = False


def check_completion_body(body: Mapping[str, Any]) -> CompletionBody:
    """Return what the gateway needs of ``body``, every field checked.

    Raises:
        BodyError: the first field OpenAI would refuse, or the platform cannot
            serve.
    """
    model = check_model(body)
    prompts = check_prompt_list(body.get("prompt"), name="prompt", cap=MAX_PROMPTS)
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise BodyError("max_tokens must be a positive integer", param="max_tokens")
    check_sampling(body)
    n = check_n(body)
    stream, include_usage = check_stream(body)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BodyError("echo must be a boolean", param="echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and not (
        _is_int(logprobs) and 0 <= logprobs <= MAX_COMPLETION_LOGPROBS
    ):
        raise BodyError(
            f"logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}",
            param="logprobs",
        )
    if body.get("suffix") is not None:
        if not isinstance(body["suffix"], str):
            raise BodyError("suffix must be a string", param="suffix")
        raise BodyError(
            "suffix is not supported: the models here do not fill in the middle",
            param="suffix",
            code="unsupported_parameter",
        )
    best_of = body.get("best_of")
    if best_of is not None and not (_is_int(best_of) and best_of == 1):
        raise BodyError(
            "best_of is not supported: send n for several choices",
            param="best_of",
            code="unsupported_parameter" if _is_int(best_of) else None,
        )
    return CompletionBody(
        model=model,
        prompts=prompts,
        stream=stream,
        max_tokens=max_tokens,
        include_usage=include_usage,
        n=n,
        echo=bool(echo),
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
