"""A pool's traffic-twin setting through the control plane: GET and PUT
/admin/pools/{model}/{version}/{region}/traffic, and the model listing's field."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from control.api.serializers import PoolTrafficOutSerializer
from models_registry.models import ModelVersion, Pool
from routing.services import build_snapshot

pytestmark = pytest.mark.django_db

URL = "/admin/pools/chat-7b/v1/eu/traffic"


@pytest.fixture
def pool(chat_v1: ModelVersion) -> Pool:
    return Pool.objects.create(
        model=chat_v1.model, version=chat_v1, region="eu", min_replicas=1
    )


def error_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert error["message"]
    return error


def test_get_shows_a_pool_records_nothing_by_default(
    admin_client: APIClient, pool: Pool
) -> None:
    response = admin_client.get(URL)

    assert response.status_code == 200, response.content
    assert set(response.json()) == set(PoolTrafficOutSerializer().fields)
    assert response.json() == {
        "model": "chat-7b",
        "version": "v1",
        "region": "eu",
        "record_traffic_share": 0.0,
    }


def test_put_sets_the_share_the_gateways_read(
    admin_client: APIClient, pool: Pool
) -> None:
    response = admin_client.put(URL, {"record_traffic_share": 0.25}, format="json")

    assert response.status_code == 200, response.content
    assert response.json()["record_traffic_share"] == 0.25
    assert Pool.objects.get(pk=pool.pk).record_traffic_share == 0.25
    listed = admin_client.get("/admin/models/chat-7b").json()["pools"]
    assert [p["record_traffic_share"] for p in listed] == [0.25]
    snapshot = build_snapshot(region="eu", default_policy="least_loaded")
    assert snapshot.versions[("chat-7b", "v1")].traffic_share == 0.25


@pytest.mark.parametrize("share", [-0.1, 1.5, "0.5", True, None])
def test_put_refuses_a_share_outside_zero_to_one(
    admin_client: APIClient, pool: Pool, share: Any
) -> None:
    response = admin_client.put(URL, {"record_traffic_share": share}, format="json")

    assert response.status_code == 400, response.content
    assert error_of(response)["param"] == "record_traffic_share"
    assert Pool.objects.get(pk=pool.pk).record_traffic_share == 0.0


def test_unknown_model_or_pool_is_a_404_naming_it(
    admin_client: APIClient, pool: Pool
) -> None:
    no_model = admin_client.get("/admin/pools/nope/v1/eu/traffic")
    no_pool = admin_client.put(
        "/admin/pools/chat-7b/v1/us/traffic", {"record_traffic_share": 1}, format="json"
    )

    assert no_model.status_code == 404 and error_of(no_model)["param"] == "model"
    assert no_pool.status_code == 404 and error_of(no_pool)["param"] == "region"


def test_takes_admin_tokens_only(
    anon_client: APIClient, pool: Pool, team_secret: str
) -> None:
    assert anon_client.get(URL).status_code == 401
    anon_client.credentials(HTTP_AUTHORIZATION=f"Bearer {team_secret}")
    put = anon_client.put(URL, {"record_traffic_share": 1.0}, format="json")
    assert put.status_code == 403
    assert Pool.objects.get(pk=pool.pk).record_traffic_share == 0.0
