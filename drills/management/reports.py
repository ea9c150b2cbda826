"""How a drill command hands out its result: ``--json -`` prints the JSON alone
(for a pipe); otherwise the JSON goes to the file named (if any), the report is
printed, and its last line names the file.

Public surface: ``write_result``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.core.management.base import OutputWrapper

__all__ = ["write_result"]


def write_result(
    stdout: OutputWrapper,
    data: dict[str, Any],
    target: str | None,
    report: Callable[[], None],
    *,
    default: Callable[[Any], Any] | None = None,
) -> None:
    """Write ``data`` as ``--json`` asks, and ``report()`` unless it is ``-``."""
    text = json.dumps(data, indent=2, default=default)
    if target == "-":
        stdout.write(text)
        return
    if target is not None:
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    report()
    if target is not None:
        stdout.write(f"json: {target}")
