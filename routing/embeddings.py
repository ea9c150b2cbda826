"""``/v1/embeddings``: its plan, and its answer built from the engine's.

Public surface: ``plan_embedding``, ``embedding_answer``.

An embeddings request is planned as a ``ChatPlan`` of surface ``embeddings`` and
served by chat's pipeline (admission, routing, metering): it is charged its input
tokens only (``max_tokens`` 0: nothing is generated), counted as completion
prompts are (``VersionCounters.count_prompts``), and each input must fit the
model's longest input (``ModelRecord.max_input_tokens``, else the version's
context), or it is a 400 before admission, never charged. Only an embedding
model answers it (a chat model is a 400 naming ``model``, as an embedding model
is on the generation APIs: ``routing.plan``). The engine's answer is one JSON
body, never a stream (``routing.attempt``); the client gets it whole, with the
model as asked and who served it, as chat's whole answer does. Nothing here
touches the ORM.
"""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import Mapping
from typing import Any

from config.json_body import BodyError
from routing.domain.embedding_body import check_embedding_body
from routing.domain.routing_key import routing_key
from routing.domain.snapshot import ConfigSnapshot
from routing.domain.tiers import parse_tier
from routing.plan import (
    _DEFAULT_MAX_MODEL_LEN,
    ChatPlan,
    GatewaySettings,
    _bad_body,
    _header,
    _resolve_for_team,
)
from routing.prompt_tokens import VersionCounters
from routing.responses import FinalUsage, GatewayError

__all__ = ["embedding_answer", "plan_embedding"]

# Body fields the gateway sets itself; everything else passes to the engine.
_GATEWAY_FIELDS = {"model", "stream", "priority"}
# A request's routing key hashes this much of its first input.
_KEY_CHARS = 1024
_KEY_TOKENS = 256


async def plan_embedding(
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
    """Return the plan of one ``/v1/embeddings`` request from ``team``.

    Raises:
        GatewayError: the request cannot be served as asked (see the module).
    """
    try:
        tier = parse_tier(_header(headers, b"x-priority"))
    except ValueError as exc:
        raise GatewayError(400, str(exc), param="x-priority") from None
    try:
        checked = check_embedding_body(body)
    except BodyError as exc:
        raise _bad_body(exc) from None
    first = checked.inputs[0]
    opening = (
        first[:_KEY_CHARS]
        if isinstance(first, str)
        else json.dumps(first[:_KEY_TOKENS])
    )
    key = routing_key(
        _header(headers, b"x-conversation-id"),
        [{"role": "user", "content": opening}],
    )
    resolution, limit = _resolve_for_team(
        snapshot, settings, team, checked.model, key, rng, kind="embedding"
    )
    record = snapshot.models[resolution.model]
    if checked.dimensions is not None and checked.dimensions > record.dimensions:
        raise GatewayError(
            400,
            f"dimensions may be at most {record.dimensions} for {resolution.model}",
            param="dimensions",
        )
    version = snapshot.versions.get((resolution.model, resolution.version))
    longest = record.max_input_tokens or (
        version.max_model_len if version else _DEFAULT_MAX_MODEL_LEN
    )
    counts = await counters.count_prompts(version, checked.inputs)
    for index, count in enumerate(counts):
        if count > longest:
            raise GatewayError(
                400,
                f"This model's maximum input length is {longest} tokens; input "
                f"{index} takes {count}.",
                param="input",
                code="context_length_exceeded",
            )
    upstream_body = {k: v for k, v in body.items() if k not in _GATEWAY_FIELDS}
    upstream_body["model"] = resolution.model
    if version is not None and version.priority_scheduling:
        upstream_body["priority"] = tier.rank
    return ChatPlan(
        request_id=f"embd-{secrets.token_hex(12)}",
        team=team,
        model_ref=checked.model,
        resolution=resolution,
        tier=tier,
        limit=limit,
        prompt_tokens=sum(counts),
        max_tokens=0,
        stream=False,
        routing_key=key,
        payload=json.dumps(upstream_body).encode(),
        started_at=started_at,
        batch_key=batch_key,
        surface="embeddings",
    )


def embedding_answer(
    raw: bytes,
    *,
    plan: ChatPlan,
    region: str,
    replica_id: str,
) -> tuple[bytes, FinalUsage, str]:
    """Return the client's answer from the engine's 200 body, its usage and id.

    The usage is the engine's ``usage.prompt_tokens`` (the gateway's count when
    it sent none); nothing is generated, so completion tokens are 0.

    Raises:
        ValueError: the body is not an embeddings answer (JSON with ``data``).
    """
    answer = json.loads(raw)
    if not isinstance(answer, dict) or not isinstance(answer.get("data"), list):
        raise ValueError("not an embeddings answer")
    engine_usage = answer.get("usage")
    prompt_tokens = plan.prompt_tokens
    if isinstance(engine_usage, dict) and isinstance(
        engine_usage.get("prompt_tokens"), int
    ):
        prompt_tokens = engine_usage["prompt_tokens"]
    usage = FinalUsage(
        prompt_tokens=prompt_tokens, cached_tokens=0, completion_tokens=0
    )
    answer_id = str(answer.get("id") or plan.request_id)
    answer.update(
        id=answer_id,
        object="list",
        model=plan.model_ref,
        usage={"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        model_version=plan.resolution.version,
        region=region,
        replica_id=replica_id,
    )
    return json.dumps(answer).encode(), usage, answer_id
