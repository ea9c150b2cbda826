"""Pull a version's weights into the node's cache and prove they are the registered ones.

Public surface: ``pull_weights``, ``verify_weights``, ``tree_digest``,
``tree_stat``, ``file_sha256``, ``tokenizer_digest``, ``read_chat_template``, ``local_identity``,
``local_path``, ``TOKENIZER_FILES``, ``WeightsError``, ``WeightsUriRefused``,
``UnsupportedScheme``, ``WeightsMismatch``.

The cache holds one directory per ``weights_hash`` (``<cache_dir>/<weights_hash>/``).
A directory appears there only by an atomic rename of a complete copy whose digest
(``engine_nodes.domain.weights``) matched, so a crash or a concurrent pull never
leaves a half-written tree under a hash name; partial copies live in
``<cache_dir>/.<hash>.*.partial`` until they are renamed or deleted.

Only directories and regular files may make up a weights tree. Symlinks and other
special files are refused: a link in a storage root could otherwise copy a file
from anywhere on the node into the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from engine_nodes.domain.weights import is_manifest_path, manifest_digest
from models_registry.domain.identity import is_sha256_hex, uri_errors

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
# The files a Hugging Face checkpoint keeps its tokenizer in. A version's
# ``tokenizer_hash`` is the manifest digest of those present in its weights tree.
TOKENIZER_FILES = (
    "added_tokens.json",
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class WeightsError(Exception):
    """The weights cannot be pulled or verified."""


class WeightsUriRefused(WeightsError):
    """The URI lies outside the configured storage roots (or is malformed)."""


class UnsupportedScheme(WeightsError):
    """The URI's scheme needs a storage driver this node does not have."""


class WeightsMismatch(WeightsError):
    """The pulled tree's digest is not the version's ``weights_hash``."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"weights digest {actual} does not match {expected}")
        self.expected = expected
        self.actual = actual


def file_sha256(path: Path) -> str:
    """Return the hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as handle:
        while n := handle.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def tree_digest(root: Path) -> str:
    """Return the manifest digest of the tree under ``root``.

    Raises:
        WeightsError: the tree holds a symlink, a special file or a name that a
            manifest cannot hold.
    """
    return manifest_digest(
        (relpath, file_sha256(path)) for relpath, path in _tree_files(root)
    )


def tree_stat(root: Path) -> tuple[tuple[str, int, int], ...]:
    """Return ``(relpath, size, mtime_ns)`` of every file under ``root``, sorted.

    A cheap fingerprint of a tree that verified: while it holds, no file was
    replaced, resized or rewritten in place (each changes the size or the mtime),
    so a start need not read every byte again. Not a proof against a writer that
    restores mtimes; ``tree_digest`` is.

    Raises:
        WeightsError: as ``tree_digest``.
    """
    return tuple(
        sorted(
            (relpath, (info := path.lstat()).st_size, info.st_mtime_ns)
            for relpath, path in _tree_files(root)
        )
    )


def tokenizer_digest(root: Path) -> str:
    """Return the manifest digest of the tokenizer files (``TOKENIZER_FILES``) in ``root``.

    Raises:
        WeightsError: none of them is there, or one is not a regular file.
    """
    entries = []
    for name in TOKENIZER_FILES:
        path = root / name
        if not path.exists() and not path.is_symlink():
            continue
        if not stat.S_ISREG(path.lstat().st_mode):
            raise WeightsError(f"{path} is not a regular file")
        entries.append((name, file_sha256(path)))
    if not entries:
        raise WeightsError(f"{root} holds no tokenizer files")
    return manifest_digest(entries)


def read_chat_template(root: Path) -> str:
    """Return the checkpoint's chat template, as vLLM (transformers) loads it.

    ``chat_template.jinja`` wins; else the ``chat_template`` string of
    ``tokenizer_config.json``.

    Raises:
        WeightsError: the checkpoint has no chat template.
    """
    path = root / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    config_path = root / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, str) and template.strip():
            return template
    raise WeightsError(f"{root} has no chat template")


def local_identity(root: Path) -> dict[str, str]:
    """Return the identity fields of a version whose weights are the tree at ``root``.

    ``weights_uri`` (``file://`` + the resolved path, with a trailing ``/``),
    ``weights_hash``, ``tokenizer_hash`` and ``chat_template``, computed from the
    files, so none of them is ever typed by hand.

    Raises:
        WeightsError: as ``tree_digest``, ``tokenizer_digest`` and
            ``read_chat_template``; or ``root`` is not a directory.
    """
    real = root.resolve()
    if not real.is_dir():
        raise WeightsError(f"{root} is not a directory")
    return {
        "weights_uri": real.as_uri() + "/",
        "weights_hash": tree_digest(real),
        "tokenizer_hash": tokenizer_digest(real),
        "chat_template": read_chat_template(real),
    }


def local_path(uri: str) -> Path | None:
    """Return the local directory a ``file://`` URI names; None for other schemes."""
    parts = urlsplit(uri)
    if parts.scheme != "file" or parts.netloc not in {"", "localhost"}:
        return None
    return Path(unquote(parts.path))


def verify_weights(path: Path, weights_hash: str) -> bool:
    """Return True when the tree at ``path`` has digest ``weights_hash``.

    False (never an exception) for a missing directory or a tree that is not a
    clean weights tree. Reads every byte: minutes for a 70B checkpoint.
    """
    if not path.is_dir() or path.is_symlink():
        return False
    try:
        return tree_digest(path) == weights_hash
    except (WeightsError, OSError) as exc:
        logger.warning("weights at %s do not verify: %s", path, exc)
        return False


