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
between two event-loop turns go out in one socket write. A row or DDL message is framed here
(``AckInbox.publish_framed``): its header block is the batch's constant lines for its subject
plus its id, not a dict validated and encoded header by header for every message. Tracing: one
PRODUCER span per subject per batch the pipeline hands over (``end_spans``), its context in each
message's headers, not a span per message. The message counters move once per batch too.

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
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats import errors as nats_errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NoStreamResponseError
from opentelemetry.trace import Span
from pydantic import BaseModel

from contracts.events.rows import ResolvedAdvancedV1, RowsChangedV2, RowsChangedV4
from contracts.registry import REGISTRY
from libs.chunks import chunk_size_for, digest_of, needs_chunks, split
from libs.stream_origin import STREAM_ORIGIN_HEADER, StreamOrigin
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
# Header on resolved marks: the server capture read (its @@server_id). A session on a server
# with another id is on another server of the topology: it resumes by the mark's GTID position.
SOURCE_SERVER_HEADER = "Sluice-Source-Server"
_WRONG_LAST_SEQ = frozenset({10071})
_CHUNK_WINDOW_BYTES = 4 * 1024 * 1024
_NO_RESPONDERS = "503"
_ROWS_TYPE = REGISTRY.key_of(RowsChangedV2)[0]
_MSG_ID_LINE = api.Header.MSG_ID.value.encode() + b": "
_ERROR_KEY = b'"error"'


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
    future: asyncio.Future[Any]
    started: float
    subject: str


@dataclass
class _BatchSpan:
    """A subject's publish span of the current batch: its trace headers, as a dict and as the
    start of a NATS header block (with the expected stream) for ``publish_framed``."""

    span: Span
    headers: dict[str, str]
    block: bytes


_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # nats-py's check of a header key


