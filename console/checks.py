"""System checks of the console's login settings (registered in ``console.apps``)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register


@register()
def check_console_login(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Some way into the console must stay: passwords, or a whole SSO client."""
    sso_fields = {
        "PLATFORM_OIDC_DISCOVERY_URL": settings.PLATFORM_OIDC_DISCOVERY_URL,
        "PLATFORM_OIDC_CLIENT_ID": settings.PLATFORM_OIDC_CLIENT_ID,
    }
    missing = sorted(name for name, value in sso_fields.items() if not value)
    if len(missing) == 1:
        return [
            Error(
                f"single sign-on needs {missing[0]} as well",
                hint="Set both PLATFORM_OIDC_DISCOVERY_URL and PLATFORM_OIDC_CLIENT_ID.",
                id="console.E002",
            )
        ]
    if missing and not settings.PLATFORM_CONSOLE_PASSWORD_LOGIN:
        return [
            Error(
                "PLATFORM_CONSOLE_PASSWORD_LOGIN=false without single sign-on: "
                "nobody could log in to the console",
                hint="Configure PLATFORM_OIDC_DISCOVERY_URL and PLATFORM_OIDC_CLIENT_ID.",
                id="console.E001",
            )
        ]
    return []
