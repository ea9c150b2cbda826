"""schemathesis hooks for tests/test_control_plane_live.py (``SCHEMATHESIS_HOOKS``):
the usage report's CSV is read as one object per line, so its answers are checked
against the schema's columns like the JSON ones."""

from __future__ import annotations

import csv
import io
from typing import Any

import schemathesis


@schemathesis.deserializer("text/csv")
def csv_lines(ctx: Any, response: Any) -> list[dict[str, str]]:
    text = response.content.decode(response.encoding or "utf-8")
    return list(csv.DictReader(io.StringIO(text)))
