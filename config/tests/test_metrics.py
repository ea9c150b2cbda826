"""/metrics answers a scraper holding the metrics token, and nobody else."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import yaml
from django.conf import settings
from django.test import Client

from metering import metrics

if TYPE_CHECKING:
    from pytest_django import Settings

TOKEN = "metrics-test-token"


@pytest.fixture
def scrape_token(settings: Settings) -> str:
    settings.PLATFORM_METRICS_TOKEN = TOKEN
    return TOKEN


def scrape(authorization: str | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {} if authorization is None else {"Authorization": authorization}
    response = Client().get("/metrics", headers=headers)
    return response.status_code, dict(response.headers), response.content


def test_metrics_without_a_token_are_refused_in_the_api_error_shape(
    scrape_token: str,
) -> None:
    status, headers, body = scrape()
    assert status == 401
    assert headers["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert headers["Content-Type"] == "application/json"
    assert Client().get("/metrics").json() == {
        "error": {
            "type": "authentication_error",
            "message": "send the metrics token: 'Authorization: Bearer <token>'",
            "param": None,
            "code": "invalid_metrics_token",
        }
    }
    assert b"platform_" not in body


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer wrong",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Basic {TOKEN}",
        TOKEN,
        "Bearer ",
    ],
)
def test_metrics_with_a_wrong_token_are_refused(
    scrape_token: str, authorization: str
) -> None:
    status, _, body = scrape(authorization)
    assert status == 401
    assert b"platform_" not in body


def test_metrics_with_the_token_show_the_teams_counts(scrape_token: str) -> None:
    metrics.TEAM_TOKENS.labels(team="metrics-team", model="chat-7b", kind="output").inc(
        3
    )
    for authorization in (f"Bearer {TOKEN}", f"bearer {TOKEN}"):
        status, headers, body = scrape(authorization)
        assert status == 200
        assert headers["Content-Type"].startswith("text/plain")
        assert b'team="metrics-team"' in body


def test_metrics_are_off_without_a_configured_token(settings: Settings) -> None:
    settings.PLATFORM_METRICS_TOKEN = ""
    response = Client().get("/metrics", headers={"Authorization": "Bearer "})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "metrics_disabled"


def test_metrics_refuse_other_methods(scrape_token: str) -> None:
    response = Client().post("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_example_scrape_config_sends_the_token_as_a_bearer() -> None:
    """platform/prometheus/prometheus.yml scrapes /metrics the way it is guarded."""
    config = yaml.safe_load(
        (settings.BASE_DIR / "platform" / "prometheus" / "prometheus.yml").read_text()
    )
    (job,) = [
        j for j in config["scrape_configs"] if j["job_name"] == "serving-platform"
    ]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer"
    assert job["authorization"]["credentials_file"]
