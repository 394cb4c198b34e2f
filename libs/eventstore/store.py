"""An event store on one JetStream stream: typed appends with optimistic concurrency, replay.

Appends encode through ``contracts.REGISTRY`` and may carry the JetStream expectations that
make the stream an event log with a single writer: ``Nats-Expected-Last-Sequence`` (nobody
appended since I last looked) and ``Nats-Expected-Last-Subject-Sequence``. A failed expectation
is an ``AppendConflict``, never a generic error, because callers react to it (step down, retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BadRequestError, NotFoundError
from pydantic import BaseModel

from contracts import REGISTRY, ContractError, Envelope
from contracts.envelope import new_event_id
from libs.config import Settings, get_settings
from libs.eventstore.deadletter import dead_letter, ensure_deadletter_stream
from libs.streams import event_types_on
from libs.telemetry.metrics import APPEND_CONFLICTS, EVENTS_APPENDED
from libs.telemetry.tracing import process_span, publish_span

log = logging.getLogger(__name__)

# JSStreamWrongLastSequenceErrF / ...ConstantErr and JSStreamWrongLastMsgIDErrF: the server's
# answers to a failed Nats-Expected-* check.
_WRONG_LAST_CODES = frozenset({10070, 10071, 10164})
_STREAM_IN_USE = 10058
_LAST_SEQ_RE = re.compile(r"wrong last sequence:\s*(\d+)")

REPLAY_BATCH = 256


class AppendConflict(Exception):
    """The stream refused an append because its expected-sequence check failed."""

    def __init__(self, stream: str, subject: str, expected: int | None, detail: str,
                 actual_last_seq: int | None = None) -> None:
        super().__init__(f"append to {stream} ({subject}) refused: expected last seq {expected}: {detail}")
        self.stream = stream
        self.subject = subject
        self.expected = expected
        self.detail = detail
        self.actual_last_seq = actual_last_seq


@dataclass(frozen=True)
class StoredEvent:
    """One decoded event as it sits in the stream; ``event`` is upcast to the newest version."""

    seq: int
    subject: str
    headers: dict[str, str]
    envelope: Envelope
    event: BaseModel
    original_version: int = field(default=0, compare=False)

    @property
    def type(self) -> str:
        return self.envelope.type


def decode_message(msg: Msg) -> StoredEvent:
    """Decode one JetStream message; raises ``ContractError`` for anything not a known event,
    and for an event of a type its subject does not carry (``streams.event_types_on``)."""
    decoded = REGISTRY.decode(msg.data)
    check_subject(msg.subject, decoded.envelope.type)
    return StoredEvent(seq=int(msg.metadata.sequence.stream), subject=msg.subject,
                       headers=dict(msg.headers or {}), envelope=decoded.envelope, event=decoded.event,
                       original_version=decoded.original_version)


def check_subject(subject: str, event_type: str) -> None:
    """Refuse an event its subject may not carry: a writer allowed only that subject (a
    sink-worker on the incidents subject) cannot pass off another event type there."""
    allowed = event_types_on(subject)
    if allowed is not None and event_type not in allowed:
        raise ContractError("unknown_type", f"{event_type!r} is not accepted on {subject} "
                                            f"(only {', '.join(allowed)})", type=event_type)


def filter_fields(subjects: str | Sequence[str]) -> dict[str, Any]:
    """Consumer config fields that select ``subjects`` (one subject or several, in stream order)."""
    if isinstance(subjects, str):
        return {"filter_subject": subjects}
    if len(subjects) == 1:
        return {"filter_subject": subjects[0]}
    return {"filter_subjects": list(subjects)}


class EventStore:
    """Appends to and replays one stream. ``producer`` names the writer in every envelope."""

    def __init__(self, js: JetStreamContext, stream: str, producer: str,
                 settings: Settings | None = None) -> None:
        self.js = js
        self.stream = stream
        self.producer = producer
        self.settings = settings or get_settings()

    async def ensure(self, subjects: list[str], **stream_config: Any) -> api.StreamInfo:
        """Create the stream, or update it when it exists with another config.

        File storage and the Nats-Msg-Id duplicate window come from the settings unless
        ``stream_config`` says otherwise; any other ``StreamConfig`` field may be passed.
        """
        fields: dict[str, Any] = {
            "storage": api.StorageType.FILE,
            "duplicate_window": self.settings.dedup_window_s,
            "num_replicas": self.settings.stream_replicas,
        }
        fields.update(stream_config)
        config = api.StreamConfig(name=self.stream, subjects=list(subjects), **fields)
        try:
            info = await self.js.add_stream(config)
        except BadRequestError as exc:
            if exc.err_code != _STREAM_IN_USE:
                raise
            info = await self.js.update_stream(config)
        # Replays park undecodable messages there, so it has to exist before the first replay.
        await ensure_deadletter_stream(self.js, self.settings)
        return info

    def max_payload(self) -> int:
        """The server's max_payload, as its INFO told the client (nats-py keeps it current)."""
        nc = getattr(self.js, "_nc", None)
        return int(getattr(nc, "max_payload", 0) or 1024 * 1024)

    async def last_seq(self) -> int:
        info = await self.js.stream_info(self.stream)
        return int(info.state.last_seq)

    async def append(self, subject: str, event: BaseModel, *, epoch: int = 0,
                     expected_last_seq: int | None = None,
                     expected_last_subject_seq: int | None = None, msg_id: str | None = None,
                     headers: Mapping[str, str] | None = None) -> int:
        """Append one event; returns its stream sequence.

        The envelope id doubles as ``Nats-Msg-Id`` (``msg_id`` when given), so a retried append
        within the duplicate window returns the sequence of the first copy instead of storing
        a second one. The server checks expectations before duplicates, though: a retry whose
        first attempt did land fails its expected-sequence check (``DomainLog`` handles that).
        """
        envelope = REGISTRY.envelope(event, producer=self.producer, epoch=epoch, event_id=msg_id)
        return await self.append_envelope(subject, envelope, expected_last_seq=expected_last_seq,
                                          expected_last_subject_seq=expected_last_subject_seq,
                                          headers=headers)

    async def append_envelope(self, subject: str, envelope: Envelope, *,
                              expected_last_seq: int | None = None,
                              expected_last_subject_seq: int | None = None,
                              headers: Mapping[str, str] | None = None) -> int:
        """``append`` for a caller that needs the exact envelope it stored (to fold it)."""
        return await self.append_raw(subject, envelope.model_dump_json().encode(), envelope.id,
                                     expected_last_seq=expected_last_seq,
                                     expected_last_subject_seq=expected_last_subject_seq, headers=headers)

    async def append_raw(self, subject: str, payload: bytes, msg_id: str, *,
                         expected_last_seq: int | None = None,
                         expected_last_subject_seq: int | None = None,
                         headers: Mapping[str, str] | None = None) -> int:
        """Append bytes that are not one envelope (a chunk of a large snapshot), with the same
        expectations, ``Nats-Msg-Id`` and conflict handling as an event."""
        hdrs = dict(headers or {})
        hdrs[api.Header.MSG_ID.value] = msg_id
        if expected_last_seq is not None:
            hdrs[api.Header.EXPECTED_LAST_SEQUENCE.value] = str(expected_last_seq)
        if expected_last_subject_seq is not None:
            hdrs[api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value] = str(expected_last_subject_seq)
        with publish_span(subject, hdrs) as (_span, traced):
            try:
                ack = await self.js.publish(subject, payload, headers=traced, stream=self.stream)
            except APIError as exc:
                if exc.err_code in _WRONG_LAST_CODES:
                    APPEND_CONFLICTS.labels(self.stream).inc()
                    detail = exc.description or "wrong last sequence"
                    match = _LAST_SEQ_RE.search(detail)
                    raise AppendConflict(
                        self.stream, subject,
                        expected_last_seq if expected_last_seq is not None else expected_last_subject_seq,
                        detail, int(match.group(1)) if match else None,
                    ) from None
                raise
        if not ack.duplicate:
            EVENTS_APPENDED.labels(self.stream).inc()
        return int(ack.seq)

    async def append_raw_pipelined(self, items: Sequence[tuple[str, bytes, str]], *, expected_last_seq: int,
                                   ack_within_s: float) -> list[int | Exception]:
        """Publish ``items`` (subject, payload, ``Nats-Msg-Id``) in order without waiting for
        each ack before the next: the i-th expects the stream's last sequence to be
        ``expected_last_seq + i`` and its last message to be the (i-1)-th, so the server stores
        them only in this order, right after ``expected_last_seq``, and refuses each one that
        would land anywhere else (a writer in between, or an earlier one of them refused). Each
        result is the stored sequence, an ``AppendConflict`` or the error its ack came with
        (``TimeoutError``: none came within ``ack_within_s``; it may have been stored all the
        same). One ack round trip for the lot instead of one each: a leader recording a burst of
        events waited for them one by one.
        """
        futures: list[asyncio.Future[api.PubAck]] = []
        for i, (subject, payload, msg_id) in enumerate(items):
            hdrs = {api.Header.MSG_ID.value: msg_id,
                    api.Header.EXPECTED_LAST_SEQUENCE.value: str(expected_last_seq + i)}
            if i:
                # The sequence alone would let the i-th land after i messages of another writer
                # (its expectation met by them, not by ours): it must also follow our previous one.
                hdrs[api.Header.EXPECTED_LAST_MSG_ID.value] = items[i - 1][2]
            with publish_span(subject, hdrs) as (_span, traced):
                futures.append(await self.js.publish_async(subject, payload, headers=traced,
                                                           stream=self.stream))
        deadline = asyncio.get_running_loop().time() + ack_within_s
        out: list[int | Exception] = []
        for (subject, _payload, _id), future in zip(items, futures, strict=True):
            try:
                ack = await asyncio.wait_for(future, max(0.0, deadline - asyncio.get_running_loop().time()))
            except APIError as exc:
                if exc.err_code in _WRONG_LAST_CODES:
                    APPEND_CONFLICTS.labels(self.stream).inc()
                    detail = exc.description or "wrong last sequence"
                    match = _LAST_SEQ_RE.search(detail)
                    out.append(AppendConflict(self.stream, subject, expected_last_seq + len(out), detail,
                                              int(match.group(1)) if match else None))
                else:
                    out.append(exc)
                continue
            except (TimeoutError, NatsTimeoutError) as exc:
                out.append(exc)
                continue
            except Exception as exc:  # no responders, a connection lost: the caller decides
                out.append(exc)
                continue
            if not ack.duplicate:
                EVENTS_APPENDED.labels(self.stream).inc()
            out.append(int(ack.seq))
        return out

    async def get(self, seq: int) -> api.RawStreamMsg | None:
        """The raw message at ``seq``, or None when it does not exist (never was or removed)."""
        try:
            return await self.js.get_msg(self.stream, seq=seq)
        except NotFoundError:
            return None

    async def replay(self, subject_filter: str | Sequence[str], from_seq: int = 1, *,
                     until_seq: int | None = None) -> AsyncIterator[StoredEvent]:
        """Yield the decoded events on ``subject_filter`` with ``from_seq <= seq <= until_seq``.

        ``until_seq`` defaults to the stream's last sequence when the replay begins, so the
        iteration always ends, even while writers keep appending. Undecodable messages are
        dead-lettered (once, by sequence) and skipped: a replay must not stop on one bad event.
        """
        end = await self.last_seq() if until_seq is None else until_seq
        from_seq = max(1, from_seq)
        if end < from_seq:
            return
        consumer = f"replay_{new_event_id()}"
        # An ephemeral, unacknowledged consumer: replay reads, it never takes messages away.
        info = await self.js.add_consumer(self.stream, api.ConsumerConfig(
            name=consumer, ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=from_seq,
            **filter_fields(subject_filter), inactive_threshold=30.0, mem_storage=True,
            num_replicas=1,
        ))
        try:
            if not info.num_pending:
                return
            sub = await self.js.pull_subscribe_bind(consumer, stream=self.stream)
            try:
                async for msg in self._read_until(sub, consumer, end):
                    try:
                        yield decode_message(msg)
                    except ContractError as exc:
                        await dead_letter(self.js, msg, exc.reason, exc.kind, self.stream, ack=False)
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        finally:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.stream, consumer)

    async def _read_until(self, sub: JetStreamContext.PullSubscription, consumer: str,
                          end: int) -> AsyncIterator[Msg]:
        while True:
            try:
                msgs = await sub.fetch(REPLAY_BATCH, timeout=1.0)
            except (TimeoutError, NatsTimeoutError):
                # Messages counted as pending can vanish meanwhile (a snapshot rollup purges
                # older snapshots); ask the consumer whether anything is left to read.
                ci = await self.js.consumer_info(self.stream, consumer)
                if not ci.num_pending:
                    return
                continue
            for msg in msgs:
                seq = int(msg.metadata.sequence.stream)
                if seq > end:
                    return
                yield msg
                if seq == end or msg.metadata.num_pending == 0:
                    return


