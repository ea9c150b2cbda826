"""Copying a version's weights to a region's storage root, and verifying them there."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from engine_nodes.weights import (
    WeightsError,
    WeightsMismatch,
    WeightsUriRefused,
    copy_weights,
    verify_weights_at,
)

FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "model-00001-of-00002.safetensors": bytes(range(256)) * 8192,  # 2 MiB: 2 chunks
    "model-00002-of-00002.safetensors": b"\x00" * 1000,
    "tokenizer/tokenizer.json": b'{"version": "1.0"}',
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def expected_hash(files: dict[str, bytes]) -> str:
    """The documented manifest, computed here without the code under test."""
    manifest = "".join(f"{p}\0{sha(files[p])}\n" for p in sorted(files))
    return sha(manifest.encode("utf-8"))


WEIGHTS_HASH = expected_hash(FILES)


class BitRotFileSystem(MemoryFileSystem):
    """An in-memory store whose objects lose a bit as they are moved: a bad bucket."""

    protocol = "bitrot"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return MemoryFileSystem._strip_protocol(path.removeprefix("bitrot://"))

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        super().mv(path1, path2, **kwargs)
        data = self.cat_file(path2)
        self.pipe_file(path2, bytes([data[0] ^ 1]) + data[1:])


fsspec.register_implementation("bitrot", BitRotFileSystem, clobber=True)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    return root


@pytest.fixture
def region_root(tmp_path: Path) -> Path:
    """The region's bucket, a local directory standing for one."""
    return tmp_path / "region-eu"


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A fresh prefix of fsspec's in-memory store, removed afterwards."""
    prefix = f"/h15-{uuid.uuid4().hex[:8]}"
    yield f"memory:/{prefix}"
    fs = fsspec.filesystem("memory")
    if fs.exists(prefix):
        fs.rm(prefix, recursive=True)


@pytest.fixture
def roots(store: Path, region_root: Path, memory_root: str) -> list[str]:
    return [
        "s3://models/",
        f"file://{store}/",
        f"file://{region_root}/",
        f"{memory_root}/",
        "bitrot://regions/",
    ]


@pytest.fixture
def source(store: Path) -> Path:
    directory = store / "chat-7b" / "v1"
    for relpath, data in FILES.items():
        path = directory / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return directory


def uri_of(path: Path) -> str:
    return f"file://{path}/"


