"""OpenTelemetry traces of the gateway: one trace per request, a span per step.

Public surface: ``Tracing``, ``RequestTrace``, ``TRACING_OFF``, ``NO_TRACE``,
``build_tracing``.

A request's trace (docs/monitoring.md#traces): the root is the gateway's server
span (``POST /v1/chat/completions``); under it ``gateway.authenticate``,
``gateway.plan``, ``gateway.admission`` (the charge and the tier's queue wait),
``gateway.route`` (the replica chosen and why), one engine client span per
attempt (``chat <model>``, GenAI's name; its ``traceparent`` goes to the engine,
so vLLM's ``llm_request`` and the simulated replica's span hang under it) and
``gateway.relay`` (first token to the answer's end). The gateway's other calls
to engines are client spans too, each sending its ``traceparent``
(``side_call``, attribute ``platform.purpose``): a split embeddings request's
chunks, a shadow copy, the live judge's answers and verdict (under a
``gateway.live_judge`` span; these run after the answer, still in its trace),
and ``POST /tokenize``'s tries. Attributes follow
OpenTelemetry's GenAI semantic conventions (``gen_ai.*``) plus ``platform.team``,
``platform.tier``, ``platform.version``, ``platform.region``. Never prompt or
answer text: nothing here reads the payload.

Cost: spans are exported by the SDK's ``BatchSpanProcessor`` on its own thread.
Off, every call here is an attribute test and a shared no-op; on and unsampled
(``ParentBased(TraceIdRatioBased)``), a request pays its root's sampling and one
``traceparent`` line (sent anyway, flags 00, so that an engine whose own sampler
is ``ParentBased(AlwaysOn)``, vLLM's, does not trace what the gateway did not).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING

from opentelemetry import trace as otel
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import (
    TraceContextTextMapPropagator,
)
from opentelemetry.util.types import AttributeValue

from routing.attempt import Attempt, AttemptResult, Cut
from routing.responses import ClientGone, GatewayError

if TYPE_CHECKING:
    from routing.domain.policies import RouteDecision
    from routing.embeddings import EngineEmbeddings
    from routing.plan import ChatPlan

__all__ = ["NO_TRACE", "TRACING_OFF", "RequestTrace", "Tracing", "build_tracing"]

_PROPAGATOR = TraceContextTextMapPropagator()
# GenAI's operation names, by the OpenAI API a request came on.
_OPERATIONS = {
    "chat": "chat",
    "responses": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}
# Policies that place a routing key on a ring: their first choice is the key's
# owner unless it was passed over for load.
_RING_POLICIES = frozenset({"prefix_affinity", "cache_aware"})


class RequestTrace:
    """The spans of one request: its root, and children started under it.

    Built by ``Tracing.start_request``; ``NO_TRACE`` when tracing is off. While
    the root is not recorded (off, or not sampled), ``start`` and ``span`` hand
    out shared no-ops, so the request builds no span objects.
    """

    __slots__ = ("_parent", "_tracer", "is_recording", "root")

    def __init__(self, tracer: otel.Tracer | None, root: otel.Span) -> None:
        self._tracer = tracer
        self.root = root
        self.is_recording = root.is_recording()
        self._parent: Context | None = (
            otel.set_span_in_context(root) if self.is_recording else None
        )

    def start(
        self,
        name: str,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
        start_time: int | None = None,
        parent: otel.Span | None = None,
    ) -> otel.Span:
        """Start a child of ``parent`` if recorded, else of the root (a no-op
        span while the root is unrecorded)."""
        if self._parent is None or self._tracer is None:
            return otel.INVALID_SPAN
        context = self._parent
        if parent is not None and parent.is_recording():
            context = otel.set_span_in_context(parent)
        return self._tracer.start_span(
            name,
            context=context,
            kind=kind,
            attributes=attributes,
            start_time=start_time,
        )

    def span(
        self, name: str, attributes: Mapping[str, AttributeValue] | None = None
    ) -> _SpanScope:
        """Return a ``with`` scope of a child span that ends it, with the error
        (a refusal's status code) if one is raised."""
        if self._parent is None:
            return _NO_SCOPE
        return _SpanScope(self.start(name, attributes=attributes))

    def engine_header(self, span: otel.Span) -> bytes:
        """Return the ``traceparent`` header line for a request made under
        ``span`` (the root's context when it is unrecorded); empty when off."""
        value = self.traceparent(span)
        return b"traceparent: %s\r\n" % value.encode() if value else b""

    def traceparent(self, span: otel.Span) -> str:
        """Return the W3C ``traceparent`` value for a request made under ``span``
        (the root's context when it is unrecorded); empty when off."""
        if self._tracer is None:
            return ""
        context = (span if span.is_recording() else self.root).get_span_context()
        if not context.is_valid:
            return ""
        return (
            f"00-{context.trace_id:032x}-{context.span_id:016x}"
            f"-{context.trace_flags:02x}"
        )

    def side_call(
        self,
        operation: str,
        *,
        model: str,
        version: str,
        replica_id: str,
        url: str,
        purpose: str,
        parent: otel.Span | None = None,
    ) -> otel.Span:
        """Start the client span of an engine call besides the answer's own
        (``purpose``: a shadow copy, a judged pair's answer or verdict, a
        tokenization, a chunk of a split embeddings request); end it with
        ``side_ended``. Its ``traceparent`` is ``traceparent(span)``."""
        if not self.is_recording:
            return otel.INVALID_SPAN
        return self.start(
            f"{operation} {model}",
            kind=SpanKind.CLIENT,
            parent=parent,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.system": "vllm",
                "gen_ai.provider.name": "vllm",
                "gen_ai.request.model": model,
                "server.address": url,
                "platform.replica_id": replica_id,
                "platform.version": version,
                "platform.purpose": purpose,
            },
        )

    @staticmethod
    def side_ended(
        span: otel.Span, *, status: int | None = None, error_kind: str | None = None
    ) -> None:
        """End a ``side_call`` span with the engine's HTTP status and, if it
        failed, why (a kind, never a message: it may quote the body)."""
        if not span.is_recording():
            return
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error_kind is not None:
            span.set_attribute("error.type", error_kind)
            span.set_status(Status(StatusCode.ERROR, error_kind))
        span.end()

    async def fetch_chunk(
        self, attempt: Attempt, *, chunk: int, index: int
    ) -> EngineEmbeddings:
        """Fetch chunk ``chunk`` of a split embeddings request (the ``index``-th
        try of it) under its engine span, its ``traceparent`` sent to the engine.

        Raises:
            UpstreamFailed, GatewayError: as ``Attempt.fetch_embeddings``.
        """
        if self._tracer is None:
            return await attempt.fetch_embeddings()
        resolution = attempt.plan.resolution
        span = self.side_call(
            "embeddings",
            model=resolution.model,
            version=resolution.version,
            replica_id=attempt.replica_id,
            url=attempt.url,
            purpose="split",
        )
        span.set_attributes({"platform.chunk": chunk, "platform.attempt": index})
        head = self.engine_header(span)
        try:
            engine = await dataclasses.replace(
                attempt, engine_head=head
            ).fetch_embeddings()
        except BaseException as exc:
            if span.is_recording():
                _set_error(span, exc)
                span.end()
            raise
        span.set_attribute("gen_ai.usage.input_tokens", engine.usage.prompt_tokens)
        self.side_ended(span)
        return engine

    def __enter__(self) -> RequestTrace:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.end(exc)

    # -- the request's steps ---------------------------------------------------------

    def planned(self, plan: ChatPlan, region: str) -> None:
        """Name on the root what the plan decided: model, version, team, tier."""
        if not self.is_recording:
            return
        self.root.set_attributes(
            {
                "gen_ai.operation.name": _OPERATIONS[plan.surface],
                "gen_ai.request.model": plan.model_ref,
                "gen_ai.request.max_tokens": plan.max_tokens,
                "gen_ai.usage.input_tokens": plan.prompt_tokens,
                "platform.team": plan.team,
                "platform.tier": plan.tier,
                "platform.model": plan.resolution.model,
                "platform.version": plan.resolution.version,
                "platform.region": region,
                "platform.stream": plan.stream,
            }
        )

    def admission(self, plan: ChatPlan, region: str) -> _SpanScope:
        """Return the scope of the charge and the tier's queue wait (and name
        on the root what the plan decided)."""
        if not self.is_recording:
            return _NO_SCOPE
        self.planned(plan, region)
        return self.span(
            "gateway.admission",
            {
                "platform.tier": plan.tier,
                "platform.team": plan.team,
                "platform.admission.charged_tokens": plan.request_tokens,
            },
        )

    def routed(self, decision: RouteDecision, nodes: int, *, started_at: float) -> None:
        """Record the routing span (begun at monotonic ``started_at``): the
        policy's choice and why."""
        if not self.is_recording:
            return
        now_ns, now = time.time_ns(), time.monotonic()
        span = self.start(
            "gateway.route", start_time=now_ns - int((now - started_at) * 1e9)
        )
        span.set_attributes(
            {
                "platform.routing.policy": decision.policy,
                "platform.routing.replicas": nodes,
                "platform.routing.candidates": len(decision.candidates),
                "platform.routing.skipped_for_load": decision.skipped_over_bound,
                "platform.routing.replica_id": decision.chosen or "",
                "platform.routing.reason": _route_reason(decision, 0),
            }
        )
        span.end(now_ns)

    async def attempt(
        self, attempt: Attempt, decision: RouteDecision, index: int
    ) -> AttemptResult:
        """Run ``attempt`` (the ``index``-th of ``decision``) under its engine
        span, its ``traceparent`` sent to the engine.

        Raises:
            UpstreamFailed, Cut: as ``Attempt.run``, the span ended first.
        """
        if self._tracer is None:
            return await attempt.run()
        if not self.is_recording:
            # Unsampled: the engine is told so, under the root's context.
            head = self.engine_header(self.root)
            return await dataclasses.replace(attempt, engine_head=head).run()
        span = self.engine_call(
            attempt.plan,
            decision,
            attempt=index,
            replica_id=attempt.replica_id,
            url=attempt.url,
        )
        started_at = time.monotonic()
        head = self.engine_header(span)
        try:
            result = await dataclasses.replace(attempt, engine_head=head).run()
        except Cut as cut:
            self.engine_ended(span, started_at=started_at, result=cut.so_far)
            raise
        except BaseException as exc:
            self.engine_ended(span, started_at=started_at, error=exc)
            raise
        self.engine_ended(span, started_at=started_at, result=result)
        return result

    def engine_call(
        self,
        plan: ChatPlan,
        decision: RouteDecision,
        *,
        attempt: int,
        replica_id: str,
        url: str,
    ) -> otel.Span:
        """Start the engine client span of one attempt (GenAI's ``chat <model>``)."""
        if not self.is_recording:
            return otel.INVALID_SPAN
        operation = _OPERATIONS[plan.surface]
        return self.start(
            f"{operation} {plan.resolution.model}",
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.system": "vllm",
                "gen_ai.provider.name": "vllm",
                "gen_ai.request.model": plan.resolution.model,
                "server.address": url,
                "platform.replica_id": replica_id,
                "platform.version": plan.resolution.version,
                "platform.attempt": attempt,
                "platform.routing.reason": _route_reason(decision, attempt),
            },
        )

    def engine_ended(
        self,
        span: otel.Span,
        *,
        started_at: float,
        result: AttemptResult | None = None,
        error: BaseException | None = None,
    ) -> None:
        """End an attempt's engine span (``started_at``: monotonic, when the
        attempt began): time to first token, tokens, and the relay's span."""
        if not span.is_recording():
            return
        if error is not None:
            _set_error(span, error)
        if result is not None:
            if result.error_kind is not None or result.error is not None:
                span.set_status(Status(StatusCode.ERROR, result.error_kind or ""))
                span.set_attribute("error.type", result.error_kind or "refused")
            span.set_attribute("platform.outcome", result.outcome)
            usage = result.usage
            if usage is not None:
                span.set_attributes(
                    {
                        "gen_ai.usage.input_tokens": usage.prompt_tokens,
                        "gen_ai.usage.output_tokens": usage.completion_tokens,
                        "platform.usage.cached_tokens": usage.cached_tokens,
                    }
                )
            if result.first_token_at is not None:
                now_ns, now = time.time_ns(), time.monotonic()
                first_ns = now_ns - int((now - result.first_token_at) * 1e9)
                ttft_s = max(0.0, result.first_token_at - started_at)
                span.set_attribute("platform.ttft_ms", round(ttft_s * 1000, 3))
                span.add_event(
                    "gen_ai.first_token",
                    {"platform.ttft_ms": round(ttft_s * 1000, 3)},
                    timestamp=first_ns,
                )
                relay = self.start("gateway.relay", start_time=first_ns)
                relay.set_attribute("platform.outcome", result.outcome)
                if usage is not None:
                    relay.set_attribute(
                        "gen_ai.usage.output_tokens", usage.completion_tokens
                    )
                relay.end(now_ns)
        span.end()

    def served(self, result: AttemptResult) -> None:
        """Note on the root how the request ended and what it used."""
        if not self.is_recording:
            return
        root = self.root
        root.set_attribute("platform.outcome", result.outcome)
        if result.replica_id:
            root.set_attribute("platform.replica_id", result.replica_id)
        if result.usage is not None:
            root.set_attributes(
                {
                    "gen_ai.usage.input_tokens": result.usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": result.usage.completion_tokens,
                }
            )

    def end(self, error: BaseException | None = None) -> None:
        """End the root, with the answer's status (an error's, if raised)."""
        if not self.is_recording:
            return
        if error is None:
            self.root.set_attribute("http.response.status_code", 200)
        else:
            _set_error(self.root, error)
        self.root.end()


