"""The request plan: everything decided about a chat request before it is admitted.

Public surface: ``GatewaySettings``, ``ChatPlan``, ``Surface``, ``team_limit``,
``payload_for``, ``plan_chat``, ``plan_completion``, ``plan_response``, and what
every ``/v1`` planner (here and ``routing.embeddings``) is built from:
``start_plan`` (tier, body, routing key, version, limits: a ``PlanOpening``),
``opening_messages`` (a prompt list's key), ``plan_upstream_body`` (the engine's
body) and ``resolve_for_team`` (``routing.tokenize`` resolves with it too).

A ``/v1/completions`` request is planned the same way (``plan_completion``), as a
``ChatPlan`` of surface ``completions``: the same admission, limits, routing,
metering and final event follow. Every choice is charged ``max_tokens`` up front
(``n`` per prompt, each prompt of a list its own ``n``), and refunded by what the
engine's usage says was generated. A request with ``tools`` is planned only for a
version whose engine parses tool calls (``VersionRecord.tool_call_parser``):
anywhere else it is a 400 before admission, never the engine's 500. A
``/v1/responses`` request (``plan_response``) is a ``ChatPlan`` of surface
``responses``: its input, as chat messages, is counted and keyed as a chat's, and
the engine is always sent ``store: false`` (the platform never stores answers).

A request's key and body are read by ``routing.intake``; from its team it goes
tier -> body -> routing key -> version -> limits -> prompt tokens, and comes out
as one immutable ``ChatPlan`` or a ``GatewayError`` in OpenAI's shape (400 bad
body or ``x-priority``, 403 a model the team may not use, 404 unknown model or
version, 503 no live version). The body's fields are checked as OpenAI checks
them (``routing.domain.chat_body`` and its siblings), so nothing a client sends
can raise anything but a ``GatewayError`` here. A ``/tokenize``
request is resolved to a version the same way (``routing.tokenize``). Nothing
here touches the ORM: keys, limits and versions come from the ``ConfigSnapshot``.
"""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from config.json_body import BodyError
from routing.domain.chat_body import check_chat_body
from routing.domain.completion_body import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    check_completion_body,
)
from routing.domain.policies import (
    DEFAULT_POLICY_OPTIONS,
    CacheAwarePolicy,
    PolicyOptions,
)
from routing.domain.refusals import DEFAULT_REFUSAL_PATTERNS
from routing.domain.resolve import (
    NoLiveVersion,
    Resolution,
    UnknownModel,
    UnknownVersion,
    resolve,
)
from routing.domain.responses_body import check_responses_body
from routing.domain.routing_key import routing_key
from routing.domain.snapshot import (
    ConfigSnapshot,
    LimitRecord,
    VersionRecord,
)
from routing.domain.tiers import Tier, parse_tier
from routing.domain.traffic import is_sampled
from routing.entitlements import check_tier
from routing.intake import header_text, refuse_body
from routing.prompt_fit import count_and_fit
from routing.prompt_tokens import VersionCounters
from routing.responses import GatewayError

__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "ChatPlan",
    "GatewaySettings",
    "PlanOpening",
    "opening_messages",
    "payload_for",
    "plan_chat",
    "plan_completion",
    "plan_response",
    "plan_upstream_body",
    "resolve_for_team",
    "start_plan",
    "team_limit",
]

