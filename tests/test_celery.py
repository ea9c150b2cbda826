"""Celery is wired as the house style says: JSON only, named tasks, beat in settings."""

from __future__ import annotations

from django.conf import settings

from config.celery import app


def test_celery_accepts_json_only():
    assert app.conf.accept_content == ["json"]
    assert app.conf.task_serializer == "json"
    assert app.conf.result_serializer == "json"


def test_every_beat_entry_names_a_registered_task():
    app.loader.import_default_modules()
    for name, entry in settings.CELERY_BEAT_SCHEDULE.items():
        assert entry["task"] in app.tasks, name


def test_every_beat_entry_expires_before_its_next_run():
    for name, entry in settings.CELERY_BEAT_SCHEDULE.items():
        interval_s = entry["schedule"].total_seconds()
        assert 0 < entry["options"]["expires"] < interval_s, name


def test_tasks_are_named_app_dot_verb_noun():
    app.loader.import_default_modules()
    ours = [name for name in app.tasks if not name.startswith("celery.")]
    assert ours
    for name in ours:
        app_label, _, verb_noun = name.partition(".")
        assert app_label in settings.INSTALLED_APPS and "_" in verb_noun, name
