"""Publishing to the ROWS stream: deterministic ids, pipelined acks, fenced resolved marks.

Every message carries ``Nats-Msg-Id`` = its envelope id, derived from the binlog position, so
a re-read after a crash or failover publishes byte-for-byte the same ids and JetStream drops
the copies inside its duplicate window (consumers drop the rest by id).

Row and DDL messages are published without waiting for each ack (up to ``window`` in flight);
a resolved mark first waits for every earlier ack, so "ts <= resolved is in the stream" holds.
Resolved marks are also the fence between two captures of one source: each carries
``Nats-Expected-Last-Subject-Sequence`` = the stream sequence of the mark it follows, so a
capture that lost its lease and did not notice yet cannot publish a mark after its successor's.

A message larger than the server's max_payload (the client knows it from the server's INFO)
is published as ordered chunks on the same subject (``libs/chunks.py``), each with its own
deterministic id; the sink joins them again. Beyond ``max_message_bytes`` a message is refused
(``MessageTooLarge``) and the pipeline stops the table with a rejection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nats.js import JetStreamContext, api
from nats.js.errors import APIError
from pydantic import BaseModel

from contracts.events.rows import ResolvedAdvancedV1, RowsChangedV2
from contracts.registry import REGISTRY
from libs.chunks import chunk_size_for, digest_of, needs_chunks, split
from libs.streams import ROWS_STREAM, resolved_subject
from libs.telemetry.tracing import publish_span
from libs.ts import ts_seconds
from services.capture import metrics
from services.capture.large_encode import approx_size, encode_rows_deterministic
from services.capture.xa import XaResume

log = logging.getLogger(__name__)

# Header on resolved marks: the seq the next row/DDL message of the source gets. With the mark's
# ts and position it is all the state a capture needs to continue exactly where it left off.
NEXT_SEQ_HEADER = "Sluice-Next-Seq"
# Header on resolved marks that pass prepared XA transactions still undecided: where the oldest
# one's group starts and their XIDs (``xa.XaResume``), so a restart can find their rows again.
XA_PREPARED_HEADER = "Sluice-Xa-Prepared"
_WRONG_LAST_SEQ = frozenset({10071})
_CHUNK_WINDOW_BYTES = 4 * 1024 * 1024


class LeaseLost(Exception):
    """This capture no longer holds the source's lease: stop publishing at once."""


class Fenced(Exception):
    """Another capture published a resolved mark for this source after the one we followed."""