class _SpanScope:
    """Ends a span at the end of a ``with`` block, noting an error raised in it."""

    __slots__ = ("span",)

    def __init__(self, span: otel.Span) -> None:
        self.span = span

    def __enter__(self) -> otel.Span:
        return self.span

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            _set_error(self.span, exc)
        self.span.end()


_NO_SCOPE = _SpanScope(otel.INVALID_SPAN)
NO_TRACE = RequestTrace(None, otel.INVALID_SPAN)


class Tracing:
    """Start requests' traces with one process's tracer (``None``: tracing off)."""

    def __init__(self, tracer: otel.Tracer | None) -> None:
        self.tracer = tracer

    @property
    def is_on(self) -> bool:
        """Whether requests are traced (subject to sampling)."""
        return self.tracer is not None

    def start_request(
        self, method: str, path: str, headers: Mapping[bytes, bytes]
    ) -> RequestTrace:
        """Start a request's root span, the child of an incoming ``traceparent``
        (W3C) if the client sent one; ``NO_TRACE`` when tracing is off."""
        tracer = self.tracer
        if tracer is None:
            return NO_TRACE
        parent = None
        traceparent = headers.get(b"traceparent")
        if traceparent is not None:
            carrier = {"traceparent": traceparent.decode("latin-1")}
            state = headers.get(b"tracestate")
            if state is not None:
                carrier["tracestate"] = state.decode("latin-1")
            parent = _PROPAGATOR.extract(carrier)
        root = tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )
        return RequestTrace(tracer, root)


