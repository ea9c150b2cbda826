"""What the gateway answers, in OpenAI's shapes: errors, the final event, whole answers.

Public surface: ``GatewayError``, ``ClientGone``, ``FinalUsage``, ``respond``,
``answer_headers``, ``final_event``, ``whole_answer``, ``whole_completion``,
``stream_error_event``, ``response_end_event``, ``whole_response``,
``response_error_event``, ``upstream_client_error``.

Every refusal is a ``GatewayError`` rendered as ``{"error": {"type", "message",
"param", "code"}}`` with its status and headers. A streamed answer ends with one
event carrying ``usage`` (``prompt_tokens``, ``cached_tokens``,
``completion_tokens``, ``total_tokens``, ``prompt_tokens_details.cached_tokens``)
and ``model_version``, ``region`` and ``replica_id``, then ``data: [DONE]``; with
``stream_options.include_usage: false`` it ends with ``data: [DONE]`` alone, as
OpenAI's does. A whole answer carries the same fields. The answer's ``id`` is the
engine's, the one on every content chunk. A ``/v1/responses`` answer ends with
the engine's terminal event (``response.completed``), whose ``response`` object
gets ``model_version``, ``region`` and ``replica_id`` beside OpenAI's fields, as a
chat's whole answer does (the SDK keeps unknown fields); a whole response is that
object. Messages never carry secrets or prompt text.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from config.asgi_io import Send
from config.errors import error_body
from routing.relay import EVENT_END, GatheredChoice, RelayOutcome

__all__ = [
    "ClientGone",
    "FinalUsage",
    "GatewayError",
    "answer_headers",
    "final_event",
    "respond",
    "response_end_event",
    "response_error_event",
    "stream_error_event",
    "upstream_client_error",
    "whole_answer",
    "whole_completion",
    "whole_response",
]

_JSON = (b"content-type", b"application/json")
_DONE = b"data: [DONE]\n\n"
_STREAM_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


class GatewayError(Exception):
    """A failure answered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        """Return the error document as JSON bytes."""
        return json.dumps(
            error_body(
                self.status,
                self.message,
                param=self.param,
                code=self.code,
                error_type=self.error_type,
            )
        ).encode()


class ClientGone(Exception):
    """The client disconnected: nothing more can be sent."""


@dataclass(frozen=True, slots=True)
class FinalUsage:
    """The tokens of one answer, as the client is told and the team is metered.

    ``cached_tokens`` is the part of ``prompt_tokens`` served from the prefix cache.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        """Return prompt plus completion tokens: what the answer used of its charge."""
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def of(
        cls, outcome: RelayOutcome, *, prompt_tokens: int, role_chunks: int = 1
    ) -> FinalUsage:
        """Return the usage of a relayed answer.

        The engine's own usage chunk wins. Without it (the stream broke), the
        prompt is the gateway's count and the completion is the content events
        forwarded, less the role chunks (one per chat choice; completions have
        none), which carry no token.
        """
        upstream = outcome.usage or {}
        prompt = int(upstream.get("prompt_tokens", prompt_tokens))
        completion = int(
            upstream.get("completion_tokens", max(0, outcome.events - role_chunks))
        )
        details = upstream.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        return cls(
            prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion
        )

    def as_openai(self) -> dict[str, Any]:
        """Return the ``usage`` object of OpenAI's answers, with ``cached_tokens``."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


