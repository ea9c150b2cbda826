"""Start and stop engine replicas: local processes, or Deployments on Kubernetes.

Public surface: ``Actuator``, ``ReplicaHandle``, ``LocalProcessActuator``,
``KubernetesActuator``, ``AppsV1Like``, ``CoreV1Like``, ``ReplicaLedger``,
``DrainOptions``, ``VLLM_OFFLINE_ENV``, ``REPLICA_ENV_DROPPED``.

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

``KubernetesActuator`` manages one Deployment per pool through an ``AppsV1Api``-like
object that the caller builds; this module never imports the ``kubernetes``
package, so the platform runs without it. ``follow_pool`` keeps a Deployment's
replicas at the pool's target (``engine_nodes.services.follow_pools_on_kubernetes``
passes ``Pool.target_replicas``), with a scale patch when only the count moved.
Given a ``CoreV1Api``-like object and a ``ReplicaLedger`` (the platform's
replicas), it never lets the ReplicaSet controller pick the pod a scale-down
removes: it interprets ``engine_nodes.domain.k8s_drain.drain_steps`` (drain the
chosen pod's replica, set its pod-deletion-cost, then scale down by one).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from engine_nodes.domain.k8s import (
    SPEC_DIGEST_ANNOTATION,
    FollowAction,
    PoolSpec,
    follow_action,
    pool_labels,
    render_deployment,
    scale_body,
)
from engine_nodes.domain.k8s_drain import (
    DELETION_COST_ANNOTATION,
    DRAINING_SINCE_ANNOTATION,
    AnnotatePod,
    Decision,
    Effect,
    MarkDraining,
    PodView,
    PoolFacts,
    ReplicaLoad,
    Scale,
    Step,
    drain_steps,
)
from engine_nodes.domain.liveness import ReplicaState
from engine_nodes.domain.replica_argv import (
    DEFAULT_SIM_PROFILE,
    ReplicaSpec,
    engine_for,
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
        # One agent's own: another agent's replicas are never its leftovers.
        self.pid_dir = Path(pid_dir) if pid_dir is not None else self.log_dir / "pids"

    def argv_for(self, spec: ReplicaSpec) -> list[str]:
        """Return the argv ``start`` would run for ``spec``.

        Raises:
            ValueError: the spec's engine config is unusable (see ``replica_argv``).
        """
        config_file = str(self.secret_path(spec)) if self._key_in_file(spec) else None
        if self.kind == "vllm":
            if engine_for(spec) == "sglang":
                return sglang_launch_argv(
                    spec, python=self.sglang_python, config_file=config_file
                )
            return vllm_serve_argv(spec, vllm_executable=self.vllm_executable)
        return sim_replica_argv(
            spec, python=self.python, profile=self.sim_profile, config_file=config_file
        )

    def secret_path(self, spec: ReplicaSpec) -> Path:
        """Return where an SGLang replica's API key file is written."""
        return self.log_dir / f"{_file_name(spec.replica_id)}.sglang.yaml"

    def environment(self, spec: ReplicaSpec | None = None) -> dict[str, str]:
        """Return the environment a replica of this kind (and ``spec``'s engine)
        starts with."""
        env = {k: v for k, v in os.environ.items() if k not in REPLICA_ENV_DROPPED}
        env["PYTHONUNBUFFERED"] = "1"  # logs reach the file as they are written
        # An SGLang replica's key is in its --config file; no engine key in env.
        sglang = spec is not None and engine_for(spec) == "sglang"
        if sglang:
            env.pop("VLLM_API_KEY", None)
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


class AppsV1Like(Protocol):
    """The part of ``kubernetes.client.AppsV1Api`` the actuator uses.

    Absent objects raise an exception whose ``status`` is 404, as
    ``kubernetes.client.exceptions.ApiException`` does.
    """

    def read_namespaced_deployment(self, name: str, namespace: str) -> Any: ...

    def create_namespaced_deployment(self, namespace: str, body: Any) -> Any: ...

    def patch_namespaced_deployment(
        self, name: str, namespace: str, body: Any
    ) -> Any: ...

    def patch_namespaced_deployment_scale(
        self, name: str, namespace: str, body: Any
    ) -> Any: ...

    def delete_namespaced_deployment(self, name: str, namespace: str) -> Any: ...


class CoreV1Like(Protocol):
    """The part of ``kubernetes.client.CoreV1Api`` the drain uses (pods: list, patch)."""

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> Any: ...

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any) -> Any: ...


