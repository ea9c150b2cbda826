"""The version gates' wiring against real vLLM (the CPU build, the tiny Llama).

``make test-vllm`` runs this module. Real processes: the node agent (``--kind
vllm``, two GPUs), its vLLM replicas, the gateway, PostgreSQL and Redis; the gates
themselves (``control.gates.run_gates``) run in this test's process, as the
Celery task would run them.

GIVEN ``tiny-llama@v1`` serving from one vLLM replica (a pool of one) and
``tiny-llama@v2`` registered with the same weights files but another
``max_num_seqs`` (so another identity), WHEN v2's gates run, THEN the weights gate
verifies the real files in place (no region storage is configured); a staging
pool of one starts a second vLLM process with v2's flags; every eval item is asked
through the gateway, pinned to ``tiny-llama@v2`` at the batch tier with the gates'
own key, and answered by that process (v1's engine generates nothing); the report
(JSON and HTML) counts every item; and the load test replays a short trace
straight at the staging replica for at least one step, with vLLM's own figures.

What the test does not judge is the verdict. The tiny model has random weights,
so it answers no eval item right; the gate config is set so that this cannot stop
the chain before the load test: no judge, and v1 is not the model's live version
(so its engine, asked nothing, shows the pinning: only v2's generates), so v2 is
scored alone against the first-version floors with thresholds wide open, and the
eval gate passes on any set of answers that all came back. Comparing with a live
version through the gateway is ``tests/test_gates_e2e.py``'s, on simulated
replicas. The load test's verdict (p95 TTFT under 1 s, 30 tokens/s streams) is
up to two shared CPU cores: the version ends ``ready`` when its step holds, or
``rejected`` by the load-test gate saying that no step held, and either is
accepted; a held step and a rejection together are not.

About 100 s on two cores: v1's replica starts in about 40 s, the staging one in
as long again (two engines starting at once would share the cores, and v1 must
serve before the eval for its idle engine to show the pinning), the eval takes a
few seconds and the load test's one step about 8.

Where the CPU build cannot be installed the module is skipped with the reason;
with ``REQUIRE_VLLM=1`` that is a failure (the root conftest's ``tiny_model``).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from django.core.management import call_command
from django.db import connection

from control import gates
from engine_nodes.domain.scrape import EngineStats
from engine_nodes.models import Replica
from engine_nodes.weights import local_identity, local_path, tree_digest
from localrun.processes import (
    Process,
    start_gateway,
    wait_until,
)
from localrun.vllm_cpu import (
    MODEL,
    TINY_VERSION_FILE,
    engine_pid,
    lower_engine_priority,
    start_vllm_agent,
)
from models_registry import services as registry
from models_registry.domain.eval_gate import CATEGORIES
from models_registry.models import GateRun, ModelVersion, Pool, VersionRegion
from tests.live import platform_env
from tests.test_vllm_e2e import (
    ENGINE_KEY,
    SERVING_TIMEOUT_S,
    _replica_logs,
    engine_metrics,
)

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker, Settings

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]

REGION = "e2e-vllm-gates"
ITEMS_PER_CATEGORY = 2
V2_MAX_NUM_SEQS = 16
# A short trace of 128-token answers (streamed in about half a second each), so
# that requests overlap and each KV sample of a window sees some in use.
TRACE_REQUESTS = 40
TRACE_ANSWER_TOKENS = 128
GATE_CONFIG: dict[str, Any] = {
    "judge_model": "",
    # Wide open: the tiny model's (random) answers cannot fail the eval gate.
    "thresholds": dict.fromkeys(CATEGORIES, 0.99),
    # One step of 3 requests/s (384 tokens/s): a 1 s warm-up, a 6 s window (five
    # KV samples, of which at least one sees a request running, or the version's
    # tokens in flight would read 0) and the drain.
    "load_test": {
        "start_tokens_per_s": 384,
        "step_tokens_per_s": 128,
        "max_tokens_per_s": 384,
        "warmup_s": 1,
        "duration_s": 6,
        "drain_s": 15,
        "stop_after_failures": 1,
    },
}


@dataclass
class GatedPlatform:
    """The running agent and gateway, v1 serving, v2 registered with gates pending."""

    gateway: Process
    agent: Process
    v1: ModelVersion
    v2: ModelVersion
    v1_url: str
    tmp: Path


@pytest.fixture
def gated(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path: Path,
    tiny_model: Path,
    settings: Settings,
) -> Iterator[GatedPlatform]:
    with django_db_blocker.unblock():
        name = str(connection.settings_dict["NAME"])
        test_name = connection.settings_dict.get("TEST", {}).get("NAME")
        if not (name.startswith("test_") or name == test_name):
            raise RuntimeError(f"refusing to run end-to-end tests against {name}")
        try:
            yield from _gated_platform(tmp_path, tiny_model, settings)
        finally:
            call_command("flush", interactive=False, verbosity=0)


def _gated_platform(
    tmp: Path, model_dir: Path, settings: Settings
) -> Iterator[GatedPlatform]:
    v1, v2 = _register(model_dir)
    eval_set = tmp / "evals" / "tiny.jsonl"
    call_command(
        "make_eval_set",
        "--items",
        str(ITEMS_PER_CATEGORY),
        "--labelled",
        "0",
        "--output",
        str(eval_set),
    )
    trace = tmp / "trace.jsonl"
    call_command(
        "make_load_trace",
        "--out",
        str(trace),
        "--requests",
        str(TRACE_REQUESTS),
        "--prompt-tokens",
        "64",
        "--answer-tokens",
        str(TRACE_ANSWER_TOKENS),
        stdout=io.StringIO(),
    )
    env = platform_env(
        region=REGION,
        prefix=f"e2e-{uuid.uuid4().hex[:8]}",
        PLATFORM_ENGINE_API_KEY=ENGINE_KEY,
    )
    # Two GPUs: v1's replica and v2's staging one.
    agent = start_vllm_agent(
        env,
        tmp,
        node="e2e-gates-node",
        region=REGION,
        gpus=2,
        start_timeout_s=SERVING_TIMEOUT_S,
    )
    gateway = None
    try:
        started = time.monotonic()
        wait_until(
            lambda: (
                Replica.objects.filter(version=v1, state="serving").exists()
                or agent.popen.poll() is not None
            ),
            timeout_s=SERVING_TIMEOUT_S,
            interval_s=0.5,
            message=f"v1's vLLM replica serving\n{_replica_logs(tmp)}",
        )
        if agent.popen.poll() is not None:
            raise AssertionError(f"agent exited:\n{agent.log()}")
        sys.stderr.write(f"\nv1 serving after {time.monotonic() - started:.1f} s\n")
        v1_url = Replica.objects.get(version=v1, state="serving").url
        lower_engine_priority(engine_pid(v1_url))
        gateway = start_gateway(env, tmp)
        # The gates read these in this process (the Celery worker's settings).
        settings.PLATFORM_GATE_REGION = REGION
        settings.PLATFORM_REGION_STORAGE = {}
        settings.PLATFORM_GATE_GATEWAY_URL = gateway.url
        settings.PLATFORM_STORAGE_ROOTS = [
            f"file://{model_dir.resolve().parent}/",
            f"file://{tmp}/",
        ]
        settings.PLATFORM_DEFAULT_EVAL_SET = f"file://{eval_set}"
        settings.PLATFORM_EVAL_REPORT_ROOT = f"file://{tmp}/reports"
        settings.PLATFORM_LOAD_TEST_TRACE = str(trace)
        settings.PLATFORM_ENGINE_API_KEY = ENGINE_KEY
        settings.PLATFORM_GATE_REPLICA_TIMEOUT_S = float(SERVING_TIMEOUT_S)
        yield GatedPlatform(
            gateway=gateway, agent=agent, v1=v1, v2=v2, v1_url=v1_url, tmp=tmp
        )
    finally:
        if gateway is not None:
            gateway.stop()
        agent.stop(grace_s=30)


def _register(model_dir: Path) -> tuple[ModelVersion, ModelVersion]:
    """Register v1 (accepted, a pool of one, not the live alias) and v2.

    The identity comes from the files, as in ``test_vllm_e2e``. v2 differs from v1
    only in ``max_num_seqs``; its gates are queued (attempt 1, pending) and this
    test runs them. v1 gets no alias, so its idle engine shows that only v2 is
    asked (module docstring).
    """
    body = {**local_identity(model_dir), **json.loads(TINY_VERSION_FILE.read_text())}
    registry.create_model(model_id=MODEL)
    registry.register_version(model_id=MODEL, version="v1", **body)
    v1 = registry.accept_version(
        model_id=MODEL,
        version="v1",
        by="test_vllm_gates",
        reason="the fleet's running version, not what is gated here",
    )
    Pool.objects.create(
        model_id=MODEL, version=v1, region=REGION, min_replicas=1, max_replicas=1
    )
    config = {**body["engine_config"], "max_num_seqs": V2_MAX_NUM_SEQS}
    v2 = registry.register_version(
        model_id=MODEL, version="v2", **{**body, "engine_config": config}
    )
    registry.set_gate_config(model_id=MODEL, raw=GATE_CONFIG)
    return v1, v2


@dataclass
class StagingSeen:
    """What the watcher saw of v2's staging replica while the gates ran."""

    url: str = ""
    models: dict[str, Any] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    metrics: list[EngineStats] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@contextlib.contextmanager
