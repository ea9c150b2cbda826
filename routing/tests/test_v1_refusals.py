"""What /v1 refuses before admission: models without limits, bad headers, bad fields.

In process (``embedded_gateway``) on the gateway settings Django configures, so the
default the platform ships with (deny) is the one under test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from routing.runtime import gateway_settings
from routing.tests.embedded_gateway import MODEL, UNGRANTED_MODEL, EmbeddedGateway

USER = [{"role": "user", "content": "x"}]


def assert_openai_error(answer: Any, status: int) -> dict[str, Any]:
    assert answer.status == status, answer.body[:300]
    assert answer.headers["content-type"] == "application/json"
    error: dict[str, Any] = answer.json()["error"]
    assert set(error) == {"type", "message", "param", "code"}
    return error


@pytest.fixture
def gateway() -> Iterator[EmbeddedGateway]:
    with EmbeddedGateway(settings=gateway_settings()) as embedded:
        yield embedded


def test_a_model_without_limits_is_403_by_default(gateway: EmbeddedGateway) -> None:
    answer = gateway.request(
        "/v1/chat/completions",
        {"model": UNGRANTED_MODEL, "messages": USER, "max_tokens": 3},
    )

    error = assert_openai_error(answer, 403)
    assert error["type"] == "permission_error"
    assert error["code"] == "model_not_allowed"
    assert error["param"] == "model"
    assert UNGRANTED_MODEL in error["message"]
    assert "/admin/teams/alpha/limits" in error["message"]
    assert not gateway.is_charged()


def test_models_lists_only_the_models_the_team_has_limits_on(
    gateway: EmbeddedGateway,
) -> None:
    answer = gateway.request("/v1/models", method="GET")

    assert answer.status == 200, answer.body[:300]
    assert [model["id"] for model in answer.json()["data"]] == [MODEL]


def test_an_explicit_default_lets_a_team_use_a_model_without_limits() -> None:
    shipped = gateway_settings()
    assert shipped.default_tokens_per_minute == 0  # the shipped default: deny
    settings = dataclasses.replace(shipped, default_tokens_per_minute=1_000)
    with EmbeddedGateway(settings=settings) as embedded:
        listed = embedded.request("/v1/models", method="GET").json()["data"]
    assert sorted(model["id"] for model in listed) == sorted([MODEL, UNGRANTED_MODEL])


@pytest.mark.parametrize("header", ["", "  "])
def test_an_empty_priority_header_is_400(gateway: EmbeddedGateway, header: str) -> None:
    answer = gateway.request(
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "max_tokens": 3},
        headers={"x-priority": header},
    )

    error = assert_openai_error(answer, 400)
    assert error["param"] == "x-priority"
    assert "x-priority is empty" in error["message"]
    assert "interactive, standard, batch" in error["message"]
    assert not gateway.is_charged()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (7, "model must be a string"),
        (["chat-7b"], "model must be a string"),
        (None, "model is required"),
        ("", "model must not be empty"),
    ],
)
def test_a_model_that_is_not_a_name_says_what_is_wrong(
    gateway: EmbeddedGateway, model: object, message: str
) -> None:
    answer = gateway.request(
        "/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 3}
    )

    error = assert_openai_error(answer, 400)
    assert error["param"] == "model"
    assert error["message"] == message


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "no-such-model", "messages": USER, "max_tokens": 3}, 404),
        ({"model": 7, "messages": USER, "max_tokens": 3}, 400),
        ({"model": UNGRANTED_MODEL, "messages": USER, "max_tokens": 3}, 403),
    ],
)
def test_answers_refused_before_the_bucket_carry_no_rate_limit_headers(
    gateway: EmbeddedGateway, body: dict[str, Any], status: int
) -> None:
    # As docs/product-teams.md says: no bucket was read, so no x-ratelimit-* headers
    # (the 400 for a request larger than the bucket has them: test_stall_e2e).
    answer = gateway.request("/v1/chat/completions", body)

    assert_openai_error(answer, status)
    assert not [name for name in answer.headers if name.startswith("x-ratelimit-")]
    assert not gateway.is_charged()
