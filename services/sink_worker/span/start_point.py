"""Where a binlog-only span without a checkpoint starts: at a source binlog position or time.

A checkpoint is ``(stream_seq, ts)``: reading resumes after ``stream_seq`` and events with a ts
at or below ``ts`` count as applied. A start point is therefore a ts threshold plus a stream
sequence before the first event above it:

- ``start_time``: the binlog stamps a transaction with its commit time in whole seconds, and
  capture's ts (``physical_ms << 18 | logical``) is at or above that stamp. The threshold is
  the start of ``start_time``'s second, so no transaction committed at or after ``start_time``
  is skipped; ones committed earlier in that same second may be applied too (the binlog cannot
  tell them apart). The sequence comes from a consumer that starts at ``start_time`` in the
  stream (JetStream's own publish times, which come after the commits).
- ``start_position`` (a source's binlog file and position): the source's events are read in
  stream order up to the first one past the position; ts grows with the binlog order, so the
  threshold is that event's ts minus one. When nothing past the position is in the stream yet,
  the span starts after what is there (capture has not read past the position).

Either start point must lie within the source's stream: capture records where it began the
source (``libs.stream_origin``), and a start point before that is refused (``uncovered``) rather
than served from the stream's first event on, which would skip what capture never read.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime
from uuid import uuid4

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api

from contracts.events.rows import SourcePositionV1
from libs.chunks import ChunkError, ChunkJoiner, chunk_info
from libs.scheduling.model import Span
from libs.stream_origin import binlog_order
from libs.streams import ROWS_STREAM, token
from libs.ts import ts_threshold, utc_moment
from services.sink_worker.span.checkpoints import Checkpoint

_FETCH = 256
_FETCH_TIMEOUT_S = 1.0


def position_key(position: SourcePositionV1) -> tuple[int, str, int]:
    """Binlog positions in binlog order: the file's numeric suffix, then the offset."""
    return binlog_order(position.binlog_file, position.binlog_pos)


async def _stream_last_seq(js: JetStreamContext, stream: str) -> int:
    info = await js.stream_info(stream)
    return int(info.state.last_seq or 0)


async def start_at_time(js: JetStreamContext, span: Span, start_time: datetime,
                        rows_stream: str = ROWS_STREAM) -> Checkpoint:
    threshold = ts_threshold(start_time)
    name = f"sink_start_{uuid4().hex}"
    await js.add_consumer(rows_stream, api.ConsumerConfig(
        name=name, ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.BY_START_TIME,
        opt_start_time=utc_moment(start_time), filter_subjects=span.subjects(),
        inactive_threshold=30.0, mem_storage=True, num_replicas=1))
    try:
        sub = await js.pull_subscribe_bind(name, stream=rows_stream)
        try:
            msgs = await sub.fetch(1, timeout=_FETCH_TIMEOUT_S)
        except (TimeoutError, NatsTimeoutError):
            msgs = []
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    finally:
        with contextlib.suppress(Exception):
            await js.delete_consumer(rows_stream, name)
    if msgs:
        seq = int(msgs[0].metadata.sequence.stream) - 1
    else:
        seq = await _stream_last_seq(js, rows_stream)
    return Checkpoint(stream_seq=max(0, seq), ts=threshold)


async def start_at_position(js: JetStreamContext, span: Span, position: SourcePositionV1,
                            rows_stream: str = ROWS_STREAM) -> Checkpoint:
    wanted = position_key(position)
    src = token(span.source)
    name = f"sink_start_{uuid4().hex}"
    await js.add_consumer(rows_stream, api.ConsumerConfig(
        name=name, ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL,
        filter_subjects=[f"sluice.rows.{src}.*.*", f"sluice.ddl.{src}.*.*"],
        inactive_threshold=30.0, mem_storage=True, num_replicas=1))
    last_seq, last_ts = 0, 0
    joiner = ChunkJoiner()
    try:
        sub = await js.pull_subscribe_bind(name, stream=rows_stream)
        try:
            while True:
                try:
                    msgs = await sub.fetch(_FETCH, timeout=_FETCH_TIMEOUT_S)
                except (TimeoutError, NatsTimeoutError):
                    break
                for msg in msgs:
                    seq = int(msg.metadata.sequence.stream)
                    body = msg.data
                    try:
                        info = chunk_info(msg.headers)
                        if info is not None:  # a large event: judged by its whole, at its first chunk
                            joined = joiner.add(info, seq, msg.data or b"", msg.headers or {})
                            if joined is None:
                                continue
                            seq, body = joined.first_seq, joined.data
                    except ChunkError:
                        last_seq = seq  # garbage: the span's reader dead-letters it
                        continue
                    try:
                        data = json.loads(body)["data"]
                        # A rows.changed v4 message of several transactions: each part's own.
                        places = [(int(d["ts"]), SourcePositionV1.model_validate(d["position"]))
                                  for d in [data, *(data.get("more") or [])]]
                    except Exception:
                        last_seq = seq  # garbage: the span's reader dead-letters it
                        continue
                    for ts, at in places:
                        if position_key(at) > wanted:
                            # Read again from this message; what is at or below ts - 1 of it
                            # (its parts before this one) is dropped as applied.
                            return Checkpoint(stream_seq=max(0, seq - 1), ts=max(0, ts - 1))
                        last_seq, last_ts = seq, max(last_ts, ts)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    finally:
        with contextlib.suppress(Exception):
            await js.delete_consumer(rows_stream, name)
    return Checkpoint(stream_seq=last_seq, ts=last_ts)
