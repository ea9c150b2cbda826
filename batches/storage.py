"""Where batch files live: fsspec URIs under the configured storage roots.

Public surface: ``StorageRefused``, ``check_uri``, ``exists``, ``file_uri``,
``write_stream``, ``write_lines``, ``read_lines``, ``read_chunks``, ``size_of``.

Every URI read or written here is checked against ``PLATFORM_STORAGE_ROOTS`` first
(``models_registry.domain.identity.uri_errors``: under a root, no ``..``), so a
caller's ``input_uri`` or ``output_uri`` can never reach outside them. Writes go to
a temporary name first and are moved into place, so a reader never sees half a
file and a finaliser that is run twice writes the same file twice.

On a local filesystem a team's files (uploads, batch output and error files) are
created mode 0600 and the directories this module creates 0700: they hold prompts
and answers, readable by the platform's own user only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec
from django.conf import settings
from fsspec.implementations.local import LocalFileSystem

from models_registry.domain.identity import uri_errors

__all__ = [
    "DIRECTORY_MODE",
    "FILE_MODE",
    "StorageRefused",
    "check_uri",
    "exists",
    "file_uri",
    "read_chunks",
    "read_lines",
    "size_of",
    "write_lines",
    "write_stream",
]


FILE_MODE = 0o600
DIRECTORY_MODE = 0o700


class StorageRefused(ValueError):
    """A URI outside the storage roots, or one that cannot be read."""


def check_uri(uri: str) -> None:
    """Raise ``StorageRefused`` unless ``uri`` lies under a configured storage root."""
    problems = uri_errors(uri, list(settings.PLATFORM_STORAGE_ROOTS))
    if problems:
        raise StorageRefused("; ".join(problems))


def file_uri(file_id: str) -> str:
    """Where the Files API keeps a file's content."""
    root = settings.PLATFORM_BATCH_STORAGE_URI
    return f"{root if root.endswith('/') else root + '/'}files/{file_id}.jsonl"


def _fs(uri: str) -> tuple[Any, str]:
    check_uri(uri)
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        # s3:// or gs:// without s3fs or gcsfs installed, or an unknown scheme.
        scheme = uri.split("://", 1)[0]
        raise StorageRefused(
            f"no filesystem for {scheme}:// here ({type(exc).__name__})"
        ) from None
    return fs, path


def exists(uri: str) -> bool:
    """Whether something is stored at ``uri``."""
    fs, path = _fs(uri)
    try:
        return bool(fs.exists(path))
    except OSError as exc:
        raise StorageRefused(f"cannot reach {uri}: {type(exc).__name__}") from None


def size_of(uri: str) -> int:
    """Return the size of the object at ``uri``.

    Raises:
        StorageRefused: outside the roots, or nothing there.
    """
    fs, path = _fs(uri)
    try:
        return int(fs.size(path))
    except OSError as exc:
        raise StorageRefused(f"cannot read {uri}: {type(exc).__name__}") from None


def write_stream(
    uri: str, chunks: Iterable[bytes], *, max_bytes: int
) -> tuple[int, str]:
    """Write ``chunks`` to ``uri``; return (bytes, sha256).

    Raises:
        OverflowError: more than ``max_bytes`` (nothing is left at ``uri``).
    """
    fs, path = _fs(uri)
    parent = path.rsplit("/", 1)[0]
    local = isinstance(fs, LocalFileSystem)
    if local:
        _make_private_dirs(parent)
    else:
        fs.makedirs(parent, exist_ok=True)
    temporary = f"{path}.part-{secrets.token_hex(4)}"
    digest = hashlib.sha256()
    size = 0
    try:
        with _create(fs, temporary, local=local) as handle:
            for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise OverflowError(size)
                digest.update(chunk)
                handle.write(chunk)
        fs.mv(temporary, path)
    finally:
        if fs.exists(temporary):
            fs.rm(temporary)
    return size, digest.hexdigest()


def _make_private_dirs(path: str) -> None:
    """Create ``path`` and any missing parents 0700 (``os.makedirs`` gives its
    mode to the last one only); existing directories are left as they are."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another writer
            os.mkdir(directory, DIRECTORY_MODE)


def _create(fs: Any, path: str, *, local: bool) -> Any:
    """Open a new file for writing: on a local disk created 0600 (whatever the
    umask lets through, never more), elsewhere as the store's own ACLs say."""
    if not local:
        return fs.open(path, "wb")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    return os.fdopen(fd, "wb")


def write_lines(uri: str, lines: Iterable[bytes]) -> tuple[int, str]:
    """Write JSONL ``lines`` (each without its newline) to ``uri``."""
    return write_stream(uri, (line + b"\n" for line in lines), max_bytes=2**62)


def read_lines(uri: str) -> Iterator[bytes]:
    """Return the lines of the object at ``uri`` (newlines stripped).

    The object is opened now (a missing one raises here, not once read).

    Raises:
        StorageRefused: outside the roots, or nothing there.
    """
    handle = _open(uri)

    def lines() -> Iterator[bytes]:
        with handle:
            for line in handle:
                yield line.rstrip(b"\r\n")

    return lines()


def read_chunks(uri: str, size: int = 64 * 1024) -> Iterator[bytes]:
    """Return the object at ``uri`` in chunks, opened now (see ``read_lines``)."""
    handle = _open(uri)

    def chunks() -> Iterator[bytes]:
        with handle:
            while chunk := handle.read(size):
                yield chunk

    return chunks()


def _open(uri: str) -> Any:
    fs, path = _fs(uri)
    try:
        return fs.open(path, "rb")
    except OSError as exc:
        raise StorageRefused(f"cannot read {uri}: {type(exc).__name__}") from None
