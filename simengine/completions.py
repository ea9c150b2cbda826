"""The pure parts of the simulated ``/v1/completions``: prompts and logprobs.

Public surface: ``CompletionPrompt``, ``read_prompts``, ``check_logprobs``,
``LogprobsWriter``, ``MAX_LOGPROBS``.

A prompt is a string, a list of strings, a list of token ids or a list of such
lists (vLLM 0.32's ``CompletionRequest.prompt``); ids decode with
``tokens.decode_token`` (an id outside the stand-in's output words decodes to a
stand-in word) and count as they are: ``prompt_tokens`` is their number.

Logprobs follow vLLM's ``CompletionLogProbs`` (``tokens``, ``token_logprobs``,
``top_logprobs`` with the ``logprobs`` likeliest, the sampled one first, ``text_offset``
running over the text as sent); the values are made up but fixed by the seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from simengine.choices import RequestError
from simengine.domain import tokens

__all__ = [
    "MAX_LOGPROBS",
    "CompletionPrompt",
    "LogprobsWriter",
    "check_logprobs",
    "read_prompts",
]

# vLLM's --max-logprobs default.
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    """One prompt: its text (for ``echo``), its token texts and ids."""

    text: str
    pieces: list[str]
    token_ids: list[int]


def _from_text(text: str) -> CompletionPrompt:
    if not text:
        # vLLM 0.32's CompletionRequest validator.
        raise RequestError(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    return CompletionPrompt(text, tokens.split_pieces(text), tokens.encode(text))


def _from_ids(ids: list[Any]) -> CompletionPrompt:
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise RequestError("prompt token ids must be non-negative integers", "prompt")
    pieces = [tokens.decode_token(i) for i in ids]
    return CompletionPrompt("".join(pieces), pieces, list(ids))


def read_prompts(prompt: Any) -> list[CompletionPrompt]:
    """Return the prompts of a completions request, or raise ``RequestError``."""
    if isinstance(prompt, str):
        return [_from_text(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [_from_text(p) for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [_from_ids(prompt)]
        if all(isinstance(p, list) and p for p in prompt):
            return [_from_ids(p) for p in prompt]
    raise RequestError(
        "prompt must be a string, a list of strings, a list of token ids or a "
        "list of lists of token ids",
        "prompt",
    )


def check_logprobs(logprobs: Any) -> int | None:
    """Return the ``logprobs`` a request asks for, or raise vLLM's 400."""
    if logprobs is None:
        return None
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0:
        raise RequestError("logprobs must be a non-negative integer", "logprobs")
    if logprobs > MAX_LOGPROBS:
        raise RequestError(
            f"Requested sample logprobs of {logprobs}, which is greater than max "
            f"allowed: {MAX_LOGPROBS}",
            "logprobs",
        )
    return logprobs


def _logprob(seed: int, position: int) -> float:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=4).digest()
    return -round(int.from_bytes(digest, "big") % 3000 / 1000.0, 4)


class LogprobsWriter:
    """Build ``CompletionLogProbs`` objects for one choice, chunk after chunk
    (``text_offset`` carries on where the previous chunk ended)."""

    def __init__(self, top: int, seed: int) -> None:
        self.top = top
        self.seed = seed
        self.offset = 0
        self.position = 0

    def write(
        self, pieces: Sequence[str], *, first_is_unscored: bool = False
    ) -> dict[str, Any]:
        """Return the logprobs of ``pieces`` (the first unscored: an echoed
        prompt's first token, which has no logprob)."""
        text_offset: list[int] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        for index, piece in enumerate(pieces):
            text_offset.append(self.offset)
            self.offset += len(piece)
            if first_is_unscored and index == 0:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            value = _logprob(self.seed, self.position)
            self.position += 1
            token_logprobs.append(value)
            top = {piece: value}
            rank = 0
            # The sampled token is the most likely here, so it is one of the
            # ``top`` (vLLM lists the sampled token and the top ones, once each).
            while len(top) < max(self.top, 1) and rank < 2 * self.top + 2:
                word = tokens.OUTPUT_WORDS[(self.position * 7 + rank * 31) % 256]
                rank += 1
                if word not in top:
                    top[word] = round(value - 0.5 * len(top), 4)
            top_logprobs.append(top)
        return {
            "text_offset": text_offset,
            "token_logprobs": token_logprobs,
            "tokens": list(pieces),
            "top_logprobs": top_logprobs,
        }
