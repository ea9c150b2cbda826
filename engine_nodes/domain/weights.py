"""A version's ``weights_hash``: the SHA-256 of its weights directory's manifest.

Public surface: ``manifest_digest``, ``manifest_text``, ``is_manifest_path``.

The manifest has one line per regular file under the weights directory, sorted by
POSIX relative path (code-point order, the same as UTF-8 byte order):

    <relpath> NUL <lowercase hex SHA-256 of the file's bytes> LF

and ``weights_hash`` is the lowercase hex SHA-256 of the manifest's UTF-8 bytes.
Directories themselves, file modes and times are not part of it; renaming a file
changes it. A path may not contain NUL or LF (they delimit the manifest), must be
relative, and may not have backslashes or empty, ``.`` or ``..`` segments, so two
different trees can never produce the same manifest.

Shell equivalent, for operators registering a version by hand::

    cd DIR && find . -type f -printf '%P\\n' | LC_ALL=C sort |
      while IFS= read -r f; do
        printf '%s\\0%s\\n' "$f" "$(sha256sum "$f" | cut -d' ' -f1)"
      done | sha256sum
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

__all__ = ["is_manifest_path", "manifest_digest", "manifest_text"]

_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")


def manifest_text(entries: Iterable[tuple[str, str]]) -> str:
    """Return the manifest for ``(relpath, file_sha256)`` pairs, in any input order.

    Raises:
        ValueError: a path is not a clean relative POSIX path, appears twice, or a
            file hash is not 64 lowercase hex digits.
    """
    seen: dict[str, str] = {}
    for relpath, file_hash in entries:
        _check_relpath(relpath)
        if _HEX64.fullmatch(file_hash) is None:
            raise ValueError(f"hash of {relpath!r} is not 64 lowercase hex digits")
        if relpath in seen:
            raise ValueError(f"{relpath!r} appears twice in the manifest")
        seen[relpath] = file_hash
    return "".join(f"{path}\0{seen[path]}\n" for path in sorted(seen))


def manifest_digest(entries: Iterable[tuple[str, str]]) -> str:
    """Return the ``weights_hash`` of a tree given its ``(relpath, sha256)`` pairs.

    Raises:
        ValueError: as ``manifest_text``.
    """
    return hashlib.sha256(manifest_text(entries).encode("utf-8")).hexdigest()


def is_manifest_path(relpath: str) -> bool:
    """Return True for a clean relative POSIX path that a manifest line can hold.

    False for empty paths, NUL, LF or backslash, a leading ``/``, and empty, ``.``
    or ``..`` segments (such a path could escape the directory it is joined to),
    and for names that are not valid Unicode (undecodable bytes from the disk).
    """
    if not relpath or any(ch in relpath for ch in "\0\n\\"):
        return False
    try:
        relpath.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(segment in {"", ".", ".."} for segment in relpath.split("/"))


def _check_relpath(relpath: str) -> None:
    if not isinstance(relpath, str) or not is_manifest_path(relpath):
        raise ValueError(f"{relpath!r} is not a clean relative POSIX path")
