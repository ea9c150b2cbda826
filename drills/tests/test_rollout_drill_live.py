"""``rollout_drill --live``: the broken version through real processes, the
platform's own guard tick deciding (``drills.rollout_live``)."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command

from models_registry.models import Model
from rollouts.models import Rollout

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PNG = b"\x89PNG\r\n\x1a\n"


def test_live_drill_rolls_back_the_broken_version_and_cleans_up(
    unblocked: None, tmp_path: Path
) -> None:
    report, plot = tmp_path / "live.json", tmp_path / "live.png"
    out = StringIO()
    call_command(
        "rollout_drill",
        "--live",
        "--scenario=bad",
        f"--json={report}",
        f"--plot={plot}",
        stdout=out,
    )
    data = json.loads(report.read_text(encoding="utf-8"))
    assert data["passed"], out.getvalue()
    (bad,) = data["scenarios"]
    assert (bad["decision"], bad["stage"]) == ("rolled_back", "canary")
    assert 0 < bad["detection_s"] <= 2 * data["guard_s"] + 1.0
    # Sequential guards roll back at the first guard whose evidence says worse:
    # the refusals (every answer one); the shorter answers may not be sure yet.
    assert "refusal_rate" in bad["tripped"]
    assert 0 < bad["conversations_saw"] <= bad["requests_saw"] < bad["requests"]
    assert (bad["moves_other"], bad["errors"]) == (0, [])
    assert [e["action"] for e in bad["evaluations"]][-1] == "roll_back"
    assert "bad_rolled_back_within_two_guard_periods" in out.getvalue()
    assert plot.read_bytes()[:8] == PNG
    # Its scratch model, rollout and pools are gone.
    assert not Model.objects.filter(pk="ro-chat").exists()
    assert not Rollout.objects.filter(model_id="ro-chat").exists()