# The OpenAI API a request came on: its engine path, event and answer shapes.
Surface = Literal["chat", "completions", "responses", "embeddings"]
# Body fields the gateway sets itself, by surface; everything else passes to the
# engine. ``priority`` is vLLM's per-request scheduling priority (with
# ``--scheduling-policy priority``): a client's own would let it jump the tiers
# inside the engine, so it never passes through. A response is always sent store
# false and a stream; an embeddings request is never streamed.
_GENERATION_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "priority",
    }
)
_GATEWAY_FIELDS: dict[Surface, frozenset[str]] = {
    "chat": _GENERATION_FIELDS,
    "completions": _GENERATION_FIELDS,
    "responses": frozenset(
        {"model", "stream", "store", "max_output_tokens", "priority"}
    ),
    "embeddings": frozenset({"model", "stream", "priority"}),
}
# A version's context when the snapshot holds no record of it.
DEFAULT_MAX_MODEL_LEN = 8192
# A prompt list's routing key (completions, embeddings) hashes this much of its
# first prompt: prompts that share a long opening (few-shot examples) share a
# key, and a warm prefix cache.
_OPENING_CHARS = 1024
_OPENING_TOKENS = 256


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What the gateway reads from settings once, at start.

    ``figures_bucket_s`` and ``refusal_patterns`` are the rollout guards' (the
    length of a figures bucket, the refusal detector's regular expressions).
    """

    region: str
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 1024
    default_tokens_per_minute: int = 0
    default_max_concurrency: int = 0
    retry_ratio: float = 0.1
    retry_min: int = 3
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 30.0
    inter_token_timeout_s: float = 15.0
    # None: no gateway stall rule (``routing.domain.stall``).
    stall_after_s: float | None = None
    shadow_concurrency: int = 16
    policy_options: PolicyOptions = field(default=DEFAULT_POLICY_OPTIONS)
    engine_api_key: str = ""
    figures_bucket_s: int = 60
    refusal_patterns: tuple[str, ...] = DEFAULT_REFUSAL_PATTERNS
    # The tiers a team may use on a model it has no entitlement row on
    # (``PLATFORM_DEFAULT_TIERS``).
    default_tiers: frozenset[Tier] = frozenset(Tier)


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """One chat request, decided: who, what, which version, how much, what to send.

    ``max_tokens`` is the client's, or the default that fits the context window;
    ``payload`` is the body for the engine (always streaming, with usage);
    ``include_usage`` is False when the client asked for no usage chunk
    (``stream_options.include_usage: false``: the gateway meters all the same);
    ``started_at`` is monotonic seconds at arrival; ``request_id`` names the answer
    only when the engine's first event carries no id of its own; ``batch_key``:
    the request came with a batch job's key (``KeyRecord.batch``).
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
    include_usage: bool = True
    # No assistant message yet: the conversation's first turn (during a rollout
    # only a first turn may go to the canary: routing.domain.sticky).
    first_turn: bool = True
    batch_key: bool = False
    surface: Surface = "chat"
    # Sequences the engine generates: n, times the prompts of a completion.
    choices: int = 1
    # An embeddings request's count of each input, in order (what a split
    # across replicas is cut by: routing.domain.embedding_split).
    input_tokens: tuple[int, ...] = ()
    # The prompt's token ids, kept only where the model routes by cache
    # (``PlanOpening.keeps_prompt_ids``); never logged, dropped with the plan.
    prompt_ids: tuple[int, ...] = ()

    @property
    def request_tokens(self) -> int:
        """Prompt plus ``max_tokens`` per choice: the most the request can hold
        in flight, and what admission charges."""
        return self.prompt_tokens + self.choices * self.max_tokens

    @property
    def output_claim(self) -> int:
        """The output tokens charged up front: ``max_tokens`` per choice."""
        return self.choices * self.max_tokens

    @property
    def is_batch_work(self) -> bool:
        """True when the request is metered as batch work.

        Asked for at the batch tier, or sent with a batch job's key at any tier:
        a batch runner raises a line to standard when its deadline nears, and the
        line is still the batch's work.
        """
        return self.tier is Tier.BATCH or self.batch_key


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


def payload_for(payload: bytes, tier: Tier, version: VersionRecord | None) -> bytes:
    """``payload`` for another version of the same request: with the tier as vLLM's
    priority where that version's engine schedules by priority, without it
    elsewhere (an engine on the default policy refuses a priority other than 0).
    Unchanged, and not re-encoded, when it already fits."""
    wanted = tier.rank if version is not None and version.priority_scheduling else None
    body = json.loads(payload)
    if body.get("priority") == wanted:
        return payload
    body.pop("priority", None)
    if wanted is not None:
        body["priority"] = wanted
    return json.dumps(body).encode()


