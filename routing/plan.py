"""The request plan: everything decided about a chat request before it is admitted.

Public surface: ``GatewaySettings``, ``ChatPlan``, ``authenticate``, ``team_limit``,
``read_json``, ``plan_chat``.

A request goes key -> team -> tier -> body -> routing key -> version -> limits ->
prompt tokens, and comes out as one immutable ``ChatPlan`` or a ``GatewayError``
in OpenAI's shape (401 bad key, 400 bad body or ``x-priority``, 403 a model the
team may not use, 404 unknown model or version, 413 too large, 503 no live
version). Nothing here touches the ORM: keys, limits and versions come from the
``ConfigSnapshot``.
"""

from __future__ import annotations

import hashlib
import json
import random
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from config.asgi_io import Receive, Scope
from routing.domain.policies import DEFAULT_POLICY_OPTIONS, PolicyOptions
from routing.domain.resolve import (
    NoLiveVersion,
    Resolution,
    UnknownModel,
    UnknownVersion,
    resolve,
)
from routing.domain.routing_key import routing_key
from routing.domain.snapshot import ConfigSnapshot, LimitRecord
from routing.domain.tiers import Tier, parse_tier
from routing.prompt_tokens import PromptRejected, VersionCounters
from routing.responses import ClientGone, GatewayError

__all__ = [
    "ChatPlan",
    "GatewaySettings",
    "authenticate",
    "plan_chat",
    "read_json",
    "team_limit",
]

_ALLOWED_ROLES = {"system", "developer", "user", "assistant", "tool"}
# Body fields the gateway sets itself; everything else passes to the engine.
_GATEWAY_FIELDS = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
}
_DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What the gateway reads from settings once, at start."""

    region: str
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 1024
    default_tokens_per_minute: int = 0
    default_max_concurrency: int = 0
    retry_ratio: float = 0.1
    retry_min: int = 3
    connect_timeout_s: float = 2.0
    shadow_concurrency: int = 16
    policy_options: PolicyOptions = field(default=DEFAULT_POLICY_OPTIONS)
    engine_api_key: str = ""


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """One chat request, decided: who, what, which version, how much, what to send.

    ``max_tokens`` is the client's, or the default that fits the context window;
    ``payload`` is the body for the engine (always streaming, with usage);
    ``started_at`` is monotonic seconds at arrival.
    """

    request_id: str
    team: str
    model_ref: str
    resolution: Resolution
    tier: Tier
    limit: LimitRecord
    prompt_tokens: int
    max_tokens: int
    stream: bool
    routing_key: str
    payload: bytes
    started_at: float

    @property
    def request_tokens(self) -> int:
        """Prompt plus ``max_tokens``: the most the request can hold in flight."""
        return self.prompt_tokens + self.max_tokens


def authenticate(scope: Scope, snapshot: ConfigSnapshot) -> str:
    """Return the team of the request's bearer key.

    Raises:
        GatewayError: 401, no key or one that is not active in the snapshot.
    """
    header = b""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            header = value
            break
    scheme, _, secret = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise GatewayError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            error_type="invalid_request_error",
        )
    key = snapshot.keys.get(hashlib.sha256(secret.strip().encode()).hexdigest())
    if key is None:
        raise GatewayError(
            401,
            "invalid API key",
            code="invalid_api_key",
            error_type="invalid_request_error",
        )
    return key.team


def team_limit(
    snapshot: ConfigSnapshot, settings: GatewaySettings, team: str, model: str
) -> LimitRecord | None:
    """Return the team's limits on a model; default limits when allowed; else None."""
    limit = snapshot.limits.get((team, model))
    if limit is not None:
        return limit
    if settings.default_tokens_per_minute > 0:
        return LimitRecord(
            team=team,
            model=model,
            tokens_per_minute=settings.default_tokens_per_minute,
            max_concurrency=settings.default_max_concurrency or 10**6,
            guaranteed_share=0.0,
        )
    return None


async def read_json(
    receive: Receive, headers: Mapping[bytes, bytes], limit: int
) -> dict[str, Any]:
    """Read the request body, at most ``limit`` bytes, as a JSON object.

    Raises:
        GatewayError: 413 too large, 400 not a JSON object.
        ClientGone: the client left before sending the whole body.
    """
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(
            413, f"request body is larger than {limit} bytes", code="request_too_large"
        )
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(
                413,
                f"request body is larger than {limit} bytes",
                code="request_too_large",
            )
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GatewayError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object")
    return body


