"""The eval gate run against real simulated replicas over HTTP, with the openai SDK.

The candidate, the live version and the judge are ``python -m simengine``
processes; their quality is set on ``/sim/faults`` per test. The default eval
set (``platform/evals/chat-default.jsonl``) is the one the gate ships with.

The replicas are started here by command line rather than with
``localrun.processes.sim_replica``: ``engine_nodes`` imports the registry,
so the registry importing it back would be a cycle between the apps
(``tests/test_layering.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from control.eval_report import write_report
from control.eval_run import EvalReport, Target, run_eval
from models_registry.domain.eval_gate import (
    EvalItem,
    EvalSetError,
    JudgeTrust,
    parse_eval_set,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EVAL_SET = ROOT / "platform/evals/chat-default.jsonl"
THRESHOLDS = {"reasoning": 0.05, "maths": 0.05, "long_output": 0.05, "general": 0.05}
CATEGORIES = ("reasoning", "maths", "long_output", "general")
PER_CATEGORY = 40
ADMIN = "eval-admin"


@dataclass
class Replica:
    """One simulated replica process serving ``model`` at ``url``."""

    popen: subprocess.Popen[bytes]
    url: str
    model: str
    log_path: Path

    def set(self, **faults: Any) -> None:
        response = httpx.post(
            f"{self.url}/sim/faults",
            json=faults,
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        assert response.status_code == 200, response.text

    def target(self, **headers: str) -> Target:
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused")
        return Target(client=client, model=self.model, headers=headers)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _is_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def sim_replica(log_dir: Path, model: str, *flags: str) -> Iterator[Replica]:
    """Run a simulated replica on a free port until the block ends."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"sim-{port}.log"
    argv = [
        sys.executable,
        "-m",
        "simengine",
        "--model",
        model,
        "--served-model-name",
        model,
        "--port",
        str(port),
        "--sim-profile",
        "h100-8b",
        "--sim-admin-token",
        ADMIN,
        *flags,
    ]
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=dict(os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while not _is_healthy(url):
            assert popen.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, f"sim replica on {port} never healthy"
            time.sleep(0.05)  # a pause between polls, not a wait for the replica
        yield Replica(popen, url, model, log_path)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(5)


@pytest.fixture(scope="module")
def items() -> list[EvalItem]:
    """The shipped set's first 40 items of each category: its 40 labelled pairs and
    enough items for every verdict here (a fifth of the set, to keep the suite
    short; identical answers tie at any size, a drop of 0.4 shows in 40)."""
    every = parse_eval_set(EVAL_SET.read_text().splitlines(), source=str(EVAL_SET))
    kept: list[EvalItem] = []
    for category in CATEGORIES:
        kept += [item for item in every if item.category == category][:PER_CATEGORY]
    assert sum(item.human_label is not None for item in kept) >= 30
    return kept


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Replica]]:
    tmp = tmp_path_factory.mktemp("eval-sims")
    with (
        sim_replica(tmp, "chat-7b@v1") as live,
        sim_replica(tmp, "chat-7b@v2") as candidate,
        sim_replica(tmp, "reason-70b@v1", "--sim-seed", "70") as judge,
        sim_replica(tmp, "chat-7b@v9", "--max-num-queued-reqs", "2") as shedding,
    ):
        yield {"live": live, "candidate": candidate, "judge": judge, "shed": shedding}


def run(items: list[EvalItem], **arguments: Any) -> EvalReport:
    """Run the gate with ``arguments``, then close the targets' clients."""

    async def main() -> EvalReport:
        try:
            return await run_eval(items, **arguments)
        finally:
            for name in ("candidate", "live", "judge"):
                if isinstance(arguments.get(name), Target):
                    await arguments[name].client.close()

    return asyncio.run(main())


def evaluate(
    items: list[EvalItem],
    replicas: dict[str, Replica],
    *,
    candidate: float,
    live: float | None = 0.9,
    judge_quality: float = 0.95,
    **overrides: Any,
) -> EvalReport:
    """Run the gate with the qualities given, through the batch tier's header."""
    replicas["candidate"].set(quality=candidate)
    if live is not None:
        replicas["live"].set(quality=live)
    replicas["judge"].set(quality=judge_quality, degraded=False)
    batch = {"x-priority": "batch"}
    arguments: dict[str, Any] = {
        "candidate": replicas["candidate"].target(**batch),
        "live": replicas["live"].target(**batch) if live is not None else None,
        "judge": replicas["judge"].target(**batch),
        "thresholds": THRESHOLDS,
        "min_kappa": 0.6,
        "min_labels": 30,
        "concurrency": 16,
    }
    arguments.update(overrides)
    return run(items, **arguments)


