"""What every control-plane view shares: its base class, body parser and schema.

Public surface: ``validated``, ``ControlPlaneView``, ``ControlPlaneSchema``,
``TeamApiSchema``, ``ErrorSerializer``, ``PATH_NAMES``, ``openapi_pattern``,
``finish_schema`` (a postprocessing hook), ``keep_admin_paths`` (a preprocessing hook).

The rules a client can break are checked here once, before any view runs, and
documented from the same constants, so the schema (``GET /admin/schema``) says
what the API refuses:

- path names (``{team}``, ``{model}``, ``{region}``) follow the slug rule
  (``config.names``), ``{version}`` the label rule (``v1``, ``v2``, ...):
  a malformed one is a 400 naming it, a well-formed unknown one a 404;
- a body is parsed by ``config.parsers.BodyParser`` (bounded, no NUL): a 400
  naming the field otherwise;
- every operation documents its errors (400, 401, 403; 404 where the path names
  something; 413 and 415 where it takes a body) with the one error shape.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework import serializers
from rest_framework.views import APIView

from config.errors import InvalidRequest
from config.fields import LabelField
from config.names import (
    SLUG_PATTERN,
    SLUG_RULE,
    VERSION_PATTERN,
    is_valid_slug,
    is_valid_version_label,
)

__all__ = [
    "PATH_NAMES",
    "ControlPlaneSchema",
    "ControlPlaneView",
    "ErrorSerializer",
    "TeamApiSchema",
    "admin_name",
    "finish_schema",
    "keep_admin_paths",
    "openapi_pattern",
    "validated",
]


@dataclass(frozen=True, slots=True)
class PathName:
    """A path variable's rule: what it says, the pattern and the check."""

    description: str
    rule: str
    pattern: str
    is_valid: Callable[[str], bool]


def _slug(description: str) -> PathName:
    return PathName(description, SLUG_RULE, SLUG_PATTERN, is_valid_slug)


# The path variables, checked before any view runs and documented from the same.
PATH_NAMES: Mapping[str, PathName] = {
    "team": _slug("A team's slug."),
    "model": _slug("A model's name."),
    "region": _slug("A region's name."),
    "version": PathName(
        "A version:",
        rule=LabelField.rule,
        pattern=VERSION_PATTERN,
        is_valid=is_valid_version_label,
    ),
}


def openapi_pattern(pattern: str) -> str:
    r"""Return a Python pattern as the schema writes it: ECMA-262, so ``$``, not ``\Z``.

    Our patterns end in ``\Z`` because Python's ``$`` also matches before a final
    newline; in the schema's dialect ``$`` means the end of the string already.
    """
    return pattern[:-2] + "$" if pattern.endswith(r"\Z") else pattern


def validated(serializer_class: type, data: Any) -> dict[str, Any]:
    """Return the validated body or raise DRF's ValidationError (rendered as a 400)."""
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


class ControlPlaneView(APIView):
    """Base of every /admin view: path names are checked after authentication.

    Authentication and permissions run first (``super().initial``), so a caller
    without the admin token learns nothing about which names are well formed.
    """

    def initial(self, request: Any, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        for name, path_name in PATH_NAMES.items():
            value = kwargs.get(name)
            if value is not None and not path_name.is_valid(value):
                raise InvalidRequest(f"{name} must be {path_name.rule}", param=name)


def admin_name(request: Any) -> str:
    """Name the admin behind a control-plane request, for records of who did what.

    The token's public prefix and name (never its secret), or the console user.
    """
    token = getattr(request, "auth", None)
    prefix = getattr(token, "prefix", "")
    if prefix:
        name = getattr(token, "name", "") or "unnamed"
        return f"admin token {prefix}… ({name})"
    user = getattr(request, "user", None)
    username = getattr(user, "get_username", lambda: "")()
    return f"console user {username}" if username else "an admin"


class ErrorDetailSerializer(serializers.Serializer):
    """The inside of every error: OpenAI's four fields."""

    type = serializers.CharField()
    message = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)


class ErrorSerializer(serializers.Serializer):
    """Every error the API answers: ``{"error": {type, message, param, code}}``."""

    error = ErrorDetailSerializer()


