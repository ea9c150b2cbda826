"""How a drill command hands out its result: ``--json -`` prints the JSON alone
(for a pipe); otherwise the JSON goes to the file named (if any), the report is
printed, and its last line names the file.

Public surface: ``add_result_arguments``, ``write_result``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.core.management.base import CommandParser, OutputWrapper

__all__ = ["add_result_arguments", "write_result"]


def add_result_arguments(parser: CommandParser) -> None:
    """Add ``--json [PATH]`` and ``--plot PATH``, as every drill command takes them."""
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write every figure as JSON to PATH (no PATH: print it instead of "
        "the table)",
    )
    parser.add_argument("--plot", type=Path, help="PNG file (default .local/drills/)")


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
