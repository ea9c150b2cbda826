"""``/v1/embeddings``: its plan, and its answer built from the engine's.

Public surface: ``plan_embedding``, ``embedding_answer``, ``longest_input``.

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

from routing.domain.embedding_body import check_embedding_body
from routing.domain.snapshot import ConfigSnapshot, ModelRecord, VersionRecord
from routing.plan import (
    DEFAULT_MAX_MODEL_LEN,
    ChatPlan,
    GatewaySettings,
    opening_messages,
    plan_upstream_body,
    start_plan,
)
from routing.prompt_tokens import VersionCounters
from routing.responses import FinalUsage, GatewayError

__all__ = ["embedding_answer", "longest_input", "plan_embedding"]


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
    checked, opening = start_plan(
        check_embedding_body,
        lambda checked: opening_messages(checked.inputs[0]),
        snapshot=snapshot,
        settings=settings,
        team=team,
        headers=headers,
        body=body,
        rng=rng,
        kind="embedding",
    )
    resolution = opening.resolution
    record = snapshot.models[resolution.model]
    if checked.dimensions is not None and checked.dimensions > record.dimensions:
        raise GatewayError(
            400,
            f"dimensions may be at most {record.dimensions} for {resolution.model}",
            param="dimensions",
        )
    longest = longest_input(record, opening.version)
    counts = await counters.count_prompts(opening.version, checked.inputs)
    for index, count in enumerate(counts):
        if count > longest:
            raise GatewayError(
                400,
                f"This model's maximum input length is {longest} tokens; input "
                f"{index} takes {count}.",
                param="input",
                code="context_length_exceeded",
            )
    return ChatPlan(
        request_id=f"embd-{secrets.token_hex(12)}",
        team=team,
        model_ref=checked.model,
        resolution=resolution,
        tier=opening.tier,
        limit=opening.limit,
        prompt_tokens=sum(counts),
        max_tokens=0,
        stream=False,
        routing_key=opening.routing_key,
        payload=plan_upstream_body(body, opening, "embeddings"),
        started_at=started_at,
        batch_key=batch_key,
        surface="embeddings",
    )


def longest_input(record: ModelRecord, version: VersionRecord | None) -> int:
    """Return the most tokens one input of an embedding model may take: the
    model's ``max_input_tokens``, else its version's context."""
    return record.max_input_tokens or (
        version.max_model_len if version else DEFAULT_MAX_MODEL_LEN
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
