"""The weights DaemonSet's command: the region's versions pulled, the node labelled."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from pytest_django import Settings

from engine_nodes.domain.k8s_placement import weights_label
from engine_nodes.management.commands import prefetch_weights
from engine_nodes.tests.test_agent import file_version
from models_registry.models import Model, Pool

pytestmark = pytest.mark.django_db


class Nodes:
    """One node's labels; records every call."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.calls: list[tuple[str, Any]] = []

    def read_node(self, name: str) -> Any:
        self.calls.append(("get", name))
        return SimpleNamespace(metadata=SimpleNamespace(labels=dict(self.labels)))

    def patch_node(self, name: str, body: Any) -> Any:
        self.calls.append(("patch", body))
        for key, value in body["metadata"]["labels"].items():
            if value is None:
                self.labels.pop(key, None)
            else:
                self.labels[key] = value


def test_prefetch_pulls_the_region_s_versions_and_labels_the_node(
    tmp_path: Path,
    chat_model: Model,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GIVEN a pool in region-a of a version on a file:// root, and a node
    labelled with a tree it no longer should hold
    WHEN prefetch_weights runs once for that node
    THEN the verified tree is in the cache under its hash, the node carries its
    label, the stale label is gone, others are untouched; a second run patches
    nothing."""
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    version = file_version(tmp_path)
    Pool.objects.create(
        model_id="chat-7b", version=version, region="region-a", min_replicas=0
    )
    stale = weights_label("cd" * 32)
    nodes = Nodes({stale: "verified", "nvidia.com/gpu.product": "NVIDIA-L4"})
    monkeypatch.setattr(prefetch_weights, "node_api", lambda **_: nodes)
    cache = tmp_path / "cache"
    argv = [
        "prefetch_weights",
        "--once",
        "--region=region-a",
        f"--cache-dir={cache}",
        "--node=gpu-1",
    ]
    out = io.StringIO()
    call_command(*argv, stdout=out)

    assert (cache / version.weights_hash / "model.safetensors").is_file()
    assert out.getvalue().strip() == f"{version.weights_hash}: verified"
    assert nodes.labels == {
        weights_label(version.weights_hash): "verified",
        "nvidia.com/gpu.product": "NVIDIA-L4",
    }
    nodes.calls.clear()
    call_command(*argv, stdout=io.StringIO())
    assert nodes.calls == [("get", "gpu-1")]


def test_prefetch_labels_nothing_it_could_not_verify(
    tmp_path: Path,
    chat_model: Model,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    version = file_version(tmp_path)
    (tmp_path / "weights" / "chat" / "model.safetensors").write_bytes(b"changed")
    Pool.objects.create(
        model_id="chat-7b", version=version, region="region-a", min_replicas=0
    )
    nodes = Nodes({})
    monkeypatch.setattr(prefetch_weights, "node_api", lambda **_: nodes)
    out = io.StringIO()
    call_command(
        "prefetch_weights",
        "--once",
        "--region=region-a",
        f"--cache-dir={tmp_path / 'cache'}",
        "--node=gpu-1",
        stdout=out,
    )
    assert out.getvalue().strip() == f"{version.weights_hash}: missing"
    assert not (tmp_path / "cache" / version.weights_hash).exists()
    assert nodes.labels == {}
    assert [call for call, _ in nodes.calls] == ["get"]
    with pytest.raises(CommandError, match="interval"):
        call_command("prefetch_weights", "--cache-dir=/x", "--interval-s=0")
