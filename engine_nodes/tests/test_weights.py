"""Tests for the weights digest and for pulling weights into the node cache."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from engine_nodes.domain.weights import (
    is_manifest_path,
    manifest_digest,
    manifest_text,
)
from engine_nodes.weights import (
    UnsupportedScheme,
    WeightsError,
    WeightsMismatch,
    WeightsUriRefused,
    file_sha256,
    local_identity,
    local_path,
    pull_weights,
    read_chat_template,
    tokenizer_digest,
    tree_digest,
    verify_weights,
)

FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "model-00001-of-00002.safetensors": bytes(range(256)) * 4096,
    "model-00002-of-00002.safetensors": b"\x00" * 1000,
    "tokenizer/tokenizer.json": b'{"version": "1.0"}',
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def expected_hash(files: dict[str, bytes]) -> str:
    """The documented manifest, computed here without the code under test."""
    manifest = "".join(f"{p}\0{sha(files[p])}\n" for p in sorted(files))
    return sha(manifest.encode("utf-8"))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    return root


@pytest.fixture
def roots(store: Path) -> list[str]:
    return ["s3://models/", f"file://{store}/"]


@pytest.fixture
def source(store: Path) -> Path:
    directory = store / "chat-7b" / "v1"
    for relpath, data in FILES.items():
        path = directory / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return directory


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def uri_of(path: Path) -> str:
    return f"file://{path}"


# -- the pure digest ---------------------------------------------------------


def test_manifest_digest_matches_documented_format() -> None:
    entries = [("b.bin", "1" * 64), ("a/x.json", "0" * 64)]
    manifest = f"a/x.json\0{'0' * 64}\nb.bin\0{'1' * 64}\n"
    assert manifest_text(entries) == manifest
    assert manifest_digest(entries) == sha(manifest.encode())


def test_manifest_digest_is_independent_of_input_order() -> None:
    entries = [(p, sha(data)) for p, data in FILES.items()]
    assert manifest_digest(entries) == manifest_digest(reversed(entries))
    assert manifest_digest(entries) == expected_hash(FILES)


def test_manifest_digest_changes_when_a_file_is_renamed() -> None:
    assert manifest_digest([("a", "0" * 64)]) != manifest_digest([("b", "0" * 64)])


@pytest.mark.parametrize(
    "entries",
    [
        [("a", "0" * 64), ("a", "1" * 64)],
        [("a", "0" * 63)],
        [("a", "A" * 64)],
        [("../a", "0" * 64)],
        [("/abs", "0" * 64)],
        [("a//b", "0" * 64)],
        [("a\nb", "0" * 64)],
    ],
)
def test_manifest_digest_rejects_bad_entries(entries: list[tuple[str, str]]) -> None:
    with pytest.raises(ValueError):
        manifest_digest(entries)


@pytest.mark.parametrize(
    ("relpath", "ok"),
    [
        ("model.safetensors", True),
        ("tokenizer/tokenizer.json", True),
        ("", False),
        ("./a", False),
        ("a/../b", False),
        ("a\\b", False),
        ("a\0b", False),
        ("bad\udcff", False),
    ],
)
def test_is_manifest_path_accepts_only_clean_relative_paths(
    relpath: str, ok: bool
) -> None:
    assert is_manifest_path(relpath) is ok


# -- hashing files and trees -------------------------------------------------


def test_file_sha256_spans_many_chunks(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    data = bytes(range(251)) * 12_000  # ~2.9 MiB: three 1 MiB chunks
    path.write_bytes(data)
    assert file_sha256(path) == sha(data)


def test_tree_digest_matches_the_manifest(source: Path) -> None:
    assert tree_digest(source) == expected_hash(FILES)


def test_verify_weights_false_for_missing_or_wrong_tree(
    source: Path, tmp_path: Path
) -> None:
    assert verify_weights(source, expected_hash(FILES))
    assert not verify_weights(tmp_path / "absent", expected_hash(FILES))
    assert not verify_weights(source, "0" * 64)


# -- pulling -------------------------------------------------------------------


def test_pull_weights_copies_and_verifies(
    source: Path, cache: Path, roots: list[str]
) -> None:
    weights_hash = expected_hash(FILES)
    path = pull_weights(
        uri_of(source), weights_hash, cache_dir=cache, storage_roots=roots
    )
    assert path == cache / weights_hash
    for relpath, data in FILES.items():
        assert (path / relpath).read_bytes() == data
    assert [p.name for p in cache.iterdir()] == [weights_hash]


def test_pull_weights_reuses_a_verified_cache(
    source: Path, cache: Path, roots: list[str]
) -> None:
    weights_hash = expected_hash(FILES)
    first = pull_weights(
        uri_of(source), weights_hash, cache_dir=cache, storage_roots=roots
    )
    # A tampered source would fail a fresh copy; the cached tree is used instead.
    (source / "config.json").write_bytes(b"tampered")
    second = pull_weights(
        uri_of(source), weights_hash, cache_dir=cache, storage_roots=roots
    )
    assert second == first
    assert (second / "config.json").read_bytes() == FILES["config.json"]


def test_pull_weights_replaces_a_corrupted_cache(
    source: Path, cache: Path, roots: list[str]
) -> None:
    weights_hash = expected_hash(FILES)
    path = pull_weights(
        uri_of(source), weights_hash, cache_dir=cache, storage_roots=roots
    )
    (path / "config.json").write_bytes(b"bit rot")
    again = pull_weights(
        uri_of(source), weights_hash, cache_dir=cache, storage_roots=roots
    )
    assert (again / "config.json").read_bytes() == FILES["config.json"]
    assert [p.name for p in cache.iterdir()] == [weights_hash]


def test_pull_weights_refuses_tampered_source_and_leaves_nothing(
    source: Path, cache: Path, roots: list[str]
) -> None:
    weights_hash = expected_hash(FILES)
    (source / "model-00002-of-00002.safetensors").write_bytes(b"\x01" * 1000)
    with pytest.raises(WeightsMismatch) as caught:
        pull_weights(uri_of(source), weights_hash, cache_dir=cache, storage_roots=roots)
    assert caught.value.expected == weights_hash
    assert caught.value.actual != weights_hash
    assert list(cache.iterdir()) == []


def test_pull_weights_refuses_uri_outside_roots(
    tmp_path: Path, cache: Path, roots: list[str]
) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(WeightsUriRefused, match="storage root"):
        pull_weights(
            uri_of(outside), expected_hash(FILES), cache_dir=cache, storage_roots=roots
        )
    assert not cache.exists()


def test_pull_weights_refuses_dotdot_path(
    store: Path, cache: Path, roots: list[str]
) -> None:
    uri = f"file://{store}/chat-7b/../../etc"
    with pytest.raises(WeightsUriRefused, match=r"'\.\.'"):
        pull_weights(uri, expected_hash(FILES), cache_dir=cache, storage_roots=roots)
    assert not cache.exists()


def test_pull_weights_refuses_symlink_escaping_the_root(
    store: Path, tmp_path: Path, cache: Path, roots: list[str]
) -> None:
    outside = tmp_path / "secrets"
    outside.mkdir()
    (outside / "key").write_bytes(b"secret")
    (store / "link").symlink_to(outside)
    with pytest.raises(WeightsUriRefused, match="resolves outside"):
        pull_weights(
            uri_of(store / "link"),
            expected_hash({"key": b"secret"}),
            cache_dir=cache,
            storage_roots=roots,
        )


def test_pull_weights_refuses_symlinks_inside_the_tree(
    source: Path, tmp_path: Path, cache: Path, roots: list[str]
) -> None:
    (tmp_path / "passwd").write_bytes(b"root:x:0:0")
    (source / "extra.json").symlink_to(tmp_path / "passwd")
    with pytest.raises(WeightsError, match="not a regular file"):
        pull_weights(
            uri_of(source), expected_hash(FILES), cache_dir=cache, storage_roots=roots
        )
    assert list(cache.iterdir()) == []


def test_pull_weights_rejects_a_hash_that_could_name_another_directory(
    source: Path, cache: Path, roots: list[str]
) -> None:
    with pytest.raises(ValueError, match="64 lowercase hex"):
        pull_weights(uri_of(source), "../../x", cache_dir=cache, storage_roots=roots)


def test_pull_weights_names_the_scheme_without_fsspec(
    cache: Path, roots: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec -> ImportError
    with pytest.raises(UnsupportedScheme, match=r"'s3'.*fsspec"):
        pull_weights(
            "s3://models/chat-7b/v1",
            expected_hash(FILES),
            cache_dir=cache,
            storage_roots=roots,
        )
    assert list(cache.iterdir()) == []


def test_pull_weights_through_fsspec(cache: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for relpath, data in FILES.items():
        fs.pipe(f"/models/chat-7b/v1/{relpath}", data)
    try:
        weights_hash = expected_hash(FILES)
        path = pull_weights(
            "memory://models/chat-7b/v1",
            weights_hash,
            cache_dir=cache,
            storage_roots=["memory://models/"],
        )
        assert path == cache / weights_hash
        assert (path / "tokenizer/tokenizer.json").read_bytes() == FILES[
            "tokenizer/tokenizer.json"
        ]
    finally:
        fs.rm("/models", recursive=True)


def checkpoint(root: Path, *, template_file: bool = True) -> Path:
    """Write a small Hugging Face-shaped checkpoint: weights, tokenizer, template."""
    root.mkdir(parents=True)
    (root / "model.safetensors").write_bytes(b"\x01" * 64)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    config = {"bos_token": "<s>"}
    if template_file:
        (root / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    else:
        config["chat_template"] = "from the config"
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def test_tokenizer_digest_covers_only_the_tokenizer_files(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m")
    expected = expected_hash(
        {
            "tokenizer.json": (root / "tokenizer.json").read_bytes(),
            "tokenizer_config.json": (root / "tokenizer_config.json").read_bytes(),
        }
    )
    assert tokenizer_digest(root) == expected
    (root / "model.safetensors").write_bytes(b"\x02" * 64)
    assert tokenizer_digest(root) == expected
    (root / "tokenizer.json").write_text("{}")
    assert tokenizer_digest(root) != expected


def test_tokenizer_digest_needs_a_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsError, match="no tokenizer files"):
        tokenizer_digest(tmp_path)


def test_chat_template_file_wins_over_the_tokenizer_config(tmp_path: Path) -> None:
    assert read_chat_template(checkpoint(tmp_path / "a")) == (
        "{{ messages[0]['content'] }}"
    )
    assert (
        read_chat_template(checkpoint(tmp_path / "b", template_file=False))
        == "from the config"
    )
    with pytest.raises(WeightsError, match="no chat template"):
        read_chat_template(tmp_path)


def test_local_identity_is_computed_from_the_files(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "tiny")
    identity = local_identity(tmp_path / "tiny")
    assert identity == {
        "weights_uri": f"file://{root.resolve()}/",
        "weights_hash": tree_digest(root),
        "tokenizer_hash": tokenizer_digest(root),
        "chat_template": "{{ messages[0]['content'] }}",
    }
    assert local_path(identity["weights_uri"]) == root.resolve()
    assert local_path("s3://models/x/") is None
    assert local_path("file://elsewhere/x/") is None
