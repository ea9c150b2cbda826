"""The gateways teams would pick instead of ours, as targets of ``bench/gateway.py``.

Public surface: ``PEERS``, ``PeerUnavailable``, ``Launch``, ``install``, ``launch``,
``version``, ``litellm_config``.

Two peers, each relaying the same fake upstreams to the same load generator as our
gateway (issue 20):

- **litellm**: the LiteLLM proxy (``litellm[proxy]`` from PyPI), one worker, no
  database: a master key and the model ``chat-7b`` as one deployment per upstream
  (``hosted_vllm/``, its router spreads requests over them);
- **smg**: SMG, the Rust router (``smg`` from PyPI), ``smg launch --policy
  round_robin`` over the upstreams, its metrics on a free loopback port. It does
  no auth, limits or metering.

Each is installed on first use into a venv of its own, ``.local/peers/<name>/``, so
that neither can touch the project's ``.venv`` and a broken release of one does not
stop the bench: ``install`` raises ``PeerUnavailable`` with the reason (and the
install log's path), and the bench goes on without that peer. A finished install
leaves a stamp naming the package; delete the venv to reinstall.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from localrun.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = ROOT / ".local" / "peers"
MODEL = "chat-7b"
LITELLM_KEY = "sk-bench-peer"
# The fake upstream sends the same token (" word") every time; LiteLLM ends a stream
# that repeats one chunk REPEATED_STREAMING_CHUNK_LIMIT times (100 by default) as a
# model stuck in a loop. A 300-token answer must get through.
REPEATED_CHUNK_LIMIT = 1_000_000
# Variables of the caller's shell that would make a peer reach for state the bench
# does not give it (LiteLLM opens a database when DATABASE_URL is set).
_DROPPED_ENV = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV")


class PeerUnavailable(RuntimeError):
    """A peer that could not be installed or found: the bench skips it."""


@dataclass(frozen=True)
class Peer:
    name: str
    package: str  # what pip installs
    executable: str  # the console script in the venv's bin/

    @property
    def venv(self) -> Path:
        return PEERS_DIR / self.name

    @property
    def binary(self) -> Path:
        return self.venv / "bin" / self.executable

    @property
    def stamp(self) -> Path:
        return self.venv / ".bench-installed"


PEERS: dict[str, Peer] = {
    "litellm": Peer("litellm", "litellm[proxy]", "litellm"),
    "smg": Peer("smg", "smg", "smg"),
}


@dataclass
class Launch:
    """How to start one peer and talk to it."""

    argv: list[str]
    env: dict[str, str]
    health_url: str
    # What the load generator sends as its bearer token ("none": the peer has no auth).
    key: str
    cwd: Path = field(default=PEERS_DIR)


def install(name: str, *, timeout_s: float = 1200.0) -> Path:
    """Return the peer's executable, installing its venv first if need be.

    Raises ``PeerUnavailable`` when the venv cannot be made or pip fails.
    """
    peer = PEERS[name]
    if peer.stamp.exists() and peer.binary.exists():
        return peer.binary
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    log_path = PEERS_DIR / f"{name}-install.log"
    print(f"installing {peer.package} into {peer.venv} (once)", flush=True)
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(peer.venv)],
        [str(peer.venv / "bin" / "python"), "-m", "pip", "install", "-q", "-U", "pip"],
        [str(peer.venv / "bin" / "python"), "-m", "pip", "install", "-q", peer.package],
    ]
    with log_path.open("w") as log:
        for argv in steps:
            try:
                done = subprocess.run(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                    env=_clean_env(),
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise PeerUnavailable(
                    f"{peer.package}: {' '.join(argv[-3:])} failed ({exc}); "
                    f"see {log_path}"
                ) from exc
            if done.returncode != 0:
                raise PeerUnavailable(
                    f"{peer.package}: {' '.join(argv[-3:])} exited "
                    f"{done.returncode}; see {log_path}"
                )
    if not peer.binary.exists():
        raise PeerUnavailable(f"{peer.package} installed no {peer.binary}")
    peer.stamp.write_text(peer.package + "\n")
    return peer.binary


def version(name: str) -> str | None:
    """The installed release of a peer (for the results), or None."""
    peer = PEERS[name]
    python = peer.venv / "bin" / "python"
    if not python.exists():
        return None
    distribution = peer.package.split("[")[0]
    try:
        done = subprocess.run(
            [
                str(python),
                "-c",
                f"import importlib.metadata as m; print(m.version({distribution!r}))",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def launch(name: str, port: int, upstreams: list[str]) -> Launch:
    """Install the peer if need be and return how to start it on ``port``.

    ``upstreams`` are base URLs of the fake upstreams (``http://127.0.0.1:P``).
    """
    binary = install(name)
    url = f"http://127.0.0.1:{port}"
    env = _clean_env()
    if name == "litellm":
        config = PEERS_DIR / f"litellm-{port}.yaml"
        config.write_text(yaml.safe_dump(litellm_config(upstreams), sort_keys=False))
        env.update(
            REPEATED_STREAMING_CHUNK_LIMIT=str(REPEATED_CHUNK_LIMIT),
            # Use the cost map in the package: this machine may have no way out.
            LITELLM_LOCAL_MODEL_COST_MAP="True",
            LITELLM_TELEMETRY="False",
            LITELLM_LOG="ERROR",
        )
        argv = [
            str(binary),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ]
        return Launch(argv, env, f"{url}/health/liveliness", LITELLM_KEY)
    if name == "smg":
        argv = [
            str(binary),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *upstreams,
            "--policy",
            "round_robin",
            "--log-level",
            "warn",
            # Its metrics listener is 0.0.0.0:29000 by default: two at once clash.
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ]
        return Launch(argv, env, f"{url}/health", "none")
    raise KeyError(name)


def litellm_config(upstreams: list[str]) -> dict[str, object]:
    """LiteLLM's proxy config: one deployment of the model per upstream, no database."""
    return {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"hosted_vllm/{MODEL}",
                    "api_base": f"{upstream.rstrip('/')}/v1",
                    "api_key": "none",
                },
            }
            for upstream in upstreams
        ],
        "general_settings": {"master_key": LITELLM_KEY},
        "litellm_settings": {"drop_params": True, "set_verbose": False},
    }


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    # The peer's own venv, not the project's, comes first on PATH.
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if "/.venv/" not in p + "/"
    )
    return env
