"""The fields of a ``/v1/embeddings`` request body, checked as OpenAI checks them.

Public surface: ``EmbeddingBody``, ``check_embedding_body``, and the limit it
checks with (``MAX_EMBEDDING_INPUTS``), which ``routing.openapi`` writes into the
schema.

``input`` is a non-empty string, a list of up to ``MAX_EMBEDDING_INPUTS``
non-empty strings, a list of token ids, or a list of such lists (OpenAI's
shapes, as vLLM takes them: ``routing.domain.prompt_list``); each entry is
embedded on its own. The answer is never streamed: ``stream`` is refused rather
than dropped. Messages never quote the client's values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from config.json_body import BodyError
from routing.domain.chat_body import check_model
from routing.domain.prompt_list import Prompt, check_prompt_list

__all__ = [
    "ENCODING_FORMATS",
    "MAX_EMBEDDING_INPUTS",
    "EmbeddingBody",
    "check_embedding_body",
]

# Inputs in one request: OpenAI's cap.
MAX_EMBEDDING_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingBody:
    """What the gateway needs of a valid embeddings body.

    ``inputs`` is the input as a list (one entry per vector asked for, text or
    token ids); ``dimensions`` the client's, None when absent.
    """

    model: str
    inputs: list[Prompt]
    encoding_format: str
    dimensions: int | None


def check_embedding_body(body: Mapping[str, Any]) -> EmbeddingBody:
    """Return what the gateway needs of ``body``, every field checked.

    Raises:
        BodyError: the first field OpenAI would refuse, or the platform cannot
            serve.
    """
    model = check_model(body)
    inputs = check_prompt_list(
        body.get("input"), name="input", cap=MAX_EMBEDDING_INPUTS
    )
    encoding_format = body.get("encoding_format", "float")
    if encoding_format is None:
        encoding_format = "float"
    if encoding_format not in ENCODING_FORMATS:
        raise BodyError(
            "encoding_format must be float or base64", param="encoding_format"
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and not (_is_int(dimensions) and dimensions >= 1):
        raise BodyError("dimensions must be a positive integer", param="dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BodyError("user must be a string", param="user")
    if body.get("stream") not in (None, False):
        raise BodyError(
            "stream is not supported: embeddings are answered whole",
            param="stream",
            code="unsupported_parameter",
        )
    return EmbeddingBody(
        model=model,
        inputs=inputs,
        encoding_format=encoding_format,
        dimensions=dimensions,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
