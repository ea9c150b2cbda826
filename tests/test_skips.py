"""Every skip for a missing service goes through conftest.py's REQUIRE_SERVICES path.

A test that calls ``pytest.skip`` itself, or is marked ``skipif``, is skipped in CI
as quietly as on a laptop; one that takes the root conftest's ``postgres`` or
``redis_url`` fixture fails there instead (``REQUIRE_SERVICES=1``). Real vLLM has
its own gate, ``REQUIRE_VLLM``, in the same file's ``tiny_model`` fixture.
``pytest.importorskip`` (an optional Python package, not a service) is not a skip
this rule is about.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GATES = ROOT / "conftest.py"
# Direct skips that concern no service, each with its reason.
ALLOWED = {
    "simengine/tests/test_sim_server.py": (
        "a prompt length the tokenizer cannot render exactly: test data, not a service"
    ),
}


def direct_skips(source: str) -> list[int]:
    """Return the lines that skip by themselves: ``pytest.skip(...)``, skip marks."""
    names = {"skip", "skipif"}
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "pytest":
            lines.extend(node.lineno for a in node.names if a.name in names)
    return sorted(lines)


def repository_test_modules() -> list[Path]:
    """Return every test and conftest module of the repository."""
    found = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0].startswith(".") or parts[0] in {"build", "bench", "platform"}:
            continue
        if "tests" in parts or path.name == "conftest.py":
            found.append(path)
    return sorted(found)


def test_no_test_skips_for_a_service_by_itself() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in repository_test_modules()
        if path != GATES and str(path.relative_to(ROOT)) not in ALLOWED
        for line in direct_skips(path.read_text())
    ]
    assert offenders == [], (
        "skip through the postgres / redis_url fixtures (conftest.py), not directly"
    )


def test_the_walk_sees_this_file_and_the_gates() -> None:
    modules = repository_test_modules()
    assert Path(__file__).resolve() in modules
    assert GATES in modules
    assert direct_skips(GATES.read_text())


@pytest.mark.parametrize(
    "source",
    [
        "import pytest\npytest.skip('no redis')\n",
        "import pytest\n@pytest.mark.skipif(True, reason='x')\ndef test_x(): ...\n",
        "import pytest\n@pytest.mark.skip\ndef test_x(): ...\n",
        "from pytest import skip\n",
    ],
)
def test_direct_skips_finds_skip_calls_and_marks(source: str) -> None:
    assert direct_skips(source)


def test_direct_skips_leaves_fixtures_and_importorskip_alone() -> None:
    source = (
        "import pytest\n"
        "def test_x(redis_url, postgres):\n"
        "    pytest.importorskip('fsspec')\n"
    )
    assert direct_skips(source) == []
