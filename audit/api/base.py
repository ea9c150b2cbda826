"""The base of every REST view that changes the control plane: its changes are
recorded in the audit trail with the admin token (or team key) that made them.

Public surface: ``AuditedMixin``, ``AuditedView``, ``body_text``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponseBase
from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.views import APIView

from audit import services
from audit.models import Source
from config.api import ControlPlaneView

__all__ = ["AuditedMixin", "AuditedView", "body_text"]


def body_text(request: Request, field: str) -> str:
    """Return a string field of the request's JSON object, or "" (a body that is
    not an object, or a field that is not a string, is the view's 400 to give)."""
    data = request.data
    value = data.get(field) if isinstance(data, dict) else None
    return value if isinstance(value, str) else ""


class AuditedMixin(APIView):
    """The audit of a DRF view's writes (POST, PUT, PATCH, DELETE), whatever
    authenticates its caller: an admin token (``AuditedView``) or a team's key.

    Subclasses name in ``audit_scope`` the rows a write may touch; they are read
    once the caller is authenticated and again when the view has answered,
    whatever the answer (``audit.services.Capture``).
    """

    _audit_capture: services.Capture | None = None

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        """Return the querysets of the rows a write to this view may change."""
        raise NotImplementedError

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        if request.method in SAFE_METHODS:
            return
        actor = services.actor_from_request(request, source=Source.REST)
        if actor is not None:
            self._audit_capture = services.Capture(
                actor, self.audit_scope(request, **kwargs)
            )

    def dispatch(
        self, request: HttpRequest, *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        self._audit_capture = None
        try:
            response = super().dispatch(request, *args, **kwargs)
        except BaseException as exc:
            if self._audit_capture is not None:
                self._audit_capture.finish_quietly(exc)
            raise
        if self._audit_capture is not None:
            self._audit_capture.finish()
        return response


class AuditedView(AuditedMixin, ControlPlaneView):
    """A control-plane view whose writes are audited with the admin token that
    made them. ``tests/test_audit_trail.py`` fails on a control-plane view with a
    write method that is not one of these."""
