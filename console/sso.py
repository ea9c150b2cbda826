"""Single sign-on for the console: OpenID Connect through Authlib's Django client.

Public surface: ``SsoBackend``, ``SsoConfig``, ``apply_console_roles``,
``console_login``, ``is_sso_enabled``, ``sso_callback``, ``sso_login``.

``/console/sso/login/`` sends the browser to the provider (authorization code with
PKCE, a state and a nonce kept in the session); ``/console/sso/callback/`` trades
the code for tokens and has Authlib check the ID token: its signature against the
provider's keys (discovery's ``jwks_uri``), issuer, audience (our client id; an
option of ours, Authlib alone would take a token for another client naming us as
``azp``), expiry and nonce. Any failure refuses the login, logs why and says so on the login
page; nothing of the token is stored. The claims then give the user's roles
(``console.domain.sso_roles``), written onto the Django user each login: a
superuser for a platform admin, the ``finance`` group, a ``team-viewer:<team>``
group per team (``console.team_viewers``). The provider is the source of truth:
roles it no longer gives are taken away at the next login. Why Authlib, and the
settings: docs/platform-admins.md#single-sign-on.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from authlib.common.errors import AuthlibBaseError
from authlib.integrations.django_client import OAuth
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.auth import authenticate, get_user_model, login
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.models import Group
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from joserfc.errors import JoseError
from requests import RequestException

from console.domain.sso_roles import ConsoleRoles, RoleMapping, roles_from_claims
from console.team_viewers import TEAM_VIEWER_GROUP_PREFIX, team_viewer_group
from metering.roles import FINANCE_GROUP

if TYPE_CHECKING:
    from authlib.integrations.django_client.apps import DjangoOAuth2App
    from django.contrib.auth.models import User

__all__ = [
    "SsoBackend",
    "SsoConfig",
    "apply_console_roles",
    "console_login",
    "is_sso_enabled",
    "sso_callback",
    "sso_login",
]

logger = logging.getLogger(__name__)

# Users made by single sign-on are named after the provider's subject, never after
# a name the provider lets users choose: a password user "operator" must not be
# taken over by an identity that calls itself "operator".
USERNAME_PREFIX = "sso:"
_NEXT_KEY = "console_sso_next"
# What talking to the provider, or checking its answer, may raise: every one
# refuses the login (RuntimeError: Authlib's word for a discovery without keys).
_PROVIDER_ERRORS = (
    AuthlibBaseError,
    JoseError,
    RequestException,
    RuntimeError,
    ValueError,
)


@dataclass(frozen=True, slots=True)
class SsoConfig:
    """The provider and client, as the settings give them."""

    discovery_url: str
    client_id: str
    client_secret: str
    scopes: tuple[str, ...]
    timeout_s: float
    leeway_s: int
    mapping: RoleMapping

    @classmethod
    def from_settings(cls) -> SsoConfig:
        """Return the configuration the settings describe."""
        return cls(
            discovery_url=settings.PLATFORM_OIDC_DISCOVERY_URL,
            client_id=settings.PLATFORM_OIDC_CLIENT_ID,
            client_secret=settings.PLATFORM_OIDC_CLIENT_SECRET,
            scopes=tuple(settings.PLATFORM_OIDC_SCOPES),
            timeout_s=settings.PLATFORM_OIDC_TIMEOUT_S,
            leeway_s=settings.PLATFORM_OIDC_LEEWAY_S,
            mapping=RoleMapping(
                groups_claim=settings.PLATFORM_OIDC_GROUPS_CLAIM,
                admin_groups=frozenset(settings.PLATFORM_OIDC_ADMIN_GROUPS),
                finance_groups=frozenset(settings.PLATFORM_OIDC_FINANCE_GROUPS),
                team_viewer_prefix=settings.PLATFORM_OIDC_TEAM_VIEWER_PREFIX,
            ),
        )


def is_sso_enabled() -> bool:
    """Whether single sign-on is configured (a discovery URL and a client id)."""
    return bool(
        settings.PLATFORM_OIDC_DISCOVERY_URL and settings.PLATFORM_OIDC_CLIENT_ID
    )


@lru_cache(maxsize=4)
def _client(config: SsoConfig) -> DjangoOAuth2App:
    # One client per configuration and process: it keeps the discovery document
    # and the provider's keys (fetched again when a token names an unknown key).
    registry = OAuth()
    return registry.register(
        name="console",
        client_id=config.client_id,
        client_secret=config.client_secret,
        server_metadata_url=config.discovery_url,
        client_kwargs={
            "scope": " ".join(config.scopes),
            "code_challenge_method": "S256",
            "default_timeout": config.timeout_s,
        },
    )


def console_login(request: HttpRequest) -> HttpResponse:
    """The admin's login page, with single sign-on and without the password form
    when password login is off (the form refuses posts then too)."""
    return admin.site.login(
        request,
        extra_context={
            "sso_enabled": is_sso_enabled(),
            "password_login": settings.PLATFORM_CONSOLE_PASSWORD_LOGIN,
        },
    )


@never_cache
def sso_login(request: HttpRequest) -> HttpResponse:
    """Send the browser to the provider; come back to ``?next=`` once logged in."""
    if not is_sso_enabled():
        raise Http404("single sign-on is not configured")
    next_path = request.GET.get("next", "")
    if not url_has_allowed_host_and_scheme(
        next_path, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        next_path = reverse("admin:index")
    request.session[_NEXT_KEY] = next_path
    redirect_uri = request.build_absolute_uri(reverse("console-sso-callback"))
    try:
        return _client(SsoConfig.from_settings()).authorize_redirect(
            request, redirect_uri
        )
    except _PROVIDER_ERRORS as exc:
        logger.warning("single sign-on: the provider is unreachable: %s", exc)
        messages.error(request, "Single sign-on is unavailable; try again later.")
        return HttpResponseRedirect(reverse("admin:login"))


@never_cache
def sso_callback(request: HttpRequest) -> HttpResponse:
    """Check the provider's answer, log the user in with the roles it gives."""
    if not is_sso_enabled():
        raise Http404("single sign-on is not configured")
    config = SsoConfig.from_settings()
    client = _client(config)
    try:
        # Authlib checks the issuer by default but the audience only through azp:
        # a token for another client that names us as azp would pass. Both are
        # required here, as OIDC Core 3.1.3.7 asks.
        claims_options = {
            "iss": {
                "essential": True,
                "values": [client.load_server_metadata()["issuer"]],
            },
            "aud": {"essential": True, "values": [config.client_id]},
        }
        token = client.authorize_access_token(
            request, claims_options=claims_options, leeway=config.leeway_s
        )
    except _PROVIDER_ERRORS as exc:
        # Bad signature, wrong issuer/audience/nonce, expired, a replayed or
        # unknown state, the provider's own error: all refuse the same way.
        return _refuse(request, f"the provider's answer was refused: {exc}")
    claims = token.get("userinfo")
    if not claims:
        return _refuse(request, "the provider sent no ID token")
    user = authenticate(request, oidc_claims=dict(claims), sso_config=config)
    if user is None:
        return _refuse(
            request, f"no console role for subject {claims.get('sub')!r}", quiet=True
        )
    login(request, user, backend="console.sso.SsoBackend")
    next_path = request.session.pop(_NEXT_KEY, "") or reverse("admin:index")
    return HttpResponseRedirect(next_path)