class _CheckedBody(Protocol):
    """A checked ``/v1`` body: each names the model asked for."""

    @property
    def model(self) -> str: ...


_Body = TypeVar("_Body", bound=_CheckedBody)


@dataclass(frozen=True, slots=True)
class PlanOpening:
    """What every ``/v1`` planner decides first: the tier (``x-priority``), the
    routing key, the version and the team's limits on its model.

    ``version`` is the version's record (None when the snapshot holds none),
    ``max_model_len`` its context (a default without a record).
    """

    tier: Tier
    routing_key: str
    resolution: Resolution
    limit: LimitRecord
    version: VersionRecord | None
    max_model_len: int
    # The model routes by its replicas' caches (policy "cache_aware"), or the
    # request is recorded for the traffic twin: the plan keeps the prompt's token
    # ids, which key its blocks.
    keeps_prompt_ids: bool = False


def start_plan(
    check: Callable[[Mapping[str, Any]], _Body],
    key_messages: Callable[[_Body], Sequence[object]],
    *,
    snapshot: ConfigSnapshot,
    settings: GatewaySettings,
    team: str,
    headers: Mapping[bytes, bytes],
    body: Mapping[str, Any],
    rng: random.Random,
    kind: str = "chat",
    batch_key: bool = False,
) -> tuple[_Body, PlanOpening]:
    """Return ``body`` as ``check`` checks it, and the request's opening.

    ``key_messages`` gives what the routing key hashes when the request names no
    conversation (``x-conversation-id``); ``kind`` is the kind of model the
    request's API serves; ``batch_key``: the request came with a batch job's key,
    and is judged as the batch tier for entitlements whatever tier it asks.

    Raises:
        GatewayError: 400 a bad ``x-priority`` or body (a ``BodyError``), a model
            of another kind; 403 a tier the team may not use on the model
            (``tier_not_entitled``); 403/404/503 as for any model (see the module).
    """
    try:
        tier = parse_tier(header_text(headers, b"x-priority"))
    except ValueError as exc:
        raise GatewayError(400, str(exc), param="x-priority") from None
    try:
        checked = check(body)
    except BodyError as exc:
        raise refuse_body(exc) from None
    key = routing_key(header_text(headers, b"x-conversation-id"), key_messages(checked))
    resolution, limit = resolve_for_team(
        snapshot, settings, team, checked.model, key, rng, kind=kind
    )
    check_tier(
        snapshot,
        settings.default_tiers,
        team,
        resolution.model,
        Tier.BATCH if batch_key else tier,
    )
    version = snapshot.versions.get((resolution.model, resolution.version))
    record = snapshot.models.get(resolution.model)
    return checked, PlanOpening(
        tier=tier,
        routing_key=key,
        resolution=resolution,
        limit=limit,
        version=version,
        max_model_len=version.max_model_len if version else DEFAULT_MAX_MODEL_LEN,
        keeps_prompt_ids=(record is not None and record.policy == CacheAwarePolicy.name)
        or (version is not None and is_sampled(key, version.traffic_share)),
    )


def plan_upstream_body(
    body: Mapping[str, Any],
    opening: PlanOpening,
    surface: Surface,
    *,
    max_tokens: int = 0,
) -> bytes:
    """Return the engine's body: the client's, less the fields the gateway sets
    (``_GATEWAY_FIELDS``), with the served model's name, a stream with usage (a
    generation; a response's ``store`` false), ``max_tokens`` (a response's
    ``max_output_tokens``; an embedding has none) and the tier as vLLM's
    priority where the version's engine schedules by priority."""
    upstream = {k: v for k, v in body.items() if k not in _GATEWAY_FIELDS[surface]}
    upstream["model"] = opening.resolution.model
    if surface == "responses":
        upstream.update(stream=True, store=False, max_output_tokens=max_tokens)
    elif surface != "embeddings":
        upstream.update(
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=max_tokens,
        )
    if opening.version is not None and opening.version.priority_scheduling:
        upstream["priority"] = opening.tier.rank
    return json.dumps(upstream).encode()


