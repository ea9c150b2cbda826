"""Start and stop engine replicas as local processes.

Public surface: ``Actuator``, ``ReplicaHandle``, ``LocalProcessActuator``,
``VLLM_OFFLINE_ENV``, ``REPLICA_ENV_DROPPED``; Kubernetes Deployments are
``engine_nodes.kubernetes_actuator``'s.

``LocalProcessActuator`` runs each replica as its own session (``setsid``), so the
replica and everything it spawns (vLLM's EngineCore and workers) form one process
group that ``stop`` signals as a whole: SIGTERM, up to ``grace_s`` for the group to
exit, then SIGKILL for whatever is left. Output goes to ``<log_dir>/<replica>.log``.
Secrets never enter a replica's argv (which every user of the machine can read in
the process list): a vLLM replica gets the engine key as ``VLLM_API_KEY`` (vLLM's
own variable for ``--api-key``, which the simulated replica reads too); an SGLang
replica, which reads no such variable, gets it in a file only the agent's user
can read (``<log_dir>/<replica>.sglang.yaml``, mode 0600, ``{"api-key": ...}``
in JSON, which is YAML too; SGLang takes only a YAML-named ``--config``, its file of
server arguments), removed when the replica stops. Simulated replicas get the admin token of ``/sim/faults`` as
``SIM_ADMIN_TOKEN``.
The platform's own secrets in the agent's environment (``REPLICA_ENV_DROPPED``:
the database and Redis URLs, the signing key, the metrics token) are not passed on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from engine_nodes.domain.replica_argv import (
    DEFAULT_SIM_PROFILE,
    ReplicaSpec,
    engine_for,
    engine_trace_args,
    engine_trace_env,
    sglang_launch_argv,
    sim_replica_argv,
    vllm_serve_argv,
)

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent

# From the vLLM CPU research note: stay offline, send no usage stats, and keep the
# engine's internal message queue on loopback instead of the node's interface.
VLLM_OFFLINE_ENV: Mapping[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
}
# The agent's secrets a replica has no use for: it talks to no database and no
# Redis, signs nothing, and gets its engine key and admin token under its own names.
REPLICA_ENV_DROPPED = frozenset(
    name
    for base in (
        "DATABASE_URL",
        "REDIS_URL",
        "SECRET_KEY",
        "PLATFORM_ENGINE_API_KEY",
        "PLATFORM_SIM_ADMIN_TOKEN",
        "PLATFORM_METRICS_TOKEN",
    )
    for name in (base, f"{base}_FILE")
)
_GROUP_POLL_S = 0.05
_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True, eq=False)
class ReplicaHandle:
    """A started replica: its id, argv, log file and the process behind it."""

    replica_id: str
    argv: tuple[str, ...]
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)
    # The 0600 file holding an SGLang replica's API key (removed at stop), or None.
    secret_path: Path | None = None

    @property
    def pid(self) -> int:
        """Return the leader's pid, which is also the process group id."""
        return self.process.pid


class Actuator(Protocol):
    """Starts and stops one node's replicas."""

    def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        """Start the replica ``spec`` describes; return at once (no health wait)."""
        ...

    def stop(self, handle: ReplicaHandle, *, grace_s: float) -> None:
        """SIGTERM the replica, SIGKILL it after ``grace_s``; return once it is gone."""
        ...

    def is_running(self, handle: ReplicaHandle) -> bool:
        """Return True while the replica's process has not exited."""
        ...

    def exit_code(self, handle: ReplicaHandle) -> int | None:
        """Return the exit status (negative: killed by that signal), None if running."""
        ...

    def stop_leftovers(self, *, keep: Collection[str], grace_s: float) -> list[str]:
        """Stop the replicas a previous life of this agent started and left running
        (all but ``keep``); return their ids."""
        ...


