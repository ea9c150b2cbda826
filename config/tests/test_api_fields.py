"""The control plane's strict fields, and their schema patterns against the rules."""

from __future__ import annotations

import re
from typing import Any

import pytest
from rest_framework import serializers

from config import fields
from config.api import openapi_pattern
from models_registry.domain.identity import uri_errors

ROOTS = ["s3://models/", "file:///srv/weights/"]


def python_pattern(pattern: str) -> re.Pattern[str]:
    r"""Compile a schema pattern as its validator reads it: ``$`` is the end (``\Z``)."""
    return re.compile(pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern)


def schema_allows_uri(uri: str) -> bool:
    allowed = python_pattern(fields.storage_uri_pattern(ROOTS)).search(uri)
    return bool(allowed) and not re.search(fields.DOT_DOT_SEGMENT, uri)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://models/chat-7b/2026-11-01/",
        "s3://models/a..b/c...",
        "s3://models/x?q=../y",
        "s3://models/x#/..",
        "file:///srv/weights/tiny/",
        "s3://models/..",
        "s3://models/a/../b",
        "s3://models/a/%2e%2E/b",
        "s3://models/a%2F..%2fb",
        "s3://models/.%2e",
        "s3://models/a b",
        "s3://models/a\tb",
        "s3://models/a\x85",
        "s3://models/a\u3000",
        "s3://models/a\x7f",
        "s3://models/x\n",
        "s3://models",
        "s3://models-private/w/",
        "S3://models/w/",
        "gs://models/w/",
        "file:///srv/weightsX/",
        "",
    ],
)
def test_storage_uri_schema_agrees_with_uri_errors(uri: str) -> None:
    assert schema_allows_uri(uri) == (uri_errors(uri, ROOTS) == [])


def test_storage_uri_pattern_escapes_the_roots() -> None:
    pattern = python_pattern(fields.storage_uri_pattern(["s3://m.x/"]))
    assert pattern.search("s3://m.x/w")
    assert not pattern.search("s3://mAx/w")


def test_template_pattern_is_the_services_rule() -> None:
    pattern = python_pattern(openapi_pattern(fields.TemplateField.pattern))
    for text in ["{{ m }}", "  x  ", "\u3000x"]:
        assert pattern.search(text)
    for text in ["", "   ", "\u3000\n\x85", "x\0"]:
        assert not pattern.search(text)


class Body(serializers.Serializer):
    slug = fields.SlugField(required=False)
    count = fields.IntegerField(required=False, min_value=1, max_value=10)
    share = fields.NumberField(required=False, greater_than=0.0, max_value=1.0)
    config = fields.EngineConfigField(required=False)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"slug": 123}, "slug"),
        ({"slug": " abc"}, "slug"),
        ({"slug": "abc\n"}, "slug"),
        ({"count": "5"}, "count"),
        ({"count": True}, "count"),
        ({"count": 5.5}, "count"),
        ({"count": 11}, "count"),
        ({"share": "0.5"}, "share"),
        ({"share": False}, "share"),
        ({"share": 0.0}, "share"),
        ({"config": {"a": ["x\0"]}}, "config"),
        ({"config": {"a\0": 1}}, "config"),
    ],
)
def test_strict_fields_refuse_what_the_schema_refuses(
    body: dict[str, Any], param: str
) -> None:
    serializer = Body(data=body)
    assert not serializer.is_valid()
    assert list(serializer.errors) == [param]


def test_strict_fields_take_what_the_schema_allows() -> None:
    serializer = Body(
        data={"slug": "chat-7b", "count": 5.0, "share": 1, "config": {"a": [1]}}
    )
    assert serializer.is_valid(), serializer.errors
    assert serializer.validated_data == {
        "slug": "chat-7b",
        "count": 5,
        "share": 1.0,
        "config": {"a": [1]},
    }
