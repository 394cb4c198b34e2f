"""The trace of a round's sort and write: one span per batch, a child of the oldest change's
publish span (capture's), linked to the first change of every other span in the batch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import trace

from libs.telemetry.tracing import extract_context, tracer
from services.sink_worker.round.pull import PulledEvent
from services.sink_worker.round.work import SpanWork


@contextlib.contextmanager
def batch_span(works: list[SpanWork]) -> Iterator[trace.Span]:
    """The span of a round's sort and apply, a child of the publish span of the oldest change in
    the round: that change's trace runs from capture's publish through the sink's pull, sort and
    apply. A batch merges many traces; it links to the first change of every other span."""
    firsts = [w.fresh[0] for w in works if w.fresh and not w.refused]
    firsts.sort(key=lambda e: e.ts)
    parent = extract_context(firsts[0].headers) if firsts else None
    with tracer().start_as_current_span("sink batch", context=parent, links=_links(firsts[1:]),
                                        attributes={"sluice.spans": len(firsts)}) as span:
        yield span


def _links(events: list[PulledEvent]) -> list[trace.Link]:
    """Links from a batch span to the publish spans of (the first event of) each span's batch."""
    links: list[trace.Link] = []
    for e in events:
        ctx = trace.get_current_span(extract_context(e.headers)).get_span_context()
        if ctx.is_valid:
            links.append(trace.Link(ctx))
        if len(links) >= 32:
            break
    return links
