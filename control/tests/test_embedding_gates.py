"""An embedding version's gates against a real simulated pooling replica over
HTTP: the retrieval eval passes on meaningful vectors and refuses random ones,
and the load test stores input tokens/s at the version's latency target.

``control.gates.run_gates`` runs in this process; the staging replica is a
``python -m simengine --runner pooling`` process, registered as the version's
serving replica (no node agent needed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from control import gates
from control.embedding_gates import embedding_load_test
from engine_nodes.models import Replica
from engine_nodes.weights import tree_digest
from localrun.processes import ROOT, Process, sim_replica
from models_registry import services as registry
from models_registry.domain.embedding_load_test import (
    EmbeddingLoadSettings,
    ModelledEmbeddingReplica,
    run_embedding_search,
)
from models_registry.models import GateRun, Model, ModelVersion, Pool
from simengine.embeddings import BATCH_BASE_MS, PER_TOKEN_MS
from tests.factories import version_body

if TYPE_CHECKING:
    from pytest_django import Settings

pytestmark = [pytest.mark.django_db, pytest.mark.e2e, pytest.mark.slow]

MODEL = "embed-small"
POOLING = ("--runner", "pooling", "--max-model-len", "512")
# A short search: the simulated replica stands for vLLM on two CPU cores, where a
# request of 16-64 texts takes about half a second alone.
SHORT = {"warmup_s": 0.5, "duration_s": 3.0}
TARGET_MS = 3000


@pytest.fixture
def storage(tmp_path: Path, settings: Settings) -> Path:
    settings.PLATFORM_STORAGE_ROOTS = [
        f"file://{tmp_path}/",
        f"file://{ROOT / 'platform' / 'evals'}/",
    ]
    settings.PLATFORM_GATE_REGION = "us-east"
    settings.PLATFORM_REGION_STORAGE = {}
    settings.PLATFORM_ENGINE_API_KEY = ""
    settings.PLATFORM_GATE_REPLICA_TIMEOUT_S = 5.0
    return tmp_path


def register(storage: Path, label: str, **engine_config: object) -> ModelVersion:
    if not Model.objects.filter(pk=MODEL).exists():
        registry.create_model(
            model_id=MODEL, kind="embedding", dimensions=384, max_input_tokens=512
        )
        Model.objects.filter(pk=MODEL).update(gate_config={"load_test": SHORT})
    root = storage / "registered" / label
    root.mkdir(parents=True)
    (root / "model.safetensors").write_bytes(label.encode())
    body = version_body(weights_uri=f"file://{root}/", weights_hash=tree_digest(root))
    body["engine_config"] = {
        "runner": "pooling",
        "latency_target_ms": TARGET_MS,
        **engine_config,
    }
    return registry.register_version(model_id=MODEL, version=label, **body)


def serve(version: ModelVersion, process: Process) -> None:
    """Make ``process`` the version's serving replica in the gate region."""
    Replica.objects.create(
        replica_id=f"{version.version}-staging",
        model_id=MODEL,
        version=version,
        region="us-east",
        node="test-node",
        url=process.url,
        state="serving",
    )


@pytest.fixture
def pooling(tmp_path: Path) -> Iterator[Process]:
    with sim_replica(tmp_path, *POOLING, model=MODEL) as process:
        yield process


def runs(version: ModelVersion) -> dict[str, GateRun]:
    return {r.kind: r for r in GateRun.objects.filter(version=version, attempt=1)}


def test_an_embedding_version_passes_its_own_gates_and_records_input_tokens(
    storage: Path, pooling: Process
) -> None:
    """GIVEN an embedding model's version on a pooling replica whose vectors
    mean something WHEN its gates run THEN the probe eval passes with the judge
    skipped for a stated reason, and the load test stores the input tokens/s
    of its best step under the 3 s target, with input tokens in flight."""
    version = register(storage, "v1")
    serve(version, pooling)

    assert gates.run_gates(version.pk, 1) == "ready"

    version.refresh_from_db()
    found = runs(version)
    assert {k: r.state for k, r in found.items()} == dict.fromkeys(
        ("weights", "eval", "load_test"), "passed"
    )
    evaluated = found["eval"].result
    assert evaluated["kind"] == "embedding"
    assert evaluated["sets"][0]["retrieval_accuracy"] == 1.0
    assert evaluated["sets"][0]["eval_set"].endswith("embedding-default.jsonl")
    assert set(evaluated["skipped"]) == {"judge", "live_comparison"}
    assert "skipped the judge" in found["eval"].detail
    load = found["load_test"].result
    assert load["unit"] == "input_tokens"
    assert load["latency_target_ms"] == TARGET_MS
    (best,) = [s for s in load["steps"] if s["concurrency"] == load["concurrency"]]
    assert best["holds"]
    top = max(s["input_tokens_per_s"] for s in load["steps"] if s["holds"])
    assert best["input_tokens_per_s"] >= 0.95 * top
    assert version.load_test_tokens_per_s == best["input_tokens_per_s"] > 0
    assert version.load_test_tokens_in_flight == round(best["tokens_in_flight"]) > 0
    assert best["latency_p95_s"] * 1000 < TARGET_MS
    assert load["steps"][-1]["holds"] is False  # the search went past the knee
    assert "input tokens/s" in found["load_test"].detail
    # The staging pool stays as the version's own.
    assert Pool.objects.filter(version=version, staging=False).count() == 1


