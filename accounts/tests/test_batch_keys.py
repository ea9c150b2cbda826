"""A batch job's key (purpose ``batch``) opens the gateway's chat completions only.

The control plane refuses it (401: it is no one's key there), the team's key list
leaves it out and will not revoke it, and the console shows it without letting
anyone edit or revoke it: the batch it was minted for owns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from accounts import services
from accounts.domain.keys import KeyKind, display_prefix, hash_secret, new_secret
from accounts.models import ApiKey

if TYPE_CHECKING:
    from rest_framework.test import APIClient

    from accounts.models import Team

pytestmark = pytest.mark.django_db


def mint_batch_key(team: Team, batch_id: str = "batch_1") -> tuple[ApiKey, str]:
    """Create a batch key the way the batch runner does; return it and its secret."""
    secret = new_secret(KeyKind.TEAM)
    key = ApiKey.objects.create(
        team=team,
        key_hash=hash_secret(secret),
        prefix=display_prefix(secret),
        name=f"batch {batch_id}",
        purpose=ApiKey.Purpose.BATCH,
    )
    return key, secret


@pytest.fixture
def console(db: None) -> Client:
    user = get_user_model().objects.create_superuser(
        username="operator", email="operator@example.com", password=None
    )
    client = Client()
    client.force_login(user)
    return client


def test_keys_default_to_the_team_purpose(team: Team) -> None:
    key, _ = services.issue_key(team_id=team.team)
    assert key.purpose == ApiKey.Purpose.TEAM == "team"


def test_find_active_team_key_refuses_a_batch_key(team: Team) -> None:
    _, batch_secret = mint_batch_key(team)
    person, person_secret = services.issue_key(team_id=team.team)

    assert services.find_active_team_key(batch_secret) is None
    found = services.find_active_team_key(person_secret)
    assert found is not None and found.pk == person.pk


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/admin/teams"),
        ("get", "/admin/teams/search/keys"),
        ("post", "/admin/teams/search/keys"),
        ("get", "/admin/models"),
    ],
)
def test_control_plane_refuses_a_batch_key_as_unknown(
    anon_client: APIClient, team: Team, method: str, path: str
) -> None:
    _, secret = mint_batch_key(team)
    anon_client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")

    response = getattr(anon_client, method)(path, {}, format="json")

    assert response.status_code == 401, response.content
    assert response.json()["error"]["type"] == "authentication_error"
    assert ApiKey.objects.filter(team=team).count() == 1  # nothing was issued


def test_team_key_list_leaves_batch_keys_out(
    admin_client: APIClient, team: Team
) -> None:
    batch, _ = mint_batch_key(team)
    person, _ = services.issue_key(team_id=team.team, name="ci")

    data = admin_client.get(f"/admin/teams/{team.team}/keys").json()["data"]

    assert [row["id"] for row in data] == [person.pk]
    assert batch.prefix not in str(data)


def test_revoking_a_batch_key_through_the_team_api_is_404(
    admin_client: APIClient, team: Team
) -> None:
    batch, _ = mint_batch_key(team)

    response = admin_client.delete(f"/admin/teams/{team.team}/keys/{batch.pk}")

    assert response.status_code == 404
    assert response.json()["error"]["param"] == "key_id"
    batch.refresh_from_db()
    assert batch.revoked_at is None


def test_console_shows_a_batch_key_read_only(console: Client, team: Team) -> None:
    batch, _ = mint_batch_key(team)
    change_url = reverse("admin:accounts_apikey_change", args=[batch.pk])

    page = console.get(change_url)
    posted = console.post(change_url, {"name": "renamed"})

    assert page.status_code == 200
    body = page.content.decode()
    assert "batch" in body and 'name="name"' not in body  # shown, not a form field
    assert posted.status_code == 403
    batch.refresh_from_db()
    assert batch.name == "batch batch_1"


def test_console_key_list_shows_the_purpose(console: Client, team: Team) -> None:
    mint_batch_key(team)
    services.issue_key(team_id=team.team)

    page = console.get(reverse("admin:accounts_apikey_changelist"))

    assert page.status_code == 200
    assert 'class="field-purpose">batch<' in page.content.decode()
    assert 'class="field-purpose">team<' in page.content.decode()


def test_console_revoke_action_leaves_batch_keys_alone(
    console: Client, team: Team
) -> None:
    batch, _ = mint_batch_key(team)
    person, _ = services.issue_key(team_id=team.team)

    response = console.post(
        reverse("admin:accounts_apikey_changelist"),
        {"action": "revoke_selected", "_selected_action": [batch.pk, person.pk]},
    )

    assert response.status_code == 302
    batch.refresh_from_db()
    person.refresh_from_db()
    assert batch.revoked_at is None
    assert person.revoked_at is not None
