"""One error shape for every API answer: ``{"error": {"type", "message", "param", "code"}}``.

Public surface: ``PlatformError`` and its subclasses (raised by services),
``error_body``, ``api_exception_handler`` (DRF) and the JSON ``handler404`` /
``handler500`` used for the API prefixes.

The shape is OpenAI's, so the same client code reads errors from ``/v1/`` and
``/admin/``. Messages never carry secrets or prompt text.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.defaults import page_not_found, server_error
from rest_framework import exceptions as drf_exceptions
from rest_framework import status
from rest_framework.response import Response

from config.control_plane import (
    database_unavailable_response,
    is_database_unavailable,
    unavailable_drf_response,
)
from config.error_shape import API_PREFIXES, error_body

logger = logging.getLogger(__name__)


class PlatformError(Exception):
    """A failure a client caused or can act on, with its HTTP status and error type."""

    status_code: int = status.HTTP_400_BAD_REQUEST
    error_type: str = "invalid_request_error"

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(PlatformError):
    """The request is malformed or breaks a rule (400)."""


class NotFound(PlatformError):
    """The named model, version, team or key does not exist (404)."""

    status_code = status.HTTP_404_NOT_FOUND
    error_type = "not_found_error"


class Conflict(PlatformError):
    """The request would duplicate something that exists (409)."""

    status_code = status.HTTP_409_CONFLICT
    error_type = "conflict_error"


def first_validation_error(detail: Any, prefix: str = "") -> tuple[str | None, str]:
    """Return (param, message) of the first error in a DRF ValidationError detail."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = str(key)
            param = None if name == "non_field_errors" else f"{prefix}{name}"
            inner_param, message = first_validation_error(
                value, f"{param}." if param else ""
            )
            return (inner_param or param), message
        return None, "invalid request"
    if isinstance(detail, list):
        for index, value in enumerate(detail):
            if isinstance(value, dict):
                return first_validation_error(value, f"{prefix}{index}.")
            return None, str(value)
        return None, "invalid request"
    return None, str(detail)


def api_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Render every control-plane failure in the one error shape."""
    if isinstance(exc, PlatformError):
        return Response(
            error_body(
                exc.status_code,
                exc.message,
                param=exc.param,
                code=exc.code,
                error_type=exc.error_type,
            ),
            status=exc.status_code,
        )
    if isinstance(exc, RequestDataTooBig):
        # Django's DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MB): raised when a view first
        # reads the body, which DRF's handler does not know.
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return Response(
            error_body(
                413,
                f"the body is larger than the {limit} bytes allowed",
                code="request_too_large",
            ),
            status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
        )
    # Imported here: accounts.auth (loaded by rest_framework.views through the
    # settings) raises PlatformError from this module, so a top-level import cycles.
    from rest_framework.views import exception_handler as drf_default_handler

    response = drf_default_handler(exc, context)
    if response is None:
        unavailable = unavailable_drf_response(exc)
        if unavailable is not None:
            return unavailable
        logger.exception(
            "unhandled error in %s", context.get("view").__class__.__name__
        )
        return Response(
            error_body(500, "internal error; the failure was logged"),
            status=status.HTTP_500_INTERNAL_SERVER_ERROR,
        )
    if isinstance(exc, drf_exceptions.ValidationError):
        param, message = first_validation_error(exc.detail)
        response.data = error_body(400, message, param=param)
    elif isinstance(exc, drf_exceptions.ParseError):
        response.data = error_body(400, f"body is not valid JSON: {exc.detail}")
    else:
        detail = getattr(exc, "detail", str(exc))
        code = getattr(detail, "code", None)
        response.data = error_body(response.status_code, str(detail), code=code)
    return response


def _is_api_path(request: HttpRequest) -> bool:
    return request.path.startswith(API_PREFIXES)


def handler404(
    request: HttpRequest, exception: Exception | None = None
) -> HttpResponse:
    """Return a JSON 404 under the API prefixes and Django's page elsewhere."""
    if _is_api_path(request):
        return JsonResponse(
            error_body(404, f"no such endpoint: {request.path}"), status=404
        )
    return page_not_found(request, exception)


def handler500(request: HttpRequest) -> HttpResponse:
    """Return a JSON 500 under the API prefixes and Django's page elsewhere.

    A lost database is a 503 with Retry-After instead (``config.control_plane``):
    Django calls this inside its ``except``, so the error is ``sys.exc_info()``.
    """
    if is_database_unavailable(sys.exc_info()[1]):
        return database_unavailable_response(request)
    if _is_api_path(request):
        return JsonResponse(
            error_body(500, "internal error; the failure was logged"), status=500
        )
    return server_error(request)
