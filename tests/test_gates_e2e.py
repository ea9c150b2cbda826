"""The version gates end to end: register, the gates run, ready, canary allowed;
a degraded version is rejected with a report that says why.

Real processes: the gateway (which also serves the control plane), the node agent
and its simulated replicas, a Celery worker with beat (the gates run on its
``gates`` queue), PostgreSQL and Redis; registration and rollouts go through the
admin REST API over HTTP. Every eval prompt goes through the gateway, pinned to a
version, at the batch tier, from the gates' own team; the judge is ``reason-70b``,
a model served by the platform like any other.

GIVEN chat-7b@v1 live (a simulated replica of quality 0.9) and the judge live,
WHEN chat-7b@v2 (the same quality) is registered, THEN its weights are copied to
the region's storage root and verified, a staging replica starts, its eval passes
against v1, the load test measures it, and it is ready: a 10% canary is accepted
and the staging pool stays as its pool. WHEN chat-7b@v3 (quality 0.5) is
registered, THEN its eval gate rejects it naming the categories that dropped, the
report (JSON and HTML) says so, its staging replica drains, and a rollout of it
is refused with the gates' reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import httpx
import pytest
from django.core.management import call_command

from engine_nodes.models import Replica
from engine_nodes.weights import tree_digest
from localrun.processes import wait_until
from localrun.seeding import VERSION_BODY, ModelSeed, VersionSeed, digest, version_body
from models_registry.models import (
    GateRun,
    JudgeItem,
    Model,
    ModelVersion,
    Pool,
    VersionRegion,
)
from tests.live import LivePlatform, start_platform

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GOOD = 0.9
BAD = 0.5
# Small, so the test stays short: 12 items per category (live and an equally good
# candidate answer alike, so the interval is 0 wide), 12 labelled pairs.
ITEMS_PER_CATEGORY = 12
LABELLED = 12
GATE_CONFIG: dict[str, Any] = {
    "min_labels": 10,
    # One short step, well under an a100-8b replica's 2,500 tokens/s: the gate's
    # wiring (staging replica, engine key, figures saved) is what this test holds;
    # stepping to a knee is drills/tests/test_load_test_gate.py's.
    "load_test": {
        "start_tokens_per_s": 800,
        "step_tokens_per_s": 400,
        "max_tokens_per_s": 800,
        "warmup_s": 2,
        "duration_s": 5,
        "drain_s": 20,
    },
}
GATES_TIMEOUT_S = 300


@pytest.fixture
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("storage")


@pytest.fixture
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    storage: Path,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("gates")
    eval_set = storage / "evals" / "chat-small.jsonl"
    call_command(
        "make_eval_set",
        "--items",
        str(ITEMS_PER_CATEGORY),
        "--labelled",
        str(LABELLED),
        "--output",
        str(eval_set),
    )
    judge = ModelSeed(
        model_id="reason-70b",
        versions=(
            VersionSeed(
                "v1",
                version_body(
                    weights_uri="s3://models/reason-70b/",
                    weights_hash=digest("judge weights"),
                    engine_config={**VERSION_BODY["engine_config"], "sim_quality": 1.0},
                ),
                min_replicas=1,
                max_replicas=1,
            ),
        ),
    )
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 1},
            engine_config={"sim_quality": GOOD},
            autoscaler=True,
            extra_models=(judge,),
            PLATFORM_STORAGE_ROOTS=f"file://{storage}/,s3://models/",
            PLATFORM_REGION_STORAGE=f"e2e=file://{storage}/regions/e2e",
            PLATFORM_EVAL_REPORT_ROOT=f"file://{storage}/reports",
            PLATFORM_DEFAULT_EVAL_SET=f"file://{eval_set}",
            PLATFORM_GATE_REPLICA_TIMEOUT_S="120",
            # The worker counts as up at its first autoscaler tick: a second
            # away, not five (the pools here are of fixed sizes).
            PLATFORM_AUTOSCALE_INTERVAL_S="1",
        ) as live,
    ):
        Model.objects.filter(pk="chat-7b").update(gate_config=GATE_CONFIG)
        yield live


def weights(storage: Path, label: str) -> tuple[str, str]:
    """Write a small weights tree for ``label``; return its URI and digest."""
    root = storage / "registered" / label
    root.mkdir(parents=True)
    (root / "model.safetensors").write_bytes(f"chat-7b {label} weights".encode())
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return f"file://{root}/", tree_digest(root)


def register(
    api: httpx.Client, storage: Path, label: str, quality: float
) -> dict[str, Any]:
    uri, digest_ = weights(storage, label)
    response = api.post(
        "/admin/models/chat-7b/versions",
        json=version_body(
            weights_uri=uri,
            weights_hash=digest_,
            engine_config={**VERSION_BODY["engine_config"], "sim_quality": quality},
        ),
    )
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    assert body["status"] == "registered"
    return body


@pytest.fixture
def api(platform: LivePlatform) -> Iterator[httpx.Client]:
    """The control plane with an admin token; its writes are checked against the
    audit trail once the test is done (the platform holds the database open)."""
    with platform.admin_api("e2e") as client:
        yield client


def settled(api: httpx.Client, label: str) -> dict[str, Any]:
    """Wait until the gates of ``label`` end; return their state."""
    url = f"/admin/models/chat-7b/versions/{label}/gates"
    seen: dict[str, Any] = {}

    def done() -> bool:
        seen.update(api.get(url).json())
        return seen["status"] in {"ready", "rejected"}

    wait_until(
        done, timeout_s=GATES_TIMEOUT_S, interval_s=1.0, message=f"{label}'s gates"
    )
    return seen


def local(uri: str) -> Path:
    return Path(unquote(urlsplit(uri).path))


def test_a_good_version_passes_its_gates_and_a_degraded_one_is_rejected(
    api: httpx.Client, storage: Path
) -> None:
    register(api, storage, "v2", GOOD)
    # Not ready yet: a canary is refused while the gates run.
    early = api.put(
        "/admin/models/chat-7b/rollout",
        json={"version": "v2", "stage": "canary", "percent": 10},
    )
    assert early.status_code == 409, early.text
    assert early.json()["error"]["code"] == "version_not_ready"

    gates = settled(api, "v2")

    assert gates["status"] == "ready", json.dumps(gates, indent=1)
    runs = {r["gate"]: r for r in gates["runs"] if r["attempt"] == 1}
    assert {g: r["state"] for g, r in runs.items()} == dict.fromkeys(
        ("weights", "eval", "load_test"), "passed"
    )
    v2 = ModelVersion.objects.get(model_id="chat-7b", version="v2")
    # Weights: copied under the region's root and verified there.
    copy = VersionRegion.objects.get(version=v2, region="e2e")
    assert copy.state == "ready"
    assert copy.uri == f"file://{storage}/regions/e2e/{v2.weights_hash}/"
    assert tree_digest(local(copy.uri)) == v2.weights_hash
    # Eval: compared with v1 through the gateway, judged by a trusted judge.
    report = json.loads(local(runs["eval"]["result"]["report"]["json"]).read_text())
    assert report["passed"] is True
    assert report["live"] == "chat-7b@v1"
    assert report["judge"] == "reason-70b"
    (chat_set,) = report["sets"]
    assert chat_set["mode"] == "compare"
    assert chat_set["judge"]["trusted"] is True
    assert chat_set["counts"]["items"] == 4 * ITEMS_PER_CATEGORY
    html = local(runs["eval"]["result"]["report"]["html"]).read_text()
    assert "chat-7b@v2" in html
    assert v2.eval_report_uri == runs["eval"]["result"]["report"]["html"]
    # Load test: its step held on the staging replica; its figures are saved.
    load = runs["load_test"]["result"]
    (step,) = load["steps"]
    assert step["holds"] and step["offered_tokens_per_s"] == pytest.approx(800)
    assert runs["load_test"]["progress"] == {"done": 1, "total": 1}
    saved = v2.load_test_tokens_per_s
    assert saved == load["tokens_per_s"] == step["output_tokens_per_s"]
    assert saved is not None and 0.8 * 800 <= saved <= 1.2 * 800
    assert v2.load_test_tokens_in_flight == int(load["tokens_in_flight"]) > 0
    assert v2.load_test_prefix_hit_rate == load["prefix_hit_rate"] is not None
    # The gates' key is revoked; the staging pool stays as v2's pool (warm canary).
    pool = Pool.objects.get(version=v2, region="e2e")
    assert pool.staging is False

    canary = api.put(
        "/admin/models/chat-7b/rollout",
        json={"version": "v2", "stage": "canary", "percent": 10},
    )
    assert canary.status_code == 200, canary.text
    assert Model.objects.get(pk="chat-7b").canary_version_id == v2.pk

    register(api, storage, "v3", BAD)
    gates = settled(api, "v3")

    assert gates["status"] == "rejected", json.dumps(gates, indent=1)
    runs = {r["gate"]: r for r in gates["runs"] if r["attempt"] == 1}
    assert (runs["weights"]["state"], runs["eval"]["state"]) == ("passed", "failed")
    assert runs["load_test"]["state"] == "skipped"
    assert gates["status_reason"].startswith("eval gate: ")
    # The reasons name what dropped, with the interval and the threshold.
    assert "a real drop of" in gates["status_reason"]
    report = json.loads(local(runs["eval"]["result"]["report"]["json"]).read_text())
    assert report["passed"] is False
    failed = {c["category"] for c in report["sets"][0]["categories"] if not c["passed"]}
    assert failed, report["sets"][0]["categories"]
    assert all(c in gates["status_reason"] for c in failed)
    # The judge's comparisons of v3's differing answers wait for people to label
    # them (a sample), blind; none is labelled yet, so the agreement is empty.
    kept = JudgeItem.objects.filter(gate_run__version__version="v3")
    assert 0 < kept.count() <= 20
    assert set(kept.values_list("judge", "candidate", "live", "label")) == {
        ("reason-70b@v1", "chat-7b@v3", "chat-7b@v1", "")
    }
    assert gates["judge_agreement"]["judge"] == "reason-70b@v1"
    assert gates["judge_agreement"]["labels"] == 0
    # Its staging replica drains and goes; its pool is removed.
    v3 = ModelVersion.objects.get(model_id="chat-7b", version="v3")
    assert not Pool.objects.filter(version=v3).exists()
    wait_until(
        lambda: not Replica.objects.filter(version=v3).exclude(state="gone").exists(),
        timeout_s=60,
        message="v3's staging replica to stop",
    )
    refused = api.put(
        "/admin/models/chat-7b/rollout",
        json={"version": "v3", "stage": "canary", "percent": 10},
    )
    assert refused.status_code == 409, refused.text
    assert "was rejected by its gates: eval gate" in refused.json()["error"]["message"]
    assert GateRun.objects.filter(version=v3, state="running").count() == 0


def register_at(
    api: httpx.Client,
    storage: Path,
    label: str,
    precision: str,
    maths_quality: float = GOOD,
) -> None:
    """Register ``label`` in ``precision``, its maths answered at ``maths_quality``."""
    uri, digest_ = weights(storage, label)
    response = api.post(
        "/admin/models/chat-7b/versions",
        json=version_body(
            weights_uri=uri,
            weights_hash=digest_,
            precision=precision,
            engine_config={
                **VERSION_BODY["engine_config"],
                "sim_profile": "a100-8b",
                "sim_quality": GOOD,
                "sim_quality_by_category": {"maths": maths_quality},
            },
        ),
    )
    assert response.status_code == 201, response.text


def test_an_int8_version_whose_maths_drops_is_rejected_beside_fp16_and_4bit(
    api: httpx.Client, storage: Path
) -> None:
    """GIVEN chat-7b@v1 live in FP16 and a 4-bit v2 that passed its gates, WHEN an
    INT8 v3 whose maths alone is worse is registered, THEN its eval gate rejects it
    naming maths, with the three precisions side by side at the gates endpoint and
    in the report; WHEN an INT8 v4 as good as live is registered, THEN it is ready,
    with the same three-way table."""
    register_at(api, storage, "v2", "4bit")
    assert settled(api, "v2")["status"] == "ready"

    register_at(api, storage, "v3", "int8", maths_quality=0.3)
    gates = settled(api, "v3")

    assert gates["status"] == "rejected", json.dumps(gates, indent=1)
    assert "precision int8 against live fp16: maths drops" in gates["status_reason"]
    runs = {r["gate"]: r for r in gates["runs"] if r["attempt"] == 1}
    (table,) = runs["eval"]["result"]["precision"]
    assert table["precisions"] == ["fp16", "int8", "4bit"]
    assert [c["version"] for c in table["columns"]] == [
        "chat-7b@v1",
        "chat-7b@v3",
        "chat-7b@v2",
    ]
    rows = {r["category"]: r for r in table["categories"]}
    assert {c for c, r in rows.items() if not r["passed"]} == {"maths"}
    assert rows["maths"]["drops"]["int8"] > 0.3
    assert rows["maths"]["drops"]["4bit"] == 0
    html = local(runs["eval"]["result"]["report"]["html"]).read_text()
    assert "Precisions side by side" in html

    register_at(api, storage, "v4", "int8")
    gates = settled(api, "v4")

    assert gates["status"] == "ready", json.dumps(gates, indent=1)
    runs = {r["gate"]: r for r in gates["runs"] if r["attempt"] == 1}
    (table,) = runs["eval"]["result"]["precision"]
    assert table["passed"] is True
    assert table["precisions"] == ["fp16", "int8", "4bit"]
    assert all(r["scores"]["4bit"] is not None for r in table["categories"])
