"""The architecture as tests: the pure core, and the order of the apps.

Nothing under */domain/ imports a framework, a store or HTTP. Between the apps, the
imports make no cycle: every module of an app counts (its tests, management
commands, migrations and admin included), and so does an import inside a function,
which hides a cycle from Python at import time but not from a reader.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APPS = [
    "accounts",
    "models_registry",
    "routing",
    "metering",
    "rollouts",
    "engine_nodes",
    "batches",
    "drills",
    "console",
]
FORBIDDEN = {
    "django",
    "rest_framework",
    "channels",
    "celery",
    "redis",
    "httpx",
    "requests",
    "aiohttp",
    "urllib3",
    "psycopg",
    "psycopg2",
    "uvicorn",
    "daphne",
    "drf_spectacular",
}


def forbidden_imports(source: str) -> list[str]:
    """Return the forbidden top-level packages that ``source`` imports."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.extend(name for name in names if name.split(".")[0] in FORBIDDEN)
    return found


def domain_modules() -> list[Path]:
    return sorted(
        path for app in APPS for path in (ROOT / app / "domain").rglob("*.py")
    )


def test_every_app_has_a_domain_package() -> None:
    for app in APPS:
        assert (ROOT / app / "domain" / "__init__.py").is_file(), app


@pytest.mark.parametrize(
    "path", domain_modules(), ids=lambda p: str(p.relative_to(ROOT))
)
def test_domain_module_imports_no_framework(path: Path) -> None:
    assert forbidden_imports(path.read_text()) == []


def test_domain_module_may_import_other_domains_only() -> None:
    for path in domain_modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                top = node.module.split(".")[0]
                if top in APPS:
                    assert ".domain" in node.module, f"{path}: imports {node.module}"


@pytest.mark.parametrize(
    "source",
    [
        "import django",
        "from django.db import models",
        "import redis.asyncio as redis",
        "from rest_framework import serializers",
        "def f():\n    import httpx\n",
        "from celery import shared_task",
    ],
)
def test_forbidden_imports_catches_framework_imports(source: str) -> None:
    assert forbidden_imports(source)


def test_forbidden_imports_allows_stdlib_and_domains() -> None:
    source = "import hashlib\nfrom accounts.domain.keys import hash_secret\nfrom . import x\n"
    assert forbidden_imports(source) == []


# -- no import cycles between apps ------------------------------------------------


def imported_modules(source: str) -> list[tuple[str, int]]:
    """Return ``(module, line)`` for every absolute import in ``source``, nested too."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def app_graph(
    root: Path, apps: Iterable[str] = APPS
) -> dict[tuple[str, str], list[str]]:
    """Return the imports between ``apps`` under ``root``, each with its sites.

    Keys are (importer, imported) pairs of apps; values are the ``path:line`` of each
    such import. ``config`` is the project, not an app: it wires the apps together
    and lends them its errors and API helpers, so it is no node of the graph.
    """
    names = set(apps)
    edges: dict[tuple[str, str], list[str]] = {}
    for app in sorted(names):
        for path in sorted((root / app).rglob("*.py")):
            for module, line in imported_modules(path.read_text()):
                target = module.split(".")[0]
                if target in names and target != app:
                    site = f"{path.relative_to(root)}:{line}"
                    edges.setdefault((app, target), []).append(site)
    return edges


def find_cycle(edges: Mapping[tuple[str, str], object]) -> list[str] | None:
    """Return one cycle of the graph as ``[a, b, ..., a]``, or None if it has none."""
    targets: dict[str, list[str]] = {}
    for source, target in sorted(edges):
        targets.setdefault(source, []).append(target)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in targets.get(node, []):
            cycle = visit(target, [*path, node])
            if cycle is not None:
                return cycle
        done.add(node)
        return None

    for node in sorted(targets):
        cycle = visit(node, [])
        if cycle is not None:
            return cycle
    return None


def test_apps_import_each_other_without_cycles() -> None:
    edges = app_graph(ROOT)
    cycle = find_cycle(edges) or []
    sites = [f"{a} -> {b}: {', '.join(edges[a, b])}" for a, b in pairwise(cycle)]
    assert cycle == [], "import cycle between apps:\n" + "\n".join(sites)


def test_rollouts_depend_on_the_registry_never_the_reverse() -> None:
    edges = app_graph(ROOT)
    assert ("rollouts", "models_registry") in edges
    assert ("models_registry", "rollouts") not in edges


def test_product_code_and_bench_import_nothing_from_tests() -> None:
    """The benchmarks and every app's non-test modules run without the test tree.

    A line of text is read, not the syntax tree, so code that bench/ hands to
    ``manage.py shell -c`` as a string counts too.
    """
    importing = re.compile(r"^\s*(from|import) tests\b", re.MULTILINE)
    modules = [*(ROOT / "bench").rglob("*.py")]
    for app in APPS:
        modules += [
            path
            for path in (ROOT / app).rglob("*.py")
            if "tests" not in path.relative_to(ROOT).parts
        ]
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted(modules)
        if importing.search(path.read_text())
    ]
    assert offenders == []


def test_find_cycle_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "shop").mkdir()
    (tmp_path / "stock").mkdir()
    (tmp_path / "shop" / "services.py").write_text("from stock.models import Item\n")
    (tmp_path / "stock" / "services.py").write_text(
        "def reorder():\n    from shop import services\n"
    )
    edges = app_graph(tmp_path, apps=["shop", "stock"])
    assert find_cycle(edges) == ["shop", "stock", "shop"]
    assert edges["stock", "shop"] == ["stock/services.py:2"]


def test_find_cycle_accepts_a_layered_graph() -> None:
    edges: dict[tuple[str, str], list[str]] = {
        ("a", "b"): [],
        ("b", "c"): [],
        ("a", "c"): [],
        ("d", "a"): [],
    }
    assert find_cycle(edges) is None
    assert find_cycle({**edges, ("c", "d"): []}) == ["a", "b", "c", "d", "a"]
