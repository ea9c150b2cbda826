"""The environment the live drills give their gateway and agent."""

from __future__ import annotations

import pytest
from django.conf import settings

from localrun.processes import database_url, drill_env


def test_drill_env_names_the_region_and_lets_overrides_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GIVEN this process's settings module and a stray setting in the environment
    WHEN a drill asks for its processes' environment with two overrides
    THEN they share this database and SECRET_KEY, run the region under its own
    prefix, keep the rest of the environment, the overrides win, and each
    process picks its own settings module."""
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "config.settings")
    monkeypatch.setenv("SOME_OTHER_VARIABLE", "kept")
    env = drill_env(
        region="drill-1",
        prefix="p-1",
        PLATFORM_SNAPSHOT_REFRESH_S="1",
        PLATFORM_TRAFFIC_FLUSH_S="0.5",
    )
    assert env["DATABASE_URL"] == database_url()
    assert env["SECRET_KEY"] == settings.SECRET_KEY
    assert (env["PLATFORM_REGION"], env["PLATFORM_REDIS_PREFIX"]) == ("drill-1", "p-1")
    assert env["PLATFORM_DEFAULT_TOKENS_PER_MINUTE"] == "0"
    assert env["PLATFORM_SNAPSHOT_REFRESH_S"] == "1"
    assert env["PLATFORM_TRAFFIC_FLUSH_S"] == "0.5"
    assert env["SOME_OTHER_VARIABLE"] == "kept"
    assert "DJANGO_SETTINGS_MODULE" not in env
    assert drill_env(region="r", prefix="p")["PLATFORM_SNAPSHOT_REFRESH_S"] == "0.5"