async def plan_chat(
    *,
    snapshot: ConfigSnapshot,
    settings: GatewaySettings,
    counters: VersionCounters,
    team: str,
    headers: Mapping[bytes, bytes],
    body: Mapping[str, Any],
    started_at: float,
    rng: random.Random,
) -> ChatPlan:
    """Return the plan of one chat request from ``team``.

    ``rng`` draws the shadow sample (one uniform draw per request).

    Raises:
        GatewayError: the request cannot be served as asked (see the module).
    """
    try:
        tier = parse_tier(_header(headers, b"x-priority"))
    except ValueError as exc:
        raise GatewayError(400, str(exc), param="x-priority") from None
    model_ref, messages, stream, max_tokens_asked = _check_body(body)
    key = routing_key(_header(headers, b"x-conversation-id"), messages)
    try:
        resolution = resolve(
            model_ref, snapshot.models, snapshot.versions, key, rng.random()
        )
    except (UnknownModel, UnknownVersion) as exc:
        raise GatewayError(
            404, str(exc), param="model", code="model_not_found"
        ) from None
    except NoLiveVersion as exc:
        raise GatewayError(
            503, str(exc), param="model", headers={"retry-after": "5"}
        ) from None
    limit = team_limit(snapshot, settings, team, resolution.model)
    if limit is None:
        raise GatewayError(
            403,
            f"team {team!r} may not use model {resolution.model!r}",
            param="model",
            code="model_not_allowed",
            error_type="permission_error",
        )
    version = snapshot.versions.get((resolution.model, resolution.version))
    max_model_len = version.max_model_len if version else _DEFAULT_MAX_MODEL_LEN
    try:
        prompt_tokens = await counters.count(version, messages)
    except PromptRejected as exc:
        raise GatewayError(400, str(exc), param="messages") from None
    if max_tokens_asked is None:
        max_tokens = max(
            1, min(settings.default_max_tokens, max_model_len - prompt_tokens)
        )
    else:
        max_tokens = max_tokens_asked
    if prompt_tokens + max_tokens > max_model_len:
        raise GatewayError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the "
            f"messages take {prompt_tokens} and max_tokens asks {max_tokens}.",
            param="messages",
            code="context_length_exceeded",
        )
    upstream_body = {k: v for k, v in body.items() if k not in _GATEWAY_FIELDS}
    upstream_body.update(
        model=resolution.model,
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=max_tokens,
    )
    return ChatPlan(
        request_id=f"chatcmpl-{secrets.token_hex(12)}",
        team=team,
        model_ref=model_ref,
        resolution=resolution,
        tier=tier,
        limit=limit,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        routing_key=key,
        payload=json.dumps(upstream_body).encode(),
        started_at=started_at,
    )


def _header(headers: Mapping[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return value.decode("latin-1") if value is not None else None


def _check_body(
    body: Mapping[str, Any],
) -> tuple[str, list[dict[str, Any]], bool, int | None]:
    """Validate the OpenAI fields the gateway relies on; return what it needs."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "model is required", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ALLOWED_ROLES:
            raise GatewayError(
                400,
                f"each message needs a role of {', '.join(sorted(_ALLOWED_ROLES))}",
                param=f"messages.{index}.role",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise GatewayError(
                400,
                "content must be a string or a list of parts",
                param=f"messages.{index}.content",
            )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or max_tokens < 1
    ):
        param = (
            "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        )
        raise GatewayError(400, f"{param} must be a positive integer", param=param)
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not low <= value <= high
        ):
            raise GatewayError(
                400, f"{name} must be a number between {low:g} and {high:g}", param=name
            )
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str)
        or (
            isinstance(stop, list)
            and len(stop) <= 4
            and all(isinstance(s, str) for s in stop)
        )
    ):
        raise GatewayError(
            400, "stop must be a string or a list of up to 4 strings", param="stop"
        )
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise GatewayError(400, "seed must be an integer", param="seed")
    if body.get("n", 1) != 1:
        raise GatewayError(400, "n must be 1", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise GatewayError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise GatewayError(
            400, "stream_options must be an object", param="stream_options"
        )
    return model, messages, stream, max_tokens