def test_a_candidate_as_good_as_live_passes(
    items: list[EvalItem], replicas: dict[str, Replica], tmp_path: Path
) -> None:
    progress: list[tuple[str, int, int]] = []
    report = evaluate(
        items,
        replicas,
        candidate=0.9,
        on_progress=lambda *step: progress.append(step),
    )
    assert report.passed, report.reasons
    task = [r for r in report.categories if r.metric == "task"]
    assert [r.category for r in task] == list(CATEGORIES)
    # Quality 0.9 shows: about a tenth of each category is answered wrong.
    assert all(0.8 <= r.live_mean <= 0.97 for r in task), task
    assert all(r.difference == 0 and r.passed for r in task)
    assert report.judge is not None and report.judge.trusted
    assert report.judge.labelled == 40 and report.judge.kappa is not None
    assert report.judge.kappa >= 0.8
    assert report.judge_prompt == "judge-v1"
    assert report.counts["identical_answers"] == len(items)
    assert report.counts["judge_calls"] == 40  # the labelled pairs only
    assert ("answers", 2 * len(items), 2 * len(items)) in progress and (
        "calibration",
        40,
        40,
    ) in progress
    json_uri, html_uri = write_report(
        f"file://{tmp_path}/reports/chat-7b/v2/eval.html",
        report.as_dict(),
        storage_roots=[f"file://{tmp_path}/reports/"],
    )
    assert (tmp_path / "reports/chat-7b/v2/eval.json").is_file()
    assert "Eval gate PASSED" in (tmp_path / "reports/chat-7b/v2/eval.html").read_text()
    assert json_uri.endswith("eval.json") and html_uri.endswith("eval.html")


