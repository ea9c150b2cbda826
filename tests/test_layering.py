"""The pure-core rule: nothing under */domain/ imports a framework, a store or HTTP."""

from __future__ import annotations

import ast
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
    "drills",
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
    found = []
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


def test_every_app_has_a_domain_package():
    for app in APPS:
        assert (ROOT / app / "domain" / "__init__.py").is_file(), app


@pytest.mark.parametrize(
    "path", domain_modules(), ids=lambda p: str(p.relative_to(ROOT))
)
def test_domain_module_imports_no_framework(path: Path):
    assert forbidden_imports(path.read_text()) == []


def test_domain_module_may_import_other_domains_only():
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
def test_forbidden_imports_catches_framework_imports(source: str):
    assert forbidden_imports(source)


def test_forbidden_imports_allows_stdlib_and_domains():
    source = "import hashlib\nfrom accounts.domain.keys import hash_secret\nfrom . import x\n"
    assert forbidden_imports(source) == []
