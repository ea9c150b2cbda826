"""A chat-like request's prompt, counted as its engine will and fitted to the
context window: what the chat and Responses planners share.

Public surface: ``count_and_fit``.
"""

from __future__ import annotations

from typing import Any

from routing.domain.snapshot import VersionRecord
from routing.prompt_tokens import PromptRejected, VersionCounters
from routing.responses import GatewayError

__all__ = ["count_and_fit"]


async def count_and_fit(
    counters: VersionCounters,
    version: VersionRecord | None,
    max_model_len: int,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    asked: int | None,
    default: int,
    names: tuple[str, str],
) -> tuple[list[int], int]:
    """Return the prompt's token ids (for ``version``) and the output tokens to
    charge: ``asked``, or ``default`` cut to what fits ``max_model_len``.
    ``names`` are the body's prompt and output-limit fields, for the errors.

    Raises:
        GatewayError: 400, the prompt refused, or it and the output do not fit.
    """
    prompt_name, limit_name = names
    verb = "take" if prompt_name.endswith("s") else "takes"
    try:
        prompt_ids = await counters.encode(version, messages, tools)
    except PromptRejected as exc:
        raise GatewayError(400, str(exc), param=prompt_name) from None
    prompt_tokens = len(prompt_ids)
    if asked is None:
        max_tokens = max(1, min(default, max_model_len - prompt_tokens))
    else:
        max_tokens = asked
    if prompt_tokens + max_tokens > max_model_len:
        raise GatewayError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the "
            f"{prompt_name} {verb} {prompt_tokens} and {limit_name} asks "
            f"{max_tokens}.",
            param=prompt_name,
            code="context_length_exceeded",
        )
    return prompt_ids, max_tokens
