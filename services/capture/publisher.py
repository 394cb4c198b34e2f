"""Publishing to the ROWS stream: deterministic ids, pipelined acks, fenced resolved marks.

Every message carries ``Nats-Msg-Id`` = its envelope id, derived from the binlog position, so
a re-read after a crash or failover publishes byte-for-byte the same ids and JetStream drops
the copies inside its duplicate window (consumers drop the rest by id).

Row and DDL messages are published without waiting for each ack (up to ``window`` in flight);
a resolved mark first waits for every earlier ack, so "ts <= resolved is in the stream" holds.
Resolved marks are also the fence between two captures of one source: each carries
``Nats-Expected-Last-Subject-Sequence`` = the stream sequence of the mark it follows, so a
capture that lost its lease and did not notice yet cannot publish a mark after its successor's.

Acks come back to one subscription of the publisher (``AckInbox``), and messages published
between two event-loop turns go out in one socket write. Tracing: one PRODUCER span per subject
per batch the pipeline hands over (``end_spans``), its context in each message's headers, not a
span per message.

A message larger than the server's max_payload (the client knows it from the server's INFO)
is published as ordered chunks on the same subject (``libs/chunks.py``), each with its own
deterministic id; the sink joins them again. Beyond ``max_message_bytes`` a message is refused
(``MessageTooLarge``) and the pipeline stops the table with a rejection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NoStreamResponseError
from opentelemetry.trace import Span
from pydantic import BaseModel

from contracts.events.rows import ResolvedAdvancedV1, RowsChangedV2
from contracts.registry import REGISTRY
from libs.chunks import chunk_size_for, digest_of, needs_chunks, split
from libs.streams import ROWS_STREAM, resolved_subject
from libs.telemetry.tracing import publish_span, start_publish_span
from libs.ts import ts_seconds
from services.capture import metrics
from services.capture.large_encode import approx_size, encode_rows_deterministic
from services.capture.rows_encode import encode_rows
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
_NO_RESPONDERS = "503"
_ROWS_TYPE = REGISTRY.key_of(RowsChangedV2)[0]


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


class AckInbox:
    """JetStream publishes whose acks come back to one subscription, as futures.

    What nats-py's ``publish_async`` does, without what costs per message there: a random
    token (a ``getrandom`` system call each), a semaphore taken through ``wait_for`` (a task
    and an event-loop turn each, so every message went out in its own socket write) and a
    done-callback. The reply subject ends in a counter; the window of ``Publisher`` bounds what
    is in flight.
    """

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._futures: dict[str, asyncio.Future[api.PubAck]] = {}
        self._next = 0

    async def publish(self, subject: str, payload: bytes,
                      headers: dict[str, str]) -> asyncio.Future[api.PubAck]:
        if self._sub is None:
            self._prefix = self._nc.new_inbox() + "."
            self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_ack)
        self._next += 1
        token = str(self._next)
        future: asyncio.Future[api.PubAck] = asyncio.get_running_loop().create_future()
        self._futures[token] = future
        try:
            await self._nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
        except BaseException:
            self._futures.pop(token, None)
            raise
        future.add_done_callback(lambda _f: self._futures.pop(token, None))
        return future

    async def _on_ack(self, msg: Msg) -> None:
        future = self._futures.pop(msg.subject[len(self._prefix):], None)
        if future is None or future.done():
            return  # a session already over, or a late answer after a timeout
        if msg.headers and msg.headers.get(api.Header.STATUS) == _NO_RESPONDERS:
            future.set_exception(NoStreamResponseError())
            return
        try:
            resp = json.loads(msg.data)
        except ValueError as exc:
            future.set_exception(exc)
            return
        if "error" in resp:
            future.set_exception(APIError.from_error(resp["error"]))
        else:
            future.set_result(api.PubAck.from_response(resp))

    async def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()


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
        self._acks = AckInbox(js._nc)
        self._spans: dict[str, tuple[Span, dict[str, str]]] = {}
        self._messages: dict[str, Any] = {}  # event type -> its counter (labels() per message costs)
        self._rows = metrics.ROWS_PUBLISHED.labels(source)

    def _span_headers(self, subject: str) -> dict[str, str]:
        """The trace headers of ``subject``'s publish span of this batch (opened on first use)."""
        found = self._spans.get(subject)
        if found is None:
            found = self._spans[subject] = start_publish_span(subject)
        return found[1]

    def end_spans(self) -> None:
        """End the batch's publish spans: one per subject a batch published to, not one per
        message (a span costs more than the publish of a small message)."""
        spans, self._spans = self._spans, {}
        for span, _headers in spans.values():
            span.end()

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
        elif isinstance(event, RowsChangedV2):
            type_ = _ROWS_TYPE
            try:
                payload = encode_rows(event, producer=self.producer, epoch=self.epoch, event_id=msg_id)
            except TypeError:  # a value orjson does not write as the contract says
                payload, type_ = self._encode(event, msg_id)
        else:
            payload, type_ = self._encode(event, msg_id)
        if needs_chunks(len(payload), max_payload):
            if len(payload) > self.max_message_bytes:
                metrics.OVERSIZED.labels(self.source).inc()
                raise MessageTooLarge(len(payload), self.max_message_bytes)
            await self._send_chunks(subject, payload, msg_id, getattr(event, "ts", 0), max_payload)
        else:
            await self._publish_one(subject, payload, {api.Header.MSG_ID.value: msg_id})
        self._counter(type_).inc()
        if rows:
            self._rows.inc(rows)

    def _counter(self, type_: str) -> Any:
        found = self._messages.get(type_)
        if found is None:
            found = self._messages[type_] = metrics.MESSAGES_PUBLISHED.labels(self.source, type_)
        return found

    async def _publish_one(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        traced = {**self._span_headers(subject), **headers,
                  api.Header.EXPECTED_STREAM.value: ROWS_STREAM}
        future = await self._acks.publish(subject, payload, traced)
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
            if not item.future.done():
                # Only then: wait_for costs a timer and an event-loop turn even for an ack that is
                # already in, and acks mostly come back in bursts ahead of the window's head.
                await asyncio.wait_for(asyncio.shield(item.future), self._ack_timeout)
            item.future.result()
        except TimeoutError:
            raise PublishFailed(f"no ack within {self._ack_timeout}s for {item.subject}") from None
        except (APIError, NoStreamResponseError) as exc:
            raise PublishFailed(f"publish to {item.subject} refused: {exc!r}") from exc
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

    async def close(self) -> None:
        """``discard``, and stop listening for acks."""
        self.discard()
        self.end_spans()
        await self._acks.close()

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
        self._counter(type_).inc()
        metrics.RESOLVED_TIME.labels(self.source).set(ts_seconds(event.ts))
