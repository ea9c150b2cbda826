"""The team API's schema (``GET /v1/openapi.json``): one valid OpenAPI 3.1
document of every /v1 operation, open without a key; /admin/schema keeps to /admin."""

from __future__ import annotations

import schemathesis
from django.test import Client

from config.v1_schema import build_v1_schema

V1_PATHS = {
    "/tokenize",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/models",
    "/v1/files",
    "/v1/files/{file_id}",
    "/v1/files/{file_id}/content",
    "/v1/batches",
    "/v1/batches/{batch_id}",
    "/v1/batches/{batch_id}/cancel",
    "/v1/organization/usage/completions",
    "/v1/organization/costs",
}


def test_v1_schema_is_valid_openapi_of_every_v1_operation() -> None:
    document = build_v1_schema()
    schemathesis.openapi.from_dict(document).validate()
    assert set(document["paths"]) == V1_PATHS
    for path, item in document["paths"].items():
        for method, operation in item.items():
            assert operation["security"] == [{"teamKey": []}], (method, path)
            for status in ("400", "401") if method == "post" else ("401",):
                content = operation["responses"][status]["content"]
                assert content["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/Error"
                }, (method, path, status)


def test_v1_schema_is_served_without_a_key(client: Client) -> None:
    response = client.get("/v1/openapi.json")
    assert response.status_code == 200
    assert response.json() == build_v1_schema()
    refused = client.post("/v1/openapi.json")
    assert refused.status_code == 405
    assert refused["Allow"] == "GET, HEAD"
