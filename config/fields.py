"""Serializer fields of the control plane's bodies that accept exactly what they say.

Public surface: ``SlugField``, ``LabelField``, ``TextField``, ``HashField``,
``TemplateField``, ``IntegerField``, ``NumberField``, ``StorageUriField``,
``EngineConfigField``,
``WHITESPACE``, ``storage_uri_pattern``.

DRF's fields coerce: ``CharField`` takes ``123`` as ``"123"``, ``IntegerField``
takes ``"5"`` and ``5.0``, and ``CharField`` trims whitespace before its checks. Each
field here takes only its JSON type and checks the value as sent, so the schema
(``GET /admin/schema``, generated from these fields) is exact both ways: what it
allows is accepted, what it refuses is a 400 naming the field. Where a service is
the authority (storage roots, an engine config's keys), the field's schema spells
the service's rule, and the schemathesis run in
``tests/test_control_plane_live.py`` holds the two equal.
"""

from __future__ import annotations

import math
from typing import Any

from django.conf import settings
from django.core.validators import RegexValidator
from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.plumbing import ResolvedComponent
from rest_framework import serializers

from config.names import SLUG_PATTERN, SLUG_RULE, VERSION_PATTERN

__all__ = [
    "WHITESPACE",
    "EngineConfigField",
    "HashField",
    "IntegerField",
    "LabelField",
    "NumberField",
    "SlugField",
    "StorageUriField",
    "TemplateField",
    "TextField",
    "storage_uri_pattern",
]

# The characters str.isspace() and str.strip() take for whitespace, as a regex
# class body: the services' rules (a blank chat template, a URI with spaces) use
# them, and the schema's patterns must name the same set in any regex dialect.
WHITESPACE = (
    r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
)
# Text PostgreSQL can store: no NUL (the body parser refuses it everywhere).
TEXT_PATTERN = r"^[^\x00]*\Z"


class _StrictString(serializers.CharField):
    """A JSON string only, never trimmed: what is validated is what was sent."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


class TextField(_StrictString):
    """Free text (a name, a description, a chat template): any string without NUL.

    The body parser refuses NUL first; the validator states the rule for the schema.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validators.append(
            RegexValidator(TEXT_PATTERN, "must not contain NUL characters")
        )


class _PatternField(_StrictString):
    """A string that must match ``pattern`` (a Python regex ending in ``\\Z``)."""

    pattern = ""
    rule = ""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validators.append(RegexValidator(self.pattern, f"must be {self.rule}"))


class SlugField(_PatternField):
    """A team, model or region name (``config.names``)."""

    pattern = SLUG_PATTERN
    rule = SLUG_RULE

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 64)
        super().__init__(**kwargs)


class LabelField(_PatternField):
    """A version label: ``v1``, ``v2``, ... (``models_registry.domain.identity``)."""

    pattern = VERSION_PATTERN
    rule = "labelled v1, v2, ..."

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 16)
        super().__init__(**kwargs)


class HashField(_PatternField):
    """A SHA-256 digest: 64 hex characters (stored lowercase)."""

    pattern = r"^[0-9a-fA-F]{64}\Z"
    rule = "a SHA-256 digest: 64 hex characters"


class TemplateField(_PatternField):
    """A chat template: text with something besides whitespace in it.

    Leading whitespace, then one other character, then anything: the pattern runs
    in linear time on a 2.5 MB body of spaces.
    """

    pattern = f"^[{WHITESPACE}]*[^\\x00{WHITESPACE}][^\\x00]*\\Z"
    rule = "text with a character other than whitespace, and no NUL"


class IntegerField(serializers.IntegerField):
    """A JSON integer only: not ``true`` or ``"5"``.

    ``5.0`` is an integer to JSON Schema (2020-12), so it is taken as ``5``.
    """

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, float) and data.is_integer():
            data = int(data)
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return int(super().to_internal_value(data))


