"""schemathesis hooks for tests/test_control_plane_live.py (``SCHEMATHESIS_HOOKS``):
the usage report's CSV and the audit trail's JSON lines are read as one object
per line, so their answers are checked against the schema like the JSON ones."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import schemathesis


@schemathesis.deserializer("text/csv")
def csv_lines(ctx: Any, response: Any) -> list[dict[str, str]]:
    text = response.content.decode(response.encoding or "utf-8")
    return list(csv.DictReader(io.StringIO(text)))


@schemathesis.deserializer("application/jsonl")
def json_lines(ctx: Any, response: Any) -> list[Any]:
    text = response.content.decode(response.encoding or "utf-8")
    return [json.loads(line) for line in text.splitlines()]
