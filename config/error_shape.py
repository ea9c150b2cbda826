"""The error document every API answer uses: OpenAI's shape.

Public surface: ``error_body``, ``API_PREFIXES``.

The lowest piece of config's ground: ``config.errors`` (the exceptions and
handlers) and ``config.control_plane`` (the lost-database 503) both build their
answers with it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["API_PREFIXES", "error_body"]

API_PREFIXES = ("/admin/", "/v1/")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def error_body(
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    error_type: str | None = None,
) -> dict[str, Any]:
    """Return the error document for ``status_code``."""
    return {
        "error": {
            "type": error_type
            or _TYPE_BY_STATUS.get(status_code, "invalid_request_error"),
            "message": message,
            "param": param,
            "code": code,
        }
    }
