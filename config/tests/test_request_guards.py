"""NUL bytes in a path or query string are refused before any view runs."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "path",
    ["/admin/teams/a%00b", "/admin/teams?team=%00", "/admin/nowhere%00"],
)
def test_nul_under_the_api_is_a_400_in_the_error_shape(path: str) -> None:
    response = Client().get(path)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "nul_character"


@pytest.mark.parametrize(
    "path",
    ["/console/accounts/team/a%00b/change/", "/console/accounts/team/?q=%00"],
)
def test_nul_in_the_console_is_a_400(path: str) -> None:
    client = Client()
    client.force_login(User.objects.create_superuser("root", password="x" * 20))
    response = client.get(path)
    assert response.status_code == 400
    assert b"NUL" in response.content


def test_a_percent_sign_that_is_not_a_nul_passes() -> None:
    assert Client().get("/admin/teams?q=%2500").status_code == 401
