"""The console's pool pages: autoscaling settings refused as the API refuses them,
schedule rows judged together, and a panel of what the autoscaler sees."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from pytest_django import Settings

from engine_nodes.models import ScalingDecision
from models_registry.models import ModelVersion, Pool, PoolSchedule

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.fixture
def console(db: None) -> Client:
    user = get_user_model().objects.create_superuser(
        username="operator", email="operator@example.com", password=None
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def pool(chat_v1: ModelVersion) -> Pool:
    return Pool.objects.create(
        model=chat_v1.model,
        version=chat_v1,
        region="eu",
        min_replicas=1,
        max_replicas=10,
        desired_replicas=4,
        autoscaler_state={"state": {"samples": [[1.0, 5, 0]]}},
    )


def change_url(pool: Pool) -> str:
    return reverse("admin:models_registry_pool_change", args=[pool.pk])


def form(pool: Pool, *rows: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """Return the change form of ``pool`` as a browser posts it, with ``rows`` as
    new schedule rows."""
    data: dict[str, Any] = {
        "model": pool.model_id,
        "version": str(pool.version_id),
        "region": pool.region,
        "min_replicas": str(pool.min_replicas),
        "max_replicas": str(pool.max_replicas),
        "warm_floor": str(pool.warm_floor),
        "target_utilisation": str(pool.target_utilisation),
        "scale_down_utilisation": str(pool.scale_down_utilisation),
        "stable_window_s": str(pool.stable_window_s),
        "panic_window_s": str(pool.panic_window_s),
        "panic_factor": str(pool.panic_factor),
        "scale_down_interval_s": str(pool.scale_down_interval_s),
        "record_traffic_share": str(pool.record_traffic_share),
        "schedule-TOTAL_FORMS": str(len(rows)),
        "schedule-INITIAL_FORMS": "0",
        "schedule-MIN_NUM_FORMS": "0",
        "schedule-MAX_NUM_FORMS": "1000",
    }
    for index, row in enumerate(rows):
        for name, value in row.items():
            data[f"schedule-{index}-{name}"] = value
    data.update({k: str(v) for k, v in changes.items()})
    return data


def row(weekdays: list[int], start: int, end: int, floor: int) -> dict[str, Any]:
    return {
        "weekdays": [str(d) for d in weekdays],
        "start_minute": str(start),
        "end_minute": str(end),
        "min_replicas": str(floor),
    }


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"min_replicas": 11}, "min_replicas"),
        ({"scale_down_utilisation": 0.8}, "scale_down_utilisation"),
        ({"target_utilisation": 1.0}, "target_utilisation"),
        ({"panic_window_s": 90}, "panic_window_s"),
        ({"panic_factor": 1}, "panic_factor"),
        ({"warm_floor": 11}, "warm_floor"),
        ({"stable_window_s": 7200}, "stable_window_s"),
        ({"record_traffic_share": 1.5}, "record_traffic_share"),
    ],
)
def test_console_refuses_settings_the_api_refuses_on_their_field(
    console: Client, pool: Pool, changes: dict[str, Any], field: str
) -> None:
    response = console.post(change_url(pool), form(pool, **changes))

    assert response.status_code == 200  # the form again, with its errors
    errors = response.context["adminform"].form.errors
    assert field in errors, errors
    stored = Pool.objects.get(pk=pool.pk)
    assert getattr(stored, field) == getattr(pool, field)  # nothing was saved
    assert stored.max_replicas == 10


def test_console_saves_settings_and_schedule_and_leaves_the_autoscalers_columns(
    console: Client, pool: Pool
) -> None:
    response = console.post(
        change_url(pool),
        form(
            pool,
            row([0, 1, 2, 3, 4], 510, 600, 6),
            target_utilisation=0.6,
            record_traffic_share=0.1,
        ),
    )

    assert response.status_code == 302, response.context["errors"]
    stored = Pool.objects.get(pk=pool.pk)
    assert stored.target_utilisation == 0.6
    assert stored.record_traffic_share == 0.1
    assert (stored.desired_replicas, stored.autoscaler_state) == (
        4,
        {"state": {"samples": [[1.0, 5, 0]]}},
    )
    schedule = PoolSchedule.objects.get()
    assert (schedule.weekdays, schedule.start_minute, schedule.min_replicas) == (
        [0, 1, 2, 3, 4],
        510,
        6,
    )


@pytest.mark.parametrize(
    ("rows", "changes", "message"),
    [
        (
            [row([0, 1, 2, 3, 4], 510, 600, 6), row([0], 540, 660, 8)],
            {},
            "overlapping rules ask for different floors",
        ),
        # One save lowers max_replicas below a row's floor: judged together.
        ([row([5], 0, 60, 8)], {"max_replicas": 5}, "exceeds max_replicas"),
    ],
)
def test_console_judges_schedule_rows_together_with_the_pool(
    console: Client,
    pool: Pool,
    rows: list[dict[str, Any]],
    changes: dict[str, Any],
    message: str,
) -> None:
    response = console.post(change_url(pool), form(pool, *rows, **changes))

    assert response.status_code == 200
    [formset] = [f.formset for f in response.context["inline_admin_formsets"]]
    assert any(message in error for error in formset.non_form_errors())
    assert not PoolSchedule.objects.exists()
    assert Pool.objects.get(pk=pool.pk).max_replicas == 10


def test_console_refuses_a_schedule_row_that_is_no_rule(
    console: Client, pool: Pool
) -> None:
    response = console.post(change_url(pool), form(pool, row([0], 600, 540, 2)))

    assert response.status_code == 200
    [formset] = [f.formset for f in response.context["inline_admin_formsets"]]
    assert "end_minute" in formset.forms[0].errors
    assert not PoolSchedule.objects.exists()


def test_console_pool_page_shows_the_autoscaler_and_warns(
    console: Client, pool: Pool, settings: Settings
) -> None:
    settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT = 110_000
    Pool.objects.filter(pk=pool.pk).update(
        autoscaler_state={
            "last": {
                "at": T0.isoformat(),
                "reason": "capacity_exhausted",
                "utilisation": 0.93,
                "stable_utilisation": 0.8,
                "is_panicking": False,
                "is_capacity_exhausted": True,
                "signals": {"serving": 4, "starting": 0, "tokens_in_flight": 409_000},
            }
        }
    )
    ScalingDecision.objects.create(
        pool=pool,
        region="eu",
        decided_at=T0,
        from_replicas=2,
        to_replicas=4,
        reason="utilisation",
        utilisation=0.81,
    )

    response = console.get(change_url(pool))

    assert response.status_code == 200
    page = response.content.decode()
    warnings = [str(m) for m in response.context["messages"]]
    assert any("capacity exhausted" in w for w in warnings)
    assert any("capacity assumed" in w and "110000" in w for w in warnings)
    assert "93%" in page and "409000" in page
    assert "2 &rarr; 4" in page and "81%" in page
    listing = console.get(reverse("admin:models_registry_pool_changelist"))
    assert "capacity exhausted, capacity assumed" in listing.content.decode()
