"""schemathesis hooks for tests/test_v1_schema_live.py (``SCHEMATHESIS_HOOKS``).

A chat or tokenize body names a model; which models exist is the platform's data,
not its schema (any non-empty name is well formed, an unknown one is a 404). So a
body that names one by a string of its own is sent naming the model the test
platform serves, and the operation is tested past its model lookup. Bodies
without a string there (the invalid ones) go as they are.
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis

MODEL = os.environ.get("V1_SCHEMA_MODEL", "chat-7b")


# The operations whose body names a model.
MODEL_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/tokenize",
    }
)


@schemathesis.hook
def map_body(ctx: Any, body: Any) -> Any:
    """Name the platform's model where the body names one by a string of its own."""
    operation = getattr(ctx, "operation", None)
    if operation is None or operation.path not in MODEL_PATHS:
        return body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"]:
        return {**body, "model": MODEL}
    return body
