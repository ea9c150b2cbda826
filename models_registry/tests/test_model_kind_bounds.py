"""An embedding model's sizes beyond their columns are a 400 naming the field;
its versions need no chat template."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from models_registry.models import ModelVersion
from tests.factories import version_body

if TYPE_CHECKING:
    from rest_framework.test import APIClient

from models_registry.api.serializers import (
    MAX_EMBEDDING_DIMENSIONS,
    MAX_INPUT_TOKENS,
    ModelCreateSerializer,
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dimensions", MAX_EMBEDDING_DIMENSIONS + 1),
        ("dimensions", 2**56),
        ("max_input_tokens", MAX_INPUT_TOKENS + 1),
    ],
)
def test_sizes_past_their_columns_are_refused(field: str, value: int) -> None:
    body = {"model": "embed-1", "kind": "embedding", "dimensions": 384}
    body["max_input_tokens"] = 256
    body[field] = value
    serializer = ModelCreateSerializer(data=body)
    assert not serializer.is_valid()
    assert field in serializer.errors


def test_sizes_at_their_bounds_are_taken() -> None:
    serializer = ModelCreateSerializer(
        data={
            "model": "embed-1",
            "kind": "embedding",
            "dimensions": MAX_EMBEDDING_DIMENSIONS,
            "max_input_tokens": MAX_INPUT_TOKENS,
        }
    )
    assert serializer.is_valid(), serializer.errors


@pytest.mark.django_db
def test_an_embedding_version_needs_no_chat_template_and_a_chat_one_does(
    admin_client: APIClient,
) -> None:
    """GIVEN an embedding model and a chat model
    WHEN a version is registered without a chat template on each
    THEN the embedding model's is taken (it renders no chat) and the chat model's
    is a 400 naming ``chat_template``, with nothing registered.
    """
    for body in (
        {
            "model": "embed-1",
            "kind": "embedding",
            "dimensions": 384,
            "max_input_tokens": 256,
        },
        {"model": "chat-1"},
    ):
        created = admin_client.post("/admin/models", body, format="json")
        assert created.status_code == 201, created.content
    version = version_body()
    del version["chat_template"]
    taken = admin_client.post("/admin/models/embed-1/versions", version, format="json")
    assert taken.status_code == 201, taken.content
    assert ModelVersion.objects.get(model_id="embed-1").chat_template == ""
    refused = admin_client.post("/admin/models/chat-1/versions", version, format="json")
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template"
    assert not ModelVersion.objects.filter(model_id="chat-1").exists()
