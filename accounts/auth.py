"""Bearer-token authentication for the control plane at /admin/.

An admin token opens every control-plane endpoint. A team's API key is recognised,
so that its holder gets 403 (you are known, but this is not yours) rather than 401;
anything else, or no token, is 401: a batch job's key too, which no person holds
and which opens only the gateway's chat completions
(``accounts.services.find_active_team_key`` never returns one).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from accounts import services
from accounts.models import AdminToken, ApiKey


@dataclass(frozen=True)
class AdminPrincipal:
    """A caller holding a valid admin token."""

    token_id: int
    is_admin: bool = True
    is_authenticated: bool = True


@dataclass(frozen=True)
class TeamPrincipal:
    """A caller holding a team API key: authenticated, never a platform admin."""

    team_id: str
    key_id: int
    is_admin: bool = False
    is_authenticated: bool = True


def bearer_secret(request: Request) -> str | None:
    """Return the secret of an ``Authorization: Bearer`` header, or None if absent.

    Raises:
        AuthenticationFailed: the header is present but not a bearer token.
    """
    header = get_authorization_header(request).split()
    if not header:
        return None
    if header[0].lower() != b"bearer" or len(header) != 2:
        raise exceptions.AuthenticationFailed(
            "Authorization header must be 'Bearer <token>'"
        )
    try:
        return header[1].decode("ascii")
    except UnicodeDecodeError:
        raise exceptions.AuthenticationFailed("token must be ASCII") from None


class AdminTokenAuthentication(BaseAuthentication):
    """Authenticate an admin token, or recognise a team key so it can be refused."""

    def authenticate(
        self, request: Request
    ) -> tuple[AdminPrincipal | TeamPrincipal, AdminToken | ApiKey] | None:
        secret = bearer_secret(request)
        if secret is None:
            return None
        now = timezone.now()
        token = services.authenticate_admin_secret(secret, now=now)
        if token is not None:
            return AdminPrincipal(token_id=token.pk), token
        key = services.find_active_team_key(secret)
        if key is not None:
            return TeamPrincipal(team_id=key.team_id, key_id=key.pk), key
        raise exceptions.AuthenticationFailed("invalid or revoked token")

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="control-plane"'


class IsPlatformAdmin(BasePermission):
    """Allow only callers holding an admin token."""

    message = (
        "this endpoint needs an admin token; team keys cannot use the control plane"
    )

    def has_permission(self, request: Request, view: object) -> bool:
        return bool(getattr(request.user, "is_admin", False))


class AdminTokenScheme(OpenApiAuthenticationExtension):
    """Describe the admin token in the OpenAPI schema as an HTTP bearer scheme."""

    target_class = "accounts.auth.AdminTokenAuthentication"
    name = "adminToken"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "An admin token."}