def listing(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_copy_weights_copies_under_the_hash_and_verifies(
    source: Path, region_root: Path, roots: list[str]
) -> None:
    uri = copy_weights(
        uri_of(source), WEIGHTS_HASH, uri_of(region_root), storage_roots=roots
    )
    assert uri == f"file://{region_root}/{WEIGHTS_HASH}/"
    copied = region_root / WEIGHTS_HASH
    for relpath, data in FILES.items():
        assert (copied / relpath).read_bytes() == data
    # No temporary prefix is left beside it.
    assert [p.name for p in region_root.iterdir()] == [WEIGHTS_HASH]
    verify_weights_at(uri, WEIGHTS_HASH, storage_roots=roots)


def test_copy_weights_between_object_stores_through_fsspec(
    source: Path, memory_root: str, roots: list[str]
) -> None:
    fs = fsspec.filesystem("memory")
    staged = copy_weights(
        uri_of(source), WEIGHTS_HASH, f"{memory_root}/us", storage_roots=roots
    )
    assert staged == f"{memory_root}/us/{WEIGHTS_HASH}/"
    # And from one bucket to another, neither of them local.
    uri = copy_weights(staged, WEIGHTS_HASH, f"{memory_root}/eu/", storage_roots=roots)
    assert uri == f"{memory_root}/eu/{WEIGHTS_HASH}/"
    prefix = memory_root.removeprefix("memory:/")
    assert (
        fs.cat_file(f"{prefix}/eu/{WEIGHTS_HASH}/tokenizer/tokenizer.json")
        == (FILES["tokenizer/tokenizer.json"])
    )
    assert sorted(fs.ls(f"{prefix}/eu", detail=False)) == [
        f"{prefix}/eu/{WEIGHTS_HASH}"
    ]


def test_copy_weights_refuses_a_tampered_source_and_leaves_nothing(
    source: Path, region_root: Path, roots: list[str]
) -> None:
    (source / "model-00002-of-00002.safetensors").write_bytes(b"\x01" * 1000)
    with pytest.raises(WeightsMismatch) as caught:
        copy_weights(
            uri_of(source), WEIGHTS_HASH, uri_of(region_root), storage_roots=roots
        )
    assert caught.value.expected == WEIGHTS_HASH
    assert caught.value.actual != WEIGHTS_HASH
    # Found in the source, before anything was moved under the hash name.
    assert str(caught.value).startswith(uri_of(source))
    assert not region_root.exists() or listing(region_root) == []


def test_copy_weights_leaves_a_wrong_tree_at_the_destination_alone(
    source: Path, region_root: Path, roots: list[str]
) -> None:
    """GIVEN a tree under the hash name whose files are not the registered ones
    THEN the copy raises naming both digests, and the tree is left as it was
    (replicas may be serving from it): that region stays not ready.
    """
    wrong = region_root / WEIGHTS_HASH
    wrong.mkdir(parents=True)
    (wrong / "config.json").write_bytes(b"someone else's")
    actual = expected_hash({"config.json": b"someone else's"})
    with pytest.raises(WeightsMismatch) as caught:
        copy_weights(
            uri_of(source), WEIGHTS_HASH, uri_of(region_root), storage_roots=roots
        )
    assert (caught.value.expected, caught.value.actual) == (WEIGHTS_HASH, actual)
    assert WEIGHTS_HASH in str(caught.value)
    assert actual in str(caught.value)
    assert listing(region_root) == [WEIGHTS_HASH, f"{WEIGHTS_HASH}/config.json"]
    assert (wrong / "config.json").read_bytes() == b"someone else's"


def test_copy_weights_reuses_a_right_tree_without_copying(
    source: Path, region_root: Path, roots: list[str]
) -> None:
    first = copy_weights(
        uri_of(source), WEIGHTS_HASH, uri_of(region_root), storage_roots=roots
    )
    copied = region_root / WEIGHTS_HASH / "config.json"
    before = copied.stat()
    # With the source gone, only a copy already there can satisfy the call.
    for path in sorted(source.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    source.rmdir()
    again = copy_weights(
        uri_of(source), WEIGHTS_HASH, uri_of(region_root), storage_roots=roots
    )
    assert again == first
    after = copied.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_copy_weights_removes_a_copy_that_does_not_read_back(
    source: Path, roots: list[str]
) -> None:
    fs = BitRotFileSystem()
    try:
        with pytest.raises(WeightsMismatch) as caught:
            copy_weights(
                uri_of(source), WEIGHTS_HASH, "bitrot://regions/eu", storage_roots=roots
            )
        assert caught.value.expected == WEIGHTS_HASH
        assert f"bitrot://regions/eu/{WEIGHTS_HASH}/" in str(caught.value)
        assert fs.find("/regions") == []
    finally:
        BitRotFileSystem.store.clear()


@pytest.mark.parametrize(
    ("source_uri", "dest_root", "match"),
    [
        ("file:///etc/", "REGION", "storage root"),
        ("SOURCE", "file:///tmp/elsewhere/", "storage root"),
        ("SOURCE", "s3://models-private/eu/", "storage root"),
        ("SOURCE", "REGION/../../outside", r"'\.\.'"),
        ("STORE/chat-7b/../..", "REGION", r"'\.\.'"),
    ],
)
def test_copy_weights_refuses_uris_outside_the_roots(
    source: Path,
    store: Path,
    region_root: Path,
    tmp_path: Path,
    roots: list[str],
    source_uri: str,
    dest_root: str,
    match: str,
) -> None:
    def expand(uri: str) -> str:
        return (
            uri.replace("SOURCE", uri_of(source))
            .replace("STORE", f"file://{store}")
            .replace("REGION", f"file://{region_root}")
        )

    with pytest.raises(WeightsUriRefused, match=match):
        copy_weights(
            expand(source_uri), WEIGHTS_HASH, expand(dest_root), storage_roots=roots
        )
    assert not region_root.exists()
    assert not (tmp_path / "outside").exists()


def test_copy_weights_refuses_a_destination_linked_out_of_the_roots(
    source: Path, region_root: Path, tmp_path: Path, roots: list[str]
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    region_root.mkdir()
    (region_root / "eu").symlink_to(outside)
    with pytest.raises(WeightsUriRefused, match="resolves outside"):
        copy_weights(
            uri_of(source),
            WEIGHTS_HASH,
            uri_of(region_root / "eu"),
            storage_roots=roots,
        )
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_copy_weights_refuses_a_symlink_in_the_source(
    source: Path, region_root: Path, tmp_path: Path, roots: list[str], kind: str
) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "key").write_bytes(b"secret")
    if kind == "file":
        (source / "extra.json").symlink_to(secrets / "key")
    else:
        (source / "extra").symlink_to(secrets)
    with pytest.raises(WeightsError, match="symlink"):
        copy_weights(
            uri_of(source), WEIGHTS_HASH, uri_of(region_root), storage_roots=roots
        )
    assert not region_root.exists() or listing(region_root) == []


@pytest.mark.parametrize("key", ["a//b", "y/../z"])
def test_copy_weights_refuses_unsafe_object_names(
    memory_root: str, region_root: Path, roots: list[str], key: str
) -> None:
    fs = fsspec.filesystem("memory")
    prefix = memory_root.removeprefix("memory:/")
    fs.pipe(f"{prefix}/src/config.json", b"{}")
    fs.pipe(f"{prefix}/src/{key}", b"x")
    with pytest.raises(WeightsError, match="unsafe name"):
        copy_weights(
            f"{memory_root}/src/",
            WEIGHTS_HASH,
            uri_of(region_root),
            storage_roots=roots,
        )
    assert not region_root.exists() or listing(region_root) == []


def test_copy_weights_rejects_a_hash_that_could_name_another_directory(
    source: Path, region_root: Path, roots: list[str]
) -> None:
    with pytest.raises(ValueError, match="64 lowercase hex"):
        copy_weights(uri_of(source), "../x", uri_of(region_root), storage_roots=roots)


def test_verify_weights_at_names_both_digests_or_the_missing_tree(
    source: Path, store: Path, roots: list[str]
) -> None:
    verify_weights_at(uri_of(source), WEIGHTS_HASH, storage_roots=roots)
    (source / "config.json").write_bytes(b"bit rot")
    with pytest.raises(WeightsMismatch) as caught:
        verify_weights_at(uri_of(source), WEIGHTS_HASH, storage_roots=roots)
    assert caught.value.expected == WEIGHTS_HASH
    assert caught.value.actual in str(caught.value)
    with pytest.raises(WeightsError, match="no weights tree"):
        verify_weights_at(uri_of(store / "absent"), WEIGHTS_HASH, storage_roots=roots)
    with pytest.raises(WeightsUriRefused):
        verify_weights_at("file:///etc/", WEIGHTS_HASH, storage_roots=roots)