def test_random_vectors_are_refused_with_the_retrieval_accuracy_named(
    storage: Path, tmp_path: Path
) -> None:
    version = register(storage, "v2", sim_embedding_random=True)
    with sim_replica(
        tmp_path, *POOLING, "--sim-embedding-random", model=MODEL
    ) as process:
        serve(version, process)
        assert gates.run_gates(version.pk, 1) == "rejected"

    version.refresh_from_db()
    assert version.status_reason.startswith("eval gate: ")
    assert "embedding-default.jsonl: retrieval accuracy 0." in version.status_reason
    assert "is under 0.90" in version.status_reason
    assert {k: r.state for k, r in runs(version).items()} == {
        "weights": "passed",
        "eval": "failed",
        "load_test": "skipped",
    }
    assert version.load_test_tokens_per_s is None
    assert not Pool.objects.filter(version=version).exists()


def test_vectors_of_the_wrong_size_are_refused(storage: Path, pooling: Process) -> None:
    version = register(storage, "v3")
    Model.objects.filter(pk=MODEL).update(dimensions=768)
    serve(version, pooling)

    assert gates.run_gates(version.pk, 1) == "rejected"

    version.refresh_from_db()
    assert "a vector has 384 values, the model's dimensions are 768" in (
        version.status_reason
    )


def test_a_target_no_step_can_hold_rejects_the_version(
    storage: Path, pooling: Process
) -> None:
    version = register(storage, "v4", latency_target_ms=50)
    serve(version, pooling)

    assert gates.run_gates(version.pk, 1) == "rejected"

    version.refresh_from_db()
    assert version.status_reason == (
        "load_test gate: no step of the load test held p95 latency under 50 ms "
        "with every request answered"
    )
    steps = runs(version)["load_test"].result["steps"]
    assert [s["concurrency"] for s in steps] == [1]
    assert version.load_test_tokens_per_s is None


def test_a_replica_that_serves_no_embeddings_fails_the_gate_with_its_answer(
    storage: Path, tmp_path: Path
) -> None:
    """A version registered without ``runner: pooling`` starts a generating
    replica, which answers /v1/embeddings with vLLM's 404: the eval gate says so."""
    version = register(storage, "v5")
    with sim_replica(tmp_path, model=MODEL) as process:
        serve(version, process)
        assert gates.run_gates(version.pk, 1) == "rejected"

    version.refresh_from_db()
    assert version.status_reason == (
        f"eval gate: the eval could not run: the replica at {process.url} answered "
        '404 to POST /v1/embeddings: {"detail":"Not Found"}'
    )


def test_the_live_search_agrees_with_the_modelled_replica(pooling: Process) -> None:
    """GIVEN one search, interpreted live against a simulated pooling replica and
    in virtual time against a model of its batcher WHEN both run at a 2 s target
    THEN they judge the same steps the same way (1 and 2 clients hold, p95 about
    0.9 and 1.6 s; 4 fail at about 3 s) and their answers agree within 10%.
    2026-12-06, 30 s windows on this 2-core box: 3,129 live, 3,189 modelled."""
    settings = EmbeddingLoadSettings(
        latency_target_ms=2000.0, warmup_s=1.0, duration_s=15.0
    )
    modelled = run_embedding_search(
        settings,
        ModelledEmbeddingReplica(
            base_s=BATCH_BASE_MS / 1000, per_token_s=PER_TOKEN_MS / 1000
        ).measure,
    )
    live = embedding_load_test(
        pooling.url, model=MODEL, api_key=None, settings=settings
    )

    assert [(s.concurrency, s.holds) for s in live.steps] == [
        (s.concurrency, s.holds) for s in modelled.steps
    ]
    assert [s.holds for s in live.steps] == [True, True, False]
    for ours, model in zip(live.steps, modelled.steps, strict=True):
        assert ours.input_tokens_per_s == pytest.approx(
            model.input_tokens_per_s, rel=0.10
        )
        assert ours.tokens_in_flight == pytest.approx(model.tokens_in_flight, rel=0.15)
    assert live.best is not None and modelled.best is not None
    assert live.best.concurrency == modelled.best.concurrency == 2
