"""The eval report: its page, and where it may be written."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from control.eval_report import (
    ReportLocationError,
    render_html,
    report_uris,
    write_report,
)
from models_registry.domain.eval_gate import EvalItem, eval_verdict, judge_trust

THRESHOLDS = {"reasoning": 0.05, "maths": 0.05, "long_output": 0.1, "general": 0.05}


def report_dict(**overrides: Any) -> dict[str, Any]:
    rng = random.Random(5)
    items = [
        EvalItem(
            id=f"{c}-{n}",
            messages=({"role": "user", "content": "q"},),
            reference="1",
            category=c,
        )
        for c in ("maths", "general")
        for n in range(100)
    ]
    live = {i.id: 1.0 for i in items}
    candidate = {
        i.id: 0.0 if i.category == "maths" and rng.random() < 0.3 else 1.0
        for i in items
    }
    trust = judge_trust([("a", "a"), ("b", "b"), ("tie", "tie")] * 12)
    verdict = eval_verdict(
        items, candidate, live, thresholds=THRESHOLDS, judge_verdicts={}, judge=trust
    )
    report = {
        **verdict.as_dict(),
        "mode": "compare",
        "candidate": "chat-7b@v2",
        "live": "chat-7b@v1",
        "judge_model": "reason-70b@v1",
        "judge_prompt": "judge-v1",
        "counts": {"items": 200},
        "timings_s": {"total": 1.5},
        "worst": {"maths": ["maths-3", "maths-7"]},
        "finished_at": "2026-12-01T00:00:00+00:00",
    }
    report.update(overrides)
    return report


def test_the_page_leads_with_the_verdict_and_has_a_table_per_category() -> None:
    page = render_html(report_dict())
    assert page.startswith("<!DOCTYPE html>")
    verdict_at = page.index("Eval gate FAILED: chat-7b@v2 against chat-7b@v1")
    assert verdict_at < page.index("<h2>Categories</h2>")
    assert page.index("maths (task): a real drop") < page.index("<h3>maths</h3>")
    assert "<h3>maths</h3>" in page and "<h3>general</h3>" in page
    assert page.count('<td class="fail">fail</td>') == 1
    assert page.count('<td class="pass">pass</td>') == 1
    assert "<code>maths-3</code>, <code>maths-7</code>" in page
    assert "judge-v1" in page and "reason-70b@v1" in page
    assert "Cohen&#x27;s kappa" in page and "1.000" in page
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched from outside


def test_everything_on_the_page_is_escaped() -> None:
    evil = "<script>alert(1)</script>"
    page = render_html(
        report_dict(
            candidate=evil,
            reasons=[evil],
            worst={"maths": [evil]},
            counts={evil: 1},
        )
    )
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_a_first_version_page_names_the_floor() -> None:
    page = render_html(report_dict(live=None, mode="floor", judge=None, passed=True))
    assert "Eval gate PASSED: chat-7b@v2</title>" in page
    assert "<th>floor</th>" in page
    assert "The judge was not checked." in page


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://r/x/", ("s3://r/x/eval-report.json", "s3://r/x/eval-report.html")),
        ("s3://r/x/eval.html", ("s3://r/x/eval.json", "s3://r/x/eval.html")),
        ("s3://r/x/eval.json", ("s3://r/x/eval.json", "s3://r/x/eval.html")),
        ("s3://r/x/eval", ("s3://r/x/eval.json", "s3://r/x/eval.html")),
    ],
)
def test_report_uris(uri: str, expected: tuple[str, str]) -> None:
    assert report_uris(uri) == expected


def test_the_report_is_written_under_a_file_root(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/reports/"
    json_uri, html_uri = write_report(
        f"{root}chat-7b/v2/eval.html", report_dict(), storage_roots=[root]
    )
    assert json_uri == f"{root}chat-7b/v2/eval.json"
    written = json.loads((tmp_path / "reports/chat-7b/v2/eval.json").read_text())
    assert written["passed"] is False
    assert written["candidate"] == "chat-7b@v2"
    page = (tmp_path / "reports/chat-7b/v2/eval.html").read_text()
    assert "Eval gate FAILED" in page
    assert html_uri.endswith("/eval.html")


def test_the_report_is_written_under_a_local_directory_root(tmp_path: Path) -> None:
    root = f"{tmp_path}/"
    json_uri, _ = write_report(f"{root}run/", report_dict(), storage_roots=[root])
    assert json_uri == f"{root}run/eval-report.json"
    assert (tmp_path / "run/eval-report.html").is_file()


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("file:///etc/cron.d/eval.html", "must lie under a configured storage root"),
        ("{root}../elsewhere/eval.html", "'..'"),
        ("{root}a%2F..%2F../x/eval.html", "'..'"),
        ("s3://models-private/eval.html", "must lie under"),
    ],
)
def test_a_uri_outside_the_roots_is_refused(tmp_path: Path, uri: str, why: str) -> None:
    root = f"file://{tmp_path}/reports/"
    with pytest.raises(ReportLocationError, match=why):
        write_report(
            uri.format(root=root), report_dict(), storage_roots=[root, "s3://models/"]
        )
    assert not (tmp_path / "elsewhere").exists()
    assert list(tmp_path.iterdir()) == []


def test_the_page_shows_the_judges_agreement_with_people() -> None:
    people = {"reason": "the judge reason-70b@v1 agrees with people: <kappa>"}
    page = render_html(report_dict(judge_agreement=people))
    assert (
        '<p class="people">People: the judge reason-70b@v1 agrees with people: '
        "&lt;kappa&gt;</p>"
    ) in page
    assert 'class="people"' not in render_html(report_dict())
