"""Reading a span's events from the ROWS stream, from its checkpoint on.

Each span has an ephemeral pull consumer on its two subjects (rows and DDL, ``filter_subjects``
needs nats-server 2.10+) that starts at ``checkpoint.stream_seq + 1``. It acknowledges nothing:
the checkpoint is the acknowledgement, so a crash simply re-reads from the checkpoint.

Events read but not applied in a round (above the resolved ts, after a DDL barrier, part of an
unfinished transaction) stay in the reader for the next round instead of being fetched again:
up to the batch size with their bodies, beyond it only as ``(stream_seq, ts)`` "ghosts" whose
bodies are read again when their turn comes. Reading always goes on to the resolved mark's
position, because only there is it known that every change up to the resolved ts has been
seen (see ``PullResult.horizon``); on a replicated stream a consumer's "nothing pending" short
of the mark is confirmed with the stream's leader first (``_none_before``: a consumer on a
replica behind the leader does not yet count what the leader stored before the mark). The
reader re-creates its consumer only when the checkpoint
moves outside the range it has read (a rewind, or a checkpoint another process advanced).

Anything on a span's subjects that is not a valid event of that span goes to the dead-letter
subject with its reason, and the span carries on after it.

A message larger than the server's max_payload arrives as a set of chunk messages
(``libs/chunks.py``). The reader joins a set into one event placed at its first chunk's stream
sequence, so a checkpoint before the event always re-reads the whole set. An incomplete set at
the end of a read (the rest not published yet, or a capture killed between chunks) is not kept:
it becomes a ghost at its first chunk with the ts its chunks carry, so it holds the horizon
below its ts exactly like an event not read yet, and its chunks are read again, from the first,
when the buffer wants it. Memory: the buffer keeps at most ``max_bytes`` of event bodies
(beyond them only ghosts), plus one set being joined and, unless the span's transactions larger
than that are applied streamed (``stream_large``, ``large_txn``), the rest of a transaction in
progress.

Read-ahead (``read_ahead``): while a round writes, the reader goes on reading past what it
returned, keeping up to a budget of further bodies (within the same ``max_bytes``). It changes
nothing a later ``pull`` returns: ``pull`` first cuts the buffer to what its own ``limit`` and
``max_bytes`` keep, and the bodies past that become ghosts whose bodies stay in memory
("spare"), so they are taken from there instead of the stream when the buffer wants them.
Garbage met while reading ahead is dead-lettered then, once, and counted in the next pull.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from uuid import uuid4

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NotFoundError
from opentelemetry.trace import Status, StatusCode
from pydantic import BaseModel, ValidationError

from contracts import REGISTRY, ContractError, Envelope
from contracts.events.rows import (
    DdlExecutedV1,
    ForeignKeysChangedV1,
    ResolvedAdvancedV1,
    RowsChangedV2,
    RowsChangedV4,
    TableMetaV1,
    parts_of,
)
from libs.chunks import ChunkError, ChunkInfo, ChunkJoiner, Joined, chunk_info
from libs.eventstore.deadletter import dead_letter
from libs.gc_pause import gc_paused
from libs.scheduling.model import Span
from libs.streams import ROWS_STREAM, resolved_subject, source_data_subjects, token
from libs.telemetry.tracing import spans_recorded, start_process_span
from services.sink_worker import metrics as m

log = logging.getLogger(__name__)

_FETCH_CHUNK = 256
_FETCH_TIMEOUT_S = 2.0
_MAX_FETCH_TIMEOUTS = 3
# A fetch brings up to _FETCH_CHUNK messages, and decoding them on the event loop (v4 messages
# of dozens of transaction parts) took a second and more on a loaded machine: the heartbeats'
# confirmations waited behind it, the worker's self-fence tripped (``fence``), every span was
# dropped and read again from its checkpoint, and the lag grew without bound (BENCHMARKS.md,
# "The sink under sysbench"). So fetches of at least _DECODE_IN_THREAD messages are decoded in
# a thread (``decode_fetched``; a thread hand-over costs more than decoding a few), and what
# stays on the loop (small fetches, chunk sets, refills, the reader's bookkeeping) gives the
# loop a turn at least every _LOOP_TURN_S.
_DECODE_IN_THREAD = 8
_LOOP_TURN_S = 0.02
# An idle span's consumer must survive the pauses between rounds; a dead worker's vanishes.
_CONSUMER_INACTIVE_S = 120.0
# A dead letter carries the message's body only below this size: it must fit one NATS message.
# A larger body stays where it is in the ROWS stream, and the dead letter says where.
_DEAD_LETTER_BODY_MAX = 512 * 1024
# Bytes a fetch may bring (its count x the server's max_payload) when it may meet chunk
# messages: the server drops a client as a slow consumer past 64 MiB pending to it. A reader
# starts at that count and doubles it after every fetch without chunks, up to _FETCH_CHUNK.
_FETCH_MAX_BYTES = 16 * 1024 * 1024


# JetStream's answer for a consumer whose server is down ("consumer is offline"): in a cluster,
# an R1 consumer on a node that stopped. It stays so until that node is back.
CONSUMER_OFFLINE = 10119


def consumer_lost(exc: APIError) -> bool:
    """Whether a JetStream error says the consumer cannot be read any more (gone, or offline)."""
    return isinstance(exc, NotFoundError) or exc.err_code == CONSUMER_OFFLINE


class Garbage(Exception):
    """A message on a span subject that is not a valid event of that span."""

    def __init__(self, kind: str, reason: str, event: PulledEvent | None = None) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason
        self.event = event
        """The event as a dead part (``dead=True``) when it is a row change of the span that is
        unusable: it still occupies its place in its transaction."""


@dataclass(frozen=True)
class PulledEvent:
    """One decoded row-change or DDL event of a span, with where it sits in the stream."""

    stream_seq: int
    subject: str
    event_id: str
    event: RowsChangedV2 | DdlExecutedV1 | ForeignKeysChangedV1
    data: bytes = field(repr=False)
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    dead: bool = False
    """Dead-lettered: never applied, but its transaction counts it as a present part (else a
    transaction with one bad message would stay incomplete, and its span stuck, forever)."""
    parts: tuple[PulledEvent, ...] = field(default=(), repr=False)
    """A ``rows.changed`` v4 message of several transaction parts: each part as the event of
    its own it would have been (its id, ts, seq), all at this message's stream sequence and
    sharing its bytes (``data``, not a copy; ``index`` says which part of them it is). The
    reader keeps the message as one entry (one stream sequence) and hands its parts over
    (``expanded``), without those at or below the checkpoint ts."""
    index: int = -1
    """Which part of ``data`` this event is (0: the message's top-level part, i: ``more[i-1]``);
    -1: ``data`` is this event alone."""

    @property
    def is_ddl(self) -> bool:
        """A barrier on the span's DDL subject: a DDL, or a foreign-key change announced on a
        parent (``foreign_keys.changed``, which has nothing to apply)."""
        return isinstance(self.event, DdlExecutedV1 | ForeignKeysChangedV1)

    @property
    def ts(self) -> int:
        return self.parts[0].ts if self.parts else self.event.ts

    @property
    def ts_last(self) -> int:
        """The highest ts it carries (its last part's; parts are in stream order)."""
        return self.parts[-1].ts if self.parts else self.event.ts

    def after(self, ts: int) -> PulledEvent | None:
        """What is left of it above ``ts`` (None: nothing; applied already)."""
        if not self.parts:
            return self if self.event.ts > ts else None
        if self.parts[0].ts > ts:
            return self
        kept = tuple(p for p in self.parts if p.ts > ts)
        return replace(self, parts=kept) if kept else None

    @property
    def body_bytes(self) -> int:
        """Bytes of body it holds in memory (a message of several: once, its parts share them)."""
        return len(self.data)

    def expanded(self) -> tuple[PulledEvent, ...]:
        """The events a round works with: its parts, or itself."""
        if not self.parts:
            return (self,)
        if self.dead:
            return tuple(replace(p, dead=True) for p in self.parts)
        return self.parts

    @property
    def seq(self) -> int:
        return self.event.seq

    @property
    def part(self) -> int:
        return self.event.part if isinstance(self.event, RowsChangedV2) else 0

    @property
    def last_part(self) -> bool:
        if self.parts:
            return self.parts[-1].last_part
        return self.event.last_part if isinstance(self.event, RowsChangedV2) else True


class LoopTurns:
    """Gives the event loop a turn (``asyncio.sleep(0)``: one pass over the ready callbacks and
    the sockets, not a wait) once ``every_s`` has passed since the last one, inside a loop that
    otherwise only computes."""

    def __init__(self, every_s: float = _LOOP_TURN_S) -> None:
        self.every_s = every_s
        self._last = time.monotonic()
        self.turns = 0

    async def maybe(self) -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s:
            await asyncio.sleep(0)
            self.turns += 1
            self._last = time.monotonic()


def decode_traced(span: Span, msg: _Fetched) -> PulledEvent | Garbage:
    """``decode_for_span`` of a freshly read message inside its process span; garbage is
    returned, not raised (it is dead-lettered by the caller, on the event loop)."""
    seq = int(msg.metadata.sequence.stream)
    if not spans_recorded():  # a span a message, a tenth of the decode, seen by nobody
        try:
            return decode_for_span(span, msg, seq)
        except Garbage as exc:
            return exc
    otel_span = start_process_span(msg.subject, msg.headers)
    try:
        otel_span.set_attribute("messaging.nats.stream_sequence", seq)
        return decode_for_span(span, msg, seq)
    except Garbage as exc:
        otel_span.set_attribute("sluice.dead_letter.kind", exc.kind)
        return exc
    except Exception as exc:
        otel_span.record_exception(exc)
        otel_span.set_status(Status(StatusCode.ERROR, repr(exc)))
        raise
    finally:
        otel_span.end()


def decode_fetched(span: Span, msgs: Sequence[_Fetched]) -> list[PulledEvent | Garbage | None]:
    """``decode_traced`` of each message of a fetch that is a whole message (None for chunks
    and invalid chunk headers: the reader joins or dead-letters those itself). Touches no
    reader state, so it runs in a thread."""
    out: list[PulledEvent | Garbage | None] = []
    for msg in msgs:
        try:
            info = chunk_info(msg.headers)
        except ChunkError:
            out.append(None)
            continue
        out.append(None if info is not None else decode_traced(span, msg))
    return out


class _Message(Protocol):
    @property
    def subject(self) -> str: ...

    @property
    def data(self) -> bytes: ...

    @property
    def headers(self) -> dict[str, str] | None: ...


class _Fetched(_Message, Protocol):
    """A message as a fetch returns it: with its place in the stream."""

    @property
    def metadata(self) -> Any: ...


def validate_rows(event: RowsChangedV2, columns: frozenset[str] | None = None) -> None:
    """Structural checks the contract cannot express: the images an op needs, known columns.
    ``columns``: ``meta_columns(event.meta)``, when the parts of one message share it."""
    if columns is None:
        columns = meta_columns(event.meta)
    for i, row in enumerate(event.rows):
        needs_before = row.op in ("update", "delete")
        needs_after = row.op in ("insert", "update")
        if needs_before and row.before is None:
            raise Garbage("invalid_data", f"row {i}: {row.op} without a before image")
        if needs_after and row.after is None:
            raise Garbage("invalid_data", f"row {i}: {row.op} without an after image")
        for image in (row.before, row.after):
            if image is not None and not columns.issuperset(image):
                unknown = set(image) - columns
                raise Garbage("invalid_data", f"row {i}: columns not in meta: {sorted(unknown)}")


def meta_columns(meta: TableMetaV1) -> frozenset[str]:
    """The column names of a rows event's metadata, checked: some, and every key column one."""
    columns = frozenset(c.name for c in meta.columns)
    if not columns:
        raise Garbage("invalid_data", "rows.changed without columns in meta")
    for col in [*meta.primary_key, *(c for uk in meta.unique_keys for c in uk)]:
        if col not in columns:
            raise Garbage("invalid_data", f"key column {col!r} is not a column of the table")
    return columns


class _RowsEnvelope(Envelope):
    """The envelope of a ``rows.changed`` event in its newest version, validated in one pass."""

    data: RowsChangedV4  # type: ignore[assignment]


_ROWS_TYPE, _ROWS_VERSION = REGISTRY.key_of(RowsChangedV4)
# Versions whose body is a newest-version body as it is: v3 is v4 without ``event_id`` and
# ``more`` (the upcaster copies it), and capture still writes a message of one part as v3.
_ROWS_AS_IS = frozenset({_ROWS_VERSION, 3})


def _rows_fast(raw: bytes) -> tuple[str, RowsChangedV2] | None:
    """``(event id, event)`` when ``raw`` is a valid newest-version rows event, else None.

    Nearly every message a span reads is one. Parsing and validating it in a single pass from
    the bytes takes half the time of the registry's general path (JSON to dicts, then the
    envelope, then the event), and this is per row of the whole stream, on the driver. Whatever
    does not pass goes the general way, which says exactly what is wrong with it; what does pass
    is exactly what the general path would accept (the same envelope fields, the same model).
    """
    try:
        env = _RowsEnvelope.model_validate_json(raw)
    except ValidationError:
        return None
    if env.type != _ROWS_TYPE or env.version not in _ROWS_AS_IS or _ROWS_VERSION != REGISTRY.latest_version(
            _ROWS_TYPE):
        return None
    if env.version != _ROWS_VERSION and (env.data.more or env.data.event_id is not None):
        return None  # v4's fields in an older version: the general path says what is wrong
    return env.id, env.data


def _with_parts(pulled: PulledEvent) -> PulledEvent:
    """A v4 message of several parts as one entry holding each part as an event of its own.

    The parts share the message's bytes: the apply job reads each part from them by its index
    (``apply_job.event_images``), so a part is neither re-encoded nor carries the table's
    metadata again (a sysbench part is a row or two beside metadata several times its size:
    per-part bodies cost most of the driver's decode and made the round's Arrow table, and the
    Spark driver's heap that carries it, several times the stream's bytes)."""
    event = pulled.event
    assert isinstance(event, RowsChangedV4)
    parts = tuple(replace(pulled, event_id=i, event=e, index=k)
                  for k, (i, e) in enumerate(parts_of(event, pulled.event_id)))
    return replace(pulled, parts=parts)


def decode_for_span(span: Span, msg: _Message, seq: int) -> PulledEvent:
    """Decode one message of ``span``'s subjects, or raise ``Garbage`` saying why it is not one."""
    raw = msg.data or b""
    parts = msg.subject.split(".")
    own = len(parts) == 5 and parts[2] == span.source and (parts[3], parts[4]) in span.tables()
    is_rows, is_ddl = own and parts[1] == "rows", own and parts[1] == "ddl"
    fast = _rows_fast(raw) if is_rows else None
    event: BaseModel
    if fast is not None:
        event_id, event = fast
    else:
        try:
            decoded = REGISTRY.decode(raw)
        except ContractError as exc:
            raise Garbage(exc.kind, exc.reason) from None
        event, event_id = decoded.event, decoded.envelope.id
        if is_rows:
            if not isinstance(event, RowsChangedV2):
                raise Garbage("unexpected_type", f"{decoded.envelope.type} on a rows subject")
        elif is_ddl:
            if not isinstance(event, DdlExecutedV1 | ForeignKeysChangedV1):
                raise Garbage("unexpected_type", f"{decoded.envelope.type} on a DDL subject")
        else:
            raise Garbage("unexpected_subject", f"{msg.subject} is not a subject of {span.name}")
    assert isinstance(event, RowsChangedV2 | DdlExecutedV1 | ForeignKeysChangedV1)
    if (token(event.source) != span.source
            or (token(event.database), token(event.table)) != (parts[3], parts[4])):
        raise Garbage("invalid_data", f"event of {event.source}/{event.database}.{event.table} "
                                      f"on {msg.subject}")
    pulled = PulledEvent(stream_seq=seq, subject=msg.subject, event_id=event_id, event=event,
                         data=raw, headers=dict(msg.headers or {}))
    if isinstance(event, RowsChangedV4) and event.more:
        pulled = _with_parts(pulled)
        try:
            columns = meta_columns(event.meta)  # the parts share the message's metadata
            for part in pulled.parts:
                assert isinstance(part.event, RowsChangedV2)
                validate_rows(part.event, columns)
        except Garbage as exc:
            # One message: dead-lettered whole, every part present but never applied.
            raise Garbage(exc.kind, exc.reason, replace(pulled, dead=True)) from None
    elif isinstance(event, RowsChangedV2):
        try:
            validate_rows(event)
        except Garbage as exc:
            raise Garbage(exc.kind, exc.reason, replace(pulled, dead=True)) from None
    return pulled


@dataclass
class PullResult:
    events: list[PulledEvent]
    """The buffer: every event of the span after the checkpoint up to some point, in stream order."""
    ghosts: list[tuple[int, int]]
    """``(stream_seq, ts)`` of the events read after the buffer, bodies dropped (memory bound)."""
    read_upto: int
    """Highest stream sequence read for the span (garbage included); the checkpoint's seq when
    nothing was read."""
    reached: bool
    """Every message of the span up to the resolved mark's position (or all that exist) was read."""
    dead_lettered: int = 0
    event_bytes: int = 0
    """Body bytes of ``events`` (what the round holds in memory for the span)."""

    def horizon(self, checkpoint_ts: int, resolved: int | None) -> int:
        """The highest ts at or below which every event of the span is in ``events``.

        The resolved mark says every change with ts <= its ts is in the stream *before the
        mark*; having read up to the mark, the only ones not in the buffer are the ghosts. The
        stream is not always in ts order (after a lost publish, capture re-publishes from its
        last mark, so an older transaction can land after newer ones), hence the ghosts' ts and
        not their position decide.
        """
        if resolved is None or not self.reached:
            return checkpoint_ts
        later = [ts for _, ts in self.ghosts if ts > checkpoint_ts]
        return min(resolved, min(later) - 1) if later else resolved

    def first_seq_after(self, ts: int) -> int | None:
        """Stream sequence of the first event read (buffer or ghost) with a ts above ``ts``."""
        seqs = [e.stream_seq for e in self.events if e.ts > ts]
        seqs += [seq for seq, g_ts in self.ghosts if g_ts > ts]
        return min(seqs) if seqs else None


class _Ghosts:
    """``(stream_seq, ts)`` of events read past the buffer, oldest first, with their minimum ts
    kept current as they are appended at the back and taken from the front (a monotonic queue)."""

    def __init__(self) -> None:
        self.items: deque[tuple[int, int]] = deque()
        self._mins: deque[tuple[int, int]] = deque()

    def __len__(self) -> int:
        return len(self.items)

    def append(self, seq: int, ts: int) -> None:
        self.items.append((seq, ts))
        while self._mins and self._mins[-1][1] >= ts:
            self._mins.pop()
        self._mins.append((seq, ts))

    def popleft(self) -> tuple[int, int]:
        item = self.items.popleft()
        if self._mins and self._mins[0][0] == item[0]:
            self._mins.popleft()
        return item

    def first_seq(self) -> int:
        return self.items[0][0]

    def min_ts(self) -> int | None:
        return self._mins[0][1] if self._mins else None


class SpanReader:
    """The span's read position: a buffer of events (bodies) right after ``base``, then ghosts
    (only ``(stream_seq, ts)``) up to ``read_upto``, which the span's consumer has reached.

    Bodies are kept for at most ``limit`` events, plus what finishes an open transaction or
    belongs before the buffer's newest event in ts order; past that, reading goes on as far as
    the resolved mark's position keeping only each event's ts, which is what the horizon needs.
    Ghost bodies are read again (a short-lived consumer) once the buffer wants them. Events at
    or below the checkpoint ts are applied already and not kept at all.
    """

    def __init__(self, js: JetStreamContext, span: Span, rows_stream: str = ROWS_STREAM, *,
                 max_bytes: int = 512 * 1024 * 1024) -> None:
        self.js = js
        self.span = span
        self.rows_stream = rows_stream
        self.max_bytes = max_bytes
        self.buffer: list[PulledEvent] = []
        self._bytes = 0  # body bytes in the buffer
        self._large = False  # chunk messages seen since the last fetch
        self._fetch_n = 0  # messages the last fetch asked for
        self._joiner = ChunkJoiner()
        self.ghosts = _Ghosts()
        self.base = -1
        self.read_upto = -1
        self._newest = -1  # highest ts in the buffer
        self._consumer: str | None = None
        self._sub: JetStreamContext.PullSubscription | None = None
        self._spare: dict[int, PulledEvent] = {}  # bodies of ghosts read ahead, by stream seq
        self._base_ts = -1  # the checkpoint ts of the last pull
        self._ahead_dead = 0  # dead-lettered while reading ahead, not yet reported by a pull
        self._stale = False  # a read-ahead stopped midway: the consumer's position is not known
        self.stream_large = False
        """A transaction in progress keeps at most ``open_max`` (events, bytes) of bodies and
        never stretches the buffer past its allowance: one left incomplete at the span's head is
        applied streamed (``large_txn``). Only for spans that path can write; the others keep
        the whole transaction, as before."""
        self.open_max = (64, 32 * 1024 * 1024)
        self._open = (-1, 0, 0)  # the buffer's last transaction: (ts, events, body bytes)
        self.confirm_reached: bool | None = None
        """Whether a consumer's "nothing pending" before the mark is confirmed with the stream's
        leader (``_none_before``); None: when the stream has replicas (``replicated``)."""

    def _config(self, name: str, start_seq: int) -> api.ConsumerConfig:
        return api.ConsumerConfig(
            name=name, ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq,
            filter_subjects=self.span.subjects(),
            inactive_threshold=_CONSUMER_INACTIVE_S, mem_storage=True, num_replicas=1,
        )

    async def _reset(self, checkpoint_seq: int) -> None:
        await self.close()
        name = f"sink_{uuid4().hex}"
        await self.js.add_consumer(self.rows_stream, self._config(name, checkpoint_seq + 1))
        self._consumer = name
        self._sub = await self.js.pull_subscribe_bind(name, stream=self.rows_stream)
        self.buffer = []
        self._bytes = 0
        self._open = (-1, 0, 0)
        self._joiner.clear()
        self.ghosts = _Ghosts()
        self._spare = {}
        self._stale = False
        self._newest = -1
        self.base = checkpoint_seq
        self.read_upto = checkpoint_seq

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.rows_stream, self._consumer)
        self._sub = None
        self._consumer = None

    async def pull(self, checkpoint: tuple[int, int], limit: int, until_seq: int | None) -> PullResult:
        """The span's events after ``checkpoint`` (``(stream_seq, ts)``), read as far as the
        stream sequence ``until_seq`` (the resolved mark's) or the end."""
        checkpoint_seq, checkpoint_ts = checkpoint
        if self._sub is None or self._stale or not (self.base <= checkpoint_seq <= self.read_upto):
            await self._reset(checkpoint_seq)
        else:
            self.base = checkpoint_seq
            self.buffer = [left for e in self.buffer
                           if e.stream_seq > checkpoint_seq and (left := e.after(checkpoint_ts)) is not None]
            self._bytes = sum(e.body_bytes for e in self.buffer)
            self._newest = max((e.ts_last for e in self.buffer), default=-1)
            self._count_open()
            while self.ghosts and (self.ghosts.first_seq() <= checkpoint_seq):
                self.ghosts.popleft()
            if (self.ghosts.min_ts() or checkpoint_ts + 1) <= checkpoint_ts:
                # Read ahead before the checkpoint passed their ts: applied (and a reader
                # that had not read them yet would drop them as it reads them).
                kept, self.ghosts = self.ghosts, _Ghosts()
                for seq, ts in kept.items:
                    if ts > checkpoint_ts:
                        self.ghosts.append(seq, ts)
            self._spare = {seq: left for seq, e in self._spare.items()
                           if seq > checkpoint_seq and (left := e.after(checkpoint_ts)) is not None}
            self._fit(limit)
        self._base_ts = checkpoint_ts
        dead, self._ahead_dead = self._ahead_dead, 0
        # Decoding a round's events allocates millions of live objects: see libs.gc_pause.
        with gc_paused():
            try:
                await self._refill(limit)
                reached, scanned_dead = await self._scan(limit, checkpoint_ts, until_seq)
                await self._refill(limit)
            except (APIError, TimeoutError, NatsTimeoutError) as exc:
                if isinstance(exc, APIError) and not consumer_lost(exc):
                    raise
                # The consumer is gone (server restart, inactivity), offline, or does not answer
                # at all (the node of a cluster that holds it, R1, is down or was killed): read
                # again from the checkpoint with a new one, which a live node holds. Reading
                # again is always correct; a consumer that was only slow costs a re-read.
                await self._reset(checkpoint_seq)
                reached, scanned_dead = await self._scan(limit, checkpoint_ts, until_seq)
                await self._refill(limit)
        events = [part for e in self.buffer for part in e.expanded()]
        return PullResult(events=events, ghosts=list(self.ghosts.items), read_upto=self.read_upto,
                          reached=reached, dead_lettered=dead + scanned_dead, event_bytes=self._bytes)

    async def read_ahead(self, until_seq: int | None, budget: int) -> None:
        """Read on past what the last ``pull`` returned, as far as ``until_seq`` (a resolved
        mark's stream sequence) or the end, keeping up to ``budget`` more bodies (within
        ``max_bytes``): the next round finds them in memory. Runs while that round's batch is
        written; the next ``pull`` returns exactly what it would have without it. A failure
        drops the consumer, so the next ``pull`` reads again from its checkpoint."""
        if self._sub is None or budget <= 0:
            return
        limit = len(self.buffer) + budget
        try:
            with gc_paused():
                await self._refill(limit)
                _, dead = await self._scan(limit, self._base_ts, until_seq, confirm=False)
                await self._refill(limit)
        except BaseException as exc:
            self._stale = True  # e.g. messages fetched but not taken in: never pull after them
            if not isinstance(exc, Exception):
                raise  # cancelled: the next pull starts over from its checkpoint
            log.warning("reading ahead failed; the next pull reads again from its checkpoint",
                        exc_info=True, extra={"span": self.span.name})
            return
        self._ahead_dead += dead

    def _drop_ghost(self) -> None:
        seq, _ = self.ghosts.popleft()
        self._spare.pop(seq, None)

    def _fit(self, limit: int) -> None:
        """Cut the buffer to what a pull with ``limit`` keeps; the bodies past it become ghosts
        whose bodies are kept in ``_spare`` (read ahead, or kept by a larger earlier limit)."""
        kept, extra = self.buffer, _Ghosts()
        self.buffer, self._bytes, self._newest, self._open = [], 0, -1, (-1, 0, 0)
        for e in kept:
            if not extra and self._wants_body(limit, ghosts=False):
                self._keep(e)
            else:
                extra.append(e.stream_seq, e.ts)
                self._spare[e.stream_seq] = e
        if extra:
            for seq, ts in self.ghosts.items:
                extra.append(seq, ts)
            self.ghosts = extra

    async def _pending(self) -> int:
        assert self._consumer is not None
        info = await self.js.consumer_info(self.rows_stream, self._consumer)
        return int(info.num_pending or 0)

    def _fetch_cap(self) -> int:
        """Messages one fetch may ask for, so that chunk messages of the server's max_payload
        stay under the subscription's pending bytes limit."""
        max_payload = int(getattr(getattr(self.js, "_nc", None), "max_payload", 0) or 1024 * 1024)
        safe = max(1, min(_FETCH_CHUNK, _FETCH_MAX_BYTES // max_payload))
        if self._large:
            self._large = False
            self._fetch_n = safe
        else:
            self._fetch_n = min(_FETCH_CHUNK, max(safe, self._fetch_n * 2)) if self._fetch_n else safe
        return self._fetch_n

    def _wants_body(self, limit: int, *, ghosts: bool = True) -> bool:
        """Whether the next event (in stream order) belongs in the buffer (``ghosts``: also
        the oldest ghost's ts, which only a refill asks about)."""
        if self.stream_large and self.buffer and not self.buffer[-1].last_part:
            _, events, size = self._open
            if events >= self.open_max[0] or size >= self.open_max[1]:
                return False  # a large transaction: the rest is read in windows (large_txn)
        if len(self.buffer) < limit and (not self.buffer or self._bytes < self.max_bytes):
            return True
        if self.buffer and not self.buffer[-1].last_part and not self.stream_large:
            return True  # the batch can only end at a transaction boundary
        if not ghosts:
            return False
        # An event older (in ts) than the buffer's newest must be sorted together with it.
        oldest_ghost = self.ghosts.min_ts()
        return oldest_ghost is not None and oldest_ghost <= self._newest

    def _keep(self, event: PulledEvent) -> None:
        self.buffer.append(event)
        self._bytes += event.body_bytes
        self._newest = max(self._newest, event.ts_last)
        # A transaction of several parts is never batched with others (capture closes a batch
        # before one), so the last transaction of an entry is the one that may be open.
        ts, events, size = self._open
        if ts == event.ts_last:
            self._open = (ts, events + 1, size + event.body_bytes)
        else:
            self._open = (event.ts_last, 1, event.body_bytes)

    def _count_open(self) -> None:
        """``_open`` of the buffer as it is (after it was cut at the front)."""
        self._open = (-1, 0, 0)
        if self.buffer:
            ts = self.buffer[-1].ts_last
            tail = [e for e in self.buffer if e.ts_last == ts]
            self._open = (ts, len(tail), sum(e.body_bytes for e in tail))

    def _ghost(self, seq: int, ts: int) -> None:
        self._spill_partial()
        self.ghosts.append(seq, ts)

    def _spill_partial(self) -> None:
        """Chunk sets being joined become ghosts at their first chunk: read again later."""
        for seq, ts in self._joiner.partial():
            self.ghosts.append(seq, ts)
        self._joiner.clear()

    async def _scan(self, limit: int, checkpoint_ts: int, until_seq: int | None, *,
                    confirm: bool = True) -> tuple[bool, int]:
        assert self._sub is not None
        dead = 0
        # Asking the consumer first avoids a fetch that waits out its timeout on an idle span.
        pending = await self._pending()
        turns = LoopTurns()
        timeouts = 0
        while pending > 0:
            body = not self.ghosts and self._wants_body(limit)
            if not body and (until_seq is None or self.read_upto >= until_seq):
                break
            room = limit - len(self.buffer)
            cap = self._fetch_cap()
            if not body:
                want = min(cap, pending)
            else:  # past the limit only to finish a transaction: small steps
                want = min(cap, pending, room) if room > 0 else min(16, cap, pending)
            try:
                msgs = await self._sub.fetch(want, timeout=_FETCH_TIMEOUT_S)
            except (TimeoutError, NatsTimeoutError):
                timeouts += 1
                if timeouts >= _MAX_FETCH_TIMEOUTS:
                    # Never spin inside a round: report what was read; the next round goes on.
                    log.warning("span consumer delivers nothing although messages are pending",
                                extra={"span": self.span.name, "pending": pending})
                    await self.close()  # the next pull starts a new consumer at the checkpoint
                    return False, dead
                pending = await self._pending()
                continue
            timeouts = 0
            # Decoding is most of a pull's CPU: in a thread, the event loop stays free for the
            # heartbeats (their confirmation is the worker's right to write, ``fence``).
            decoded = (await asyncio.to_thread(decode_fetched, self.span, msgs)
                       if len(msgs) >= _DECODE_IN_THREAD else [None] * len(msgs))
            for msg, pre in zip(msgs, decoded, strict=True):
                await turns.maybe()
                pending = int(msg.metadata.num_pending or 0)
                try:
                    info = chunk_info(msg.headers)
                except ChunkError as exc:
                    await self._take_garbage(msg, exc)
                    dead += 1
                    continue
                if info is not None:
                    event = await self._take_chunk(msg, info, checkpoint_ts, limit)
                    if event is None:
                        continue
                else:
                    event = await self._take(msg, pre)
                if event is None or event.dead:
                    dead += 1
                if event is None:
                    continue
                event = event.after(checkpoint_ts)
                if event is None:
                    continue  # a late copy of an applied event
                elif not self.ghosts and self._wants_body(limit):
                    self._keep(event)
                else:
                    self._ghost(event.stream_seq, event.ts)
        self._spill_partial()
        if until_seq is not None and self.read_upto >= until_seq:
            reached = True
        elif pending == 0 and until_seq is not None and confirm and await self._must_confirm():
            reached = await self._none_before(until_seq)
        else:
            reached = pending == 0
        return reached, dead

    async def _must_confirm(self) -> bool:
        if self.confirm_reached is None:
            self.confirm_reached = await replicated(self.js, self.rows_stream)
        return self.confirm_reached

    async def _none_before(self, until_seq: int) -> bool:
        """Whether the stream holds no message of the span's subjects after what was read and
        at or before ``until_seq``, asked of the stream's leader. A consumer counts pending
        messages in the store of the server that holds it, and in a cluster that may be a
        replica still behind the leader (one that was catching up after a node was killed):
        its "nothing pending" then passed over messages stored before the mark, the horizon
        moved to the mark's ts, and those messages were dropped as applied when they came."""
        for subject in self.span.subjects():
            try:
                raw = await self.js.get_msg(self.rows_stream, seq=self.read_upto + 1, subject=subject,
                                            next=True)
            except NotFoundError:
                continue
            if int(raw.seq or 0) <= until_seq:
                log.info("the span's consumer said nothing pending before the mark, the stream's "
                         "leader has more: read again next round",
                         extra={"span": self.span.name, "read_upto": self.read_upto,
                                "found_seq": raw.seq, "mark_seq": until_seq})
                return False
        return True

    async def _take_chunk(self, msg: Msg, info: ChunkInfo, checkpoint_ts: int,
                          limit: int) -> PulledEvent | None:
        """Join a chunk read in ``_scan``: the event once its set is complete, else None."""
        seq = int(msg.metadata.sequence.stream)
        self.read_upto = max(self.read_upto, seq)
        self._large = True
        if info.ts <= checkpoint_ts:
            return None  # a late copy of an applied event
        if self.ghosts or not self._wants_body(limit):
            if info.index == 0 and not self._joiner.knows(info):
                self._ghost(seq, info.ts)  # read again, whole, when the buffer wants it
            return None
        try:
            joined = self._joiner.add(info, seq, msg.data or b"", msg.headers or {})
        except ChunkError as exc:
            await self._take_garbage(msg, exc)
            return None
        if joined is None:
            return None
        m.CHUNK_SETS_JOINED.inc()
        return await self._take_joined(joined, msg.subject)

    async def _take_joined(self, joined: Joined, subject: str) -> PulledEvent | None:
        parked = _Parked(subject, joined.data, joined.headers)
        try:
            return decode_for_span(self.span, parked, joined.first_seq)
        except Garbage as exc:
            await self._park(parked, f"{exc.reason} (chunked message, stream seq "
                                     f"{joined.first_seq}..{joined.last_seq})", exc.kind, joined.first_seq)
            return exc.event

    async def _take_garbage(self, msg: Msg, exc: ChunkError) -> None:
        seq = int(msg.metadata.sequence.stream)
        self.read_upto = max(self.read_upto, seq)
        await dead_letter(self.js, msg, str(exc), "invalid_chunk", self.rows_stream, seq=seq, ack=False)

    async def _park(self, parked: _Parked, reason: str, kind: str, seq: int) -> None:
        if len(parked.data) > _DEAD_LETTER_BODY_MAX:
            reason = f"{reason}; body of {len(parked.data)} bytes left in {self.rows_stream}"
            parked = _Parked(parked.subject, b"", parked.headers)
        await dead_letter(self.js, parked, reason, kind, self.rows_stream, seq=seq, ack=False)

    async def _take(self, msg: Msg, decoded: PulledEvent | Garbage | None = None) -> PulledEvent | None:
        """A freshly read message (``decoded``: decoded already, ``decode_fetched``); garbage
        is dead-lettered (None, or its dead event)."""
        seq = int(msg.metadata.sequence.stream)
        self.read_upto = max(self.read_upto, seq)
        if decoded is None:
            decoded = decode_traced(self.span, msg)
        if isinstance(decoded, Garbage):
            await dead_letter(self.js, msg, decoded.reason, decoded.kind, self.rows_stream, seq=seq,
                              ack=False)
            return decoded.event
        return decoded

    async def _refill(self, limit: int) -> None:
        """Read the bodies of the first ghosts again while the buffer wants them."""
        while self.ghosts and self.ghosts.first_seq() in self._spare and self._wants_body(limit):
            self._keep(self._spare.pop(self.ghosts.popleft()[0]))
        if not self.ghosts or not self._wants_body(limit):
            return
        name = f"sink_refill_{uuid4().hex}"
        await self.js.add_consumer(self.rows_stream, self._config(name, self.ghosts.first_seq()))
        try:
            sub = await self.js.pull_subscribe_bind(name, stream=self.rows_stream)
            joiner = ChunkJoiner()
            turns = LoopTurns()
            try:
                while self.ghosts and self._wants_body(limit):
                    try:
                        # A ghost may be a chunk set of many messages: fetch what a set needs.
                        cap = self._fetch_cap()
                        want = cap if joiner else len(self.ghosts)
                        msgs = await sub.fetch(min(cap, want), timeout=_FETCH_TIMEOUT_S)
                    except (TimeoutError, NatsTimeoutError):
                        if not joiner:
                            log.warning("ghost events no longer readable", extra={
                                "span": self.span.name, "from_seq": self.ghosts.first_seq()})
                        return
                    for msg in msgs:
                        await turns.maybe()
                        seq = int(msg.metadata.sequence.stream)
                        try:
                            info = chunk_info(msg.headers)
                        except ChunkError:
                            continue  # dead-lettered when first read
                        self._large = self._large or info is not None
                        if info is not None and (info.index > 0 or joiner.knows(info)):
                            if not joiner.knows(info):
                                continue  # the tail of a set whose start is not a ghost
                            try:
                                joined = joiner.add(info, seq, msg.data or b"", msg.headers or {})
                            except ChunkError:
                                return  # dead-lettered when first read; the ghost stays
                            if (joined is not None and self.ghosts
                                    and self.ghosts.first_seq() == joined.first_seq):
                                self._drop_ghost()
                                event = await self._take_joined(joined, msg.subject)
                                if event is not None:
                                    self._keep(event)
                            continue
                        if joiner:
                            # Another message inside an incomplete set (two captures publishing
                            # at once): the set stays a ghost until a later read finds it whole.
                            return
                        while self.ghosts and self.ghosts.first_seq() < seq:
                            self._drop_ghost()  # gone from the stream meanwhile (limits)
                        if not self.ghosts or self.ghosts.first_seq() != seq:
                            continue  # garbage or a late copy, handled when first read
                        if not self._wants_body(limit):
                            break
                        if info is not None:  # chunk 0 of a ghost: join the set, then keep it
                            joiner.add(info, seq, msg.data or b"", msg.headers or {})
                            continue
                        self._drop_ghost()
                        try:
                            event = decode_for_span(self.span, msg, seq)
                        except Garbage as exc:
                            if exc.event is None:
                                continue
                            event = exc.event  # dead-lettered when first read
                        # As when first read: only what lies above the checkpoint.
                        kept = event.after(self._base_ts)
                        if kept is not None:
                            self._keep(kept)
                    if joiner and msgs and not int(msgs[-1].metadata.num_pending or 0):
                        return  # the rest of the set is not in the stream yet: wait for it
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        finally:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.rows_stream, name)

    async def dead_letter_event(self, event: PulledEvent, kind: str, reason: str) -> None:
        """Park an event the pipeline found unusable (e.g. a row without its key columns)."""
        await self._park(_Parked(event.subject, event.data, event.headers), reason, kind, event.stream_seq)
        self.buffer = [_dead_in(e, event) if e.stream_seq == event.stream_seq else e for e in self.buffer]


def _dead_in(entry: PulledEvent, event: PulledEvent) -> PulledEvent:
    """``entry`` with ``event`` (itself, or one of its parts) dead."""
    if not entry.parts:
        return replace(entry, dead=True)
    return replace(entry, parts=tuple(replace(p, dead=True) if p.event_id == event.event_id else p
                                      for p in entry.parts))


@dataclass(frozen=True)
class _Parked:
    subject: str
    data: bytes
    headers: dict[str, str] | None


@dataclass(frozen=True)
class ResolvedMark:
    ts: int
    stream_seq: int


_REPLICATED: dict[tuple[int, str], bool] = {}


async def replicated(js: JetStreamContext, stream: str) -> bool:
    """Whether ``stream`` has more than one replica (read once per connection and stream)."""
    key = (id(js), stream)
    found = _REPLICATED.get(key)
    if found is None:
        info = await js.stream_info(stream)
        found = _REPLICATED[key] = int(info.config.num_replicas or 1) > 1
    return found


async def latest_resolved(js: JetStreamContext, source: str,
                          rows_stream: str = ROWS_STREAM) -> ResolvedMark | None:
    """The source's newest resolved mark (capture rolls the subject up, so it is the only one)."""
    try:
        raw = await js.get_last_msg(rows_stream, resolved_subject(source))
    except NotFoundError:
        return None
    try:
        decoded = REGISTRY.decode(raw.data or b"")
    except ContractError as exc:
        log.warning("undecodable resolved mark", extra={"source": source, "reason": str(exc)})
        return None
    if not isinstance(decoded.event, ResolvedAdvancedV1):
        log.warning("unexpected event on the resolved subject",
                    extra={"source": source, "type": decoded.envelope.type})
        return None
    return ResolvedMark(ts=decoded.event.ts, stream_seq=int(raw.seq or 0))


async def last_data_seq(js: JetStreamContext, source: str, rows_stream: str = ROWS_STREAM) -> int:
    """The stream sequence of the source's newest data message (a table's rows or DDL, a
    rejection), whoever published it; 0 when it has none. One request, however many tables."""
    try:
        raw = await js.get_last_msg(rows_stream, source_data_subjects(source))
    except NotFoundError:
        return 0
    return int(raw.seq or 0)
