"""A small OTLP/HTTP trace receiver for tests: ``python -m tests.otlp_collector``.

No OpenTelemetry Collector binary is packaged for Debian, PyPI or npm here
(docs/monitoring.md#traces), so the end-to-end tests run this in its own
process: it takes ``POST /v1/traces`` (``application/x-protobuf``, gzip or not),
decodes the ``ExportTraceServiceRequest`` with the official
``opentelemetry-proto`` package and appends one JSON line per span to ``--out``
(trace and span ids in hex, the service's name, every attribute and event), which
the test reads. It prints its port once it listens.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

_LOCK = threading.Lock()


def value_of(value: AnyValue) -> Any:
    """Return an OTLP ``AnyValue`` as plain JSON."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind) if kind else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    """Return OTLP key-values as a dict."""
    items: list[KeyValue] = list(pairs)
    return {pair.key: value_of(pair.value) for pair in items}


def spans_of(request: ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """Return the request's spans as JSON objects."""
    spans: list[dict[str, Any]] = []
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    {
                        "service": resource.get("service.name"),
                        "resource": resource,
                        "scope": scope_spans.scope.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "name": span.name,
                        "kind": span.kind,
                        "start_ns": span.start_time_unix_nano,
                        "end_ns": span.end_time_unix_nano,
                        "status": span.status.code,
                        "attributes": attributes_of(span.attributes),
                        "events": [
                            {
                                "name": event.name,
                                "attributes": attributes_of(event.attributes),
                            }
                            for event in span.events
                        ],
                    }
                )
    return spans


class _Handler(BaseHTTPRequestHandler):
    out: Path

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        lines = "".join(json.dumps(span) + "\n" for span in spans_of(request))
        with _LOCK, self.out.open("a") as file:
            file.write(lines)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@contextmanager
def running_collector(out: Path) -> Iterator[str]:
    """Run this receiver as its own process, writing spans to ``out``; yield its
    traces URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.otlp_collector", "--out", str(out)],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}/v1/traces"
    finally:
        process.terminate()
        process.wait(timeout=10)


def read_spans(path: Path) -> list[dict[str, Any]]:
    """Return the spans received so far (the file's whole lines)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text.splitlines(keepends=True) if "\n" in line]


def main() -> None:
    """Serve until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    handler = type("Handler", (_Handler,), {"out": args.out})
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