async def respond(
    send: Send,
    status: int,
    body: bytes,
    *,
    headers: Mapping[str, str] | None = None,
    raw_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Send a whole JSON answer."""
    out = [_JSON, (b"content-length", str(len(body)).encode())]
    out.extend((k.encode(), v.encode()) for k, v in (headers or {}).items())
    out.extend(raw_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})


def answer_headers(
    *,
    request_id: str,
    version: str,
    region: str,
    replica_id: str,
    rate_limit: Mapping[str, str],
    stream: bool,
) -> list[tuple[bytes, bytes]]:
    """Return an answer's headers: who served it, and the team's rate-limit state."""
    headers = [
        (b"x-request-id", request_id.encode()),
        (b"x-model-version", version.encode()),
        (b"x-region", region.encode()),
        (b"x-replica-id", replica_id.encode()),
    ]
    headers.extend((k.encode(), v.encode()) for k, v in rate_limit.items())
    if stream:
        headers[:0] = _STREAM_HEADERS
    return headers


def final_event(
    *,
    answer_id: str,
    model_ref: str,
    version: str,
    region: str,
    replica_id: str,
    usage: FinalUsage,
    include_usage: bool = True,
    chunk_object: str = "chat.completion.chunk",
) -> bytes:
    """Return the stream's last event (usage and who served it), then ``[DONE]``.

    Without ``include_usage`` (the client asked for no usage chunk) only ``[DONE]``.
    ``chunk_object`` is the stream's object (``text_completion`` for completions).
    """
    if not include_usage:
        return _DONE
    final = {
        "id": answer_id,
        "object": chunk_object,
        "created": int(time.time()),
        "model": model_ref,
        "choices": [],
        "usage": usage.as_openai(),
        "model_version": version,
        "region": region,
        "replica_id": replica_id,
    }
    return b"data: " + json.dumps(final).encode() + EVENT_END + _DONE


def whole_answer(
    *,
    answer_id: str,
    model_ref: str,
    version: str,
    region: str,
    replica_id: str,
    outcome: RelayOutcome,
    usage: FinalUsage,
) -> bytes:
    """Return a non-streaming answer (``chat.completion``) built from the relay:
    each choice's message with its text, or its tool calls (content null then)."""
    answer = {
        "id": answer_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_ref,
        "choices": [_chat_choice(choice) for choice in outcome.choices],
        "usage": usage.as_openai(),
        "model_version": version,
        "region": region,
        "replica_id": replica_id,
    }
    return json.dumps(answer).encode()


def whole_completion(
    *,
    answer_id: str,
    model_ref: str,
    version: str,
    region: str,
    replica_id: str,
    outcome: RelayOutcome,
    usage: FinalUsage,
) -> bytes:
    """Return a non-streaming ``text_completion`` built from the relay."""
    answer = {
        "id": answer_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_ref,
        "choices": [
            {
                "index": choice.index,
                "text": choice.content,
                "logprobs": choice.completion_logprobs,
                "finish_reason": choice.finish_reason or "stop",
            }
            for choice in outcome.choices
        ],
        "usage": usage.as_openai(),
        "model_version": version,
        "region": region,
        "replica_id": replica_id,
    }
    return json.dumps(answer).encode()


def _chat_choice(choice: GatheredChoice) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": choice.content if choice.content or not choice.tool_calls else None,
    }
    if choice.tool_calls:
        message["tool_calls"] = list(choice.tool_calls)
    return {
        "index": choice.index,
        "message": message,
        "logprobs": {"content": list(choice.logprobs)} if choice.logprobs else None,
        "finish_reason": choice.finish_reason or "stop",
    }


def whole_response(
    *,
    response: dict[str, Any],
    model_ref: str,
    version: str,
    region: str,
    replica_id: str,
) -> dict[str, Any]:
    """Return a ``/v1/responses`` answer's response object (the engine's, from
    its terminal event) with the model the client named and who served it."""
    return {
        **response,
        "model": model_ref,
        "model_version": version,
        "region": region,
        "replica_id": replica_id,
    }


def response_end_event(terminal: dict[str, Any], response: dict[str, Any]) -> bytes:
    """Return a ``/v1/responses`` stream's last event: the engine's terminal event
    (``response.completed``...) carrying ``response`` (``whole_response``)."""
    kind = str(terminal.get("type") or "response.completed")
    event = {**terminal, "response": response}
    return (
        b"event: "
        + kind.encode()
        + b"\ndata: "
        + json.dumps(event).encode()
        + EVENT_END
    )


def response_error_event(*, replica_id: str) -> bytes:
    """Return the event that ends a ``/v1/responses`` stream broken after its
    first token (OpenAI's ``error`` event)."""
    event = {
        "type": "error",
        "code": "upstream_failed",
        "message": "the replica failed mid-stream; the answer is incomplete",
        "param": None,
        "replica_id": replica_id,
    }
    return b"event: error\ndata: " + json.dumps(event).encode() + EVENT_END


def stream_error_event(*, replica_id: str) -> bytes:
    """Return the event that ends a stream broken after tokens were sent."""
    error = error_body(
        502,
        "the replica failed mid-stream; the answer is incomplete",
        code="upstream_failed",
        error_type="server_error",
    )
    error["error"]["replica_id"] = replica_id
    return b"data: " + json.dumps(error).encode() + EVENT_END + _DONE


def upstream_client_error(status: int, raw: bytes) -> GatewayError:
    """Turn an engine's 4xx (vLLM shape, integer code) into OpenAI's shape."""
    message = "the replica refused the request"
    param = None
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        error = json.loads(raw)["error"]
        message = str(error.get("message") or message)
        param = error.get("param")
    return GatewayError(
        status if status in (400, 404, 413, 422) else 400, message, param=param
    )