def opening_messages(first: str | list[int]) -> list[dict[str, Any]]:
    """Return what a prompt list's routing key hashes: the opening of its first
    prompt (``_OPENING_CHARS`` characters or ``_OPENING_TOKENS`` token ids), as a
    user message."""
    opening = (
        first[:_OPENING_CHARS]
        if isinstance(first, str)
        else json.dumps(first[:_OPENING_TOKENS])
    )
    return [{"role": "user", "content": opening}]


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
    batch_key: bool = False,
) -> ChatPlan:
    """Return the plan of one chat request from ``team``.

    ``rng`` draws the shadow sample (one uniform draw per request); ``batch_key``
    says the request's key is a batch job's (``KeyRecord.batch``).

    Raises:
        GatewayError: the request cannot be served as asked (see the module).
    """
    checked, opening = start_plan(
        check_chat_body,
        lambda checked: checked.messages,
        snapshot=snapshot,
        settings=settings,
        team=team,
        headers=headers,
        body=body,
        rng=rng,
        batch_key=batch_key,
    )
    messages = checked.messages
    _check_tools_served(checked.tools, opening)
    prompt_ids, max_tokens = await count_and_fit(
        counters,
        opening.version,
        opening.max_model_len,
        messages,
        checked.tools,
        asked=checked.max_tokens,
        default=settings.default_max_tokens,
        names=("messages", "max_tokens"),
    )
    return ChatPlan(
        request_id=f"chatcmpl-{secrets.token_hex(12)}",
        team=team,
        model_ref=checked.model,
        resolution=opening.resolution,
        tier=opening.tier,
        limit=opening.limit,
        prompt_tokens=len(prompt_ids),
        prompt_ids=tuple(prompt_ids) if opening.keeps_prompt_ids else (),
        max_tokens=max_tokens,
        stream=checked.stream,
        routing_key=opening.routing_key,
        payload=plan_upstream_body(body, opening, "chat", max_tokens=max_tokens),
        started_at=started_at,
        include_usage=checked.include_usage,
        first_turn=not any(m.get("role") == "assistant" for m in messages),
        batch_key=batch_key,
        choices=checked.n,
    )


async def plan_completion(
    *,
    snapshot: ConfigSnapshot,
    settings: GatewaySettings,
    counters: VersionCounters,
    team: str,
    headers: Mapping[bytes, bytes],
    body: Mapping[str, Any],
    started_at: float,
    rng: random.Random,
    batch_key: bool = False,
) -> ChatPlan:
    """Return the plan of one ``/v1/completions`` request from ``team``.

    The routing key is the conversation header's, else a hash of the opening of
    the first prompt (``opening_messages``). Each prompt must fit the context with
    ``max_tokens`` (with ``echo`` the prompt comes back too, uncharged: it is
    counted once, as prompt tokens).

    Raises:
        GatewayError: the request cannot be served as asked (see the module).
    """
    checked, opening = start_plan(
        check_completion_body,
        lambda checked: opening_messages(checked.prompts[0]),
        snapshot=snapshot,
        settings=settings,
        team=team,
        headers=headers,
        body=body,
        rng=rng,
        batch_key=batch_key,
    )
    max_model_len = opening.max_model_len
    counts = await counters.count_prompts(opening.version, checked.prompts)
    max_tokens = checked.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    for index, count in enumerate(counts):
        if count + max_tokens > max_model_len:
            raise GatewayError(
                400,
                f"This model's maximum context length is {max_model_len} tokens; "
                f"prompt {index} takes {count} and max_tokens asks {max_tokens}.",
                param="prompt",
                code="context_length_exceeded",
            )
    return ChatPlan(
        request_id=f"cmpl-{secrets.token_hex(12)}",
        team=team,
        model_ref=checked.model,
        resolution=opening.resolution,
        tier=opening.tier,
        limit=opening.limit,
        prompt_tokens=sum(counts),
        max_tokens=max_tokens,
        stream=checked.stream,
        routing_key=opening.routing_key,
        payload=plan_upstream_body(body, opening, "completions", max_tokens=max_tokens),
        started_at=started_at,
        include_usage=checked.include_usage,
        batch_key=batch_key,
        surface="completions",
        choices=checked.n * len(checked.prompts),
    )


