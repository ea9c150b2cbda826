import pytest


@pytest.mark.django_db
def test_admin_fixture_creates_token(admin_client):
    response = admin_client.get("/admin/teams")
    assert response.status_code == 200, response.content