class LocalProcessActuator:
    """Run replicas as child processes of the node agent.

    ``kind="sim"`` runs ``python -m simengine`` from the project root (with
    ``--sim-engine sglang`` for a version whose engine is SGLang);
    ``kind="vllm"`` runs the real engines: ``vllm serve`` with ``VLLM_OFFLINE_ENV``
    on top of the agent's environment (an empty ``VLLM_CPU_KVCACHE_SPACE`` is
    dropped: vLLM's CPU worker crashes on it), or ``sglang_python -m
    sglang.launch_server`` for an SGLang version. ``env`` adds or overrides
    variables for both kinds. ``engine_api_key`` is the key every replica demands
    on ``/v1`` (``VLLM_API_KEY``, or the 0600 ``--config`` file for SGLang),
    ``sim_admin_token`` becomes ``SIM_ADMIN_TOKEN`` (simulated replicas only); empty
    means none.

    Each replica's leader pid (and its start time, so that a reused pid is never
    taken for it) is kept in ``pid_dir`` while it runs. A node agent killed
    outright (SIGKILL, the OOM killer) leaves its replicas running in their own
    sessions; ``stop_leftovers``, which the next agent calls as it starts, stops
    them by those files. Without it they would serve on unseen, their GPUs and
    ports held for good, while the new agent starts their replacements.
    """

    def __init__(
        self,
        *,
        kind: Literal["sim", "vllm"] = "sim",
        python: str = sys.executable,
        log_dir: Path,
        vllm_executable: str = "vllm",
        sglang_python: str = "python3",
        sim_profile: str = DEFAULT_SIM_PROFILE,
        env: Mapping[str, str] | None = None,
        engine_api_key: str = "",
        sim_admin_token: str = "",
        cwd: Path = ROOT,
        pid_dir: Path | None = None,
        otlp_traces_endpoint: str = "",
    ) -> None:
        if kind not in ("sim", "vllm"):
            raise ValueError(f"kind must be 'sim' or 'vllm', not {kind!r}")
        self.kind = kind
        self.python = python
        self.log_dir = Path(log_dir)
        self.vllm_executable = vllm_executable
        self.sglang_python = sglang_python
        self.sim_profile = sim_profile
        self.env = dict(env or {})
        self.engine_api_key = engine_api_key
        self.sim_admin_token = sim_admin_token
        self.cwd = cwd
        # Where engines export their own spans (OTLP/HTTP): vLLM's and the
        # simulator's --otlp-traces-endpoint, SGLang's with --enable-trace.
        self.otlp_traces_endpoint = otlp_traces_endpoint
        # One agent's own: another agent's replicas are never its leftovers.
        self.pid_dir = Path(pid_dir) if pid_dir is not None else self.log_dir / "pids"

    def argv_for(self, spec: ReplicaSpec) -> list[str]:
        """Return the argv ``start`` would run for ``spec``.

        Raises:
            ValueError: the spec's engine config is unusable (see ``replica_argv``).
        """
        config_file = str(self.secret_path(spec)) if self._key_in_file(spec) else None
        engine = engine_for(spec)
        if self.kind == "vllm":
            if engine == "sglang":
                return [
                    *sglang_launch_argv(
                        spec, python=self.sglang_python, config_file=config_file
                    ),
                    *engine_trace_args("sglang", self.otlp_traces_endpoint),
                ]
            return [
                *vllm_serve_argv(spec, vllm_executable=self.vllm_executable),
                *engine_trace_args("vllm", self.otlp_traces_endpoint),
            ]
        # A simulated SGLang replica takes SGLang's flags, and the simulator
        # knows no --enable-trace: it exports no spans.
        return [
            *sim_replica_argv(
                spec,
                python=self.python,
                profile=self.sim_profile,
                config_file=config_file,
            ),
            *(
                engine_trace_args("sim", self.otlp_traces_endpoint)
                if engine != "sglang"
                else []
            ),
        ]

    def secret_path(self, spec: ReplicaSpec) -> Path:
        """Return where an SGLang replica's API key file is written."""
        return self.log_dir / f"{_file_name(spec.replica_id)}.sglang.yaml"

    def environment(self, spec: ReplicaSpec | None = None) -> dict[str, str]:
        """Return the environment a replica of this kind (and ``spec``'s engine)
        starts with."""
        env = {k: v for k, v in os.environ.items() if k not in REPLICA_ENV_DROPPED}
        env["PYTHONUNBUFFERED"] = "1"  # logs reach the file as they are written
        # An SGLang replica's key is in its --config file; no engine key in env.
        engine = engine_for(spec) if spec is not None else "vllm"
        sglang = engine == "sglang"
        if sglang:
            env.pop("VLLM_API_KEY", None)
        if self.kind == "vllm":
            env.update(engine_trace_env(engine, self.otlp_traces_endpoint))
        if self.kind == "vllm" and not sglang:
            env.update(VLLM_OFFLINE_ENV)
            if not env.get("VLLM_CPU_KVCACHE_SPACE", "x"):
                del env["VLLM_CPU_KVCACHE_SPACE"]
        if self.engine_api_key and not sglang:
            env["VLLM_API_KEY"] = self.engine_api_key
        if self.kind == "sim" and self.sim_admin_token:
            env["SIM_ADMIN_TOKEN"] = self.sim_admin_token
        env.update(self.env)
        return env

    def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        """Spawn the replica in a new session, appending its output to its log.

        Raises:
            ValueError: the spec's engine config is unusable (see ``replica_argv``).
            OSError: the executable cannot be run.
        """
        argv = self.argv_for(spec)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{_file_name(spec.replica_id)}.log"
        secret_path = None
        if self._key_in_file(spec):
            secret_path = self.secret_path(spec)
            # JSON is YAML, and quotes the key whatever characters it holds.
            _write_private(secret_path, json.dumps({"api-key": self.engine_api_key}))
        with log_path.open("ab") as log:
            log.write(f"==> starting {shlex.join(argv)}\n".encode())
            log.flush()
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(spec),
                cwd=self.cwd,
                start_new_session=True,
            )
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        self._pid_path(spec.replica_id).write_text(
            f"{process.pid} {_start_time(process.pid)}\n"
        )
        logger.info(
            "started replica %s (pid %d, log %s)",
            spec.replica_id,
            process.pid,
            log_path,
        )
        return ReplicaHandle(
            replica_id=spec.replica_id,
            argv=tuple(argv),
            log_path=log_path,
            process=process,
            secret_path=secret_path,
        )

    def _key_in_file(self, spec: ReplicaSpec) -> bool:
        return bool(self.engine_api_key) and engine_for(spec) == "sglang"

    def stop(self, handle: ReplicaHandle, *, grace_s: float) -> None:
        """Stop the replica's process group; return once the leader is reaped.

        SIGTERM goes to the whole group. Once the leader has exited, the rest of
        the group gets what is left of ``grace_s`` to follow, then SIGKILL; a
        leader that outlives ``grace_s`` is killed with its group.
        """
        process = handle.process
        deadline = time.monotonic() + max(grace_s, 0.0)
        _signal_group(handle.pid, signal.SIGTERM)
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            logger.warning(
                "replica %s ignored SIGTERM for %.1f s; killing it",
                handle.replica_id,
                grace_s,
            )
        else:
            _wait_group_gone(handle.pid, deadline)
        # Also reaps stragglers (engine workers) that outlived a clean leader exit.
        _signal_group(handle.pid, signal.SIGKILL)
        process.wait()
        self._pid_path(handle.replica_id).unlink(missing_ok=True)
        if handle.secret_path is not None:
            handle.secret_path.unlink(missing_ok=True)
        logger.info(
            "replica %s stopped (exit %s)", handle.replica_id, process.returncode
        )

    def is_running(self, handle: ReplicaHandle) -> bool:
        """Return True while the leader process has not exited."""
        return handle.process.poll() is None

    def exit_code(self, handle: ReplicaHandle) -> int | None:
        """Return the leader's exit status, or None while it runs."""
        return handle.process.poll()

    def stop_leftovers(self, *, keep: Collection[str], grace_s: float) -> list[str]:
        """Stop each replica a previous agent left running (by ``pid_dir``).

        A pid file whose process is gone, or whose pid now names another process
        (its start time differs), is only removed. A leftover's group gets
        SIGTERM, up to ``grace_s`` for its leader to exit, then SIGKILL, as
        ``stop`` does; it is not this process's child, so it is not waited for.
        """
        stopped: list[str] = []
        if not self.pid_dir.is_dir():
            return stopped
        kept = {_file_name(replica_id) for replica_id in keep}
        for path in sorted(self.pid_dir.glob("*.pid")):
            if path.stem in kept:
                continue
            try:
                pid_text, started = path.read_text().split()
                pid = int(pid_text)
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            if _start_time(pid) == started and _is_group_leader(pid):
                deadline = time.monotonic() + max(grace_s, 0.0)
                _signal_group(pid, signal.SIGTERM)
                while _start_time(pid) == started and time.monotonic() < deadline:
                    # A short pause between polls of the leader, bounded by grace_s.
                    time.sleep(_GROUP_POLL_S)
                _signal_group(pid, signal.SIGKILL)
                logger.warning(
                    "stopped replica %s left running (pid %d)", path.stem, pid
                )
                stopped.append(path.stem)
            path.unlink(missing_ok=True)
        return stopped

    def _pid_path(self, replica_id: str) -> Path:
        return self.pid_dir / f"{_file_name(replica_id)}.pid"


def _file_name(replica_id: str) -> str:
    return _UNSAFE_FILE_CHARS.sub("_", replica_id)


def _start_time(pid: int) -> str:
    """Return when process ``pid`` started (clock ticks since boot, from
    ``/proc``), or "" if it is gone or a zombie: a pid and its start time name
    one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[1].split()
    # Field 3 (the state) is fields[0]; field 22 (starttime) is fields[19].
    return "" if fields[0] in ("Z", "X") else fields[19]


def _is_group_leader(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only (0600 from creation,
    so the key is never readable by others, even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        os.fchmod(file.fileno(), 0o600)  # an older file may have had another mode
        file.write(text)


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    # The group is gone once all its members have exited: nothing to signal.
    # EPERM can only mean the id now belongs to someone else's group: leave it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _wait_group_gone(pgid: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        # A short pause between polls of the group, bounded by the deadline.
        time.sleep(_GROUP_POLL_S)
