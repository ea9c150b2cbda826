"""Make the test provider's database: ``python -m tests.oidc_provider.seed SPEC``.

SPEC is a JSON file: ``{"users": [{"username", "password", "groups", "email"}],
"clients": [{"client_id", "client_secret", "redirect_uris"}]}``. Run with
``DJANGO_SETTINGS_MODULE=tests.oidc_provider.settings`` (``process.py`` does).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(spec_path: str) -> None:
    import django

    django.setup()
    from django.contrib.auth.models import Group, User
    from django.core.management import call_command
    from oauth2_provider.models import Application

    spec = json.loads(Path(spec_path).read_text())
    call_command("migrate", verbosity=0)
    for entry in spec["users"]:
        user = User.objects.create_user(
            username=entry["username"],
            password=entry["password"],
            email=entry.get("email", ""),
        )
        for name in entry.get("groups", []):
            user.groups.add(Group.objects.get_or_create(name=name)[0])
    for client in spec["clients"]:
        Application.objects.create(
            name=client["client_id"],
            client_id=client["client_id"],
            client_secret=client["client_secret"],
            client_type=Application.CLIENT_CONFIDENTIAL,
            authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
            redirect_uris=" ".join(client["redirect_uris"]),
            algorithm=Application.RS256_ALGORITHM,
            skip_authorization=True,
        )


if __name__ == "__main__":
    main(sys.argv[1])
