"""Encoding a row-change message with large values: deterministic, and off the event loop.

A message that goes in chunks must encode to the same bytes every time the capture reads the
same binlog event again: after a crash between chunks, the next capture (this process again,
or another replica with another epoch) re-publishes the chunks under the same ids, JetStream
keeps the first copy of each, and the sink joins chunks from both attempts. So the envelope of
a chunked message holds nothing of the moment or of the publisher: ``time`` is the commit time
of its ts, ``producer`` is ``capture/<source>`` and ``epoch`` 0 (rows events are fenced by the
resolved marks, not by their epoch).

A 64 MB value takes seconds of CPU to encode on a loaded machine; done in one call on the
event loop it would stop the lease renewals and cost the capture its lease. The encode runs
in a worker thread and never holds the GIL long: the large strings are left out of the
pydantic encode (a placeholder each) and spliced in afterwards slice by slice.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pydantic_core

from contracts.events.rows import RowImageV2, RowsChangedV2
from contracts.registry import REGISTRY
from libs.ts import ts_seconds

LARGE_VALUE = 256 * 1024
"""A string value at least this long is spliced in rather than encoded by pydantic."""
_SLICE = 1024 * 1024


def approx_size(event: RowsChangedV2) -> int:
    """Bytes of the string values of the event's images: cheap (``len`` only)."""
    size = 0
    for row in event.rows:
        for image in (row.before, row.after):
            if image:
                size += sum(len(v) for v in image.values() if isinstance(v, str))
    return size


def chunk_producer(source: str) -> str:
    return f"capture/{source}"


def _placeholder(n: int) -> str:
    return f"\x00sluice-large-value-{n}\x00"


def _json_string(value: str) -> bytes:
    """``value`` as a JSON string, escaped a slice at a time (the GIL is free between slices)."""
    parts = [b'"']
    for start in range(0, len(value), _SLICE):
        parts.append(json.dumps(value[start:start + _SLICE], ensure_ascii=False)[1:-1].encode("utf-8"))
    parts.append(b'"')
    return b"".join(parts)


def encode_rows_deterministic(event: RowsChangedV2, *, event_id: str) -> bytes:
    """The envelope of ``event`` as JSON bytes, a pure function of the event and its id."""
    large: list[str] = []

    def swap(image: dict[str, Any] | None) -> dict[str, Any] | None:
        if image is None:
            return None
        out: dict[str, Any] = {}
        for name, value in image.items():
            if isinstance(value, str) and len(value) >= LARGE_VALUE:
                out[name] = _placeholder(len(large))
                large.append(value)
            else:
                out[name] = value
        return out

    rows = [RowImageV2.model_construct(op=r.op, before=swap(r.before), after=swap(r.after),
                                       ordinal=r.ordinal)
            for r in event.rows]
    small = event.model_copy(update={"rows": rows})
    env = REGISTRY.envelope(small, producer=chunk_producer(event.source), epoch=0, event_id=event_id)
    env = env.model_copy(update={"time": datetime.fromtimestamp(ts_seconds(event.ts), UTC)})
    head = env.model_dump_json().encode()
    if not large:
        return head
    parts: list[bytes] = []
    rest = head
    for n, value in enumerate(large):
        token = pydantic_core.to_json(_placeholder(n))
        before, found, rest = rest.partition(token)
        if not found:
            raise ValueError(f"placeholder {n} not found in the encoded event")
        parts.append(before)
        parts.append(_json_string(value))
    parts.append(rest)
    return b"".join(parts)
