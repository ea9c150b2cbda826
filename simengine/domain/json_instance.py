"""Deterministic JSON values that satisfy a JSON Schema: the simulated structured
output (``response_format``, tool-call arguments).

Public surface: ``make_instance``.

vLLM constrains decoding with a grammar built from the schema, so whatever the
model says validates. The stand-in builds one valid value directly:

- objects carry every ``required`` property and every declared one (none extra,
  so ``additionalProperties: false`` holds); an object without declared
  properties is ``{}``;
- strings honour ``enum``, ``const``, ``minLength``/``maxLength`` and the
  ``date``/``date-time``/``email``/``uuid`` formats (a ``pattern`` is not solved:
  the plain word may miss it); integers and numbers sit inside
  ``minimum``/``maximum`` (exclusive ones too) and ``multipleOf`` for integers;
  arrays have between ``minItems`` and ``maxItems`` items (two when free);
- ``anyOf``/``oneOf`` take their first branch, ``allOf`` merges its parts'
  properties, ``$ref`` follows ``#/$defs/...`` or ``#/definitions/...`` as
  pydantic emits them, a type list takes its first non-null type;
- anything unknown gets the smallest value of its type (an empty schema: a word).

Words come from the tokenizer's output vocabulary, picked by ``seed``, so the same
schema and seed always give the same value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from simengine.domain.tokens import OUTPUT_WORDS

__all__ = ["make_instance"]

_MAX_DEPTH = 12


class _Builder:
    def __init__(self, root: Mapping[str, Any], seed: int) -> None:
        self.root = root
        self.seed = seed
        self.counter = 0

    def word(self) -> str:
        self.counter += 1
        digest = hashlib.blake2b(
            f"{self.seed}:{self.counter}".encode(), digest_size=2
        ).digest()
        return OUTPUT_WORDS[digest[0]].strip()

    def number(self, low: int, high: int) -> int:
        self.counter += 1
        digest = hashlib.blake2b(
            f"{self.seed}#{self.counter}".encode(), digest_size=4
        ).digest()
        return low + int.from_bytes(digest, "big") % (high - low + 1)

    def resolve(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        seen = 0
        while isinstance(schema.get("$ref"), str) and seen < _MAX_DEPTH:
            ref: str = schema["$ref"]
            target: Any = self.root
            for part in ref.removeprefix("#/").split("/"):
                if not part or not isinstance(target, Mapping):
                    break
                target = target.get(part, {})
            schema = target if isinstance(target, Mapping) else {}
            seen += 1
        return schema

    def build(self, schema: Any, depth: int = 0) -> Any:
        if not isinstance(schema, Mapping):
            return {} if schema is True or schema is None else None
        schema = self.resolve(schema)
        if "const" in schema:
            return schema["const"]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return enum[0]
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                return self.build(self._first_branch(branches), depth + 1)
        parts = schema.get("allOf")
        if isinstance(parts, list) and parts:
            return self.build(self._merge(schema, parts), depth + 1)
        kind = self._type(schema)
        if depth >= _MAX_DEPTH:
            return {"object": {}, "array": []}.get(kind)
        return self._build_typed(kind, schema, depth)

    def _build_typed(self, kind: str, schema: Mapping[str, Any], depth: int) -> Any:
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return self._number(schema)
        if kind == "boolean":
            return self.number(0, 1) == 1
        if kind == "null":
            return None
        return self._string(schema)

    def _first_branch(self, branches: list[Any]) -> Any:
        # The first branch, unless it is the null of an Optional (pydantic puts
        # {"type": "null"} second, but a hand-written schema may not).
        for branch in branches:
            if not (isinstance(branch, Mapping) and branch.get("type") == "null"):
                return branch
        return branches[0]

    def _merge(self, schema: Mapping[str, Any], parts: list[Any]) -> dict[str, Any]:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        properties: dict[str, Any] = dict(merged.get("properties") or {})
        required: list[str] = list(merged.get("required") or [])
        for part in parts:
            if not isinstance(part, Mapping):
                continue
            part = self.resolve(part)
            for key, value in part.items():
                if key == "properties" and isinstance(value, Mapping):
                    properties.update(value)
                elif key == "required" and isinstance(value, list):
                    required.extend(v for v in value if v not in required)
                elif key not in merged:
                    merged[key] = value
        if properties:
            merged["properties"] = properties
        if required:
            merged["required"] = required
        return merged

    @staticmethod
    def _type(schema: Mapping[str, Any]) -> str:
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
        if isinstance(kind, str):
            return kind
        if "properties" in schema or "additionalProperties" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        if "minimum" in schema or "maximum" in schema:
            return "number"
        return "string"

    def _object(self, schema: Mapping[str, Any], depth: int) -> dict[str, Any]:
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            properties = {}
        names = list(properties)
        for name in schema.get("required") or ():
            if isinstance(name, str) and name not in properties:
                names.append(name)
        return {name: self.build(properties.get(name, {}), depth + 1) for name in names}

    def _array(self, schema: Mapping[str, Any], depth: int) -> list[Any]:
        low = _int(schema.get("minItems"), 0)
        high = _int(schema.get("maxItems"), max(low, 2))
        count = max(low, min(high, 2))
        if schema.get("uniqueItems"):
            # Items of one schema may come out equal: keep as few as allowed.
            count = min(count, max(low, 1))
        prefix = schema.get("prefixItems")
        items = schema.get("items", {})
        values: list[Any] = []
        for index in range(count):
            if isinstance(prefix, list) and index < len(prefix):
                values.append(self.build(prefix[index], depth + 1))
            else:
                values.append(self.build(items, depth + 1))
        return values

    def _integer(self, schema: Mapping[str, Any]) -> int:
        low = _bound(schema, "minimum", "exclusiveMinimum", 0, step=1)
        high = _bound(schema, "maximum", "exclusiveMaximum", low + 100, step=-1)
        low_i, high_i = _ceil(low), _floor(high)
        if high_i < low_i:
            return low_i
        value = self.number(low_i, min(high_i, low_i + 100))
        multiple = schema.get("multipleOf")
        if isinstance(multiple, int) and multiple > 0:
            value = -(-value // multiple) * multiple
            if value > high_i:
                value -= multiple
        return value

    def _number(self, schema: Mapping[str, Any]) -> float:
        low = _bound(schema, "minimum", "exclusiveMinimum", 0.0, step=0.5)
        high = _bound(schema, "maximum", "exclusiveMaximum", low + 100.0, step=-0.5)
        if high < low:
            return float(low)
        return round(low + (high - low) * self.number(0, 100) / 100.0, 2)

    def _string(self, schema: Mapping[str, Any]) -> str:
        fmt = schema.get("format")
        if fmt == "date-time":
            return "2026-01-01T00:00:00Z"
        if fmt == "date":
            return "2026-01-01"
        if fmt == "time":
            return "00:00:00"
        if fmt == "email":
            return f"{self.word()}@example.com"
        if fmt == "uuid":
            return "00000000-0000-4000-8000-000000000000"
        if fmt == "uri":
            return f"https://example.com/{self.word()}"
        low = _int(schema.get("minLength"), 0)
        high = _int(schema.get("maxLength"), max(low, 40))
        text = " ".join(self.word() for _ in range(2))
        while len(text) < low:
            text += " " + self.word()
        return text[: max(high, 0)]


def _int(value: Any, default: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return default


def _bound(
    schema: Mapping[str, Any],
    inclusive: str,
    exclusive: str,
    default: float,
    step: float,
) -> float:
    value = schema.get(inclusive)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    value = schema.get(exclusive)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value + step
    return default


def _ceil(value: float) -> int:
    return -int(-value // 1)


def _floor(value: float) -> int:
    return int(value // 1)


def make_instance(schema: Any, seed: int) -> Any:
    """Return a JSON value valid against ``schema`` (a JSON Schema as a mapping).

    Deterministic in ``(schema, seed)``; ``$ref`` resolves against ``schema``
    itself (its ``$defs``/``definitions``).
    """
    root = schema if isinstance(schema, Mapping) else {}
    return _Builder(root, seed).build(schema)
