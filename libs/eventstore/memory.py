"""An in-memory domain log for unit tests of the leaders' handlers: no nats-server.

Modelled on the eventsourcing library's POPO recorder (plain Python objects behind the same
interface as the real recorder): ``MemoryStream`` stands for one JetStream stream (sequences
from 1, the expected-last-sequence check, ``Nats-Rollup: sub`` keeping only a subject's newest
message, the server's max_payload refusing a larger message) and ``MemoryDomainLog`` has
``DomainLog``'s interface and semantics over it: ``open`` replays the newest snapshot plus the
events after it and appends ``LeaderElected``, refusing a log that holds a newer epoch; every
append is fenced on the last sequence this log knows, so a second writer on the same stream
makes the first one's next append raise ``Fenced``; the lease is checked before each append.
Snapshots are written and read with the same code as on JetStream (``snapshot_chunks``): a large
state as chunk messages on alternating chunk subjects, then its ``snapshot.taken``; a reader
that cannot join the chunks replays the events instead. Messages go through the contracts
registry as JSON both ways, so what a test reads back is what a follower would decode (upcast
to the newest version).

Not modelled: acks lost in flight (the real log's retry with the same message id) and the
duplicate window, dead letters (nothing undecodable gets in; a snapshot that does not decode
fails the test instead), the ``sluice_snapshots_unusable`` metric, stream configuration
(retention, replicas, deny-delete), and a snapshot replaced while a reader joins its chunks
(nothing runs between a memory log's appends).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

from nats.errors import MaxPayloadError
from pydantic import BaseModel

from contracts import REGISTRY, Envelope
from contracts.envelope import new_event_id
from contracts.events.leadership import LeaderElectedV1
from contracts.events.snapshots import SnapshotTakenV2
from libs.eventstore.domain_log import Fenced, LeaseLost, LeaseView
from libs.eventstore.snapshot_chunks import DEFAULT_MAX_PAYLOAD, RawChunk, TornSnapshot, assemble, plan
from libs.eventstore.snapshots import Fold, Loaded, Restore
from libs.eventstore.store import AppendConflict, StoredEvent
from libs.streams import domain_events_subject, domain_fold_subjects, domain_snapshot_subject, domain_stream

S = TypeVar("S")


class MemoryStream:
    """One stream's messages in memory, in sequence order (the POPO recorder)."""

    def __init__(self, name: str, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.name = name
        self.max_payload = max_payload
        self._messages: list[tuple[str, dict[str, str], bytes]] = []
        self._rolled_up: set[int] = set()
        self._raw: set[int] = set()
        """Messages that are not envelopes (snapshot chunks): read with ``get_raw`` only."""
        self._appended = asyncio.Event()

    @property
    def last_seq(self) -> int:
        return len(self._messages)

    def append(self, subject: str, envelope: Envelope, *, expected_last_seq: int | None = None,
               headers: Mapping[str, str] | None = None, rollup: bool = False) -> int:
        """Store one message; with ``expected_last_seq`` only if the stream ends there (else
        ``AppendConflict``, like JetStream's ``Nats-Expected-Last-Sequence``)."""
        return self.append_raw(subject, envelope.model_dump_json().encode(),
                               expected_last_seq=expected_last_seq, headers=headers, rollup=rollup,
                               envelope=True)

    def append_raw(self, subject: str, data: bytes, *, expected_last_seq: int | None = None,
                   headers: Mapping[str, str] | None = None, rollup: bool = False,
                   envelope: bool = False) -> int:
        """``append`` of bytes; ``MaxPayloadError`` past ``max_payload`` (as nats-py raises it
        from the server's INFO; headers not counted, as nats-py does not)."""
        if len(data) > self.max_payload:
            raise MaxPayloadError()
        if expected_last_seq is not None and expected_last_seq != self.last_seq:
            raise AppendConflict(self.name, subject, expected_last_seq, "wrong last sequence",
                                 self.last_seq)
        if rollup:  # Nats-Rollup: sub keeps only the newest message of the subject
            self._rolled_up.update(seq for seq, (subj, _h, _d) in enumerate(self._messages, 1)
                                   if subj == subject)
        self._messages.append((subject, dict(headers or {}), data))
        seq = self.last_seq
        if not envelope:
            self._raw.add(seq)
        self._appended.set()
        return seq

    def get_raw(self, seq: int) -> RawChunk | None:
        """``(subject, headers, data)`` at ``seq``, or None when there is none (or rolled up)."""
        if not 1 <= seq <= self.last_seq or seq in self._rolled_up:
            return None
        subject, headers, data = self._messages[seq - 1]
        return subject, dict(headers), data

    def subject_counts(self) -> dict[str, int]:
        """Messages present per subject (as ``stream_info(subjects_filter=...)`` tells)."""
        counts: dict[str, int] = {}
        for seq, (subject, _h, _d) in enumerate(self._messages, 1):
            if seq not in self._rolled_up:
                counts[subject] = counts.get(subject, 0) + 1
        return counts

    def get(self, seq: int) -> StoredEvent | None:
        if not 1 <= seq <= self.last_seq or seq in self._rolled_up or seq in self._raw:
            return None
        subject, headers, data = self._messages[seq - 1]
        decoded = REGISTRY.decode(data)
        return StoredEvent(seq=seq, subject=subject, headers=dict(headers), envelope=decoded.envelope,
                           event=decoded.event, original_version=decoded.original_version)

    def last_of(self, subject: str) -> StoredEvent | None:
        for seq in range(self.last_seq, 0, -1):
            if self._messages[seq - 1][0] == subject:
                return self.get(seq)
        return None

    def read(self, subjects: list[str] | None = None, from_seq: int = 1,
             until_seq: int | None = None) -> list[StoredEvent]:
        """The messages of ``subjects`` (all without) from ``from_seq`` to ``until_seq``."""
        end = self.last_seq if until_seq is None else min(until_seq, self.last_seq)
        found = []
        for seq in range(max(1, from_seq), end + 1):
            if subjects is None or self._messages[seq - 1][0] in subjects:
                stored = self.get(seq)
                if stored is not None:
                    found.append(stored)
        return found

    async def follow(self, subjects: list[str] | None = None,
                     from_seq: int = 1) -> AsyncIterator[StoredEvent]:
        """Every message of ``subjects`` from ``from_seq`` on, waiting for new ones (the
        follower's view); ends only when the consumer stops iterating."""
        next_seq = from_seq
        while True:
            if self.last_seq < next_seq:
                # No await between the check and the wait: an append cannot slip in between.
                self._appended.clear()
                await self._appended.wait()
                continue
            for stored in self.read(subjects, next_seq):
                yield stored
            next_seq = self.last_seq + 1


class MemoryDomainLog(Generic[S]):
    """``DomainLog`` over a ``MemoryStream`` (its own, or one shared with another writer or a
    reader). Same constructor keywords, minus the JetStream context and settings."""

    def __init__(self, domain: str, *, producer: str, stream: MemoryStream | None = None,
                 fold: Fold[S] | None = None, initial: S | None = None,
                 restore: Restore[S] | None = None,
                 dump: Callable[[S], dict[str, Any]] | None = None) -> None:
        self.domain = domain
        self.producer = producer
        self.memory = stream if stream is not None else MemoryStream(domain_stream(domain))
        self.events_subject = domain_events_subject(domain)
        self.snapshot_subject = domain_snapshot_subject(domain)
        self.fold_subjects = domain_fold_subjects(domain)
        self._fold = fold
        self._initial = initial
        self._restore = restore
        self._dump = dump
        self.state: S | None = initial
        self.epoch = 0
        self.last_seq = 0
        self.leadership: LeaseView | None = None
        self.loaded: Loaded[Any] | None = None
        self.fenced = False
        self._opened = False
        self._chunks_subject: str | None = None

    @property
    def stream(self) -> str:
        return self.memory.name

    def replay(self) -> Loaded[Any]:
        """Newest snapshot's state plus the events after it (``Snapshots.load``)."""
        end = self.memory.last_seq
        snap = self.memory.last_of(self.snapshot_subject)
        state: Any = self._initial
        state_seq = max_epoch = 0
        chunks_subject = None
        if snap is not None:
            event = snap.event
            assert isinstance(event, SnapshotTakenV2)
            ref = event.chunks
            try:
                raw_state = assemble(event, [self.memory.get_raw(ref.first_seq + i)
                                                  for i in range(ref.count)] if ref is not None else [])
            except TornSnapshot:
                snap = None  # replay every event, as Snapshots.latest does
            else:
                state = self._restore(raw_state) if self._restore else raw_state
                state_seq, max_epoch = event.up_to_seq, snap.envelope.epoch
                chunks_subject = ref.subject if ref is not None else None
        replayed = 0
        for stored in self.memory.read(self.fold_subjects, state_seq + 1, end):
            if self._fold is not None:
                state = self._fold(state, stored)
            state_seq = stored.seq
            max_epoch = max(max_epoch, stored.envelope.epoch)
            replayed += 1
        return Loaded(state=state, last_seq=end, state_seq=state_seq,
                      snapshot_seq=snap.seq if snap is not None else None, events_replayed=replayed,
                      max_epoch=max_epoch, snapshot_chunks=chunks_subject)

    async def open(self, service: str, candidate: str, epoch: int,
                   leadership: LeaseView | None = None) -> int:
        self.epoch = epoch
        self.leadership = leadership
        loaded = self.loaded = self.replay()
        self.state = cast(S, loaded.state)
        self.last_seq = loaded.last_seq
        self._chunks_subject = loaded.snapshot_chunks
        self._opened = True
        if loaded.max_epoch > epoch:
            self.fenced = True
            raise Fenced(self.stream, self.events_subject, self.last_seq,
                         f"log already holds epoch {loaded.max_epoch} > {epoch}")
        return await self.append(LeaderElectedV1(service=service, candidate=candidate, epoch=epoch))

    def _check_can_append(self) -> None:
        if not self._opened:
            raise RuntimeError("DomainLog.open() first")
        if self.fenced:
            raise Fenced(self.stream, self.events_subject, self.last_seq, "fenced earlier")
        if self.leadership is not None and not self.leadership.valid():
            self.fenced = True
            raise LeaseLost(self.stream, self.events_subject, self.last_seq, "lease no longer valid")

    def _publish(self, subject: str, envelope: Envelope | bytes, headers: Mapping[str, str] | None,
                 rollup: bool = False) -> int:
        try:
            if isinstance(envelope, Envelope):
                seq = self.memory.append(subject, envelope, expected_last_seq=self.last_seq, headers=headers,
                                         rollup=rollup)
            else:
                seq = self.memory.append_raw(subject, envelope, expected_last_seq=self.last_seq,
                                             headers=headers, rollup=rollup)
        except AppendConflict as exc:
            self.fenced = True
            raise Fenced(exc.stream, exc.subject, self.last_seq, exc.detail, exc.actual_last_seq) from None
        self.last_seq = seq
        return seq

    async def append_many(self, events: Sequence[BaseModel]) -> list[int]:
        return [await self.append(event) for event in events]

    async def append(self, event: BaseModel, *, msg_id: str | None = None,
                     headers: Mapping[str, str] | None = None) -> int:
        self._check_can_append()
        envelope = REGISTRY.envelope(event, producer=self.producer, epoch=self.epoch,
                                     event_id=msg_id or new_event_id())
        seq = self._publish(self.events_subject, envelope, headers)
        if self._fold is not None:
            stored = self.memory.get(seq)
            assert stored is not None
            self.state = self._fold(cast(S, self.state), stored)
        return seq

    async def snapshot(self, state: dict[str, Any] | None = None) -> int:
        self._check_can_append()
        if state is None:
            if self._fold is None:
                raise ValueError("this DomainLog keeps no state: pass the state to snapshot")
            state = self._dump(cast(S, self.state)) if self._dump else cast(dict[str, Any], self.state)
        planned = plan(self.domain, self.snapshot_subject, self.last_seq, state, epoch=self.epoch,
                       newest_chunks=self._chunks_subject, max_payload=self.memory.max_payload)
        first = 0
        for index, chunk in enumerate(planned.chunks):
            seq = self._publish(planned.subject, chunk.data, chunk.headers, rollup=index == 0)
            first = first or seq
            self._check_can_append()
        envelope = REGISTRY.envelope(planned.marker(first), producer=self.producer, epoch=self.epoch)
        seq = self._publish(self.snapshot_subject, envelope, None, rollup=True)
        if planned.chunks:
            self._chunks_subject = planned.subject
        return seq

    def events(self) -> list[BaseModel]:
        """The events subject's events in order (what a test asserts on)."""
        return [stored.event for stored in self.memory.read([self.events_subject])]