def test_a_candidate_of_half_the_quality_fails_in_every_category(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    report = evaluate(items, replicas, candidate=0.5)
    assert not report.passed
    for category in CATEGORIES:
        assert any(
            r.startswith(f"{category} (task): a real drop of") for r in report.reasons
        ), (category, report.reasons)
    task = {r.category: r for r in report.categories if r.metric == "task"}
    assert all(r.high < -0.05 for r in task.values())
    # The trusted judge compared the answers that differ, and preferred live's.
    judged = {r.category: r for r in report.categories if r.metric == "judge"}
    assert set(judged) == set(CATEGORIES)
    assert all(not r.passed for r in judged.values())
    rows = [row for row in report.items if "candidate_side" in row]
    assert {row["candidate_side"] for row in rows} == {"a", "b"}  # the order guard
    assert report.counts["judge_comparisons"] == len(rows) > len(items) // 4
    assert all(len(report.worst[c]) == 10 for c in CATEGORIES)
    # A judge of quality 0.95 errs on about one comparison in twenty.
    lost = [row for row in rows if row["candidate"] < row["live"]]
    misjudged = [row for row in lost if row["judge"] != "live"]
    assert len(misjudged) <= 0.1 * len(lost)


def test_a_judge_of_half_the_quality_is_not_trusted_and_fails_closed(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    report = evaluate(items, replicas, candidate=0.9, judge_quality=0.5)
    assert not report.passed
    assert report.reasons[0].startswith("the judge is not trusted: Cohen's kappa")
    assert report.judge is not None and not report.judge.trusted
    assert report.judge.kappa is not None and report.judge.kappa < 0.6
    # The task metric alone would have passed; no comparison was asked.
    assert all(r.passed for r in report.categories)
    assert report.counts["judge_calls"] == 40
    assert "judge_comparisons" not in report.counts


def test_human_labels_that_trust_the_judge_replace_the_labelled_pairs(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    """GIVEN a judge that would fail the eval set's labelled pairs
    WHEN enough human labels trust it (models_registry.judge_labels)
    THEN no calibration is asked, it compares, and its comparisons come back
    with their text for people to label."""
    people = JudgeTrust(labelled=30, kappa=0.8, min_kappa=0.6, min_labels=30)
    report = evaluate(
        items, replicas, candidate=0.5, judge_quality=0.5, human_trust=people
    )
    assert report.judge == people
    assert report.counts["judge_calls"] == report.counts["judge_comparisons"] > 0
    pairs = {p.item_id: p for p in report.judged_pairs}
    assert len(pairs) == report.counts["judge_comparisons"]
    by_id = {i.id: i for i in items}
    for pair in pairs.values():
        assert pair.messages == by_id[pair.item_id].messages
        assert pair.candidate_answer.strip() != pair.live_answer.strip()
        assert pair.verdict in {"candidate", "live", "tie"}
    assert "judged_pairs" not in report.as_dict()  # never in the JSON report


def test_an_untrusted_judge_still_compares_a_sample_for_people_to_label(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    report = evaluate(
        items, replicas, candidate=0.5, judge_quality=0.5, label_sample=10
    )
    assert not report.passed
    assert report.reasons[0].startswith("the judge is not trusted")
    # Its verdicts count for nothing: no judge metric, the labelled pairs and the
    # sample asked.
    assert all(r.metric == "task" for r in report.categories)
    assert report.counts["judge_label_comparisons"] == 10
    assert report.counts["judge_calls"] == 40 + 10
    assert len(report.judged_pairs) >= 9  # an unreadable reply is left out
    assert all(
        p.candidate_answer.strip() != p.live_answer.strip() for p in report.judged_pairs
    )


def test_human_labels_below_the_floor_fail_closed_without_asking_the_judge(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    people = JudgeTrust(labelled=30, kappa=0.3, min_kappa=0.6, min_labels=30)
    report = evaluate(items, replicas, candidate=0.9, human_trust=people)
    assert not report.passed
    assert report.reasons[0].startswith(
        "the judge is not trusted: Cohen's kappa 0.30 against 30 human labels"
    )
    assert report.counts["judge_calls"] == 0
    assert report.judged_pairs == ()


def test_a_judge_that_answers_nothing_readable_fails_closed(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    replicas["candidate"].set(quality=0.9)
    replicas["live"].set(quality=0.9)
    replicas["judge"].set(degraded=True)  # "I am sorry, I cannot help with that."
    try:
        report = run(
            items,
            candidate=replicas["candidate"].target(),
            live=replicas["live"].target(),
            judge=replicas["judge"].target(),
            thresholds=THRESHOLDS,
            min_kappa=0.6,
            min_labels=30,
            concurrency=16,
        )
    finally:
        replicas["judge"].set(degraded=False)
    assert not report.passed
    assert report.reasons[0] == (
        "the judge reason-70b@v1 answered nothing readable (40 replies), so the "
        "gate fails closed"
    )


def test_an_unreachable_judge_fails_closed(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    gone = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{_free_port()}/v1", api_key="x"
    )
    report = evaluate(
        items[:40], replicas, candidate=0.9, judge=Target(gone, "reason-70b@v1")
    )
    assert not report.passed
    assert report.reasons[0].startswith(
        "the judge could not be asked, so the gate fails closed: reason-70b@v1 "
        "could not be reached"
    )


def test_with_no_judge_the_task_metrics_decide(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    same = evaluate(items, replicas, candidate=0.9, judge=None)
    assert same.passed, same.reasons
    assert same.judge is None
    assert {r.metric for r in same.categories} == {"task"}
    worse = evaluate(items, replicas, candidate=0.5, judge=None)
    assert not worse.passed
    assert all("(task)" in reason for reason in worse.reasons)


def test_a_first_version_is_held_to_the_floors(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    good = evaluate(items, replicas, candidate=0.9, live=None)
    assert good.passed, good.reasons
    assert good.mode == "floor" and good.judge is None
    assert {r.metric for r in good.categories} == {"floor"}
    bad = evaluate(items, replicas, candidate=0.3, live=None)
    assert not bad.passed
    # Each category falls below its floor (long outputs cut to half score 0.5).
    assert [r.split(":")[0] for r in bad.reasons] == [
        f"{c} (floor)" for c in CATEGORIES
    ], bad.reasons
    assert (
        sum("a real drop" in r for r in bad.reasons) >= 2
    )  # the others "likely" at 40 items a category


def test_the_shed_batch_tier_is_retried_until_answered(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    """GIVEN a replica that refuses past two queued requests (503)
    WHEN 16 answers are asked at once
    THEN the refused ones are retried after a backoff and every item is answered."""
    shedding = replicas["shed"]
    report = run(
        items[:48],
        candidate=shedding.target(),
        live=None,
        judge=None,
        thresholds=THRESHOLDS,
        min_kappa=0.6,
        min_labels=30,
        concurrency=16,
    )
    assert report.counts["candidate_retries"] > 0
    assert len([row for row in report.items if "candidate" in row]) == 48
    assert report.passed, report.reasons


def test_a_refusal_that_outlasts_the_patience_fails_with_a_clear_error(
    items: list[EvalItem], replicas: dict[str, Replica]
) -> None:
    shedding = replicas["shed"]
    shedding.set(stall=True)  # two requests hang; every other one is refused
    try:
        report = run(
            items[:8],
            candidate=shedding.target(),
            live=None,
            judge=None,
            thresholds=THRESHOLDS,
            min_kappa=0.6,
            min_labels=30,
            concurrency=8,
            patience_s=1.0,
        )
    finally:
        shedding.set(stall=False)
    assert not report.passed
    assert report.categories == ()
    assert report.reasons[0].startswith(
        "could not collect the answers: chat-7b@v9 kept answering HTTP 503"
    )
    assert "gave up after 1 s" in report.reasons[0]


def test_a_malformed_eval_line_fails_naming_the_file_and_line(tmp_path: Path) -> None:
    lines = EVAL_SET.read_text().splitlines()
    lines[41] = lines[41].replace('"category": "', '"category": "poetry-')
    broken = tmp_path / "chat-broken.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    with pytest.raises(EvalSetError) as raised:
        parse_eval_set(broken.read_text().splitlines(), source=str(broken))
    assert raised.value.line == 42
    assert str(raised.value).startswith(f"{broken}, line 42: category must be one of")