async def plan_response(
    *,
    snapshot: ConfigSnapshot,
    settings: GatewaySettings,
    counters: VersionCounters,
    team: str,
    headers: Mapping[bytes, bytes],
    body: Mapping[str, Any],
    started_at: float,
    rng: random.Random,
    batch_key: bool = False,
) -> ChatPlan:
    """Return the plan of one ``/v1/responses`` request from ``team``.

    Planned as a chat of its input's messages (``routing.domain.responses_body``):
    the same routing key, tool check and count; ``max_output_tokens`` is the
    client's, or chat's default that fits the context.

    Raises:
        GatewayError: the request cannot be served as asked (see the module).
    """
    checked, opening = start_plan(
        check_responses_body,
        lambda checked: checked.messages,
        snapshot=snapshot,
        settings=settings,
        team=team,
        headers=headers,
        body=body,
        rng=rng,
        batch_key=batch_key,
    )
    messages = checked.messages
    _check_tools_served(checked.tools, opening)
    prompt_ids, max_tokens = await count_and_fit(
        counters,
        opening.version,
        opening.max_model_len,
        messages,
        checked.tools,
        asked=checked.max_output_tokens,
        default=settings.default_max_tokens,
        names=("input", "max_output_tokens"),
    )
    return ChatPlan(
        request_id=f"resp_{secrets.token_hex(12)}",
        team=team,
        model_ref=checked.model,
        resolution=opening.resolution,
        tier=opening.tier,
        limit=opening.limit,
        prompt_tokens=len(prompt_ids),
        prompt_ids=tuple(prompt_ids) if opening.keeps_prompt_ids else (),
        max_tokens=max_tokens,
        stream=checked.stream,
        routing_key=opening.routing_key,
        payload=plan_upstream_body(body, opening, "responses", max_tokens=max_tokens),
        started_at=started_at,
        first_turn=not any(m.get("role") == "assistant" for m in messages),
        batch_key=batch_key,
        surface="responses",
    )


def resolve_for_team(
    snapshot: ConfigSnapshot,
    settings: GatewaySettings,
    team: str,
    model_ref: str,
    key: str,
    rng: random.Random,
    *,
    kind: str | None = "chat",
) -> tuple[Resolution, LimitRecord]:
    """Return the version ``model_ref`` resolves to for ``key``, and the team's limits.

    ``kind`` is the kind of model the request's API serves (None: any).

    Raises:
        GatewayError: 404 unknown model or version, 503 no live version, 403 a
            model the team may not use, 400 a model of another kind.
    """
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
    record = snapshot.models.get(resolution.model)
    if kind is not None and record is not None and record.kind != kind:
        what = (
            "an embedding model: use it with /v1/embeddings"
            if record.is_embedding
            else "a chat model: use it with chat, completions or responses"
        )
        raise GatewayError(
            400,
            f"{resolution.model} is {what}",
            param="model",
            code="model_not_supported",
        )
    limit = team_limit(snapshot, settings, team, resolution.model)
    if limit is None:
        raise GatewayError(
            403,
            f"team {team!r} may not use model {resolution.model!r}: it has no "
            "limits on it; ask a platform admin to grant them "
            f"(PUT /admin/teams/{team}/limits)",
            param="model",
            code="model_not_allowed",
            error_type="permission_error",
        )
    return resolution, limit


def _check_tools_served(
    tools: list[dict[str, Any]] | None, opening: PlanOpening
) -> None:
    """Refuse tools (400) for a version whose engine parses no tool calls."""
    resolution, version = opening.resolution, opening.version
    if tools is not None and not (version and version.tool_call_parser):
        raise GatewayError(
            400,
            f"{resolution.model}@{resolution.version} does not serve tool calls: "
            "its engine runs no tool-call parser (a platform admin sets "
            "engine_config tool_call_parser on the version)",
            param="tools",
            code="unsupported_parameter",
        )
