"""The control plane's answer while its database is unreachable: 503, Retry-After.

Public surface: ``is_database_unavailable``, ``database_unavailable_response``,
``unavailable_drf_response``, ``retry_after_header``, ``DatabaseUnavailable``
(middleware).

Serving does not need the database (the gateway routes from its snapshot, limits
live in Redis), but everything Django serves does: the admin API, the Files and
Batch APIs and the console. While the database is down those answer 503 with a
``Retry-After`` header (``PLATFORM_CONTROL_PLANE_RETRY_AFTER_S``) instead of a 500,
in the API's error shape under the API prefixes and as a short page elsewhere, so
a client or a rollout script knows to wait and try again. Only connection-level
failures count (no connection, the server shutting down, a pool timeout); a
query's own error (a constraint, a deadlock) stays what it was.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.deprecation import MiddlewareMixin

from config.error_shape import API_PREFIXES, error_body

__all__ = [
    "DatabaseUnavailable",
    "database_unavailable_response",
    "is_database_unavailable",
    "retry_after_header",
    "unavailable_drf_response",
]

MESSAGE = "the control plane's database is unavailable; retry later"

# SQLSTATE classes of a lost or refused connection: 08 (connection exception) and
# 57P (operator intervention: admin shutdown, crash shutdown, cannot connect now).
_UNAVAILABLE_SQLSTATES = ("08", "57P")


def is_database_unavailable(exc: BaseException | None) -> bool:
    """Return True if ``exc`` (or what it wraps) says the database cannot be reached.

    Django wraps the driver's error (``django.db.OperationalError`` from
    ``psycopg.OperationalError``); a failed connect carries no SQLSTATE, a
    server shutting down one of class 57P, a broken connection class 08.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, InterfaceError):
            return True
        if isinstance(exc, OperationalError):
            return _is_unavailable_state(getattr(exc.__cause__, "sqlstate", None))
        if _is_driver_unavailable(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _is_driver_unavailable(exc: BaseException) -> bool:
    """psycopg's own errors, raised where Django did not wrap them (a pool)."""
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return False
    if isinstance(exc, psycopg.InterfaceError):
        return True
    if isinstance(exc, psycopg.OperationalError):
        return _is_unavailable_state(exc.sqlstate)
    return False


def _is_unavailable_state(sqlstate: object) -> bool:
    """No SQLSTATE (the connect failed) or one of a lost or refused connection."""
    return sqlstate is None or str(sqlstate).startswith(_UNAVAILABLE_SQLSTATES)


def retry_after_header() -> dict[str, str]:
    """Return the ``Retry-After`` header (whole seconds, at least 1)."""
    seconds = max(1, round(settings.PLATFORM_CONTROL_PLANE_RETRY_AFTER_S))
    return {"Retry-After": str(seconds)}


def database_unavailable_response(request: HttpRequest) -> HttpResponse:
    """Return the 503: the API's error shape under the API prefixes, a page elsewhere."""
    headers = retry_after_header()
    if request.path.startswith(API_PREFIXES):
        return JsonResponse(
            error_body(503, MESSAGE, code="control_plane_unavailable"),
            status=503,
            headers=headers,
        )
    page = (
        "<!doctype html><title>Service unavailable</title>"
        f"<h1>Service unavailable</h1><p>The console's database is unavailable. "
        f"Try again in {headers['Retry-After']} seconds.</p>"
    )
    return HttpResponse(page, status=503, headers=headers)


class DatabaseUnavailable(MiddlewareMixin):
    """Turn a view's lost-database error into the 503 (``database_unavailable_response``).

    DRF views answer through ``config.errors.api_exception_handler``, which does the
    same; errors raised outside any view (a middleware saving the session) reach
    ``config.errors.handler500``, which checks too.
    """

    def process_exception(
        self, request: HttpRequest, exception: Exception
    ) -> HttpResponse | None:
        if is_database_unavailable(exception):
            return database_unavailable_response(request)
        return None


def unavailable_drf_response(exc: BaseException) -> Any:
    """Return the DRF ``Response`` for a lost database, or None for other errors."""
    if not is_database_unavailable(exc):
        return None
    from rest_framework.response import Response

    return Response(
        error_body(503, MESSAGE, code="control_plane_unavailable"),
        status=503,
        headers=retry_after_header(),
    )
