"""Middleware that refuses requests no view could answer safely.

Public surface: ``RejectNulBytes``.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse
from django.utils.deprecation import MiddlewareMixin

from config.errors import API_PREFIXES, error_body

__all__ = ["RejectNulBytes"]


class RejectNulBytes(MiddlewareMixin):
    """Answer 400 to a path or query string that holds a NUL byte (``%00``).

    PostgreSQL cannot hold NUL in text, so a name from the path or a filter from the
    query string that carries one made the lookup fail with a DataError (a 500),
    under /admin and in the console alike. Under the API prefixes the 400 has the
    API's error shape.
    """

    def process_request(self, request: HttpRequest) -> HttpResponse | None:
        query = request.META.get("QUERY_STRING", "")
        if "\0" not in request.path and "%00" not in query and "\0" not in query:
            return None
        message = "the path or query string contains a NUL byte (%00)"
        if request.path.startswith(API_PREFIXES):
            return JsonResponse(
                error_body(400, message, code="nul_character"), status=400
            )
        return HttpResponseBadRequest(message)
