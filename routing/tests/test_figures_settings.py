"""The rollout figures' settings as a fresh process reads them: the bucket length,
the refusal patterns, and a bad pattern stopping the process at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from localrun.processes import ROOT

PRINT_SETTINGS = (
    "import json, django; django.setup(); from django.conf import settings; "
    "from routing.runtime import gateway_settings; g = gateway_settings(); "
    "print(json.dumps([settings.PLATFORM_FIGURES_BUCKET_S, g.figures_bucket_s, "
    "list(g.refusal_patterns)]))"
)


def settings_process(**env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PLATFORM_FIGURES_BUCKET_S", "PLATFORM_REFUSAL_PATTERNS")
    }
    environ.update(DJANGO_SETTINGS_MODULE="config.settings", **env)
    return subprocess.run(
        [sys.executable, "-c", PRINT_SETTINGS],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def read(**env: str) -> list[object]:
    process = settings_process(**env)
    assert process.returncode == 0, process.stderr
    return list(json.loads(process.stdout.splitlines()[-1]))


def test_defaults_and_overrides_reach_the_gateway() -> None:
    from routing.domain.refusals import DEFAULT_REFUSAL_PATTERNS

    assert read() == [60, 60, list(DEFAULT_REFUSAL_PATTERNS)]
    assert read(
        PLATFORM_FIGURES_BUCKET_S="10",
        PLATFORM_REFUSAL_PATTERNS=json.dumps(["no\\b", "nope"]),
    ) == [10, 10, ["no\\b", "nope"]]
    assert read(PLATFORM_REFUSAL_PATTERNS="[]")[2] == []


def test_a_bad_pattern_stops_the_process_naming_it() -> None:
    process = settings_process(PLATFORM_REFUSAL_PATTERNS='["ok", "I (cannot"]')
    assert process.returncode != 0
    assert (
        "ImproperlyConfigured: PLATFORM_REFUSAL_PATTERNS pattern 1 ('I (cannot') "
        "is not a valid regular expression" in process.stderr
    )
    process = settings_process(PLATFORM_FIGURES_BUCKET_S="0")
    assert "PLATFORM_FIGURES_BUCKET_S must be at least 1" in process.stderr
