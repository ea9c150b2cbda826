"""A request body parsed as one JSON object, within bounds a client cannot break.

Public surface: ``BodyError``, ``MAX_DEPTH``, ``MAX_INT_DIGITS``,
``parse_json_object``.

Python's ``json`` fails on input a client controls in ways that are not
``JSONDecodeError``: nesting near the interpreter's recursion limit raises
``RecursionError``, an integer literal past 4,300 digits ``ValueError``, and
``"\\ud800"`` decodes to a lone surrogate, which then fails every UTF-8 encode
downstream (the routing key, the prompt count). ``parse_json_object`` refuses each
with a ``BodyError`` naming the parameter (the top-level key, or the path of the
string), as it refuses ``NaN``, ``Infinity`` and numbers too large for a double,
which are not JSON (RFC 8259) and would reach the engine as ``Infinity``.

Invariants of an accepted body: a ``dict``; no container deeper than
``MAX_DEPTH`` (the body itself is depth 1); no string or key with a surrogate code
point; every float finite; every integer at most ``MAX_INT_DIGITS`` digits. Bodies
are UTF-8 (RFC 8259 section 8.1): any other encoding is not valid JSON here.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "BodyError", "parse_json_object"]

# Far deeper than any OpenAI body (a message's image part is depth 6; a
# response_format schema nests two levels per level of the schema), far below the
# decoder's recursion limit (about 1,000, less the caller's frames).
MAX_DEPTH = 64
# An int64 is 19 digits; nothing in an OpenAI body is larger.
MAX_INT_DIGITS = 64

_WHITESPACE = frozenset(" \t\n\r")
# A JSON escape of a UTF-16 surrogate, high or low: only these decode to one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyError(ValueError):
    """A request body that is refused with a 400, naming ``param`` when it can.

    ``message`` never quotes the client's values (they may be prompt text).
    """

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class _Unbounded(ValueError):
    """A literal ``parse_json_object`` refuses (raised inside the decoder)."""


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise _Unbounded(f"integers longer than {MAX_INT_DIGITS} digits are refused")
    return int(literal)


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Unbounded("numbers must be finite (this one is too large for a double)")
    return value


def _parse_constant(literal: str) -> float:
    raise _Unbounded(f"{literal} is not a JSON number")


_DECODER = json.JSONDecoder(
    parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Return ``raw`` parsed as a JSON object within the module's bounds.

    Raises:
        BodyError: not UTF-8, not JSON, not an object, or out of bounds.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyError("the body is not valid JSON (it must be UTF-8)") from None
    try:
        body = _DECODER.decode(text)
    except json.JSONDecodeError:
        raise BodyError("the body is not valid JSON") from None
    except (RecursionError, _Unbounded) as exc:
        # The decoder does not say where it failed: decode the members one at a
        # time to name the parameter.
        param = _failing_member(text)
        if isinstance(exc, RecursionError):
            raise BodyError(
                f"the body is nested deeper than {MAX_DEPTH} levels", param=param
            ) from None
        raise BodyError(str(exc), param=param) from None
    if not isinstance(body, dict):
        raise BodyError("the body must be a JSON object")
    # Cheap tests on the text decide whether the tree must be walked at all:
    # nesting past MAX_DEPTH needs that many brackets, a surrogate an escape.
    is_deep = text.count("[") + text.count("{") > MAX_DEPTH
    has_escape = _SURROGATE_ESCAPE.search(text) is not None
    if is_deep or has_escape:
        _check_tree(body, surrogates=has_escape)
    return body


def _check_tree(body: dict[str, Any], *, surrogates: bool) -> None:
    """Walk ``body`` without recursion: depth, and lone surrogates if asked."""
    stack: list[tuple[dict[str, Any] | list[Any], tuple[str | int, ...]]] = [(body, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_DEPTH:
            raise BodyError(
                f"the body is nested deeper than {MAX_DEPTH} levels",
                param=_param(path[:1]),
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if surrogates and isinstance(key, str) and _SURROGATE.search(key):
                raise _surrogate_error((*path, key))
            if isinstance(value, dict | list):
                stack.append((value, (*path, key)))
            elif surrogates and isinstance(value, str) and _SURROGATE.search(value):
                raise _surrogate_error((*path, key))


def _surrogate_error(path: tuple[str | int, ...]) -> BodyError:
    return BodyError(
        "strings must be valid Unicode: a lone UTF-16 surrogate (such as \\ud800) "
        "is not a character",
        param=_param(path),
    )


def _param(path: tuple[str | int, ...]) -> str | None:
    """Return ``path`` dotted (``messages.0.content``), safe to put in JSON."""
    if not path:
        return None
    dotted = ".".join(str(part) for part in path)
    return dotted.encode("utf-8", "backslashreplace").decode("utf-8")


def _failing_member(text: str) -> str | None:
    """Return the top-level key whose value fails to decode or is too deep."""
    index = _skip(text, 0)
    if not text.startswith("{", index):
        return None
    index += 1
    while True:
        index = _skip(text, index)
        try:
            key, index = _DECODER.raw_decode(text, index)
        except json.JSONDecodeError:
            return None
        index = _skip(text, index)
        if not isinstance(key, str) or not text.startswith(":", index):
            return None
        try:
            value, index = _DECODER.raw_decode(text, _skip(text, index + 1))
        except (RecursionError, _Unbounded):
            return _param((key,))
        except json.JSONDecodeError:
            return None
        if _is_deeper_than(value, MAX_DEPTH - 1):
            return _param((key,))
        index = _skip(text, index)
        if not text.startswith(",", index):
            return None
        index += 1


def _skip(text: str, index: int) -> int:
    """Return the index of the first character at or after ``index`` that is not
    JSON whitespace."""
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index


def _is_deeper_than(value: Any, limit: int) -> bool:
    """Return True if ``value`` holds containers more than ``limit`` deep."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)
    return False
