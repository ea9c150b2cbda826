"""A batch's input and output lines, in OpenAI's batch format; pure rules.

Public surface: ``ENDPOINT``, ``ENDPOINTS``, ``EMBEDDINGS``, ``MAX_LINES``,
``MAX_EMBEDDING_INPUTS``, ``LineError``, ``InputLine``, ``ParsedInput``,
``InputRejected``, ``parse_input``, ``parse_window``, ``output_line``,
``error_line``, ``request_id``.

An input line is a JSON object ``{"custom_id", "method": "POST", "url", "body":
{...}}`` whose ``url`` is the batch's endpoint (``/v1/chat/completions`` or
``/v1/embeddings``). The whole input is refused (a 400 at creation,
``InputRejected``) when it cannot be a batch at all: no line, more than
``MAX_LINES``, a ``custom_id`` used twice, lines naming different models (one
batch runs on one model, as OpenAI's does), a line whose ``url`` is another
endpoint than the batch's (OpenAI fails such a file at validation,
``url_mismatch``: one batch, one endpoint), or an embeddings batch asking for
more than ``MAX_EMBEDDING_INPUTS`` vectors in all (OpenAI's cap). A single line
that is malformed (not JSON, not an object, a wrong method, no url, no body, a
streaming body, another model than the batch's) does not stop the batch: it
becomes a ``LineError`` that goes to the error file with its ``custom_id`` (when
it has one) and the reason, and the other lines run. A body is not checked
further here: the gateway checks it as it checks a live request, and its 400
is the line's answer in the error file, as OpenAI's is.

Output lines are OpenAI's: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}`` for an answered line (any HTTP status),
``{"id", "custom_id", "response": null, "error": {"code", "message"}}`` for one
that never got an answer (malformed, expired, cancelled).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from config.json_body import BodyError, parse_json_object

__all__ = [
    "EMBEDDINGS",
    "ENDPOINT",
    "ENDPOINTS",
    "MAX_EMBEDDING_INPUTS",
    "MAX_LINES",
    "InputLine",
    "InputRejected",
    "LineError",
    "ParsedInput",
    "error_line",
    "output_line",
    "parse_input",
    "parse_window",
    "request_id",
]

ENDPOINT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
# The endpoints a batch may run, with the kind of model each serves.
ENDPOINTS = {ENDPOINT: "chat", EMBEDDINGS: "embedding"}
MAX_LINES = 50_000
# Vectors asked for across an embeddings batch's lines (OpenAI's cap).
MAX_EMBEDDING_INPUTS = 50_000
MAX_CUSTOM_ID = 512
# A completion window: a whole number of seconds, minutes, hours or days, at most
# a week ("24h" is OpenAI's only window; shorter ones let a job ask for less).
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400


class InputRejected(ValueError):
    """The input cannot be a batch (a 400 at creation)."""

    def __init__(self, message: str, *, code: str, line: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.line = line


@dataclass(frozen=True, slots=True)
class LineError:
    """Why one line cannot run; it goes to the error file."""

    code: str
    message: str


@dataclass(frozen=True, slots=True)
class InputLine:
    """One line of input: a request to run, or the error that stops it."""

    index: int  # 0-based among the non-blank lines
    line_number: int  # 1-based in the file, for messages
    custom_id: str | None
    body: dict[str, Any] | None
    error: LineError | None


@dataclass(frozen=True, slots=True)
class ParsedInput:
    lines: tuple[InputLine, ...]
    model: str

    @property
    def runnable(self) -> int:
        return sum(1 for line in self.lines if line.error is None)


def parse_window(text: object) -> int:
    """Return a completion window ("24h", "90m", "45s", "2d") in seconds.

    Raises:
        ValueError: anything else, or a window longer than a week.
    """
    if not isinstance(text, str) or not (match := _WINDOW.match(text.strip())):
        raise ValueError(
            "completion_window must be a whole number of s, m, h or d, such as '24h'"
        )
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds > MAX_WINDOW_S:
        raise ValueError("completion_window must be at most 7 days")
    return seconds


def parse_input(
    raw_lines: Iterable[bytes], *, model: str | None, endpoint: str = ENDPOINT
) -> ParsedInput:
    """Parse a JSONL input; ``model`` is the batch's model when the caller named one.

    Raises:
        InputRejected: no line, too many, a duplicate ``custom_id``, lines that
            name different models (or none, when the caller named no model), a
            line for another endpoint, or too many embedding inputs.
    """
    parsed: list[tuple[int, str | None, dict[str, Any] | LineError]] = []
    seen: dict[str, int] = {}
    models: dict[str, int] = {}
    inputs = 0
    for line_number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        if len(parsed) >= MAX_LINES:
            raise InputRejected(
                f"a batch holds at most {MAX_LINES} lines", code="too_many_lines"
            )
        custom_id, value = _read_line(raw, line_number)
        if custom_id is not None:
            if custom_id in seen:
                raise InputRejected(
                    f"custom_id {custom_id!r} appears on lines {seen[custom_id]} "
                    f"and {line_number}; each must be unique",
                    code="duplicate_custom_id",
                    line=line_number,
                )
            seen[custom_id] = line_number
        if isinstance(value, dict):
            _check_url(value, endpoint, line_number)
            if isinstance(named := _model_of(value), str):
                models.setdefault(named, line_number)
            if endpoint == EMBEDDINGS:
                inputs += _inputs_of(value)
                if inputs > MAX_EMBEDDING_INPUTS:
                    raise InputRejected(
                        f"an embeddings batch asks for at most "
                        f"{MAX_EMBEDDING_INPUTS} inputs in all; line {line_number} "
                        "goes past it",
                        code="too_many_inputs",
                        line=line_number,
                    )
        parsed.append((line_number, custom_id, value))
    if not parsed:
        raise InputRejected("the input holds no line", code="empty_file")
    if model is None:
        if len(models) > 1:
            first, second = list(models)[:2]
            raise InputRejected(
                f"lines name different models ({first!r} on line {models[first]}, "
                f"{second!r} on line {models[second]}); a batch runs on one model",
                code="mixed_models",
                line=models[second],
            )
        if not models:
            raise InputRejected(
                "no line names a model (body.model)", code="missing_model"
            )
        model = next(iter(models))
    lines = tuple(
        _check_line(index, line_number, custom_id, value, model, endpoint)
        for index, (line_number, custom_id, value) in enumerate(parsed)
    )
    return ParsedInput(lines=lines, model=model)


def _model_of(value: dict[str, Any]) -> object:
    body = value.get("body")
    return body.get("model") if isinstance(body, dict) else None


def _check_url(value: dict[str, Any], endpoint: str, line_number: int) -> None:
    """Refuse the input when a line names another endpoint than the batch's.

    Raises:
        InputRejected: ``url`` is a string other than ``endpoint``.
    """
    url = value.get("url")
    if isinstance(url, str) and url != endpoint:
        raise InputRejected(
            f"line {line_number}: url must be the batch's endpoint {endpoint!r}; "
            "a batch runs one endpoint",
            code="url_mismatch",
            line=line_number,
        )


def _inputs_of(value: dict[str, Any]) -> int:
    """The vectors an embeddings line asks for (one for a malformed input: the
    gateway refuses it, and it counts no more than one)."""
    body = value.get("body")
    given = body.get("input") if isinstance(body, dict) else None
    if not isinstance(given, list) or not given:
        return 1
    if all(isinstance(x, int) and not isinstance(x, bool) for x in given):
        return 1  # one list of token ids
    return len(given)


def _read_line(
    raw: bytes, line_number: int
) -> tuple[str | None, dict[str, Any] | LineError]:
    """Return a line's custom_id (when it has a usable one) and its object or error."""
    # The gateway's own bounds (nesting, non-finite numbers, huge integers, lone
    # surrogates); a NUL cannot be stored in jsonb.
    try:
        value = parse_json_object(raw)
    except BodyError as exc:
        return None, LineError("invalid_json", f"line {line_number}: {exc.message}")
    if b"\\u0000" in raw:
        return None, LineError(
            "invalid_json", f"line {line_number} holds a NUL character (\\u0000)"
        )
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id.strip():
        return None, LineError(
            "missing_custom_id", f"line {line_number} has no custom_id string"
        )
    if len(custom_id) > MAX_CUSTOM_ID:
        return None, LineError(
            "invalid_custom_id",
            f"line {line_number}: custom_id is longer than {MAX_CUSTOM_ID} characters",
        )
    return custom_id, value


