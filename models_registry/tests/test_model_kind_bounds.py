"""An embedding model's sizes beyond their columns are a 400 naming the field."""

from __future__ import annotations

import pytest

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
