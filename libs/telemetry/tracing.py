"""OpenTelemetry tracing: OTLP export when configured, W3C context carried in NATS headers.

The exporter follows the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and the other ``OTEL_*``
variables); with none set, spans are still created so trace ids reach logs and messages, but
nothing is exported. Span names follow the messaging conventions: ``publish <subject>`` and
``process <subject>``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind

_provider: TracerProvider | None = None
_recorded = False


def setup_tracing(service_name: str, extra_processor: SpanProcessor | None = None) -> TracerProvider:
    """Install the process' tracer provider once; later calls return the same provider."""
    global _provider, _recorded
    if _provider is not None:
        if extra_processor is not None:
            _provider.add_span_processor(extra_processor)
            _recorded = True
        return _provider
    provider = TracerProvider(resource=Resource.create({"service.name": f"sluice-{service_name}"}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    ):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        _recorded = True
    if extra_processor is not None:
        provider.add_span_processor(extra_processor)
        _recorded = True
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.shutdown()


@functools.cache
def tracer() -> trace.Tracer:
    # Once: get_tracer builds a new tracer (and its instrumentation scope) on every call, which
    # showed at a process span a message. Before setup_tracing it is the API's proxy, which
    # follows the provider installed later.
    return trace.get_tracer("sluice")


def spans_recorded() -> bool:
    """Whether anything takes this process' spans (an OTLP exporter, a test's processor). Without
    it a span that is never current only costs: it reaches no log, message or exporter."""
    return _recorded


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Return ``headers`` plus the current W3C trace context (traceparent, tracestate)."""
    carrier = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(headers or {})


@contextlib.contextmanager
def publish_span(
    subject: str, headers: dict[str, str] | None = None
) -> Iterator[tuple[Span, dict[str, str]]]:
    """A PRODUCER span for one publish; yields the headers to send, with the context injected."""
    with tracer().start_as_current_span(
        f"publish {subject}", kind=SpanKind.PRODUCER,
        attributes={"messaging.system": "nats", "messaging.destination.name": subject,
                    "messaging.operation.type": "publish"},
    ) as span:
        yield span, inject_headers(headers)


def start_publish_span(subject: str) -> tuple[Span, dict[str, str]]:
    """A PRODUCER span for several publishes to ``subject`` (the caller ends it), and the
    headers that carry its context: for publishers that send many messages a moment, where a
    span each would cost more than the publish itself."""
    span = tracer().start_span(
        f"publish {subject}", kind=SpanKind.PRODUCER,
        attributes={"messaging.system": "nats", "messaging.destination.name": subject,
                    "messaging.operation.type": "publish"})
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier


_PROCESS = {"messaging.system": "nats", "messaging.operation.type": "process"}


def start_process_span(subject: str, headers: Mapping[str, str] | None) -> Span:
    """A CONSUMER span for one message, child of the publisher's span, started but not made
    current (the caller ends it): for a consumer that decodes many messages a moment, where
    ``process_span``'s context switch in and out would cost more than the decode."""
    return tracer().start_span(f"process {subject}", context=extract_context(headers),
                               kind=SpanKind.CONSUMER,
                               attributes={**_PROCESS, "messaging.destination.name": subject})


@contextlib.contextmanager
def process_span(subject: str, headers: Mapping[str, str] | None) -> Iterator[Span]:
    """A CONSUMER span for handling one message, child of the publisher's span."""
    ctx = extract_context(headers)
    with tracer().start_as_current_span(
        f"process {subject}", context=ctx, kind=SpanKind.CONSUMER,
        attributes={**_PROCESS, "messaging.destination.name": subject},
    ) as span:
        yield span
