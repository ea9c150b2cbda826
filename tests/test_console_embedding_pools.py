"""The console shows an embedding pool as one: its kind, and its capacity and load
in input tokens/s (what the autoscaler sizes it on), beside a chat pool's tokens
in flight."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from models_registry import services as registry_services
from models_registry.models import ModelVersion, Pool
from tests.factories import VERSION_BODY, ReplicaFactory, accept, digest, version_body

pytestmark = pytest.mark.django_db

EMBED_URL = "/console/fleet/pools/embed-1/v1/local/"
CHAT_URL = "/console/fleet/pools/chat-7b/v1/local/"


@pytest.fixture
def console(db: None) -> Client:
    user = get_user_model().objects.create_superuser(
        username="operator", email="", password=None
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def pools(chat_v1: ModelVersion) -> None:
    """embed-1@v1 (two serving replicas of 12,500 input tokens/s, the last tick
    measured 9,000 admitted) and chat-7b@v1, both in ``local``."""
    registry_services.create_model(
        model_id="embed-1", kind="embedding", dimensions=384, max_input_tokens=512
    )
    body = version_body(
        weights_uri="s3://models/embed-1/",
        weights_hash=digest("embed weights"),
        engine_config={**VERSION_BODY["engine_config"], "runner": "pooling"},
    )
    embed = accept(registry_services.register_version(model_id="embed-1", **body))
    ModelVersion.objects.filter(pk=embed.pk).update(
        load_test_tokens_per_s=12_500.0, load_test_tokens_in_flight=500
    )
    now = timezone.now()
    Pool.objects.create(
        model=embed.model,
        version=embed,
        region="local",
        max_replicas=5,
        desired_replicas=2,
        autoscaler_state={
            "last": {
                "at": now.isoformat(),
                "reason": "hold",
                "signals": {"admitted_tokens_per_s": 9_000.0},
            }
        },
    )
    Pool.objects.create(
        model=chat_v1.model, version=chat_v1, region="local", desired_replicas=1
    )
    for replica_id, version in (("e-a", embed), ("e-b", embed), ("c-a", chat_v1)):
        ReplicaFactory.create(
            replica_id=replica_id,
            version=version,
            last_heartbeat=now,
            tokens_in_flight=300,
        )


def test_pool_page_of_an_embedding_pool_shows_input_tokens_per_s(
    console: Client, pools: None
) -> None:
    response = console.get(EMBED_URL)

    assert response.status_code == 200
    body = response.content.decode()
    assert '<td data-field="kind">embedding</td>' in body
    assert "Capacity (input tokens/s)" in body
    assert '<td data-field="capacity_tokens_per_s">25000</td>' in body
    assert '<td data-field="admitted_tokens_per_s">9000</td>' in body
    feed: dict[str, Any] = console.get(EMBED_URL, {"format": "json"}).json()
    assert (feed["kind"], feed["capacity_tokens_per_s"]) == ("embedding", 25_000.0)
    assert feed["admitted_tokens_per_s"] == 9_000.0


def test_pool_page_of_a_chat_pool_shows_no_input_rate(
    console: Client, pools: None
) -> None:
    body = console.get(CHAT_URL).content.decode()

    assert '<td data-field="kind">chat</td>' in body
    assert "input tokens/s" not in body
    assert 'data-field="capacity_tokens_in_flight"' in body


def test_fleet_table_shows_each_pools_kind_and_its_load_in_its_unit(
    console: Client, pools: None
) -> None:
    body = console.get("/console/").content.decode()

    embed_row = body[body.index('data-pool="embed-1/v1/local"') :]
    embed_row = embed_row[: embed_row.index("</tr>")]
    assert '<td data-field="kind">embedding</td>' in embed_row
    assert "9000 / 25000 input tokens/s" in embed_row
    chat_row = body[body.index('data-pool="chat-7b/v1/local"') :]
    chat_row = chat_row[: chat_row.index("</tr>")]
    assert '<td data-field="kind">chat</td>' in chat_row
    assert "input tokens/s" not in chat_row
    assert "300 / " in chat_row  # tokens in flight over capacity

    feed = console.get("/console/", {"format": "json"}).json()
    cells = {row["pool"]: row for row in feed["pools"]}
    assert cells["embed-1/v1/local"]["kind"] == "embedding"
    assert cells["embed-1/v1/local"]["capacity_tokens_per_s"] == 25_000.0
    assert cells["chat-7b/v1/local"]["capacity_tokens_per_s"] is None
