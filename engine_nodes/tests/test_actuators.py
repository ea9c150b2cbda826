"""Tests for the replica actuators: real child processes, and a recording fake API."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_nodes.actuators import LocalProcessActuator, ReplicaHandle
from engine_nodes.domain.k8s import PoolSpec, render_deployment
from engine_nodes.domain.replica_argv import ReplicaSpec
from engine_nodes.kubernetes_actuator import KubernetesActuator
from localrun.processes import wait_until

WATCHED_ENV = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "VLLM_NO_USAGE_STATS",
    "DO_NOT_TRACK",
    "VLLM_HOST_IP",
    "VLLM_CPU_KVCACHE_SPACE",
    "PYTHONUNBUFFERED",
)

# A stand-in replica. It installs its SIGTERM behaviour, starts a grandchild in its
# process group, then announces itself with an atomically renamed marker file.
FAKE_REPLICA = """\
#!{python}
import json, os, signal, subprocess, sys
from pathlib import Path

out = Path({out!r})
mode = {mode!r}


def on_term(signum, frame):
    (out / "terminated").write_text("yes")
    sys.exit(0)


if mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, on_term)
grandchild = subprocess.Popen(
    [sys.executable, "-c", "import signal; signal.pause()"]
)
state = {{
    "argv": sys.argv,
    "env": {{k: os.environ.get(k) for k in {watched!r}}},
    "pid": os.getpid(),
    "pgid": os.getpgid(0),
    "grandchild": grandchild.pid,
}}
(out / "ready.tmp").write_text(json.dumps(state))
(out / "ready.tmp").rename(out / "ready.json")
print("replica up", flush=True)
if mode == "exit":
    sys.exit(3)
while True:
    signal.pause()
"""


def make_spec(**overrides: Any) -> ReplicaSpec:
    fields: dict[str, Any] = {
        "replica_id": "chat-7b/v1/node-a:0",
        "model": "chat-7b",
        "version": "v1",
        "served_model_name": "chat-7b@v1",
        "precision": "fp16",
        "gpus_per_replica": 1,
        "engine_config": {"max_num_seqs": 32},
        "weights_dir": "/weights/abc",
        "host": "127.0.0.1",
        "port": 8123,
    }
    fields.update(overrides)
    return ReplicaSpec(**fields)


def write_fake_replica(
    tmp_path: Path, mode: str, watched: tuple[str, ...] = WATCHED_ENV
) -> tuple[Path, Path]:
    out = tmp_path / f"out-{mode}"
    out.mkdir()
    script = tmp_path / f"fake-replica-{mode}"
    script.write_text(
        FAKE_REPLICA.format(
            python=sys.executable, out=str(out), mode=mode, watched=watched
        )
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, out


def read_ready(out: Path) -> dict[str, Any]:
    path = out / "ready.json"
    wait_until(path.exists, timeout_s=15, message="the replica's ready marker")
    return json.loads(path.read_text())


def is_alive(pid: int) -> bool:
    """Return True while ``pid`` exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] != "Z"


@pytest.fixture
def handles() -> Iterator[list[tuple[LocalProcessActuator, ReplicaHandle]]]:
    """Started replicas, killed at teardown if a test left them running."""
    started: list[tuple[LocalProcessActuator, ReplicaHandle]] = []
    yield started
    for actuator, handle in started:
        actuator.stop(handle, grace_s=0)


# -- LocalProcessActuator ----------------------------------------------------------


