"""The gates' orchestration against the real database: what each failure leaves.

These run ``control.gates.run_gates`` in this process, on paths that end
before a gateway is needed (the weights gate, a malformed eval set, a judge that
cannot judge); the whole chain with real processes is ``test_gates_e2e``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from control import gates
from engine_nodes.weights import tree_digest
from localrun.processes import ROOT
from models_registry import services as registry
from models_registry.models import GateRun, Model, ModelVersion, Pool, VersionRegion
from rollouts.services import set_alias
from tests.factories import digest, version_body

if TYPE_CHECKING:
    from pytest_django import Settings

pytestmark = pytest.mark.django_db


def weights_tree(root: Path, content: bytes) -> tuple[str, str]:
    """Write a one-file weights tree; return its URI and digest."""
    root.mkdir(parents=True)
    (root / "model.safetensors").write_bytes(content)
    return f"file://{root}/", tree_digest(root)


@pytest.fixture
def storage(tmp_path: Path, settings: Settings) -> Path:
    # The default eval set ships under platform/evals/.
    settings.PLATFORM_STORAGE_ROOTS = [
        f"file://{tmp_path}/",
        f"file://{ROOT / 'platform' / 'evals'}/",
    ]
    settings.PLATFORM_GATE_REGION = "us-east"
    settings.PLATFORM_REGION_STORAGE = {
        "us-east": f"file://{tmp_path}/us-east",
        "eu-west": f"file://{tmp_path}/eu-west",
    }
    return tmp_path


def register(storage: Path, chat_model: Model, *, label: str = "v2") -> ModelVersion:
    """Register ``label`` as a candidate, with chat-7b@v1 live (accepted) before it:
    the eval gate compares with it, so it asks the judge."""
    if not ModelVersion.objects.filter(model_id="chat-7b", version="v1").exists():
        live_uri, live_digest = weights_tree(storage / "registered" / "v1", b"live")
        registry.register_version(
            model_id="chat-7b",
            version="v1",
            **version_body(weights_uri=live_uri, weights_hash=live_digest),
        )
        registry.accept_version(model_id="chat-7b", version="v1", by="t", reason="t")
        set_alias(model_id="chat-7b", version="v1")
    uri, digest = weights_tree(
        storage / "registered" / label, b"weights " + label.encode()
    )
    return registry.register_version(
        model_id="chat-7b",
        version=label,
        **version_body(weights_uri=uri, weights_hash=digest),
    )


def states(version: ModelVersion, attempt: int = 1) -> dict[str, str]:
    return dict(
        GateRun.objects.filter(version=version, attempt=attempt).values_list(
            "kind", "state"
        )
    )


def test_a_bad_copy_in_one_region_leaves_that_region_not_ready(
    storage: Path, chat_model: Model, settings: Settings
) -> None:
    """GIVEN eu-west already holds a different tree under the version's hash
    WHEN the gates run THEN us-east gets a verified copy and is ready, eu-west is
    failed with both digests named, and its tree is left as it was; the weights
    gate passes (the gates run in us-east) and the eval gate runs next."""
    version = register(storage, chat_model)
    squatter = storage / "eu-west" / version.weights_hash
    squatter.mkdir(parents=True)
    (squatter / "model.safetensors").write_bytes(b"something else")
    # The eval gate then stops at a judge that does not exist: no gateway needed.
    Model.objects.filter(pk="chat-7b").update(gate_config={"judge_model": "nobody"})

    assert gates.run_gates(version.pk, 1) == "rejected"

    regions = {r.region: r for r in VersionRegion.objects.filter(version=version)}
    assert regions["us-east"].state == "ready"
    assert regions["us-east"].uri == f"file://{storage}/us-east/{version.weights_hash}/"
    assert (
        tree_digest(storage / "us-east" / version.weights_hash) == version.weights_hash
    )
    assert regions["eu-west"].state == "failed"
    assert version.weights_hash in regions["eu-west"].detail
    assert (squatter / "model.safetensors").read_bytes() == b"something else"
    assert states(version) == {
        "weights": "passed",
        "eval": "failed",
        "load_test": "skipped",
    }
    weights_run = GateRun.objects.get(version=version, kind="weights")
    assert weights_run.detail == "ready in us-east; not ready in eu-west"


def test_weights_that_do_not_match_their_hash_reject_the_version(
    storage: Path, chat_model: Model
) -> None:
    version = register(storage, chat_model)
    (storage / "registered" / "v2" / "model.safetensors").write_bytes(b"tampered")

    assert gates.run_gates(version.pk, 1) == "rejected"

    version.refresh_from_db()
    assert version.status == "rejected"
    assert version.status_reason.startswith(
        "weights gate: the weights are not ready in us-east, where the gates run"
    )
    assert states(version) == {
        "weights": "failed",
        "eval": "skipped",
        "load_test": "skipped",
    }
    assert {r.state for r in VersionRegion.objects.filter(version=version)} == {
        "failed"
    }
    assert not (storage / "us-east" / version.weights_hash).exists()


def test_a_malformed_eval_line_fails_the_gate_naming_file_and_line(
    storage: Path, chat_model: Model, settings: Settings
) -> None:
    eval_set = storage / "evals" / "broken.jsonl"
    eval_set.parent.mkdir()
    good = (
        '{"id": "a", "messages": [{"role": "user", "content": "Reply with exactly '
        'this word: lantern"}], "reference": "lantern", "category": "general"}'
    )
    eval_set.write_text(good + "\n" + '{"id": "b", "messages": []}\n')
    Model.objects.filter(pk="chat-7b").update(
        gate_config={"eval_set_uri": f"file://{eval_set}"}
    )
    version = register(storage, chat_model)

    assert gates.run_gates(version.pk, 1) == "rejected"

    version.refresh_from_db()
    assert f"{eval_set}, line 2" in version.status_reason
    assert version.status_reason.startswith("eval gate: eval set ")
    eval_run = GateRun.objects.get(version=version, kind="eval")
    assert eval_run.state == "failed"
    assert "line 2" in eval_run.detail
    # It failed before it asked for a staging replica.
    assert not Pool.objects.filter(version=version).exists()


@pytest.mark.parametrize(
    ("judge", "why"),
    [
        ("nobody", "the judge nobody is not a registered model"),
        ("reason-70b", "the judge reason-70b has no live version that is ready"),
    ],
)
def test_a_judge_that_cannot_judge_fails_the_gate_closed(
    storage: Path, chat_model: Model, judge: str, why: str
) -> None:
    registry.create_model(model_id="reason-70b")
    Model.objects.filter(pk="chat-7b").update(gate_config={"judge_model": judge})
    version = register(storage, chat_model)

    gates.run_gates(version.pk, 1)

    version.refresh_from_db()
    assert version.status == "rejected"
    assert version.status_reason == f"eval gate: {why}"


def test_an_eval_set_outside_the_storage_roots_is_refused(
    storage: Path, chat_model: Model
) -> None:
    Model.objects.filter(pk="chat-7b").update(
        gate_config={"eval_set_uri": "file:///etc/passwd"}
    )
    version = register(storage, chat_model)

    gates.run_gates(version.pk, 1)

    version.refresh_from_db()
    assert "must lie under a configured storage root" in version.status_reason


def test_an_accepted_or_superseded_attempt_does_nothing(
    storage: Path, chat_model: Model
) -> None:
    version = register(storage, chat_model)
    registry.accept_version(model_id="chat-7b", version="v2", by="ops", reason="test")

    assert gates.run_gates(version.pk, 1) == "ready"
    assert not VersionRegion.objects.filter(version=version).exists()
    assert states(version) == dict.fromkeys(["weights", "eval", "load_test"], "skipped")


def test_a_redelivered_attempt_does_not_run_a_passed_gate_again(
    storage: Path, chat_model: Model
) -> None:
    """A worker that died after the weights gate: the task runs again, skips the
    weights (passed in this attempt) and goes on with the eval gate."""
    version = register(storage, chat_model)
    GateRun.objects.filter(version=version, kind="weights").update(
        state="passed", detail="passed before the worker died"
    )
    Model.objects.filter(pk="chat-7b").update(gate_config={"judge_model": "nobody"})

    gates.run_gates(version.pk, 1)

    assert not VersionRegion.objects.filter(version=version).exists()
    weights_run = GateRun.objects.get(version=version, kind="weights")
    assert weights_run.detail == "passed before the worker died"
    assert states(version)["eval"] == "failed"


def test_a_first_version_needs_no_judge(
    storage: Path, chat_model: Model, settings: Settings
) -> None:
    """No live version to compare with: the candidate is held to the floors and
    the judge is not asked, so a judge that does not exist (yet: a judge model's
    own first version) does not stop it; here it then waits for its staging
    replica, which no agent starts."""
    settings.PLATFORM_GATE_REPLICA_TIMEOUT_S = 0.2
    Model.objects.filter(pk="chat-7b").update(gate_config={"judge_model": "nobody"})
    uri, digest = weights_tree(storage / "registered" / "first", b"first")
    version = registry.register_version(
        model_id="chat-7b", **version_body(weights_uri=uri, weights_hash=digest)
    )

    gates.run_gates(version.pk, 1)

    version.refresh_from_db()
    assert "judge" not in version.status_reason
    assert version.status_reason.startswith(
        "eval gate: no replica of chat-7b@v1 served in us-east"
    )
    # The staging pool it asked for goes with the rejection.
    assert not Pool.objects.filter(version=version).exists()


def test_a_change_of_precision_asks_a_ready_version_of_each_other_precision(
    chat_model: Model,
) -> None:
    def version(label: str, precision: str, *, ready: bool) -> ModelVersion:
        created = registry.register_version(
            model_id="chat-7b",
            version=label,
            **version_body(weights_hash=digest(label), precision=precision),
        )
        if ready:
            registry.accept_version(
                model_id="chat-7b", version=label, by="t", reason="t"
            )
        return created

    live = version("v1", "fp16", ready=True)
    version("v2", "4bit", ready=True)
    version("v3", "4bit", ready=False)  # newer, but nothing serves it
    candidate = version("v4", "int8", ready=False)
    same = version("v5", "fp16", ready=False)

    plan = gates._precision_plan(candidate, live)

    assert plan is not None
    assert (plan.candidate, plan.live) == ("int8", "fp16")
    assert plan.others == {"4bit": "chat-7b@v2"}
    assert plan.missing == {}
    assert gates._precision_plan(same, live) is None
    # With no ready 4-bit version, the report says why it is not measured.
    ModelVersion.objects.filter(version="v2").update(status="rejected")
    plan = gates._precision_plan(candidate, live)
    assert plan is not None and plan.others == {}
    assert "chat-7b@v3" in plan.missing["4bit"]
