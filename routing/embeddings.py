"""``/v1/embeddings``: its plan, and its answer built from the engine's.

Public surface: ``plan_embedding``, ``embedding_answer``, ``longest_input``, and
a large request's split across replicas: ``EngineEmbeddings``,
``read_embeddings``, ``split_plan``, ``merge_embeddings``.

An embeddings request is planned as a ``ChatPlan`` of surface ``embeddings`` and
served by chat's pipeline (admission, routing, metering): it is charged its input
tokens only (``max_tokens`` 0: nothing is generated), counted as completion
prompts are (``VersionCounters.count_prompts``), and each input must fit the
model's longest input (``ModelRecord.max_input_tokens``, else the version's
context), or it is a 400 before admission, never charged. Only an embedding
model answers it (a chat model is a 400 naming ``model``, as an embedding model
is on the generation APIs: ``routing.plan``). The engine's answer is one JSON
body, never a stream (``routing.attempt``); the client gets it whole, with the
model as asked and who served it, as chat's whole answer does. A large list of
inputs may be split into contiguous chunks sent at once to idle replicas
(``routing.domain.embedding_split`` decides; ``routing.chat`` sends them); the
chunks' answers are merged in input order, their usage summed. Nothing here
touches the ORM.
"""

from __future__ import annotations

import dataclasses
import json
import random
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

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

__all__ = [
    "EngineEmbeddings",
    "EngineVector",
    "embedding_answer",
    "longest_input",
    "merge_embeddings",
    "plan_embedding",
    "read_embeddings",
    "split_plan",
]


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
        batch_key=batch_key,
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
        input_tokens=tuple(counts),
    )


def longest_input(record: ModelRecord, version: VersionRecord | None) -> int:
    """Return the most tokens one input of an embedding model may take: the
    model's ``max_input_tokens``, else its version's context."""
    return record.max_input_tokens or (
        version.max_model_len if version else DEFAULT_MAX_MODEL_LEN
    )


class EngineVector(msgspec.Struct):
    """One vector of an engine's answer. Its ``embedding`` (a list of floats, or
    base64 text) is kept as the engine's own bytes: never parsed into floats or
    written out again, as a whole answer can be megabytes of numbers."""

    index: int
    embedding: msgspec.Raw
    object: str = "embedding"


class _EngineAnswer(msgspec.Struct):
    """An engine's embeddings answer as the gateway reads it (other fields are
    dropped: OpenAI's answer has no others)."""

    data: list[EngineVector]
    id: str | None = None
    created: int | None = None
    usage: dict[str, Any] | None = None


class _ClientAnswer(msgspec.Struct, omit_defaults=True):
    """The client's answer: OpenAI's fields, then who served it (``created``
    and ``replica_ids`` only where there is one)."""

    id: str
    object: str
    data: list[EngineVector]
    model: str
    usage: dict[str, int]
    model_version: str
    region: str
    replica_id: str
    created: int | None = None
    replica_ids: list[str] | None = None


_DECODER = msgspec.json.Decoder(_EngineAnswer)
_ENCODER = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class EngineEmbeddings:
    """An engine's 200 answer to an embeddings request, read: its vectors (each
    still the engine's bytes), its id and creation time, and its usage."""

    data: list[EngineVector]
    usage: FinalUsage
    answer_id: str | None = None
    created: int | None = None


def read_embeddings(raw: bytes, *, counted: int) -> EngineEmbeddings:
    """Return the engine's answer, its usage the engine's ``usage.prompt_tokens``
    (``counted``, the gateway's count, when it sent none); nothing is generated,
    so completion tokens are 0.

    Only the answer's frame is parsed: each vector's numbers are skipped over,
    not read (``EngineVector``), so a large answer costs the event loop a scan.

    Raises:
        ValueError: the body is not an embeddings answer (JSON with ``data``, a
            list of vectors each with an integer ``index`` and an ``embedding``).
    """
    try:
        answer = _DECODER.decode(raw)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"not an embeddings answer: {exc}") from None
    engine_usage = answer.usage or {}
    prompt_tokens = engine_usage.get("prompt_tokens")
    if type(prompt_tokens) is not int:
        prompt_tokens = counted
    return EngineEmbeddings(
        data=answer.data,
        usage=FinalUsage(
            prompt_tokens=prompt_tokens, cached_tokens=0, completion_tokens=0
        ),
        answer_id=answer.id,
        created=answer.created,
    )


def split_plan(plan: ChatPlan, chunk: range) -> ChatPlan:
    """Return the plan of the inputs ``chunk`` of an embeddings request (a list
    of inputs), as sent to one replica of a split."""
    body = json.loads(plan.payload)
    body["input"] = body["input"][chunk.start : chunk.stop]
    counts = plan.input_tokens[chunk.start : chunk.stop]
    return dataclasses.replace(
        plan,
        payload=json.dumps(body).encode(),
        prompt_tokens=sum(counts),
        input_tokens=counts,
    )


def merge_embeddings(
    parts: Sequence[EngineEmbeddings], chunks: Sequence[range]
) -> EngineEmbeddings:
    """Return the answers of a split's chunks as one: ``data`` in input order,
    each ``index`` its input's in the whole request, the usage summed.

    Raises:
        ValueError: a chunk's answer does not hold one vector per input.
    """
    data: list[EngineVector] = []
    for part, chunk in zip(parts, chunks, strict=True):
        items = part.data
        if sorted(item.index for item in items) != list(range(len(chunk))):
            raise ValueError("a chunk's answer does not hold one vector per input")
        for item in sorted(items, key=lambda item: item.index):
            data.append(
                EngineVector(
                    index=chunk.start + item.index,
                    embedding=item.embedding,
                    object=item.object,
                )
            )
    prompt_tokens = sum(part.usage.prompt_tokens for part in parts)
    return EngineEmbeddings(
        data=data,
        usage=FinalUsage(
            prompt_tokens=prompt_tokens, cached_tokens=0, completion_tokens=0
        ),
        answer_id=parts[0].answer_id,
        created=parts[0].created,
    )


def embedding_answer(
    engine: EngineEmbeddings,
    *,
    plan: ChatPlan,
    region: str,
    replica_ids: Sequence[str],
) -> tuple[bytes, str]:
    """Return the client's answer and its id: the engine's, with the model as
    asked, the usage the engine's, and who served it (``replica_id``; a split
    answer names every replica of its chunks in ``replica_ids`` too)."""
    prompt_tokens = engine.usage.prompt_tokens
    answer_id = engine.answer_id or plan.request_id
    answer = _ClientAnswer(
        id=answer_id,
        object="list",
        data=engine.data,
        model=plan.model_ref,
        usage={"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        model_version=plan.resolution.version,
        region=region,
        replica_id=replica_ids[0],
        created=engine.created,
        replica_ids=list(replica_ids) if len(replica_ids) > 1 else None,
    )
    return _ENCODER.encode(answer), answer_id
