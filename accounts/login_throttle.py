"""The console's login form, locked out after repeated wrong passwords.

Public surface: ``ConsoleLoginForm``, ``LoginThrottle``.

Two rules (``accounts.domain.login_throttle``), both kept in the Django cache (Redis
when ``REDIS_URL`` is set, so every server process shares them):

- a user name from one address: ``PLATFORM_CONSOLE_LOGIN_MAX_FAILURES`` (5) wrong
  passwords within ``PLATFORM_CONSOLE_LOGIN_LOCKOUT_S`` (15 min) lock that pair out
  for as long. Guessing the password of one account stops there, while the account
  stays open from every other address: a lock on the account alone would let
  anyone lock the operators out of their console.
- an address, whatever the user names: ``PLATFORM_CONSOLE_LOGIN_MAX_FAILURES_PER_IP``
  (20) failures lock the address out, so one client cannot spread its guesses over
  many user names.

A locked-out attempt is refused before the password is checked, even when it is the
right one. A successful login clears the pair's count (not the address's). The
address is ``REMOTE_ADDR``: behind a proxy that is the proxy's, and every user
shares the per-address rule. Read-modify-write on the cache is not atomic, so two
failures at the same instant may count once; a lockout a guess or two late is an
accepted inexactness.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.utils import timezone

from accounts.domain.login_throttle import (
    LoginFailures,
    ThrottleRule,
    after_failure,
    retry_after_s,
)

__all__ = ["ConsoleLoginForm", "LoginThrottle"]

logger = logging.getLogger(__name__)

_PREFIX = "console-login"


@dataclass(frozen=True, slots=True)
class LoginThrottle:
    """The two lockout rules over the Django cache."""

    per_user_and_ip: ThrottleRule
    per_ip: ThrottleRule

    @classmethod
    def from_settings(cls) -> LoginThrottle:
        """Return the throttle the settings describe."""
        lockout_s = settings.PLATFORM_CONSOLE_LOGIN_LOCKOUT_S
        return cls(
            per_user_and_ip=ThrottleRule(
                max_failures=settings.PLATFORM_CONSOLE_LOGIN_MAX_FAILURES,
                window_s=lockout_s,
                lockout_s=lockout_s,
            ),
            per_ip=ThrottleRule(
                max_failures=settings.PLATFORM_CONSOLE_LOGIN_MAX_FAILURES_PER_IP,
                window_s=lockout_s,
                lockout_s=lockout_s,
            ),
        )

    def retry_after_s(self, username: str, ip: str, now: float) -> float:
        """Return how long a login as ``username`` from ``ip`` is refused (0: none)."""
        return max(
            retry_after_s(_read(_pair_key(username, ip)), now),
            retry_after_s(_read(_ip_key(ip)), now),
        )

    def note_failure(self, username: str, ip: str, now: float) -> None:
        """Count one wrong password; log when it starts a lockout."""
        for key, rule in (
            (_pair_key(username, ip), self.per_user_and_ip),
            (_ip_key(ip), self.per_ip),
        ):
            before = _read(key)
            state = after_failure(before, now, rule)
            if state.locked_until > before.locked_until:
                logger.warning(
                    "console login from %s locked out for %.0f s after %d failures",
                    ip,
                    rule.lockout_s,
                    rule.max_failures,
                )
            _write(key, state, rule)

    def note_success(self, username: str, ip: str) -> None:
        """Forget the pair's failures (the address keeps its count)."""
        cache.delete(_pair_key(username, ip))


def _pair_key(username: str, ip: str) -> str:
    # Hashed: the name typed may be a password typed in the wrong field. Casefolded:
    # a case variant must not buy a fresh count where names match without case.
    digest = hashlib.sha256(username.casefold().encode()).hexdigest()[:32]
    return f"{_PREFIX}:user:{digest}:{ip}"


def _ip_key(ip: str) -> str:
    return f"{_PREFIX}:ip:{ip}"


def _read(key: str) -> LoginFailures:
    raw: Any = cache.get(key)
    if not isinstance(raw, dict):
        return LoginFailures()
    try:
        return LoginFailures(
            times=tuple(float(t) for t in raw["times"]),
            locked_until=float(raw["locked_until"]),
        )
    except (KeyError, TypeError, ValueError):
        return LoginFailures()


def _write(key: str, state: LoginFailures, rule: ThrottleRule) -> None:
    # The entry outlives both the window and a lockout; then it is worth nothing.
    timeout_s = math.ceil(rule.window_s + rule.lockout_s)
    cache.set(
        key,
        {"times": list(state.times), "locked_until": state.locked_until},
        timeout=timeout_s,
    )


class ConsoleLoginForm(AdminAuthenticationForm):
    """The admin login form, refusing a locked-out user name or address."""

    error_messages = {
        **AdminAuthenticationForm.error_messages,
        "throttled": "Too many failed logins. Try again in %(minutes)d minute(s).",
        "password_login_off": "Password login is turned off; use single sign-on.",
    }

    def clean(self) -> dict[str, Any]:
        if not settings.PLATFORM_CONSOLE_PASSWORD_LOGIN:
            # The page shows no form then; a post made anyway is refused whole.
            raise ValidationError(
                self.error_messages["password_login_off"], code="password_login_off"
            )
        throttle = LoginThrottle.from_settings()
        username = str(self.cleaned_data.get("username") or "")
        ip = str(self.request.META.get("REMOTE_ADDR") or "") if self.request else ""
        now = timezone.now().timestamp()
        wait_s = throttle.retry_after_s(username, ip, now)
        if wait_s > 0:
            raise ValidationError(
                self.error_messages["throttled"],
                code="throttled",
                params={"minutes": math.ceil(wait_s / 60)},
            )
        try:
            cleaned = super().clean()
        except ValidationError:
            throttle.note_failure(username, ip, now)
            raise
        throttle.note_success(username, ip)
        return cleaned