Handler = Callable[[StoredEvent], Awaitable[None]]


async def consume(js: JetStreamContext, *, stream: str, durable: str, subject_filter: str,
                  handler: Handler, stopping: asyncio.Event, batch: int = 64,
                  fetch_timeout: float = 1.0, ack_wait: float = 30.0, max_attempts: int = 5,
                  deliver_policy: api.DeliverPolicy = api.DeliverPolicy.ALL) -> None:
    """Consume ``subject_filter`` with a durable pull consumer until ``stopping`` is set.

    Good events go to ``handler`` and are acked once it returns. Messages that are not valid
    events are dead-lettered with the ``ContractError`` kind and reason and acked, so one bad
    message never blocks the ones after it. A handler that keeps failing on the same message
    dead-letters it (kind ``handler_error``) after ``max_attempts`` deliveries; retries before
    that are spaced by a nak delay. The server-side ``max_deliver`` is not used because the
    server would then stop delivering without telling anyone: the message would be lost.
    """
    try:
        await js.consumer_info(stream, durable)
    except NotFoundError:
        await js.add_consumer(stream, api.ConsumerConfig(
            durable_name=durable, name=durable, ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=deliver_policy, filter_subject=subject_filter, ack_wait=ack_wait,
            max_ack_pending=max(batch * 4, 256),
        ))
    await ensure_deadletter_stream(js)
    sub = await js.pull_subscribe_bind(durable, stream=stream)
    try:
        while not stopping.is_set():
            try:
                msgs = await sub.fetch(batch, timeout=fetch_timeout)
            except (TimeoutError, NatsTimeoutError):
                continue
            for msg in msgs:
                await _handle_one(js, stream, msg, handler, max_attempts)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _handle_one(js: JetStreamContext, stream: str, msg: Msg, handler: Handler,
                      max_attempts: int) -> None:
    try:
        stored = decode_message(msg)
    except ContractError as exc:
        await dead_letter(js, msg, exc.reason, exc.kind, stream)
        return
    with process_span(msg.subject, msg.headers):
        try:
            await handler(stored)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            attempts = msg.metadata.num_delivered
            if attempts >= max_attempts:
                await dead_letter(js, msg, f"handler failed {attempts} times: {exc!r}",
                                  "handler_error", stream)
            else:
                log.warning("handler failed, will retry", exc_info=True,
                            extra={"stream": stream, "seq": stored.seq, "attempt": attempts})
                await msg.nak(delay=min(0.5 * 2 ** attempts, 30.0))
            return
    await msg.ack()
