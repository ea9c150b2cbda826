"""Run the test OIDC provider as a process of its own.

Public surface: ``OidcProvider``, ``ProviderUser``, ``run_provider``.

django-oauth-toolkit's OpenID Connect server in a small Django project
(``tests.oidc_provider.settings``) under ``runserver``, on a free port, with its
own SQLite database and an RSA key drawn for the run. It knows ``users`` (their
groups become the ``groups`` claim) and one confidential client that may come
back to ``redirect_uris``. The platform finds it by discovery, as it would a real
provider. ``tamper(mode)`` makes its next ID tokens defective
(``tests.oidc_provider.validator``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from localrun.processes import ROOT, Process, free_port, wait_until

__all__ = ["OidcProvider", "ProviderUser", "run_provider"]


@dataclass(frozen=True, slots=True)
class ProviderUser:
    """A user of the provider and the groups it puts in the ID token."""

    username: str
    password: str
    groups: tuple[str, ...] = ()
    email: str = ""


@dataclass
class OidcProvider:
    """The running provider and the client registered with it."""

    url: str
    data_dir: Path
    client_id: str
    client_secret: str
    process: Process = field(repr=False)

    @property
    def discovery_url(self) -> str:
        return f"{self.url}/o/.well-known/openid-configuration"

    def tamper(self, mode: str) -> None:
        """Spoil the next ID tokens with ``mode``; ``""`` makes them good again."""
        path = self.data_dir / "tamper"
        if mode:
            path.write_text(mode)
        else:
            path.unlink(missing_ok=True)

    def platform_env(self) -> dict[str, str]:
        """Return the platform settings that point its console at this provider."""
        return {
            "PLATFORM_OIDC_DISCOVERY_URL": self.discovery_url,
            "PLATFORM_OIDC_CLIENT_ID": self.client_id,
            "PLATFORM_OIDC_CLIENT_SECRET": self.client_secret,
        }


def _write_rsa_key(path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _is_up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def run_provider(
    tmp: Path,
    *,
    users: Sequence[ProviderUser],
    redirect_uris: Sequence[str],
    client_id: str = "platform-console",
    client_secret: str = "platform-console-secret",
) -> Iterator[OidcProvider]:
    """Start the provider under ``tmp``; stop it when the block ends."""
    data_dir = tmp / "oidc-provider"
    data_dir.mkdir(parents=True, exist_ok=True)
    _write_rsa_key(data_dir / "rsa.pem")
    spec = {
        "users": [
            {
                "username": u.username,
                "password": u.password,
                "groups": list(u.groups),
                "email": u.email,
            }
            for u in users
        ],
        "clients": [
            {
                "client_id": client_id,
                "client_secret": client_secret,
                "redirect_uris": list(redirect_uris),
            }
        ],
    }
    (data_dir / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.oidc_provider.settings",
        "OIDC_PROVIDER_DIR": str(data_dir),
        "PYTHONPATH": str(ROOT),
    }
    subprocess.run(
        [sys.executable, "-m", "tests.oidc_provider.seed", str(data_dir / "spec.json")],
        env=env,
        cwd=ROOT,
        check=True,
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = data_dir / "provider.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "django",
                "runserver",
                "--noreload",
                f"127.0.0.1:{port}",
            ],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    process = Process(popen=popen, url=url, log_path=log_path)
    provider = OidcProvider(
        url=url,
        data_dir=data_dir,
        client_id=client_id,
        client_secret=client_secret,
        process=process,
    )
    try:
        wait_until(
            lambda: popen.poll() is not None or _is_up(provider.discovery_url),
            timeout_s=30,
            message="the OIDC provider's discovery document",
        )
        if popen.poll() is not None:
            raise RuntimeError(f"the OIDC provider exited:\n{process.log()}")
        yield provider
    finally:
        process.stop()
