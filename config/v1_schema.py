"""The team API's OpenAPI 3.1 document, served at ``GET /v1/openapi.json``.

Public surface: ``build_v1_schema``, ``v1_schema_view``.

One document for every /v1 operation a team key calls: the gateway's own
(``routing.openapi``, written from the constants its body checks use) merged with
the ones Django serves (files, batches, a team's usage: drf-spectacular, from
their views' annotations, generated for those paths only).
"""

from __future__ import annotations

import functools
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.urls import include, path
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.settings import patched_settings

from config.errors import error_body
from config.json_body import MAX_DEPTH
from routing.openapi import gateway_components, gateway_paths

__all__ = ["build_v1_schema", "v1_schema_view"]

_DJANGO_V1 = [
    path("v1/", include("batches.api.urls")),
    path("v1/organization/", include("metering.api.urls")),
]
_SECURITY_SCHEME = "teamKey"
_DESCRIPTION = (
    "OpenAI's API as the platform serves it, with a team's API key. A JSON body is "
    f"one object, nested at most {MAX_DEPTH} levels deep, with finite numbers and "
    "no lone surrogates. Every error has one shape: "
    '{"error": {"type", "message", "param", "code"}}. Not served here: tools and '
    "functions, n other than 1, content other than text (only null is valid in "
    "those fields)."
)


def _django_v1() -> dict[str, Any]:
    """Return drf-spectacular's document of the Django-served /v1 operations."""
    with patched_settings(
        {
            "PREPROCESSING_HOOKS": [],
            "SCHEMA_PATH_PREFIX": "/v1",
            "TITLE": "",
            "DESCRIPTION": "",
        }
    ):
        generator = SchemaGenerator(patterns=_DJANGO_V1)
        return generator.get_schema(request=None, public=True)


@functools.cache
def build_v1_schema() -> dict[str, Any]:
    """Return the whole /v1 document (built once per process: it holds no state)."""
    django = _django_v1()
    components = django.get("components", {})
    schemas = {**components.get("schemas", {}), **gateway_components()}
    paths = {**gateway_paths(), **django["paths"]}
    for item in paths.values():
        for operation in item.values():
            operation["security"] = [{_SECURITY_SCHEME: []}]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Serving platform API",
            "version": "1",
            "description": _DESCRIPTION,
        },
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "securitySchemes": {
                _SECURITY_SCHEME: {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A team's API key.",
                }
            },
        },
        "security": [{_SECURITY_SCHEME: []}],
    }


def v1_schema_view(request: HttpRequest) -> JsonResponse:
    """Answer the /v1 document. No key is needed: it describes the public API and
    holds no secrets (no keys, teams, models, versions or limits)."""
    if request.method not in ("GET", "HEAD"):
        response = JsonResponse(
            error_body(405, "use GET for /v1/openapi.json"), status=405
        )
        response["Allow"] = "GET, HEAD"
        return response
    return JsonResponse(build_v1_schema())