def _plain_header_value(value: str) -> bool:
    """Whether nats-py would send ``value`` as it is (it strips it and turns CR/LF into spaces):
    the framed path writes values unchanged, so anything else takes nats-py's own path."""
    return "\r" not in value and "\n" not in value and value == value.strip()


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
        self._futures: dict[str, asyncio.Future[Any]] = {}
        self._next = 0

    async def _reply(self) -> tuple[str, asyncio.Future[Any]]:
        if self._sub is None:
            self._prefix = self._nc.new_inbox() + "."
            self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_ack)
        self._next += 1
        token = str(self._next)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._futures[token] = future
        future.add_done_callback(lambda _f: self._futures.pop(token, None))
        return self._prefix + token, future

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str]) -> asyncio.Future[Any]:
        """Publish through nats-py (its header and subject checks); the ack's future."""
        reply, future = await self._reply()
        try:
            await self._nc.publish(subject, payload, reply=reply, headers=headers)
        except BaseException:
            future.cancel()
            raise
        return future

    def can_frame(self, payload: bytes) -> bool:
        """Whether ``publish_framed`` may send now: connected (else nats-py's path decides about
        its reconnect buffer) and within the server's max_payload (else nats-py's error)."""
        nc = self._nc
        return nc.is_connected and len(payload) <= nc.max_payload

    async def publish_framed(self, subject: str, payload: bytes, header_block: bytes) -> asyncio.Future[Any]:
        """Publish with a header block framed by the caller (``NATS/1.0`` line, header lines,
        empty line), as nats-py 2.16's ``_send_publish`` frames it: nats-py validates each header
        key with a regular expression and encodes it, per message, which cost more than the
        rest of a one-row message. The caller checks ``can_frame`` first and builds the block
        from keys and values nats-py would send unchanged (``_plain_header_value``)."""
        nc = self._nc
        if nc.is_closed:
            raise nats_errors.ConnectionClosedError
        if nc.is_draining_pubs:
            raise nats_errors.ConnectionDrainingError
        reply, future = await self._reply()
        try:
            size = len(payload)
            hdr_len = len(header_block)
            cmd = b"".join((f"HPUB {subject} {reply} {hdr_len} {hdr_len + size}\r\n".encode(),
                            header_block, payload, b"\r\n"))
            nc.stats["out_msgs"] += 1
            nc.stats["out_bytes"] += size
            await nc._send_command(cmd)
            if nc._flush_queue is not None and nc._flush_queue.empty():
                await nc._flush_pending()
        except BaseException:
            future.cancel()
            raise
        return future

    async def _on_ack(self, msg: Msg) -> None:
        future = self._futures.pop(msg.subject[len(self._prefix):], None)
        if future is None or future.done():
            return  # a session already over, or a late answer after a timeout
        if msg.headers and msg.headers.get(api.Header.STATUS) == _NO_RESPONDERS:
            future.set_exception(NoStreamResponseError())
            return
        data = msg.data
        if _ERROR_KEY not in data:
            # A stored message's ack: only its arrival matters (_settle_one), so it is not
            # parsed into a PubAck (a dataclass built field by field, per message).
            future.set_result(None)
            return
        try:
            resp = json.loads(data)
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
        self.origin: StreamOrigin | None = None
        """Where the source's stream begins: every mark says so (``libs.stream_origin``)."""
        self.resolved_stream_seq = 0  # stream sequence of the last resolved mark of the source
        self._resolved_subject = resolved_subject(source)
        self._latency = metrics.PUBLISH_LATENCY.labels(source)
        # The server's max_payload, as its INFO told the client (nats-py keeps it current).
        self._max_payload = max_payload or (lambda: 1024 * 1024)
        self.max_message_bytes = max_message_bytes
        self._acks = AckInbox(js._nc)
        self._spans: dict[str, _BatchSpan] = {}
        self._messages: dict[str, Any] = {}  # event type -> its counter (labels() per message costs)
        self._counts: dict[str, int] = {}  # event type -> messages published, not counted yet
        self._rows_uncounted = 0
        self._rows = metrics.ROWS_PUBLISHED.labels(source)

    def _batch_span(self, subject: str) -> _BatchSpan:
        """``subject``'s publish span of this batch (opened on first use)."""
        found = self._spans.get(subject)
        if found is None:
            span, headers = start_publish_span(subject)
            lines = [*headers.items(), (api.Header.EXPECTED_STREAM.value, ROWS_STREAM)]
            plain = all(_HEADER_KEY.fullmatch(k) and _plain_header_value(v) for k, v in lines)
            block = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in lines) if plain else b""
            found = self._spans[subject] = _BatchSpan(span, headers, block)
        return found

    def _span_headers(self, subject: str) -> dict[str, str]:
        """The trace headers of ``subject``'s publish span of this batch (opened on first use)."""
        return self._batch_span(subject).headers

    def end_spans(self) -> None:
        """End the batch's publish spans: one per subject a batch published to, not one per
        message (a span costs more than the publish of a small message); count its messages."""
        spans, self._spans = self._spans, {}
        for batch in spans.values():
            batch.span.end()
        self._count()

    def _count(self) -> None:
        counts, self._counts = self._counts, {}
        for type_, n in counts.items():
            self._counter(type_).inc(n)
        if self._rows_uncounted:
            self._rows.inc(self._rows_uncounted)
            self._rows_uncounted = 0

    def _check_lease(self) -> None:
        if not self._is_valid():
            raise LeaseLost(f"capture lease of source {self.source} lost")

    def _encode(self, event: BaseModel, msg_id: str) -> tuple[bytes, str]:
        data = REGISTRY.encode(event, producer=self.producer, epoch=self.epoch, event_id=msg_id)
        return data, REGISTRY.key_of(type(event))[0]

    async def send(self, subject: str, event: BaseModel, msg_id: str, *, rows: int = 0,
                   size_bound: int | None = None) -> None:
        """Publish one row/DDL/rejection message; its ack is awaited by ``flush`` (or when the
        window is full). ``size_bound``: at least ``approx_size(event)`` (the pipeline's size
        of the part), so a small message is known to be small without going over its values."""
        self._check_lease()
        max_payload = self._max_payload()
        large = chunk_size_for(max_payload) // 2
        if isinstance(event, RowsChangedV4) and event.more:
            # Several transactions: never in chunks (their ids and encoding are one part's);
            # the pipeline publishes the parts one by one instead.
            type_ = _ROWS_TYPE
            try:
                payload = encode_rows(event, producer=self.producer, epoch=self.epoch, event_id=msg_id)
            except TypeError:
                payload, type_ = self._encode(event, msg_id)
            if needs_chunks(len(payload), max_payload):
                raise MessageTooLarge(len(payload), max_payload)
            await self._publish_message(subject, payload, msg_id)
            self._counts[type_] = self._counts.get(type_, 0) + 1
            self._rows_uncounted += rows
            return
        if isinstance(event, RowsChangedV2) and (size_bound is None or size_bound > large) \
                and approx_size(event) > large:
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
            await self._publish_message(subject, payload, msg_id)
        self._counts[type_] = self._counts.get(type_, 0) + 1
        self._rows_uncounted += rows

    def _counter(self, type_: str) -> Any:
        found = self._messages.get(type_)
        if found is None:
            found = self._messages[type_] = metrics.MESSAGES_PUBLISHED.labels(self.source, type_)
        return found

    async def _publish_message(self, subject: str, payload: bytes, msg_id: str) -> None:
        """One message (not a chunk): framed here when nats-py would frame it the same way."""
        batch = self._batch_span(subject)
        if batch.block and _plain_header_value(msg_id) and self._acks.can_frame(payload):
            block = b"".join((batch.block, _MSG_ID_LINE, msg_id.encode(), b"\r\n\r\n"))
            future = await self._acks.publish_framed(subject, payload, block)
            await self._in_flight_add(future, subject)
        else:
            await self._publish_one(subject, payload, {api.Header.MSG_ID.value: msg_id})

    async def _publish_one(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        traced = {**self._span_headers(subject), **headers,
                  api.Header.EXPECTED_STREAM.value: ROWS_STREAM}
        future = await self._acks.publish(subject, payload, traced)
        await self._in_flight_add(future, subject)

    async def _in_flight_add(self, future: asyncio.Future[Any], subject: str) -> None:
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
            self._count()

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
                       xa: XaResume | None = None, server: str | None = None) -> None:
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
        if server is not None:
            headers[SOURCE_SERVER_HEADER] = server
        if self.origin is not None:
            headers[STREAM_ORIGIN_HEADER] = self.origin.header()
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
