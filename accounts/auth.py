"""Bearer-token authentication for the control plane at /admin/ and for the parts
of /v1 that Django serves.

An admin token of scope ``admin`` opens every control-plane endpoint; one of scope
``reports`` (finance's) opens ``/admin/reports/...`` only (``CanReadReports``) and
gets 403 elsewhere. A team's API key is recognised, so that its holder gets 403
(you are known, but this is not yours) rather than 401; anything else, or no token,
is 401: a batch job's key too, which no person holds and which opens only the
gateway's chat completions and embeddings
(``accounts.services.find_active_team_key`` never returns one).
``TeamKeyAuthentication`` and ``IsTeam`` guard the team's own /v1 endpoints
(files, batches, its usage), through their base view TeamView.
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
    """A caller holding a valid admin token; ``is_admin`` only with scope admin
    (a reports token reads reports and nothing else)."""

    token_id: int
    scope: str = AdminToken.Scope.ADMIN
    is_authenticated: bool = True

    @property
    def is_admin(self) -> bool:
        return self.scope == AdminToken.Scope.ADMIN

    @property
    def can_read_reports(self) -> bool:
        return self.scope in (AdminToken.Scope.ADMIN, AdminToken.Scope.REPORTS)


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
            return AdminPrincipal(token_id=token.pk, scope=token.scope), token
        key = services.find_active_team_key(secret)
        if key is not None:
            return TeamPrincipal(team_id=key.team_id, key_id=key.pk), key
        raise exceptions.AuthenticationFailed("invalid or revoked token")

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="control-plane"'


class IsPlatformAdmin(BasePermission):
    """Allow only callers holding an admin token."""

    message = (
        "this endpoint needs an admin token; team keys and reports tokens cannot use it"
    )

    def has_permission(self, request: Request, view: object) -> bool:
        return bool(getattr(request.user, "is_admin", False))


class CanReadReports(BasePermission):
    """Allow callers holding an admin token or a reports (finance) token."""

    message = "this endpoint needs an admin token or a reports token"

    def has_permission(self, request: Request, view: object) -> bool:
        return bool(getattr(request.user, "can_read_reports", False))


# -- team keys, for the parts of /v1 that Django serves --------------------------------


@dataclass(frozen=True)
class TeamCaller:
    """A caller holding one of a team's API keys (a person's, never a batch's)."""

    team_id: str
    key_id: int
    is_admin: bool = False
    is_authenticated: bool = True


class TeamKeyAuthentication(BaseAuthentication):
    """Authenticate a team's API key; anything else is a 401 in OpenAI's shape.

    The keys the platform mints for a batch's own lines open only the gateway
    (``accounts.services.find_active_team_key`` never returns one).
    """

    def authenticate(self, request: Request) -> tuple[TeamCaller, ApiKey] | None:
        secret = bearer_secret(request)
        if secret is None:
            return None
        key = services.find_active_team_key(secret)
        if key is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
        return TeamCaller(team_id=key.team_id, key_id=key.pk), key

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'


class IsTeam(BasePermission):
    """Allow only callers holding a team's API key."""

    message = "this endpoint needs a team's API key"

    def has_permission(self, request: Request, view: object) -> bool:
        return isinstance(request.user, TeamCaller)


class AdminTokenScheme(OpenApiAuthenticationExtension):
    """Describe the admin token in the OpenAPI schema as an HTTP bearer scheme."""

    target_class = "accounts.auth.AdminTokenAuthentication"
    name = "adminToken"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "An admin token."}


class TeamKeyScheme(OpenApiAuthenticationExtension):
    """Describe a team's API key in the OpenAPI schema as an HTTP bearer scheme."""

    target_class = "accounts.auth.TeamKeyAuthentication"
    name = "teamKey"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "A team's API key."}