def pull_weights(
    weights_uri: str,
    weights_hash: str,
    *,
    cache_dir: Path,
    storage_roots: Sequence[str],
) -> Path:
    """Return ``cache_dir/<weights_hash>``, copying and verifying the tree if needed.

    A cached tree that verifies is reused. One that does not is moved aside and
    deleted, then pulled again. ``file://`` URIs are copied with the standard
    library; other schemes go through ``fsspec`` when it is installed.

    Raises:
        ValueError: ``weights_hash`` is not 64 lowercase hex digits.
        WeightsUriRefused: the URI is outside ``storage_roots``, climbs with ``..``,
            or (for ``file://``) resolves outside them through a symlink.
        UnsupportedScheme: no driver for the URI's scheme.
        WeightsMismatch: the copy's digest differs; nothing is left in the cache.
        WeightsError: the source is not a directory or holds a special file.
    """
    # The hash names a directory: anything but hex could climb out of the cache.
    if not is_sha256_hex(weights_hash):
        raise ValueError("weights_hash must be 64 lowercase hex digits")
    errors = uri_errors(weights_uri, storage_roots)
    if errors:
        raise WeightsUriRefused(f"weights URI {weights_uri!r}: {'; '.join(errors)}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / weights_hash
    if final.exists():
        if verify_weights(final, weights_hash):
            return final
        logger.warning("cached weights %s do not verify; pulling again", final)
        _discard(final, cache_dir, weights_hash)

    partial = Path(
        tempfile.mkdtemp(prefix=f".{weights_hash}.", suffix=".partial", dir=cache_dir)
    )
    try:
        _copy_into(weights_uri, partial, storage_roots)
        actual = tree_digest(partial)
        if actual != weights_hash:
            raise WeightsMismatch(weights_hash, actual)
        try:
            partial.rename(final)
        except OSError:
            # Another pull of the same hash won the race; keep its verified tree.
            if not verify_weights(final, weights_hash):
                raise
            shutil.rmtree(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    logger.info("pulled weights %s into %s", weights_uri, final)
    return final


def _copy_into(uri: str, dest: Path, storage_roots: Sequence[str]) -> None:
    parts = urlsplit(uri)
    if parts.scheme == "file":
        _copy_local(_local_source(uri, storage_roots), dest)
    else:
        _copy_remote(uri, parts.scheme, dest)


def _local_source(uri: str, storage_roots: Sequence[str]) -> Path:
    parts = urlsplit(uri)
    if parts.netloc not in {"", "localhost"}:
        raise WeightsUriRefused(f"file URI {uri!r} names a remote host")
    source = Path(unquote(parts.path))
    try:
        real = source.resolve(strict=True)
    except OSError as exc:
        raise WeightsError(f"weights directory {source} is unreadable: {exc}") from None
    roots = [
        Path(unquote(urlsplit(root).path)).resolve()
        for root in storage_roots
        if urlsplit(root).scheme == "file"
    ]
    if not any(real.is_relative_to(root) for root in roots):
        raise WeightsUriRefused(f"{source} resolves outside the storage roots")
    if not real.is_dir():
        raise WeightsError(f"weights source {source} is not a directory")
    return real


def _copy_local(source: Path, dest: Path) -> None:
    for relpath, path in _tree_files(source):
        target = dest / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target, follow_symlinks=False)


def _copy_remote(uri: str, scheme: str, dest: Path) -> None:
    try:
        import fsspec
    except ImportError:
        raise UnsupportedScheme(
            f"weights URI scheme {scheme!r} needs the fsspec package and its "
            f"{scheme!r} driver (e.g. s3fs, gcsfs); install them or use file://"
        ) from None
    try:
        fs, root = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise UnsupportedScheme(f"weights URI scheme {scheme!r}: {exc}") from None
    root = root.rstrip("/")
    if not fs.isdir(root):
        raise WeightsError(f"weights source {uri} is not a directory")
    for remote in sorted(fs.find(root)):
        relpath = remote[len(root) + 1 :]
        # Object keys may hold '..' or '//': never let one escape ``dest``.
        if not remote.startswith(root + "/") or not is_manifest_path(relpath):
            raise WeightsError(f"remote object {remote!r} has an unsafe name")
        target = dest / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))


def _tree_files(root: Path) -> Iterator[tuple[str, Path]]:
    """Yield ``(posix relpath, path)`` for every regular file under ``root``."""
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise_walk_error):
        base = Path(dirpath)
        for name in dirnames:
            if (base / name).is_symlink():
                raise WeightsError(f"{base / name} is a symlink; weights may not link")
        for name in filenames:
            path = base / name
            mode = path.lstat().st_mode
            if not stat.S_ISREG(mode):
                raise WeightsError(f"{path} is not a regular file")
            relpath = path.relative_to(root).as_posix()
            if not is_manifest_path(relpath):
                raise WeightsError(f"{path} has a name a manifest cannot hold")
            yield relpath, path


def _discard(path: Path, cache_dir: Path, weights_hash: str) -> None:
    # Rename first so the hash name is free at once, even if deletion is slow.
    trash = Path(
        tempfile.mkdtemp(prefix=f".{weights_hash}.", suffix=".trash", dir=cache_dir)
    )
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        path.rename(trash / "tree")
    shutil.rmtree(trash)


def _raise_walk_error(exc: OSError) -> None:
    # os.walk skips unreadable directories silently; a weights tree must not.
    raise exc
