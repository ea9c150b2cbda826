"""The simulated replica's spans, as vLLM's: one ``llm_request`` per request.

Public surface: ``EngineTracer``, ``build_engine_tracer``.

Started with ``--otlp-traces-endpoint URL`` (vLLM's flag), the replica exports
one SERVER span per finished chat request over OTLP/HTTP, named and attributed
as vLLM V1's ``OutputProcessor.do_tracing`` does (``llm_request``;
``gen_ai.request.*``, ``gen_ai.usage.prompt_tokens``/``completion_tokens``,
``gen_ai.latency.*`` in seconds), begun at the request's arrival and parented
by its W3C ``traceparent``, so that it joins the gateway's trace. As vLLM's, the
sampler is the SDK's default, ``ParentBased(AlwaysOn)``: a request whose
``traceparent`` is unsampled is not traced. Never prompt or answer text.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import trace as otel
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import (
    TraceContextTextMapPropagator,
)

from simengine.domain.engine import FinishedRequest

__all__ = ["EngineTracer", "build_engine_tracer"]

_PROPAGATOR = TraceContextTextMapPropagator()


class EngineTracer:
    """Emit each finished request's ``llm_request`` span."""

    def __init__(self, tracer: otel.Tracer) -> None:
        self.tracer = tracer

    def finished(
        self,
        headers: Mapping[bytes, bytes],
        *,
        model: str,
        max_tokens: int,
        done: FinishedRequest,
    ) -> None:
        """Record ``done``'s span (its times are monotonic seconds, now's clock)."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers.items()
            if name in (b"traceparent", b"tracestate")
        }
        context = _PROPAGATOR.extract(carrier) if carrier else None
        now_ns, now = time.time_ns(), time.monotonic()

        def wall_ns(at: float) -> int:
            return now_ns - int((now - at) * 1e9)

        attributes: dict[str, str | int | float] = {
            "gen_ai.response.model": model,
            "gen_ai.request.id": done.request_id,
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.n": 1,
            "gen_ai.usage.prompt_tokens": done.prompt_tokens,
            "gen_ai.usage.completion_tokens": done.output_tokens,
            "gen_ai.usage.num_sequences": 1,
            "gen_ai.latency.e2e": done.finished_at - done.arrived_at,
        }
        if done.scheduled_at is not None:
            attributes["gen_ai.latency.time_in_queue"] = (
                done.scheduled_at - done.arrived_at
            )
        if done.first_token_at is not None:
            attributes["gen_ai.latency.time_to_first_token"] = (
                done.first_token_at - done.arrived_at
            )
        span = self.tracer.start_span(
            "llm_request",
            context=context,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=wall_ns(done.arrived_at),
        )
        span.end(wall_ns(done.finished_at))


def build_engine_tracer(endpoint: str, *, model: str) -> EngineTracer:
    """Return a tracer exporting to ``endpoint`` (OTLP/HTTP) in batches, off the
    request path."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(
        resource=Resource.create({"service.name": "vllm", "platform.model": model})
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint)))
    return EngineTracer(provider.get_tracer("vllm.llm_engine"))