def watch_staging(version: ModelVersion) -> Iterator[StagingSeen]:
    """Watch for the version's serving replica while the block runs.

    Once it serves: record its ``/v1/models`` and its engine's command line, and
    renice its engine as ``test_vllm_e2e`` does (two cores: the agent must keep
    beating); then scrape its ``/metrics`` every second. The replica may be gone
    soon after the gates end (a rejected version's staging replica drains), so
    what the test asserts about the process is what was seen here.
    """
    seen = StagingSeen()
    done = threading.Event()

    def watch() -> None:
        try:
            while not done.is_set():
                if not seen.url:
                    replica = Replica.objects.filter(
                        version=version, region=REGION, state="serving"
                    ).first()
                    if replica is not None:
                        _first_sight(seen, replica.url)
                else:
                    with contextlib.suppress(httpx.HTTPError):
                        seen.metrics.append(engine_metrics(seen.url))
                done.wait(1.0)
        except Exception as exc:  # reported by the test, not lost in a thread
            seen.errors.append(repr(exc))
        finally:
            connection.close()

    thread = threading.Thread(target=watch, name="watch-staging", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join(30)


def _first_sight(seen: StagingSeen, url: str) -> None:
    response = httpx.get(
        f"{url}/v1/models",
        headers={"Authorization": f"Bearer {ENGINE_KEY}"},
        timeout=10,
    )
    response.raise_for_status()
    pid = engine_pid(url)
    seen.argv = [
        arg.decode()
        for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if arg
    ]
    seen.models = response.json()
    lower_engine_priority(pid)
    seen.url = url


def flag(argv: list[str], name: str) -> str:
    """Return the value after ``name`` in ``argv``."""
    assert name in argv, argv
    return argv[argv.index(name) + 1]


def test_gates_run_against_real_vllm_replicas(gated: GatedPlatform) -> None:
    v1, v2 = gated.v1, gated.v2
    started = time.monotonic()
    with watch_staging(v2) as seen:
        status = gates.run_gates(v2.pk, 1)
    elapsed = time.monotonic() - started

    v2.refresh_from_db()
    runs = {r.kind: r for r in GateRun.objects.filter(version=v2, attempt=1)}
    summary = {k: (r.state, r.detail) for k, r in runs.items()}
    figures = {k: v for k, v in runs["load_test"].result.items() if k != "settings"}
    sys.stderr.write(
        f"\nv2's gates ran in {elapsed:.1f} s: {v2.status} {v2.status_reason!r}\n"
        f"load test: {json.dumps(figures)}\n"
    )
    assert status == v2.status, summary
    assert not seen.errors, seen.errors
    # Weights: verified in place against the real files (no region storage).
    assert runs["weights"].state == "passed", summary
    copy = VersionRegion.objects.get(version=v2, region=REGION)
    assert (copy.state, copy.uri, copy.detail) == ("ready", v2.weights_uri, "verified")
    weights_dir = local_path(v2.weights_uri)
    assert weights_dir is not None
    assert tree_digest(weights_dir) == v2.weights_hash == v1.weights_hash
    # A staging replica of v2 served: a real vLLM process started with v2's flags.
    assert seen.url, f"no serving replica of v2 was seen\n{_replica_logs(gated.tmp)}"
    assert seen.url != gated.v1_url
    (served,) = seen.models["data"]
    assert (served["id"], served["owned_by"]) == (MODEL, "vllm")
    assert served["max_model_len"] == v2.engine_config["max_model_len"]
    assert flag(seen.argv, "--max-num-seqs") == str(V2_MAX_NUM_SEQS)
    assert flag(seen.argv, "--served-model-name") == MODEL
    assert any(arg.endswith("vllm") for arg in seen.argv[:2]), seen.argv
    # Eval: every item went through the gateway, pinned to v2, and was answered.
    assert runs["eval"].state == "passed", summary
    report_uris = runs["eval"].result["report"]
    report_path = local_path(report_uris["json"])
    assert report_path is not None
    report = json.loads(report_path.read_text())
    assert report["candidate"] == f"{MODEL}@v2"
    assert (report["live"], report["judge"]) == (None, None)
    (eval_set,) = report["sets"]
    assert eval_set["mode"] == "floor"
    counts = eval_set["counts"]
    items = len(CATEGORIES) * ITEMS_PER_CATEGORY
    assert counts["items"] == items
    assert counts["candidate_calls"] == items + counts["candidate_retries"]
    assert len(eval_set["items"]) == items
    assert all("candidate" in item for item in eval_set["items"]), eval_set["items"]
    assert {c["category"] for c in eval_set["categories"]} == set(CATEGORIES)
    html_path = local_path(report_uris["html"])
    assert html_path is not None
    assert f"{MODEL}@v2" in html_path.read_text()
    assert v2.eval_report_uri == report_uris["html"]
    # The answers came from v2's engine; v1's (serving all along) generated nothing.
    assert seen.metrics, "no scrape of the staging replica"
    assert max(m.generation_tokens for m in seen.metrics) > 0
    assert engine_metrics(gated.v1_url).generation_tokens == 0
    # Load test: at least one step replayed against the replica, with figures.
    load = runs["load_test"]
    assert load.state in {"passed", "failed"}, summary
    steps = load.result.get("steps")
    assert steps, (summary, load.result)
    first = steps[0]
    assert first["requests"] > 0, first
    assert first["output_tokens_per_s"] > 0, first
    assert first["ttft_p95_s"] is not None, first
    assert first["arrival_rate"] == pytest.approx(
        GATE_CONFIG["load_test"]["start_tokens_per_s"] / TRACE_ANSWER_TOKENS
    )
    assert load.result["trace_requests"] == TRACE_REQUESTS
    assert not GateRun.objects.filter(version=v2, state__in=["pending", "running"])
    # The verdict is the load test's, either way (module docstring).
    if load.state == "passed":
        assert status == "ready", summary
        assert v2.load_test_tokens_per_s == load.result["tokens_per_s"] > 0
        assert v2.load_test_tokens_in_flight
        assert Pool.objects.get(version=v2, region=REGION).staging is False
    else:
        assert status == "rejected", summary
        assert v2.status_reason.startswith("load_test gate: "), v2.status_reason
        # Its reason says no step held: then none may have.
        assert not any(step["holds"] for step in steps), (v2.status_reason, figures)
        assert not Pool.objects.filter(version=v2).exists()