def _refuse(request: HttpRequest, why: str, *, quiet: bool = False) -> HttpResponse:
    logger.warning("single sign-on refused: %s", why)
    shown = (
        "Your account has no role in this console."
        if quiet
        else "Single sign-on failed; the login was refused."
    )
    messages.error(request, shown)
    return HttpResponseRedirect(reverse("admin:login"))


def _username(subject: str) -> str:
    name = f"{USERNAME_PREFIX}{subject}"
    if len(name) <= 150:
        return name
    # Subjects may be up to 255 characters; the user name holds 150.
    return f"{USERNAME_PREFIX}sha256:{hashlib.sha256(subject.encode()).hexdigest()}"


@transaction.atomic
def apply_console_roles(*, user: User, roles: ConsoleRoles) -> None:
    """Make ``user``'s console roles exactly ``roles``.

    A platform admin is a superuser; finance is the ``finance`` group; a team's
    viewer is that team's viewer group (made on first use). Any role makes the user
    staff (the console's door); other groups, given by hand, are left alone.
    """
    user.is_superuser = roles.is_admin
    user.is_staff = roles.has_any
    user.save(update_fields=["is_superuser", "is_staff"])
    wanted = {team_viewer_group(team) for team in roles.viewer_of}
    if roles.is_finance:
        wanted.add(FINANCE_GROUP)
    held = set(
        user.groups.filter(name__startswith=TEAM_VIEWER_GROUP_PREFIX).values_list(
            "name", flat=True
        )
    )
    if user.groups.filter(name=FINANCE_GROUP).exists():
        held.add(FINANCE_GROUP)
    if held - wanted:
        user.groups.remove(*Group.objects.filter(name__in=held - wanted))
    for name in sorted(wanted - held):
        group, _ = Group.objects.get_or_create(name=name)
        user.groups.add(group)


class SsoBackend(ModelBackend):
    """Authenticate a user from checked OIDC claims; never from a password.

    A ``ModelBackend`` for the permissions: with password login off, Django's own
    backend is not installed, and this one answers for groups' permissions.
    """

    def authenticate(  # type: ignore[override]
        self,
        request: HttpRequest | None,
        oidc_claims: dict[str, Any] | None = None,
        sso_config: SsoConfig | None = None,
        **kwargs: Any,
    ) -> User | None:
        """Return the user for ``oidc_claims`` with its roles applied, or None when
        the claims give no role (or the user was deactivated here)."""
        if oidc_claims is None or sso_config is None:
            return None
        subject = oidc_claims.get("sub")
        if not isinstance(subject, str) or not subject:
            return None
        roles = roles_from_claims(oidc_claims, sso_config.mapping)
        if not roles.has_any:
            return None
        user, created = get_user_model().objects.get_or_create(
            username=_username(subject)
        )
        if created:
            user.set_unusable_password()
        if not self.user_can_authenticate(user):
            return None
        user.email = str(oidc_claims.get("email") or "")[:254]
        user.first_name = str(oidc_claims.get("given_name") or "")[:150]
        user.last_name = str(oidc_claims.get("family_name") or "")[:150]
        if not (user.first_name or user.last_name):
            user.first_name = str(oidc_claims.get("name") or "")[:150]
        user.save()
        apply_console_roles(user=user, roles=roles)
        return user