def test_local_actuator_starts_vllm_with_exact_argv_and_offline_env(
    tmp_path: Path,
    handles: list[tuple[LocalProcessActuator, ReplicaHandle]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    script, out = write_fake_replica(tmp_path, "graceful")
    actuator = LocalProcessActuator(
        kind="vllm", vllm_executable=str(script), log_dir=tmp_path / "logs"
    )
    spec = make_spec()
    handle = actuator.start(spec)
    handles.append((actuator, handle))

    state = read_ready(out)
    assert state["argv"][1:] == [
        "serve",
        "/weights/abc",
        "--served-model-name",
        "chat-7b@v1",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--tensor-parallel-size",
        "1",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--dtype",
        "float16",
        "--max-num-seqs",
        "32",
    ]
    assert list(handle.argv) == [str(script), *state["argv"][1:]]
    assert state["env"] == {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": None,
        "PYTHONUNBUFFERED": "1",
    }
    # Its own session: the replica leads its process group.
    assert state["pgid"] == state["pid"] == handle.pid
    assert actuator.is_running(handle)
    assert actuator.exit_code(handle) is None


SECRET_ENV = (
    "VLLM_API_KEY",
    "SIM_ADMIN_TOKEN",
    "DATABASE_URL",
    "REDIS_URL",
    "SECRET_KEY_FILE",
    "PLATFORM_ENGINE_API_KEY",
    "PLATFORM_METRICS_TOKEN",
    "PLATFORM_SIM_ADMIN_TOKEN_FILE",
)


@pytest.mark.parametrize("kind", ["sim", "vllm"])
def test_local_actuator_passes_secrets_in_the_environment_never_the_argv(
    tmp_path: Path,
    handles: list[tuple[LocalProcessActuator, ReplicaHandle]],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """The engine key and the sim's admin token reach the replica under the names
    it reads; the agent's own secrets do not reach it at all."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("SIM_ADMIN_TOKEN", raising=False)
    for name in SECRET_ENV[2:]:  # the agent's own secrets
        monkeypatch.setenv(name, f"agent-{name}")
    script, out = write_fake_replica(tmp_path, "graceful", watched=SECRET_ENV)
    actuator = LocalProcessActuator(
        kind="sim" if kind == "sim" else "vllm",
        python=str(script),
        vllm_executable=str(script),
        log_dir=tmp_path / "logs",
        engine_api_key="sk-engine-secret",
        sim_admin_token="sim-admin-secret",
    )
    handle = actuator.start(make_spec())
    handles.append((actuator, handle))

    state = read_ready(out)
    assert state["env"] == {
        "VLLM_API_KEY": "sk-engine-secret",
        "SIM_ADMIN_TOKEN": "sim-admin-secret" if kind == "sim" else None,
        "DATABASE_URL": None,
        "REDIS_URL": None,
        "SECRET_KEY_FILE": None,
        "PLATFORM_ENGINE_API_KEY": None,
        "PLATFORM_METRICS_TOKEN": None,
        "PLATFORM_SIM_ADMIN_TOKEN_FILE": None,
    }
    cmdline = Path(f"/proc/{handle.pid}/cmdline").read_bytes()
    for secret in (b"sk-engine-secret", b"sim-admin-secret"):
        assert secret not in cmdline
        assert secret.decode() not in " ".join(handle.argv)
        assert secret not in handle.log_path.read_bytes()


@pytest.mark.parametrize("kind", ["sim", "vllm"])
def test_an_sglang_replica_gets_its_key_in_a_private_config_file(
    tmp_path: Path,
    handles: list[tuple[LocalProcessActuator, ReplicaHandle]],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """GIVEN a version whose engine is SGLang (which reads no VLLM_API_KEY)
    WHEN the actuator starts a replica of it (simulated or real)
    THEN the key is in a 0600 JSON file passed as --config, never in the argv, the
    log or the environment, and the file is gone once the replica stops."""
    monkeypatch.setenv("VLLM_API_KEY", "inherited-key")  # the agent's, not passed on
    script, out = write_fake_replica(tmp_path, "graceful", watched=SECRET_ENV)
    actuator = LocalProcessActuator(
        kind="sim" if kind == "sim" else "vllm",
        python=str(script),
        sglang_python=str(script),
        log_dir=tmp_path / "logs",
        engine_api_key="sk-engine-secret",
        sim_admin_token="sim-admin-secret",
    )
    spec = make_spec(engine_config={"engine": "sglang"})
    handle = actuator.start(spec)
    handles.append((actuator, handle))

    state = read_ready(out)
    argv = state["argv"][1:]
    expected_start = (
        ["-m", "simengine", "--sim-engine", "sglang"]
        if kind == "sim"
        else ["-m", "sglang.launch_server"]
    )
    assert argv[: len(expected_start)] == expected_start
    assert argv[argv.index("--model-path") + 1] == "/weights/abc"
    config = Path(argv[argv.index("--config") + 1])
    assert config == actuator.secret_path(spec) == handle.secret_path
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert json.loads(config.read_text()) == {"api-key": "sk-engine-secret"}
    assert state["env"]["VLLM_API_KEY"] is None
    assert state["env"]["SIM_ADMIN_TOKEN"] == (
        "sim-admin-secret" if kind == "sim" else None
    )
    cmdline = Path(f"/proc/{handle.pid}/cmdline").read_bytes()
    assert b"sk-engine-secret" not in cmdline
    assert b"sk-engine-secret" not in handle.log_path.read_bytes()

    actuator.stop(handle, grace_s=5)
    handles.remove((actuator, handle))
    assert not config.exists()


def test_local_actuator_writes_a_log_per_replica(
    tmp_path: Path, handles: list[tuple[LocalProcessActuator, ReplicaHandle]]
) -> None:
    script, _out = write_fake_replica(tmp_path, "graceful")
    actuator = LocalProcessActuator(
        kind="vllm", vllm_executable=str(script), log_dir=tmp_path / "logs"
    )
    handle = actuator.start(make_spec())
    handles.append((actuator, handle))

    assert handle.log_path == tmp_path / "logs" / "chat-7b_v1_node-a_0.log"
    wait_until(
        lambda: "replica up" in handle.log_path.read_text(),
        timeout_s=15,
        message="the replica's output in its log",
    )
    assert handle.log_path.read_text().startswith(f"==> starting {script} serve ")


def test_local_actuator_sim_kind_runs_the_simulator_argv(
    tmp_path: Path, handles: list[tuple[LocalProcessActuator, ReplicaHandle]]
) -> None:
    script, out = write_fake_replica(tmp_path, "graceful")
    actuator = LocalProcessActuator(
        kind="sim", python=str(script), log_dir=tmp_path / "logs"
    )
    handle = actuator.start(make_spec(weights_dir=""))
    handles.append((actuator, handle))

    state = read_ready(out)
    assert state["argv"][1:] == [
        "-m",
        "simengine",
        "--model",
        "chat-7b",
        "--served-model-name",
        "chat-7b@v1",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--sim-profile",
        "a100-8b",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-num-seqs",
        "32",
    ]
    assert state["env"]["PYTHONUNBUFFERED"] == "1"


def test_local_actuator_stop_terminates_the_whole_group(
    tmp_path: Path, handles: list[tuple[LocalProcessActuator, ReplicaHandle]]
) -> None:
    script, out = write_fake_replica(tmp_path, "graceful")
    actuator = LocalProcessActuator(
        kind="vllm", vllm_executable=str(script), log_dir=tmp_path / "logs"
    )
    handle = actuator.start(make_spec())
    handles.append((actuator, handle))
    state = read_ready(out)
    assert is_alive(state["grandchild"])

    actuator.stop(handle, grace_s=10)

    assert not actuator.is_running(handle)
    assert actuator.exit_code(handle) == 0  # its SIGTERM handler ran
    assert (out / "terminated").read_text() == "yes"
    wait_until(
        lambda: not is_alive(state["grandchild"]),
        timeout_s=10,
        message="the grandchild to exit",
    )


def test_local_actuator_stop_escalates_to_sigkill(
    tmp_path: Path, handles: list[tuple[LocalProcessActuator, ReplicaHandle]]
) -> None:
    script, out = write_fake_replica(tmp_path, "ignore")
    actuator = LocalProcessActuator(
        kind="vllm", vllm_executable=str(script), log_dir=tmp_path / "logs"
    )
    handle = actuator.start(make_spec())
    handles.append((actuator, handle))
    state = read_ready(out)

    actuator.stop(handle, grace_s=0.5)

    assert not actuator.is_running(handle)
    assert actuator.exit_code(handle) == -signal.SIGKILL
    assert not (out / "terminated").exists()
    wait_until(
        lambda: not is_alive(state["grandchild"]),
        timeout_s=10,
        message="the grandchild to be killed",
    )


def test_local_actuator_reports_an_exit_code_of_its_own(
    tmp_path: Path, handles: list[tuple[LocalProcessActuator, ReplicaHandle]]
) -> None:
    script, _out = write_fake_replica(tmp_path, "exit")
    actuator = LocalProcessActuator(
        kind="vllm", vllm_executable=str(script), log_dir=tmp_path / "logs"
    )
    handle = actuator.start(make_spec())
    handles.append((actuator, handle))

    wait_until(
        lambda: not actuator.is_running(handle),
        timeout_s=15,
        message="the replica to exit",
    )
    assert actuator.exit_code(handle) == 3


def test_a_restarted_agent_stops_the_replicas_its_previous_life_left(
    tmp_path: Path, handles: list[tuple[LocalProcessActuator, ReplicaHandle]]
) -> None:
    # GIVEN two replicas started by an agent that was then killed outright (its
    # actuator is simply dropped: nothing stops them)
    script, out = write_fake_replica(tmp_path, "graceful")
    before = LocalProcessActuator(
        kind="vllm", vllm_executable=str(script), log_dir=tmp_path / "logs"
    )
    left = before.start(make_spec())
    handles.append((before, left))
    state = read_ready(out)
    kept = before.start(make_spec(replica_id="chat-7b/v1/node-a:1"))
    handles.append((before, kept))
    # WHEN the next agent's actuator, on the same folder, stops the leftovers
    # but the ones it keeps
    after = LocalProcessActuator(
        kind="vllm", vllm_executable=str(script), log_dir=tmp_path / "logs"
    )
    stopped = after.stop_leftovers(keep=["chat-7b/v1/node-a:1"], grace_s=10)
    # THEN the leftover's whole group is gone (its SIGTERM handler ran), the kept
    # one runs on, and only the kept one's pid file remains
    assert stopped == ["chat-7b_v1_node-a_0"]
    left.process.wait(10)
    assert (out / "terminated").read_text() == "yes"
    wait_until(
        lambda: not is_alive(state["grandchild"]),
        timeout_s=10,
        message="the leftover's grandchild to exit",
    )
    assert before.is_running(kept)
    assert [p.name for p in (tmp_path / "logs" / "pids").iterdir()] == [
        "chat-7b_v1_node-a_1.pid"
    ]


def test_stop_leftovers_never_signals_a_pid_reused_by_another_process(
    tmp_path: Path,
) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # This test's own pid, but with another start time: not the replica's process.
    (pid_dir / "r0.pid").write_text(f"{os.getpid()} 1\n")
    (pid_dir / "r1.pid").write_text("not a pid\n")
    actuator = LocalProcessActuator(kind="sim", log_dir=tmp_path, pid_dir=pid_dir)

    assert actuator.stop_leftovers(keep=(), grace_s=0) == []
    assert list(pid_dir.iterdir()) == []


def test_local_actuator_refuses_an_unsafe_spec_before_spawning(tmp_path: Path) -> None:
    actuator = LocalProcessActuator(kind="vllm", log_dir=tmp_path / "logs")
    with pytest.raises(ValueError, match="the platform controls it"):
        actuator.start(make_spec(engine_config={"api_key": "x"}))
    assert not (tmp_path / "logs").exists()


def test_local_actuator_rejects_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind"):
        # Not one of the kinds the type names: the run-time check is under test.
        LocalProcessActuator(kind="docker", log_dir=tmp_path)  # type: ignore[arg-type]


def test_sim_argv_is_accepted_by_the_simulator_parser(tmp_path: Path) -> None:
    cli = pytest.importorskip("simengine.cli")
    actuator = LocalProcessActuator(kind="sim", log_dir=tmp_path)
    spec = make_spec(
        precision="int8",
        gpus_per_replica=2,
        engine_config={"max_num_batched_tokens": 8192, "enable_prefix_caching": False},
        max_model_len=32768,
    )
    args = cli.build_parser().parse_args(actuator.argv_for(spec)[3:])
    assert args.sim_profile == "h100-70b-int8-tp2"
    assert args.max_model_len == 32768
    assert args.max_num_batched_tokens == 8192
    assert args.enable_prefix_caching is False
    assert args.enable_prompt_tokens_details is True


def test_otlp_traces_endpoint_reaches_vllm_and_the_simulator(tmp_path: Path) -> None:
    cli = pytest.importorskip("simengine.cli")
    url = "http://collector:4318/v1/traces"
    sim = LocalProcessActuator(kind="sim", log_dir=tmp_path, otlp_traces_endpoint=url)
    args = cli.build_parser().parse_args(sim.argv_for(make_spec())[3:])
    assert args.otlp_traces_endpoint == url
    vllm = LocalProcessActuator(kind="vllm", log_dir=tmp_path, otlp_traces_endpoint=url)
    assert vllm.argv_for(make_spec())[-2:] == ["--otlp-traces-endpoint", url]
    # vLLM's exporter is gRPC unless told: the endpoint is OTLP/HTTP's.
    env = vllm.environment(make_spec())
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    plain = LocalProcessActuator(kind="vllm", log_dir=tmp_path)
    assert "--otlp-traces-endpoint" not in plain.argv_for(make_spec())


def test_otlp_traces_endpoint_turns_on_sglangs_own_tracing(tmp_path: Path) -> None:
    """SGLang exports spans only with --enable-trace, and over OTLP/HTTP only when
    told; its simulated stand-in takes SGLang's flags and gets none."""
    url = "http://collector:4318/v1/traces"
    spec = make_spec(engine_config={"engine": "sglang"})
    real = LocalProcessActuator(kind="vllm", log_dir=tmp_path, otlp_traces_endpoint=url)
    argv = real.argv_for(spec)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[-3:] == ["--enable-trace", "--otlp-traces-endpoint", url]
    env = real.environment(spec)
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    sim = LocalProcessActuator(kind="sim", log_dir=tmp_path, otlp_traces_endpoint=url)
    assert "--otlp-traces-endpoint" not in sim.argv_for(spec)
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in sim.environment(spec)
    plain = LocalProcessActuator(kind="vllm", log_dir=tmp_path)
    assert "--enable-trace" not in plain.argv_for(spec)
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in plain.environment(spec)


# -- KubernetesActuator ------------------------------------------------------------


class ApiError(Exception):
    """Mirrors kubernetes.client.exceptions.ApiException's ``status``."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class FakeAppsV1:
    """Records calls; holds Deployments by (namespace, name)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}

    def read_namespaced_deployment(self, name: str, namespace: str) -> Any:
        self.calls.append(("read", {"name": name, "namespace": namespace}))
        if (namespace, name) not in self.objects:
            raise ApiError(404)
        return self.objects[namespace, name]

    def create_namespaced_deployment(self, namespace: str, body: Any) -> Any:
        self.calls.append(("create", {"namespace": namespace, "body": body}))
        key = (namespace, body["metadata"]["name"])
        if key in self.objects:
            raise ApiError(409)
        self.objects[key] = body
        return body

    def patch_namespaced_deployment(self, name: str, namespace: str, body: Any) -> Any:
        self.calls.append(
            ("patch", {"name": name, "namespace": namespace, "body": body})
        )
        if (namespace, name) not in self.objects:
            raise ApiError(404)
        self.objects[namespace, name] = body
        return body

    def patch_namespaced_deployment_scale(
        self, name: str, namespace: str, body: Any
    ) -> Any:
        self.calls.append(
            ("scale", {"name": name, "namespace": namespace, "body": body})
        )
        if (namespace, name) not in self.objects:
            raise ApiError(404)
        self.objects[namespace, name]["spec"]["replicas"] = body["spec"]["replicas"]
        return body

    def delete_namespaced_deployment(self, name: str, namespace: str) -> Any:
        self.calls.append(("delete", {"name": name, "namespace": namespace}))
        if self.objects.pop((namespace, name), None) is None:
            raise ApiError(404)
        return {"status": "Success"}


class RacingAppsV1(FakeAppsV1):
    """Another writer creates the Deployment between our read and our create."""

    def read_namespaced_deployment(self, name: str, namespace: str) -> Any:
        result = None
        try:
            result = super().read_namespaced_deployment(name, namespace)
        finally:
            self.objects.setdefault((namespace, name), {"spec": {"replicas": 0}})
        return result


def make_pool(**overrides: Any) -> PoolSpec:
    fields: dict[str, Any] = {
        "model": "chat-7b",
        "version": "v1",
        "region": "eu-west",
        "replicas": 2,
        "image": "vllm/vllm-openai:v0.32.0",
        "gpus_per_replica": 1,
        "argv": ("vllm", "serve", "/weights/abc", "--port", "8000"),
        "weights_dir": "/weights/abc",
        "weights_host_path": "/srv/weights/abc",
    }
    fields.update(overrides)
    return PoolSpec(**fields)


def test_kubernetes_actuator_creates_when_absent() -> None:
    api = FakeAppsV1()
    actuator = KubernetesActuator(api, "serving")
    name = actuator.apply_pool(make_pool())

    assert name == "vllm-chat-7b-v1-eu-west"
    manifest = render_deployment(namespace="serving", spec=make_pool())
    assert api.calls == [
        ("read", {"name": name, "namespace": "serving"}),
        ("create", {"namespace": "serving", "body": manifest}),
    ]


def test_kubernetes_actuator_patches_when_present() -> None:
    api = FakeAppsV1()
    actuator = KubernetesActuator(api, "serving")
    actuator.apply_pool(make_pool())
    api.calls.clear()

    name = actuator.apply_pool(make_pool(replicas=5))

    manifest = render_deployment(namespace="serving", spec=make_pool(replicas=5))
    assert api.calls == [
        ("read", {"name": name, "namespace": "serving"}),
        ("patch", {"name": name, "namespace": "serving", "body": manifest}),
    ]
    assert api.objects["serving", name]["spec"]["replicas"] == 5


def test_kubernetes_actuator_patches_after_losing_a_create_race() -> None:
    api = RacingAppsV1()
    name = KubernetesActuator(api, "serving").apply_pool(make_pool())
    assert [call for call, _ in api.calls] == ["read", "create", "patch"]
    assert api.objects["serving", name]["spec"]["replicas"] == 2


def test_kubernetes_actuator_raises_other_api_errors() -> None:
    class Forbidden(FakeAppsV1):
        def read_namespaced_deployment(self, name: str, namespace: str) -> Any:
            raise ApiError(403)

    api = Forbidden()
    with pytest.raises(ApiError):
        KubernetesActuator(api, "serving").apply_pool(make_pool())
    assert api.calls == []


def test_kubernetes_actuator_scales_and_deletes() -> None:
    api = FakeAppsV1()
    actuator = KubernetesActuator(api, "serving")
    name = actuator.apply_pool(make_pool())
    api.calls.clear()

    actuator.scale_pool(name, 7)
    assert actuator.delete_pool(name) is True
    assert actuator.delete_pool(name) is False  # already gone: not an error

    assert api.calls == [
        (
            "scale",
            {"name": name, "namespace": "serving", "body": {"spec": {"replicas": 7}}},
        ),
        ("delete", {"name": name, "namespace": "serving"}),
        ("delete", {"name": name, "namespace": "serving"}),
    ]


def test_kubernetes_actuator_rejects_negative_scale() -> None:
    with pytest.raises(ValueError):
        KubernetesActuator(FakeAppsV1(), "serving").scale_pool("x", -1)


def test_render_deployment_round_trips_through_the_kubernetes_client() -> None:
    """Every key is one the API knows: nothing is dropped by deserialization."""
    client = pytest.importorskip("kubernetes.client")
    api_client = client.ApiClient()
    manifest = render_deployment(
        namespace="serving", spec=make_pool(weights_host_path=None, weights_pvc="w")
    )
    deployment = api_client._ApiClient__deserialize(manifest, "V1Deployment")

    assert isinstance(deployment, client.V1Deployment)
    assert api_client.sanitize_for_serialization(deployment) == manifest
    container = deployment.spec.template.spec.containers[0]
    assert container.resources.limits == {"nvidia.com/gpu": "1"}
    assert container.startup_probe.failure_threshold == 30
