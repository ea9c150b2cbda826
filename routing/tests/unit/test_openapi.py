"""The gateway's part of the /v1 schema is valid OpenAPI and says what
``routing.domain.chat_body`` checks: the same ranges, roles, counts and patterns."""

from __future__ import annotations

import re
from typing import Any

import pytest
import schemathesis

from routing.domain import (
    chat_body,
    completion_body,
    embedding_body,
    responses_body,
)
from routing.openapi import gateway_components, gateway_paths

COMPONENTS = gateway_components()
CHAT = COMPONENTS["ChatCompletionRequest"]["properties"]
COMPLETION = COMPONENTS["CompletionRequest"]["properties"]


def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "gateway", "version": "1"},
        "paths": gateway_paths(),
        "components": {"schemas": COMPONENTS},
    }


def not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """Return the branch of a nullable schema that is not null."""
    branches = [b for b in schema.get("anyOf", [schema]) if b != {"type": "null"}]
    assert len(branches) == 1, schema
    return branches[0]


def test_gateway_schema_is_valid_openapi() -> None:
    schemathesis.openapi.from_dict(document()).validate()


@pytest.mark.parametrize("name", sorted(chat_body.NUMBER_RANGES))
def test_chat_number_ranges_are_chat_bodys(name: str) -> None:
    schema = not_null(CHAT[name])
    assert (schema["minimum"], schema["maximum"]) == chat_body.NUMBER_RANGES[name]


def test_chat_limits_are_chat_bodys() -> None:
    seed = not_null(CHAT["seed"])
    assert (seed["minimum"], seed["maximum"]) == chat_body.INT64_RANGE
    assert not_null(CHAT["top_logprobs"])["maximum"] == chat_body.MAX_TOP_LOGPROBS
    stop = not_null(CHAT["stop"])["anyOf"][1]
    assert stop["maxItems"] == chat_body.MAX_STOP
    bias = not_null(CHAT["logit_bias"])["additionalProperties"]
    assert (bias["minimum"], bias["maximum"]) == chat_body.LOGIT_BIAS_RANGE
    name = COMPONENTS["ResponseFormat"]["oneOf"][1]["properties"]["json_schema"]
    assert name["properties"]["name"]["pattern"] == f"^{chat_body.NAME_PATTERN}$"
    assert re.fullmatch(name["properties"]["name"]["pattern"][1:-1], "a" * 64)


def test_chat_roles_and_formats_are_chat_bodys() -> None:
    messages = COMPONENTS["Messages"]["items"]["oneOf"]
    roles = {role for m in messages for role in m["properties"]["role"]["enum"]}
    assert roles == chat_body.ALLOWED_ROLES
    formats = COMPONENTS["ResponseFormat"]["oneOf"]
    kinds = set(formats[0]["properties"]["type"]["enum"])
    assert kinds | {formats[1]["properties"]["type"]["const"]} == (
        chat_body.RESPONSE_FORMATS
    )


def test_caps_on_choices_tools_and_prompts_are_the_bodys() -> None:
    assert not_null(CHAT["n"])["maximum"] == chat_body.MAX_N
    assert not_null(COMPLETION["n"])["maximum"] == chat_body.MAX_N
    assert not_null(CHAT["tools"])["maxItems"] == chat_body.MAX_TOOLS
    choices = set(COMPONENTS["ToolChoice"]["anyOf"][0]["enum"])
    assert choices == chat_body.TOOL_CHOICES
    lists = COMPLETION["prompt"]["anyOf"][2]
    assert lists["maxItems"] == completion_body.MAX_PROMPTS
    logprobs = not_null(COMPLETION["logprobs"])
    assert logprobs["maximum"] == completion_body.MAX_COMPLETION_LOGPROBS


def test_unsupported_fields_admit_only_null() -> None:
    for name in chat_body.UNSUPPORTED_FIELDS:
        assert CHAT[name]["type"] == "null", name
    assert COMPLETION["suffix"]["type"] == "null"
    parts = COMPONENTS["TextPart"]["properties"]["type"]
    assert parts == {"const": "text"}


def test_responses_fields_are_responses_bodys() -> None:
    request = COMPONENTS["ResponseRequest"]
    assert set(request["properties"]) == responses_body.ACCEPTED_FIELDS
    assert request["additionalProperties"] is False  # unknown fields are a 400
    properties = request["properties"]
    for name in responses_body.RESPONSES_SAMPLING:
        low, high = chat_body.NUMBER_RANGES[name]
        assert not_null(properties[name])["minimum"] == low
        assert not_null(properties[name])["maximum"] == high
    assert not_null(properties["include"])["items"]["enum"] == sorted(
        responses_body.INCLUDABLE
    )
    assert not_null(properties["tools"])["maxItems"] == chat_body.MAX_TOOLS
    metadata = not_null(properties["metadata"])
    assert metadata["maxProperties"] == responses_body.MAX_METADATA_PAIRS
    for name in responses_body.UNSUPPORTED_FIELDS:
        assert properties[name]["type"] == "null"
    # What the platform never does is only ever false.
    for name in ("store", "background"):
        assert not_null(properties[name])["const"] is False
    items = COMPONENTS["InputItems"]["items"]["anyOf"]
    messages = [item for item in items if "role" in item["properties"]]
    roles = {role for item in messages for role in item["properties"]["role"]["enum"]}
    assert roles == responses_body.INPUT_ROLES


def test_embeddings_fields_are_embedding_bodys() -> None:
    embedding = COMPONENTS["EmbeddingRequest"]["properties"]
    assert embedding["input"]["anyOf"][2]["maxItems"] == (
        embedding_body.MAX_EMBEDDING_INPUTS
    )
    assert not_null(embedding["encoding_format"])["enum"] == list(
        embedding_body.ENCODING_FORMATS
    )
    assert not_null(embedding["dimensions"])["minimum"] == 1
    assert "/v1/embeddings" in gateway_paths()
