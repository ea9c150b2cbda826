"""Pull a version's weights into the node's cache and prove they are the registered ones.

Public surface: ``pull_weights``, ``verify_weights``, ``copy_weights``,
``verify_weights_at``, ``tree_digest``, ``tree_stat``, ``file_sha256``,
``tokenizer_digest``, ``read_chat_template``, ``local_identity``, ``local_path``,
``TOKENIZER_FILES``, ``WeightsError``, ``WeightsUriRefused``, ``UnsupportedScheme``,
``WeightsMismatch``.

The cache holds one directory per ``weights_hash`` (``<cache_dir>/<weights_hash>/``).
A directory appears there only by an atomic rename of a complete copy whose digest
(``engine_nodes.domain.weights``) matched, so a crash or a concurrent pull never
leaves a half-written tree under a hash name; partial copies live in
``<cache_dir>/.<hash>.*.partial`` until they are renamed or deleted.

Only directories and regular files may make up a weights tree. Symlinks and other
special files are refused: a link in a storage root could otherwise copy a file
from anywhere on the node into the cache.

A region's copy (``copy_weights``, the weights gate) is content-addressed the same
way, one prefix per hash under the region's storage root
(``<dest_root>/<weights_hash>/``), and written through ``fsspec`` for every scheme
(``file://`` directories stand for buckets in tests). The copy streams into
``<dest_root>/.<hash>.<random>.partial/`` while each file's SHA-256 is computed,
and moves under the hash name only once the source's digest matched; the
destination is then read back and verified. A tree already under the hash name is
never overwritten (replicas may be serving from it): it is verified instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from engine_nodes.domain.weights import is_manifest_path, manifest_digest
from models_registry.domain.identity import is_sha256_hex, uri_errors

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

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

    def __init__(self, expected: str, actual: str, *, where: str = "") -> None:
        message = f"weights digest {actual} does not match {expected}"
        super().__init__(f"{where}: {message}" if where else message)
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


def local_identity(root: Path, *, kind: str = "chat") -> dict[str, str]:
    """Return the identity fields of a version whose weights are the tree at ``root``.

    ``weights_uri`` (``file://`` + the resolved path, with a trailing ``/``),
    ``weights_hash``, ``tokenizer_hash`` and ``chat_template``, computed from the
    files, so none of them is ever typed by hand. A version of an embedding model
    (``kind``) needs no chat template: it is empty when the checkpoint has none.

    Raises:
        WeightsError: as ``tree_digest``, ``tokenizer_digest`` and
            ``read_chat_template`` (a chat model only); or ``root`` is not a
            directory.
    """
    real = root.resolve()
    if not real.is_dir():
        raise WeightsError(f"{root} is not a directory")
    try:
        template = read_chat_template(real)
    except WeightsError:
        if kind == "chat":
            raise
        template = ""
    return {
        "weights_uri": real.as_uri() + "/",
        "weights_hash": tree_digest(real),
        "tokenizer_hash": tokenizer_digest(real),
        "chat_template": template,
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


def copy_weights(
    source_uri: str,
    weights_hash: str,
    dest_root: str,
    *,
    storage_roots: Sequence[str],
) -> str:
    """Copy the tree at ``source_uri`` to ``<dest_root>/<weights_hash>/``; return that URI.

    Both ends go through ``fsspec``, whatever their scheme. Each file's SHA-256 is
    computed while it streams into a temporary prefix next to the destination;
    only when the source's digest is ``weights_hash`` is the copy moved under the
    hash name, and then read back from the destination and verified (the region's
    proof that its copy is the registered one). A tree already under the hash name
    is verified and reused, never overwritten: replicas may be serving from it.

    Raises:
        ValueError: ``weights_hash`` is not 64 lowercase hex digits.
        WeightsUriRefused: either URI lies outside ``storage_roots``, climbs with
            ``..``, or (for ``file://``) resolves outside them through a symlink.
        UnsupportedScheme: no ``fsspec`` driver for a URI's scheme.
        WeightsMismatch: the source's digest differs (nothing is left at the
            destination), or the tree at the destination does not verify (one
            found there is left alone; one this call wrote is removed).
        WeightsError: the source is missing, not a directory, or holds a link, a
            special file or an unsafe name; or storage I/O failed.
    """
    _check_hash(weights_hash)
    dest_uri = f"{dest_root.rstrip('/')}/{weights_hash}/"
    _check_uri(source_uri, storage_roots)
    _check_uri(dest_uri, storage_roots)
    source_shown, dest_shown = _redact(source_uri), _redact(dest_uri)
    src_fs, src_root = _tree_fs(source_uri, storage_roots)
    dest_fs, final = _tree_fs(dest_uri, storage_roots)
    started = time.monotonic()
    try:
        if _holds_tree(dest_fs, final, dest_shown):
            _verify_tree(dest_fs, final, weights_hash, where=dest_shown)
            logger.info("weights copy at %s already there and verified", dest_shown)
            return dest_uri
        partial = (
            f"{final.rsplit('/', 1)[0]}/.{weights_hash}.{uuid.uuid4().hex}.partial"
        )
        try:
            actual = _stream_tree(src_fs, src_root, dest_fs, partial, source_shown)
            if actual != weights_hash:
                raise WeightsMismatch(weights_hash, actual, where=source_shown)
            is_moved = _move_tree(dest_fs, partial, final, dest_shown)
        finally:
            _remove_tree(dest_fs, partial)
        try:
            _verify_tree(dest_fs, final, weights_hash, where=dest_shown)
        except WeightsError:
            if is_moved:
                # Written just now and served by nobody yet (the region is not
                # ready until this returns): remove it, so a retry copies afresh.
                _remove_tree(dest_fs, final)
            raise
    except OSError as exc:
        raise WeightsError(
            f"copying weights {source_shown} to {dest_shown} failed: {exc}"
        ) from exc
    logger.info(
        "copied weights %s to %s and verified them (%.1f s)",
        source_shown,
        dest_shown,
        time.monotonic() - started,
    )
    return dest_uri


def verify_weights_at(
    uri: str, weights_hash: str, *, storage_roots: Sequence[str]
) -> None:
    """Check that the tree at ``uri`` (any ``fsspec`` scheme) has digest ``weights_hash``.

    For a region that serves from the registered URI in place. Reads every byte.

    Raises:
        ValueError, WeightsUriRefused, UnsupportedScheme: as ``copy_weights``.
        WeightsMismatch: the digest differs (names expected and actual).
        WeightsError: no tree there, or it holds a link, a special file or an
            unsafe name; or storage I/O failed.
    """
    _check_hash(weights_hash)
    _check_uri(uri, storage_roots)
    shown = _redact(uri)
    fs, root = _tree_fs(uri, storage_roots)
    try:
        if not _holds_tree(fs, root, shown):
            raise WeightsError(f"no weights tree at {shown}")
        _verify_tree(fs, root, weights_hash, where=shown)
    except OSError as exc:
        raise WeightsError(f"verifying weights at {shown} failed: {exc}") from exc
    logger.info("weights at %s verified", shown)


def _check_hash(weights_hash: str) -> None:
    # The hash names a directory: anything but hex could climb out of it.
    if not is_sha256_hex(weights_hash):
        raise ValueError("weights_hash must be 64 lowercase hex digits")


def _check_uri(uri: str, storage_roots: Sequence[str]) -> None:
    errors = uri_errors(uri, storage_roots)
    if errors:
        raise WeightsUriRefused(f"weights URI {_redact(uri)!r}: {'; '.join(errors)}")


def _redact(uri: str) -> str:
    """Return ``uri`` without user info or query, which may carry credentials."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "***" if parts.query else ""
    return urlunsplit(parts._replace(netloc=netloc, query=query, fragment=""))


def _tree_fs(uri: str, storage_roots: Sequence[str]) -> tuple[AbstractFileSystem, str]:
    """Return the filesystem and root path (no trailing ``/``) a weights URI names.

    A ``file://`` path is resolved (through any symlinks in its existing part) and
    must still lie under a ``file://`` storage root.
    """
    parts = urlsplit(uri)
    try:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem
    except ImportError:
        raise UnsupportedScheme(
            f"weights URI scheme {parts.scheme!r} needs the fsspec package"
        ) from None
    if parts.scheme == "file":
        if parts.netloc not in {"", "localhost"}:
            raise WeightsUriRefused(f"file URI {uri!r} names a remote host")
        real = Path(unquote(parts.path)).resolve()
        roots = [
            Path(unquote(urlsplit(root).path)).resolve()
            for root in storage_roots
            if urlsplit(root).scheme == "file"
        ]
        if not any(real.is_relative_to(root) for root in roots):
            raise WeightsUriRefused(f"{real} resolves outside the storage roots")
        return LocalFileSystem(), real.as_posix()
    try:
        fs, root = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise UnsupportedScheme(f"weights URI scheme {parts.scheme!r}: {exc}") from None
    return fs, str(root).rstrip("/")


def _list_tree(fs: AbstractFileSystem, root: str, shown: str) -> list[tuple[str, str]]:
    """Return ``(relpath, path)`` of every file under ``root``, sorted by relpath.

    Raises:
        WeightsError: ``root`` is not a directory; an entry is a link, a special
            file, or has a name a manifest cannot hold (object keys may hold
            ``..`` or ``//``: none may escape the tree it is copied into).
    """
    if not fs.isdir(root):
        raise WeightsError(f"weights source {shown} is not a directory")
    files = []
    entries: dict[str, dict[str, Any]] = fs.find(root, withdirs=True, detail=True)
    for name, info in entries.items():
        path = name.rstrip("/")
        if path == root:
            continue
        relpath = path[len(root) + 1 :]
        if not path.startswith(root + "/") or not is_manifest_path(relpath):
            raise WeightsError(f"object {relpath!r} in {shown} has an unsafe name")
        if info.get("islink"):
            raise WeightsError(
                f"{relpath} in {shown} is a symlink; weights may not link"
            )
        if info.get("type") == "file":
            files.append((relpath, path))
        elif info.get("type") != "directory":
            raise WeightsError(f"{relpath} in {shown} is not a regular file")
    return sorted(files)


def _holds_tree(fs: AbstractFileSystem, root: str, shown: str) -> bool:
    """Return True when something is stored under ``root``."""
    if not fs.exists(root):
        return False
    if not fs.isdir(root):
        raise WeightsError(f"{shown} is not a directory")
    return bool(fs.find(root))


def _stream_tree(
    src_fs: AbstractFileSystem,
    src_root: str,
    dest_fs: AbstractFileSystem,
    dest: str,
    shown: str,
) -> str:
    """Copy every file under ``src_root`` to ``dest``; return the source's digest."""
    entries = []
    for relpath, path in _list_tree(src_fs, src_root, shown):
        target = f"{dest}/{relpath}"
        dest_fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        digest = hashlib.sha256()
        with src_fs.open(path, "rb") as reader, dest_fs.open(target, "wb") as writer:
            while chunk := reader.read(CHUNK_BYTES):
                digest.update(chunk)
                writer.write(chunk)
        entries.append((relpath, digest.hexdigest()))
    return manifest_digest(entries)


def _verify_tree(
    fs: AbstractFileSystem, root: str, weights_hash: str, *, where: str
) -> None:
    """Read the tree under ``root`` back; raise ``WeightsMismatch`` if it differs."""
    entries = []
    for relpath, path in _list_tree(fs, root, where):
        digest = hashlib.sha256()
        with fs.open(path, "rb") as reader:
            while chunk := reader.read(CHUNK_BYTES):
                digest.update(chunk)
        entries.append((relpath, digest.hexdigest()))
    actual = manifest_digest(entries)
    if actual != weights_hash:
        raise WeightsMismatch(weights_hash, actual, where=where)


def _move_tree(fs: AbstractFileSystem, partial: str, final: str, shown: str) -> bool:
    """Move the copy under its hash name; False when another copy got there first."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        try:
            # Atomic; replaces only an empty directory.
            os.rename(partial, final)
        except OSError:
            if not _holds_tree(fs, final, shown):
                raise
            return False
        return True
    # Object stores have no rename: objects move one by one. A crash midway
    # leaves a partial tree under the hash name, which verifies as a mismatch and
    # keeps the region not ready until an operator removes it.
    if _holds_tree(fs, final, shown):
        return False
    for relpath, path in _list_tree(fs, partial, shown):
        fs.mv(path, f"{final}/{relpath}")
    return True


def _remove_tree(fs: AbstractFileSystem, root: str) -> None:
    try:
        if fs.exists(root):
            fs.rm(root, recursive=True)
    except FileNotFoundError:
        pass  # object stores forget a prefix once its last object is gone
    except OSError as exc:
        logger.warning("could not remove %s: %s", root, exc)


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