TRACING_OFF = Tracing(None)


def build_tracing(
    *,
    is_enabled: bool,
    endpoint: str,
    sample_ratio: float,
    service_name: str,
    resource_attributes: Mapping[str, str],
) -> Tracing:
    """Return the process's tracing: an SDK tracer exporting over OTLP/HTTP in
    batches, sampling ``ParentBased(TraceIdRatioBased(sample_ratio))``; off when
    not ``is_enabled``. ``endpoint`` empty: the SDK's own environment variables
    (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_ENDPOINT``)."""
    if not is_enabled:
        return TRACING_OFF
    # Imported only when on: the exporter brings protobuf and requests.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name, **resource_attributes}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None))
    )
    return Tracing(provider.get_tracer("routing.gateway"))


def _route_reason(decision: RouteDecision, attempt: int) -> str:
    """Why this replica: ``owner`` (the key's on the ring), ``skipped_for_load``
    (the owner was over its bound), ``retried`` (an earlier one failed before
    its first token), or the policy's name (it has no owner)."""
    if attempt > 0:
        return "retried"
    if decision.policy not in _RING_POLICIES:
        return decision.policy
    return "skipped_for_load" if decision.skipped_over_bound else "owner"


def _set_error(span: otel.Span, error: BaseException) -> None:
    """Note ``error`` on ``span``: a refusal's status and code, a client that
    left, or the exception's type (never its message: it may quote the body)."""
    if isinstance(error, GatewayError):
        span.set_attribute("http.response.status_code", error.status)
        span.set_attribute("error.type", error.code or str(error.status))
        if error.status >= 500 or error.status == 429:
            span.set_status(Status(StatusCode.ERROR, error.code or ""))
    elif isinstance(error, (asyncio.CancelledError, ClientGone)):
        span.set_attribute("error.type", "client_closed")
    else:
        span.set_attribute("error.type", type(error).__name__)
        span.set_status(Status(StatusCode.ERROR))
