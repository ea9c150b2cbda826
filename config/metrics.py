"""``/metrics`` for a scraper that holds the metrics token, nobody else.

Public surface: ``metrics_view``.

The exposition names every team and its token counts, so it is not public: the
scraper sends ``Authorization: Bearer <PLATFORM_METRICS_TOKEN>`` (Prometheus's
``authorization`` block, ``platform/prometheus/prometheus.yml``). No token or a
wrong one is 401, and with no token configured the endpoint is off (403); both in
the API's error shape. The check reads settings only, never the database, so a
gateway whose control plane is down still reports that it is.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django_prometheus import exports

from config.errors import error_body

__all__ = ["metrics_view"]


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _refuse(status: int, message: str, code: str | None = None) -> JsonResponse:
    response = JsonResponse(error_body(status, message, code=code), status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Return the Prometheus exposition to a caller with the metrics token."""
    if request.method not in ("GET", "HEAD"):
        response = _refuse(405, "use GET for /metrics")
        response["Allow"] = "GET, HEAD"
        return response
    token = settings.PLATFORM_METRICS_TOKEN
    if not token:
        return _refuse(
            403,
            "metrics are off: set PLATFORM_METRICS_TOKEN to let a scraper in",
            "metrics_disabled",
        )
    scheme, _, secret = request.headers.get("Authorization", "").partition(" ")
    # Equal-length digests, compared in constant time: neither the token's
    # characters nor its length leak through the answer's timing.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        _digest(secret.strip()), _digest(token)
    ):
        return _refuse(
            401,
            "send the metrics token: 'Authorization: Bearer <token>'",
            "invalid_metrics_token",
        )
    return exports.ExportToDjangoView(request)
