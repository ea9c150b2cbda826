"""Settings of the test OIDC provider: django-oauth-toolkit's OpenID Connect server.

A Django project of its own, started by ``tests.oidc_provider.process`` as a
separate process with its own SQLite database and RSA key under
``OIDC_PROVIDER_DIR``. Never the platform's settings: nothing here is deployed.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR = Path(os.environ["OIDC_PROVIDER_DIR"])

SECRET_KEY = "oidc-test-provider-only"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "oauth2_provider",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "tests.oidc_provider.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [Path(__file__).resolve().parent / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": ["django.template.context_processors.request"]
        },
    }
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": DATA_DIR / "provider.sqlite3",
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
LOGIN_URL = "/login/"
# The platform runs on the same host (another port): cookies do not tell ports
# apart, so the provider's must not be named like the console's.
SESSION_COOKIE_NAME = "provider_sessionid"
CSRF_COOKIE_NAME = "provider_csrftoken"
# Test users only: a fast hash.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

OAUTH2_PROVIDER = {
    "OIDC_ENABLED": True,
    "OIDC_RSA_PRIVATE_KEY": (DATA_DIR / "rsa.pem").read_text(),
    "PKCE_REQUIRED": True,
    "SCOPES": {
        "openid": "OpenID Connect",
        "email": "Email address",
        "profile": "Profile",
    },
    "OAUTH2_VALIDATOR_CLASS": "tests.oidc_provider.validator.ProviderValidator",
}
