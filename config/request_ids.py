"""Middleware that gives every request Django serves an id, and answers it back.

Public surface: ``RequestId``, ``HEADER``, ``META_KEY``.

The id is the caller's ``X-Request-Id`` when it is a short token (a client, a
proxy or a test that wants to find its request again), else a fresh one. It is
put back in ``request.META`` (what the views and the audit trail read) and sent
back in the answer's ``X-Request-Id``. The audit trail stores it on every entry a
request wrote, so a caller can find what its own request changed. It is a label
for finding things, never trusted for anything else: two callers may send the
same one.
"""

from __future__ import annotations

import re
import uuid

from django.http import HttpRequest, HttpResponseBase
from django.utils.deprecation import MiddlewareMixin

__all__ = ["HEADER", "META_KEY", "RequestId"]

HEADER = "X-Request-Id"
META_KEY = "HTTP_X_REQUEST_ID"
# What a caller's id may be: no spaces, no header tricks, and it fits the trail.
_TOKEN = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class RequestId(MiddlewareMixin):
    """Take the caller's ``X-Request-Id`` (or make one) and answer it back."""

    def process_request(self, request: HttpRequest) -> None:
        given = str(request.META.get(META_KEY, ""))
        request.META[META_KEY] = given if _TOKEN.fullmatch(given) else uuid.uuid4().hex

    def process_response(
        self, request: HttpRequest, response: HttpResponseBase
    ) -> HttpResponseBase:
        request_id = request.META.get(META_KEY)
        if request_id:
            response[HEADER] = request_id
        return response