class NumberField(serializers.FloatField):
    """A finite JSON number only (``"0.5"`` and ``true`` are refused).

    ``greater_than`` is an exclusive minimum (a canary's percent must be above 0),
    ``less_than`` an exclusive maximum (a utilisation threshold below 1).
    """

    def __init__(
        self,
        *,
        greater_than: float | None = None,
        less_than: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.greater_than = greater_than
        self.less_than = less_than

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        value = float(super().to_internal_value(data))
        if not math.isfinite(value):
            self.fail("invalid")
        if self.greater_than is not None and value <= self.greater_than:
            raise serializers.ValidationError(
                f"Ensure this value is greater than {self.greater_than}."
            )
        if self.less_than is not None and value >= self.less_than:
            raise serializers.ValidationError(
                f"Ensure this value is less than {self.less_than}."
            )
        return value


class NumberFieldSchema(OpenApiSerializerFieldExtension):
    """A ``NumberField``'s schema: DRF's, with its exclusive bounds if it has them."""

    target_class = NumberField

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema: dict[str, Any] = auto_schema._map_serializer_field(
            self.target, direction, bypass_extensions=True
        )
        if self.target.greater_than is not None:
            # OpenAPI 3.1 (JSON Schema 2020-12): the bound itself, not a flag.
            schema["exclusiveMinimum"] = self.target.greater_than
        if self.target.less_than is not None:
            schema["exclusiveMaximum"] = self.target.less_than
        return schema


def _regex_literal(text: str) -> str:
    """Return ``text`` escaped for a regex in any dialect (ECMA-262 and Python)."""
    return "".join(f"\\{ch}" if ch in r"\^$.|?*+()[]{}" else ch for ch in text)


def storage_uri_pattern(roots: list[str]) -> str:
    """Return the pattern of a URI under ``roots`` (``uri_errors``' first rules)."""
    prefixes = "|".join(
        _regex_literal(root if root.endswith("/") else f"{root}/") for root in roots
    )
    return f"^(?:{prefixes})[^\\x00-\\x1f{WHITESPACE}?#\\\\]*$"


# A ".." path segment, also percent-encoded, before any query or fragment.
DOT_DOT_SEGMENT = r"^[^?#]*(?:/|%2[fF])(?:\.|%2[eE]){2}(?:$|[/?#]|%2[fF])"


class StorageUriField(_StrictString):
    """A weights or report URI; ``models_registry.services`` checks it against the
    storage roots, which settings may change, so its schema is drawn at request."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 1024)
        super().__init__(**kwargs)


class StorageUriFieldSchema(OpenApiSerializerFieldExtension):
    """The schema of a ``StorageUriField``: under a configured root, no whitespace
    or control characters, no ``..`` segment (``uri_errors``)."""

    target_class = StorageUriField

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        field = self.target
        # drf-spectacular adds the empty string of an allow_blank field itself.
        pattern = storage_uri_pattern(list(settings.PLATFORM_STORAGE_ROOTS))
        return {
            "type": "string",
            "maxLength": field.max_length,
            "pattern": pattern,
            "not": {"pattern": DOT_DOT_SEGMENT},
        }


class EngineConfigField(serializers.JSONField):
    """A JSON object of engine flags; ``engine_config_errors`` is the rule.

    No string or key in it may hold a NUL: jsonb cannot store one (a DataError).
    """

    def to_internal_value(self, data: Any) -> Any:
        value = super().to_internal_value(data)
        where = _nul_path(value)
        if where is not None:
            raise serializers.ValidationError(
                f"{where or 'the value'} must not contain NUL characters (\\u0000)"
            )
        return value


def _nul_path(value: Any) -> str | None:
    """Return the dotted path of the first string or key holding a NUL, or None."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if "\0" in node:
                return path
            continue
        if isinstance(node, dict):
            for key, item in node.items():
                where = f"{path}.{key}" if path else str(key)
                if "\0" in str(key):
                    return where
                stack.append((item, where))
        elif isinstance(node, list):
            stack.extend(
                (item, f"{path}.{index}" if path else str(index))
                for index, item in enumerate(node)
            )
    return None


_JSON_VALUE = "EngineConfigValue"


class EngineConfigFieldSchema(OpenApiSerializerFieldExtension):
    """The schema of an engine config: an object whose keys are non-empty, any JSON
    below it, and no NUL in any string or key (the body parser's rule)."""

    target_class = EngineConfigField

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        ref = {"$ref": f"#/components/schemas/{_JSON_VALUE}"}
        keys = {"minLength": 1, "pattern": TEXT_PATTERN}
        value = {
            "anyOf": [
                {"type": "string", "pattern": TEXT_PATTERN},
                {"type": "number"},
                {"type": "boolean"},
                {"type": "null"},
                {"type": "array", "items": ref},
                {
                    "type": "object",
                    "propertyNames": {"pattern": TEXT_PATTERN},
                    "additionalProperties": ref,
                },
            ],
            "description": "Any JSON value without NUL characters.",
        }
        auto_schema.registry.register_on_missing(
            ResolvedComponent(
                name=_JSON_VALUE,
                type=ResolvedComponent.SCHEMA,
                object=_JSON_VALUE,
                schema=value,
            )
        )
        return {
            "type": "object",
            "propertyNames": keys,
            "additionalProperties": ref,
            "description": "Engine flags spelled with underscores, e.g. "
            '{"max_num_seqs": 256}.',
        }