class MessageTooLarge(Exception):
    """One message is over ``max_message_bytes``: it is not published, even in chunks."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes over the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class PublishFailed(Exception):
    """A publish was not acknowledged; the session restarts from the last resolved mark."""


@dataclass
class _InFlight:
    future: asyncio.Future[api.PubAck]
    started: float
    subject: str


class Publisher:
    def __init__(self, js: JetStreamContext, source: str, producer: str, *,
                 is_valid: Callable[[], bool], epoch: int = 0, window: int = 256,
                 ack_timeout: float = 10.0, max_payload: Callable[[], int] | None = None,
                 max_message_bytes: int = 256 * 1024 * 1024) -> None:
        self.js = js
        self.source = source
        self.producer = producer
        self.epoch = epoch
        self._is_valid = is_valid
        self._window = window
        self._ack_timeout = ack_timeout
        self._in_flight: deque[_InFlight] = deque()
        self.resolved_stream_seq = 0  # stream sequence of the last resolved mark of the source
        self._resolved_subject = resolved_subject(source)
        self._latency = metrics.PUBLISH_LATENCY.labels(source)
        # The server's max_payload, as its INFO told the client (nats-py keeps it current).
        self._max_payload = max_payload or (lambda: 1024 * 1024)
        self.max_message_bytes = max_message_bytes

    def _check_lease(self) -> None:
        if not self._is_valid():
            raise LeaseLost(f"capture lease of source {self.source} lost")

    def _encode(self, event: BaseModel, msg_id: str) -> tuple[bytes, str]:
        data = REGISTRY.encode(event, producer=self.producer, epoch=self.epoch, event_id=msg_id)
        return data, REGISTRY.key_of(type(event))[0]

    async def send(self, subject: str, event: BaseModel, msg_id: str, *, rows: int = 0) -> None:
        """Publish one row/DDL/rejection message; its ack is awaited by ``flush`` (or when the
        window is full)."""
        self._check_lease()
        max_payload = self._max_payload()
        if isinstance(event, RowsChangedV2) and approx_size(event) > chunk_size_for(max_payload) // 2:
            # Likely to need chunks: the deterministic encoding, in a thread (large_encode.py).
            payload = await asyncio.to_thread(encode_rows_deterministic, event, event_id=msg_id)
            type_ = REGISTRY.key_of(RowsChangedV2)[0]
        else:
            payload, type_ = self._encode(event, msg_id)
        if needs_chunks(len(payload), max_payload):
            if len(payload) > self.max_message_bytes:
                metrics.OVERSIZED.labels(self.source).inc()
                raise MessageTooLarge(len(payload), self.max_message_bytes)
            await self._send_chunks(subject, payload, msg_id, getattr(event, "ts", 0), max_payload)
        else:
            await self._publish_one(subject, payload, {api.Header.MSG_ID.value: msg_id})
        metrics.MESSAGES_PUBLISHED.labels(self.source, type_).inc()
        if rows:
            metrics.ROWS_PUBLISHED.labels(self.source).inc(rows)

    async def _publish_one(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        with publish_span(subject, headers) as (_span, traced):
            future = await self.js.publish_async(subject, payload, headers=traced,
                                                 stream=ROWS_STREAM, wait_stall=self._ack_timeout)
        self._in_flight.append(_InFlight(future, time.perf_counter(), subject))
        while len(self._in_flight) > self._window:
            await self._settle_one()

    async def _send_chunks(self, subject: str, payload: bytes, msg_id: str, ts: int,
                           max_payload: int) -> None:
        # Chunks are published in order on one connection, so they are stored in order. At
        # most _CHUNK_WINDOW_BYTES of them wait for their acks: the lease renewals share this
        # connection, and behind a whole 64 MB row queued at once they would arrive too late.
        count = 0
        window = max(1, _CHUNK_WINDOW_BYTES // max_payload)
        digest = await asyncio.to_thread(digest_of, payload)
        for chunk_id, chunk_headers, piece in split(payload, msg_id, ts, max_payload, digest):
            await self._publish_one(subject, piece, {api.Header.MSG_ID.value: chunk_id, **chunk_headers})
            count += 1
            while len(self._in_flight) > window:
                await self._settle_one()
        metrics.CHUNKS_PUBLISHED.labels(self.source).inc(count)
        await self.flush()

    async def _settle_one(self) -> None:
        item = self._in_flight.popleft()
        try:
            await asyncio.wait_for(asyncio.shield(item.future), self._ack_timeout)
        except TimeoutError:
            raise PublishFailed(f"no ack within {self._ack_timeout}s for {item.subject}") from None
        except APIError as exc:
            raise PublishFailed(f"publish to {item.subject} refused: {exc}") from exc
        self._latency.observe(time.perf_counter() - item.started)

    async def flush(self) -> None:
        """Wait for every outstanding ack; raises ``PublishFailed`` for the first one missing."""
        try:
            while self._in_flight:
                await self._settle_one()
        finally:
            self._in_flight.clear()

    def discard(self) -> None:
        """Forget outstanding acks (the session is over; its re-read will publish them again)."""
        for item in self._in_flight:
            item.future.cancel()
        self._in_flight.clear()

    async def resolved(self, event: ResolvedAdvancedV1, msg_id: str, next_seq: int, *,
                       xa: XaResume | None = None) -> None:
        """Publish a resolved mark once everything before it is acked; keeps one per source."""
        await self.flush()
        self._check_lease()
        payload, type_ = self._encode(event, msg_id)
        headers = {
            api.Header.MSG_ID.value: msg_id,
            api.Header.ROLLUP.value: "sub",
            api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(self.resolved_stream_seq),
            NEXT_SEQ_HEADER: str(next_seq),
        }
        if xa is not None:
            headers[XA_PREPARED_HEADER] = xa.header()
        started = time.perf_counter()
        with publish_span(self._resolved_subject, headers) as (_span, traced):
            try:
                ack = await self.js.publish(self._resolved_subject, payload, headers=traced,
                                            stream=ROWS_STREAM, timeout=self._ack_timeout)
            except APIError as exc:
                if exc.err_code in _WRONG_LAST_SEQ:
                    raise Fenced(f"another capture advanced {self._resolved_subject}: {exc}") from exc
                raise PublishFailed(f"resolved mark refused: {exc}") from exc
            except TimeoutError:
                raise PublishFailed("no ack for the resolved mark") from None
        self._latency.observe(time.perf_counter() - started)
        self.resolved_stream_seq = int(ack.seq)
        metrics.MESSAGES_PUBLISHED.labels(self.source, type_).inc()
        metrics.RESOLVED_TIME.labels(self.source).set(ts_seconds(event.ts))
