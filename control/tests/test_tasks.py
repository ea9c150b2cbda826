"""The control loops' tasks under their names, and under the names they had before."""

from __future__ import annotations

from django.conf import settings

from config.celery import app
from control import tasks


def test_every_renamed_task_runs_the_same_body_under_both_names() -> None:
    app.loader.import_default_modules()
    assert tasks.RENAMED
    for old, new in tasks.RENAMED.items():
        assert new.startswith("control."), new
        assert app.tasks[old].run is app.tasks[new].run, old


def test_a_renamed_task_keeps_its_limits_under_its_old_name() -> None:
    app.loader.import_default_modules()
    for old, new in tasks.RENAMED.items():
        for option in ("acks_late", "ignore_result", "time_limit", "soft_time_limit"):
            assert getattr(app.tasks[old], option) == getattr(app.tasks[new], option), (
                old,
                option,
            )


def test_a_routed_task_is_routed_under_both_names() -> None:
    routes = settings.CELERY_TASK_ROUTES
    for old, new in tasks.RENAMED.items():
        assert routes.get(old) == routes.get(new), old


def test_beat_schedules_the_new_names() -> None:
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert not scheduled & set(tasks.RENAMED)