_ERRORS_ALWAYS = {
    "400": "The request is malformed (the error's param names the field).",
    "401": "No admin token, or one that is unknown or revoked.",
    "403": "A team key: the control plane takes admin tokens only.",
}
_ERRORS_WITH_PATH = {
    "404": "The model, version, pool, team or key named does not exist."
}
_ERRORS_WITH_BODY = {
    "413": "The body is larger than 2.5 MB.",
    "415": "The body is not application/json.",
}


class ControlPlaneSchema(AutoSchema):
    """The schema of a control-plane operation, with its path rules and its errors."""

    def get_override_parameters(self) -> list[Any]:
        parameters = list(super().get_override_parameters())
        for name, path_name in PATH_NAMES.items():
            if f"{{{name}}}" in self.path:
                parameters.append(
                    OpenApiParameter(
                        name,
                        OpenApiTypes.STR,
                        OpenApiParameter.PATH,
                        description=f"{path_name.description} {path_name.rule}.",
                        pattern=openapi_pattern(path_name.pattern),
                    )
                )
        return parameters

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)
        errors = dict(_ERRORS_ALWAYS)
        if "{" in self.path:
            errors.update(_ERRORS_WITH_PATH)
        if self.method in {"POST", "PUT", "PATCH"}:
            errors.update(_ERRORS_WITH_BODY)
        for code, description in errors.items():
            if code not in responses:
                response = self._get_response_for_code(
                    ErrorSerializer, code, direction=direction
                )
                responses[code] = {**response, "description": description}
        return dict(sorted(responses.items()))


_TEAM_ERRORS = {
    "400": "The request is malformed (the error's param names the field).",
    "401": "No API key, or one that is unknown or revoked.",
}
_TEAM_ERRORS_WITH_PATH = {"404": "The file or batch named does not exist."}
_TEAM_ERRORS_WITH_BODY = {
    "413": "The body is larger than the API takes.",
    "415": "The body's media type is not the one the operation takes.",
}


class TeamApiSchema(AutoSchema):
    """The schema of a /v1 operation Django serves for a team's key (files,
    batches, usage), with its errors in the one shape."""

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)
        errors = dict(_TEAM_ERRORS)
        if "{" in self.path:
            errors.update(_TEAM_ERRORS_WITH_PATH)
        if self.method == "POST":
            errors.update(_TEAM_ERRORS_WITH_BODY)
        for code, description in errors.items():
            if code not in responses:
                response = self._get_response_for_code(
                    ErrorSerializer, code, direction=direction
                )
                responses[code] = {**response, "description": description}
        return dict(sorted(responses.items()))


def keep_admin_paths(endpoints: list[Any], **kwargs: Any) -> list[Any]:
    """Keep the control plane's operations (a preprocessing hook): /admin/schema
    documents /admin only; the team API has its own (``GET /v1/openapi.json``)."""
    return [e for e in endpoints if e[0].startswith("/admin/")]


def finish_schema(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Write every pattern in the schema's dialect (a postprocessing hook).

    Serializer fields carry the Python patterns they validate with (``\\Z``);
    drf-spectacular copies them as they are. A blank-allowed string field comes out
    as ``oneOf: [the string, an empty string]``, which "" matches twice, and so
    violates (oneOf means exactly one): where the string admits "" already, the
    second branch goes (never where a pattern or a minimum length refuses "", as
    a storage URI's does: there both branches stand).
    """
    stack: list[Any] = [result]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                node["pattern"] = openapi_pattern(pattern)
            _collapse_blank_branch(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return result


def _collapse_blank_branch(node: dict[str, Any]) -> None:
    branches = node.get("oneOf")
    if not isinstance(branches, list) or len(branches) != 2:
        return
    string, blank = branches
    if (
        isinstance(string, dict)
        and blank == {"type": "string", "maxLength": 0}
        and string.get("type") == "string"
        and not string.get("minLength")
        and _admits_empty(string.get("pattern"))
    ):
        del node["oneOf"]
        node.update(string)


def _admits_empty(pattern: object) -> bool:
    if pattern is None:
        return True
    try:
        return isinstance(pattern, str) and re.search(pattern, "") is not None
    except re.error:
        return False