def _check_line(
    index: int,
    line_number: int,
    custom_id: str | None,
    value: dict[str, Any] | LineError,
    model: str,
    endpoint: str,
) -> InputLine:
    """Check a line's method, url, body, stream and model; fill in the model."""

    def bad(code: str, message: str) -> InputLine:
        return InputLine(index, line_number, custom_id, None, LineError(code, message))

    if isinstance(value, LineError):
        return InputLine(index, line_number, custom_id, None, value)
    where = f"line {line_number}"
    if value.get("method") != "POST":
        return bad("invalid_method", f"{where}: method must be 'POST'")
    if value.get("url") != endpoint:  # none, or not a string (parse_input)
        return bad("invalid_url", f"{where}: url must be {endpoint!r}")
    body = value.get("body")
    if not isinstance(body, dict):
        return bad("invalid_body", f"{where}: body must be an object")
    if body.get("stream"):
        return bad("stream_unsupported", f"{where}: a batch line cannot stream")
    named = body.get("model")
    if named is None:
        body = {**body, "model": model}
    elif named != model:
        return bad(
            "model_mismatch",
            f"{where}: body.model {named!r} is not the batch's model {model!r}",
        )
    return InputLine(index, line_number, custom_id, body, None)


def request_id(batch_id: str, index: int) -> str:
    """The id of one line's request in the output (``batch_req_...``)."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"


def output_line(
    *, batch_id: str, index: int, custom_id: str | None, status_code: int, body: Any
) -> dict[str, Any]:
    """An answered line: the gateway's status and body."""
    rid = request_id(batch_id, index)
    return {
        "id": rid,
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": rid, "body": body},
        "error": None,
    }


def error_line(
    *, batch_id: str, index: int, custom_id: str | None, code: str, message: str
) -> dict[str, Any]:
    """A line that got no answer: malformed, expired or cancelled."""
    return {
        "id": request_id(batch_id, index),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