class ReplicaLedger(Protocol):
    """The platform's side of a drain: its replicas, keyed by pod name."""

    def loads(self, replica_ids: Collection[str]) -> Mapping[str, ReplicaLoad]:
        """Return what is known of each replica (absent: no row, no beat)."""
        ...

    def mark_draining(self, replica_id: str) -> bool:
        """Take the replica out of every gateway's ring; False if it moved meanwhile."""
        ...

    def mark_serving(self, replica_id: str) -> bool:
        """Put a draining replica back in the rings; False if it moved meanwhile."""
        ...


@dataclass(frozen=True, slots=True)
class DrainOptions:
    """How a Deployment scale-down drains: the deadline, the settle time, retries.

    ``settle_s``: how long a drained replica stays after its last stream, so the
    gateways' snapshots have dropped it; ``conflict_retries``: reads and decides
    again after this many 409s (another writer moved the Deployment meanwhile).
    """

    drain_timeout_s: float
    settle_s: float = 0.0
    conflict_retries: int = 3


class _Conflict(Exception):
    """A write lost to another writer (409): read again, decide again."""


class KubernetesActuator:
    """Keep one Deployment per pool in ``namespace`` equal to its ``PoolSpec``.

    Build it with ``KubernetesActuator(kubernetes.client.AppsV1Api(), "serving")``
    after ``kubernetes.config.load_incluster_config()`` (or a kubeconfig). With
    ``core`` (a ``CoreV1Api``), ``ledger`` and ``drain``, a scale-down drains the
    pod that leaves first (``engine_nodes.domain.k8s_drain``); without them,
    Kubernetes picks the pod, as before.
    """

    def __init__(
        self,
        api: AppsV1Like,
        namespace: str,
        *,
        core: CoreV1Like | None = None,
        ledger: ReplicaLedger | None = None,
        drain: DrainOptions | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if (core is None) != (ledger is None) or (core is None) != (drain is None):
            raise ValueError("core, ledger and drain go together")
        self.api = api
        self.namespace = namespace
        self.core = core
        self.ledger = ledger
        self.drain = drain
        self.clock = clock

    def apply_pool(self, spec: PoolSpec) -> str:
        """Create the pool's Deployment, or patch it if it exists; return its name.

        A create that loses a race to another writer (409) falls back to a patch.
        """
        manifest = render_deployment(namespace=self.namespace, spec=spec)
        name: str = manifest["metadata"]["name"]
        try:
            self.api.read_namespaced_deployment(name=name, namespace=self.namespace)
        except Exception as exc:
            if _status(exc) != 404:
                raise
            try:
                self.api.create_namespaced_deployment(
                    namespace=self.namespace, body=manifest
                )
            except Exception as create_exc:
                if _status(create_exc) != 409:
                    raise
            else:
                logger.info("created deployment %s/%s", self.namespace, name)
                return name
        self.api.patch_namespaced_deployment(
            name=name, namespace=self.namespace, body=manifest
        )
        logger.info("patched deployment %s/%s", self.namespace, name)
        return name

    def scale_pool(
        self, name: str, replicas: int, *, resource_version: str | None = None
    ) -> None:
        """Set the Deployment's replica count through its scale subresource.

        With ``resource_version``, the API refuses (409) if the Deployment changed
        since it was read at that version.
        """
        body = scale_body(replicas)
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        self.api.patch_namespaced_deployment_scale(
            name=name, namespace=self.namespace, body=body
        )

    def follow_pool(self, spec: PoolSpec) -> FollowAction:
        """Bring the pool's Deployment to ``spec`` (its replicas included); say how.

        One read, then at most one write: a create, a whole patch when the
        manifest changed beyond its replica count, or a scale patch when only the
        count differs (``engine_nodes.domain.k8s.follow_action``). A create that
        loses a race to another writer (409) falls back to a whole patch. With a
        drain, a whole patch keeps the live count when it is above the target, and
        the count moves by ``drain_steps``, each write of it retried (read and
        decided again) on a 409.
        """
        for attempt in range(self.drain.conflict_retries + 1 if self.drain else 1):
            try:
                return self._follow_once(spec)
            except _Conflict:
                logger.info(
                    "deployment %s/%s changed meanwhile (409, try %d)",
                    self.namespace,
                    spec.name,
                    attempt + 1,
                )
        raise RuntimeError(f"deployment {spec.name}: too many conflicts")

    def _follow_once(self, spec: PoolSpec) -> FollowAction:
        manifest = render_deployment(namespace=self.namespace, spec=spec)
        name: str = manifest["metadata"]["name"]
        try:
            live = self.api.read_namespaced_deployment(
                name=name, namespace=self.namespace
            )
        except Exception as exc:
            if _status(exc) != 404:
                raise
            live = None
        metadata = _field(live, "metadata")
        annotations = _field(metadata, "annotations") or {}
        live_replicas = _field(_field(live, "spec"), "replicas")
        action = follow_action(
            manifest,
            existing_digest=annotations.get(SPEC_DIGEST_ANNOTATION),
            existing_replicas=live_replicas,
            is_present=live is not None,
        )
        action = self._write(manifest, action, live_replicas)
        if action in (FollowAction.SCALE, FollowAction.NONE) and self.drain:
            version = _read(metadata, "resourceVersion")
            scaled = self._drain_tick(spec, live_replicas or 0, version)
            action = FollowAction.SCALE if scaled else FollowAction.NONE
        if action != FollowAction.NONE:
            logger.info(
                "%s deployment %s/%s (replicas %d)",
                action,
                self.namespace,
                name,
                spec.replicas,
            )
        return action

    def _write(
        self, manifest: dict[str, Any], action: FollowAction, live_replicas: Any
    ) -> FollowAction:
        """Create or patch the Deployment as ``action`` says; return what was done.

        A patch leaves the count to the next tick's drain when it would lower it.
        """
        name: str = manifest["metadata"]["name"]
        if action == FollowAction.CREATE:
            try:
                self.api.create_namespaced_deployment(
                    namespace=self.namespace, body=manifest
                )
            except Exception as exc:
                if _status(exc) != 409:
                    raise
                action = FollowAction.PATCH
        if action == FollowAction.PATCH:
            if (
                self.drain is not None
                and (live_replicas or 0) > (manifest["spec"]["replicas"])
            ):
                # Down only through the drain: a whole patch would let the
                # controller pick the pod.
                manifest["spec"]["replicas"] = live_replicas
            self.api.patch_namespaced_deployment(
                name=name, namespace=self.namespace, body=manifest
            )
        elif action == FollowAction.SCALE and self.drain is None:
            self.scale_pool(name, manifest["spec"]["replicas"])
        return action

    def pool_facts(self, spec: PoolSpec, replicas: int, *, now: float) -> PoolFacts:
        """Return the facts ``drain_steps`` decides on: the pods and their replicas."""
        assert self.core is not None and self.ledger is not None
        assert self.drain is not None
        selector = ",".join(f"{k}={v}" for k, v in pool_labels(spec).items())
        listed = self.core.list_namespaced_pod(
            namespace=self.namespace, label_selector=selector
        )
        pods = [_pod_view(item) for item in _field(listed, "items") or []]
        loads = self.ledger.loads([p.pod for p, _ in pods])
        hashes = {h for p, h in pods if not p.is_terminating}
        return PoolFacts(
            replicas=replicas,
            target=spec.replicas,
            pods=tuple(_with_load(p, loads.get(p.pod)) for p, _ in pods),
            now=now,
            drain_timeout_s=self.drain.drain_timeout_s,
            settle_s=self.drain.settle_s,
            is_rolling_out=len(hashes) > 1,
        )

    def _drain_tick(self, spec: PoolSpec, replicas: int, version: str | None) -> bool:
        """Perform one tick of ``drain_steps``; return whether it scaled."""
        now = self.clock()
        steps = drain_steps(self.pool_facts(spec, replicas, now=now))
        scaled = False
        answer: bool | None = None
        while True:
            try:
                effect = next(steps) if answer is None else steps.send(answer)
            except StopIteration as stop:
                decision: Decision = stop.value
                break
            answer = self._perform(spec.name, effect, version)
            scaled = scaled or (isinstance(effect, Scale) and answer)
        if decision.step != Step.CONVERGED:
            logger.info(
                "deployment %s/%s: %s %s",
                self.namespace,
                spec.name,
                decision.step,
                decision.pod or "",
            )
        return scaled

    def _perform(self, name: str, effect: Effect, version: str | None) -> bool:
        """Perform one effect on the API and the ledger; return whether it was done."""
        assert self.core is not None and self.ledger is not None
        try:
            if isinstance(effect, Scale):
                self.scale_pool(name, effect.replicas, resource_version=version)
            elif isinstance(effect, AnnotatePod):
                cost = str(effect.cost) if effect.cost else None  # 0: the default
                self._annotate(effect.pod, {DELETION_COST_ANNOTATION: cost})
            elif isinstance(effect, MarkDraining):
                if not self.ledger.mark_draining(effect.replica_id):
                    return False
                # The stamp after the ledger: a pod stamped draining is out of
                # the rings; a restart re-reads the deadline from it.
                self._annotate(effect.pod, {DRAINING_SINCE_ANNOTATION: f"{effect.at}"})
            else:
                self._annotate(effect.pod, {DRAINING_SINCE_ANNOTATION: None})
                return self.ledger.mark_serving(effect.replica_id)
        except Exception as exc:
            if _status(exc) == 409:
                raise _Conflict from exc
            if _status(exc) == 404 and not isinstance(effect, Scale):
                return False  # the pod is gone meanwhile
            raise
        return True

    def _annotate(self, pod: str, annotations: dict[str, str | None]) -> None:
        assert self.core is not None
        self.core.patch_namespaced_pod(
            name=pod,
            namespace=self.namespace,
            body={"metadata": {"annotations": annotations}},
        )

    def delete_pool(self, name: str) -> bool:
        """Delete the Deployment; return False if it was already gone."""
        try:
            self.api.delete_namespaced_deployment(name=name, namespace=self.namespace)
        except Exception as exc:
            if _status(exc) != 404:
                raise
            return False
        logger.info("deleted deployment %s/%s", self.namespace, name)
        return True


def _field(obj: Any, name: str) -> Any:
    """Return ``obj[name]`` of a dict, or ``obj.name`` of a client model; None if absent.

    The official client returns models (``V1Deployment``); a dict stands in for
    one in tests and in callers that read the API's JSON. The names used here
    (metadata, annotations, spec, replicas) are the same in both spellings.
    """
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _read(obj: Any, name: str) -> Any:
    """Return a field by its API name (``creationTimestamp``) from a dict, or by
    the client model's (``creation_timestamp``); None if absent."""
    if isinstance(obj, Mapping) or obj is None:
        return _field(obj, name)
    return _field(obj, re.sub(r"([A-Z])", r"_\1", name).lower())


def _epoch(value: Any) -> float | None:
    """Return a timestamp (RFC 3339 text or ``datetime``) as seconds since the epoch."""
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return float(value.timestamp())


def _pod_view(pod: Any) -> tuple[PodView, str]:
    """Return a pod as the drain sees it (its replica: so far unknown), and its
    ``pod-template-hash`` (two of them: a rollout is moving the pool)."""
    metadata = _read(pod, "metadata")
    name = str(_read(metadata, "name"))
    annotations = _read(metadata, "annotations") or {}
    labels = _read(metadata, "labels") or {}
    status = _read(pod, "status")
    conditions = _read(status, "conditions") or []
    is_ready = _read(status, "phase") == "Running" and any(
        _read(c, "type") == "Ready" and _read(c, "status") == "True" for c in conditions
    )
    since = annotations.get(DRAINING_SINCE_ANNOTATION)
    try:
        cost = int(annotations.get(DELETION_COST_ANNOTATION, 0))
    except ValueError:
        cost = 0
    view = PodView(
        pod=name,
        replica_id=name,
        state=ReplicaState.SERVING if is_ready else ReplicaState.STARTING,
        is_ready=is_ready,
        is_terminating=_read(metadata, "deletionTimestamp") is not None,
        # Unknown until the ledger says: never taken for zero.
        streams=None,
        created_at=_epoch(_read(metadata, "creationTimestamp")) or 0.0,
        draining_since=float(since) if since else None,
        deletion_cost=cost,
    )
    return view, str(labels.get("pod-template-hash", ""))


def _with_load(pod: PodView, load: ReplicaLoad | None) -> PodView:
    """Return ``pod`` with its replica's state and streams from the ledger."""
    state = pod.state if load is None else load.state
    if pod.draining_since is not None:
        state = ReplicaState.DRAINING
    elif not pod.is_ready:
        state = ReplicaState.STARTING
    return replace(
        pod,
        state=state,
        streams=None if load is None else load.streams,
        tokens_in_flight=0 if load is None else load.tokens_in_flight,
    )


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None
