"""Celery is wired as the house style says: JSON only, named tasks, beat in settings."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from django.conf import settings

from config.celery import app

# Binds a queue the way a worker's start does (its `celery` queue and its pidbox
# both wrote an exchange table), with the broker that runs when REDIS_URL is unset.
_BIND_ON_FILESYSTEM_BROKER = """
from kombu import Exchange, Queue

from config.celery import app

with app.connection_for_write() as conn:
    assert conn.transport_cls == "filesystem", conn.transport_cls
    channel = conn.default_channel
    Queue("broker-probe", Exchange("broker-probe"), routing_key="probe")(
        channel
    ).declare()
    print(channel.control_folder.resolve())
"""


def test_celery_accepts_json_only() -> None:
    assert app.conf.accept_content == ["json"]
    assert app.conf.task_serializer == "json"
    assert app.conf.result_serializer == "json"


def test_every_beat_entry_names_a_registered_task() -> None:
    app.loader.import_default_modules()
    for name, entry in settings.CELERY_BEAT_SCHEDULE.items():
        assert entry["task"] in app.tasks, name


def test_every_beat_entry_expires_before_its_next_run() -> None:
    for name, entry in settings.CELERY_BEAT_SCHEDULE.items():
        schedule, options = entry["schedule"], entry["options"]
        assert isinstance(schedule, timedelta), name
        assert isinstance(options, dict), name
        assert 0 < options["expires"] < schedule.total_seconds(), name


def test_tasks_are_named_app_dot_verb_noun() -> None:
    app.loader.import_default_modules()
    ours = [name for name in app.tasks if not name.startswith("celery.")]
    assert ours
    for name in ours:
        app_label, _, verb_noun = name.partition(".")
        assert app_label in settings.INSTALLED_APPS and "_" in verb_noun, name


def test_filesystem_broker_writes_under_local_dir_only(tmp_path: Path) -> None:
    """GIVEN no REDIS_URL, WHEN a process started elsewhere binds a queue,
    THEN the exchange table lands under .local/broker/ and the cwd stays empty."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = str(settings.BASE_DIR)
    out = subprocess.run(
        [sys.executable, "-c", _BIND_ON_FILESYSTEM_BROKER],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    table = Path(out.stdout.strip()) / "broker-probe.exchange"
    try:
        assert table.is_file()
        assert table.is_relative_to(settings.LOCAL_DIR)
        assert list(tmp_path.iterdir()) == []
    finally:
        table.unlink(missing_ok=True)
