"""The structured-output stand-in: every value it builds validates."""

from __future__ import annotations

from typing import Any, Literal

import jsonschema
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simengine.domain.json_instance import make_instance


class Address(pydantic.BaseModel):
    street: str
    zip_code: str = pydantic.Field(min_length=5, max_length=5)


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str
    age: int = pydantic.Field(ge=18, le=99)
    score: float = pydantic.Field(gt=0, lt=1)
    role: Literal["admin", "user"]
    tags: list[str] = pydantic.Field(min_length=1, max_length=3)
    home: Address
    previous: list[Address] = []
    nickname: str | None = None
    active: bool


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object"},
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 7, "maximum": 7}},
        "required": ["a"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 3, "maxItems": 5},
    {"const": {"fixed": True}},
    {"anyOf": [{"type": "null"}, {"type": "string", "format": "email"}]},
    {"type": ["null", "number"], "exclusiveMinimum": 1, "exclusiveMaximum": 2},
    {"type": "integer", "multipleOf": 5, "minimum": 3, "maximum": 12},
    {"allOf": [{"properties": {"a": {"type": "string"}}}, {"required": ["b"]}]},
    {"type": "string", "minLength": 30, "maxLength": 31},
    {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_make_instance_validates_against_hand_written_schemas(
    schema: dict[str, Any],
) -> None:
    for seed in range(5):
        jsonschema.validate(make_instance(schema, seed), schema)


def test_make_instance_follows_pydantic_defs_and_refs() -> None:
    schema = Person.model_json_schema()
    for seed in range(20):
        value = make_instance(schema, seed)
        jsonschema.validate(value, schema)
        Person.model_validate(value)


def test_make_instance_is_deterministic_in_schema_and_seed() -> None:
    schema = Person.model_json_schema()
    assert make_instance(schema, 3) == make_instance(schema, 3)


_leaf = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 20),
    ),
    st.builds(
        lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": lo + hi},
        st.integers(0, 20),
        st.integers(0, 20),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "number"}),
    st.lists(st.text(max_size=5), min_size=1, max_size=3).map(lambda e: {"enum": e}),
)
_schemas = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.dictionaries(st.text(min_size=1, max_size=6), inner, max_size=4).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props)[:2],
                "additionalProperties": False,
            }
        ),
        st.builds(
            lambda items, lo: {"type": "array", "items": items, "minItems": lo},
            inner,
            st.integers(0, 4),
        ),
        st.lists(inner, min_size=1, max_size=3).map(lambda b: {"anyOf": b}),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(schema=_schemas, seed=st.integers(0, 2**32))
def test_make_instance_validates_for_generated_schemas(
    schema: dict[str, Any], seed: int
) -> None:
    jsonschema.validate(make_instance(schema, seed), schema)
