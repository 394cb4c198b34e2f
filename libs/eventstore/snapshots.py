"""Snapshots of a domain's folded state, so rebuild cost follows live state, not history.

A snapshot is a ``snapshot.taken`` event on the domain's snapshot subject, published with
``Nats-Rollup: sub``: the server then keeps only the newest one, and loading is "read the last
message of one subject, replay the events after its ``up_to_seq``". A state too large for one
message is written as chunks before its ``snapshot.taken`` (``snapshot_chunks``): a reader joins
them, and one that cannot (chunks gone or not joining) replays the events instead. Events are
never removed by a snapshot, so a full replay stays possible and gives the same state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from nats.js import api
from nats.js.errors import NotFoundError

from contracts import REGISTRY, ContractError
from contracts.events.snapshots import SnapshotTakenV2
from libs.eventstore.deadletter import dead_letter
from libs.eventstore.snapshot_chunks import RawChunk, TornSnapshot, assemble, plan
from libs.eventstore.store import EventStore, StoredEvent
from libs.streams import domain_fold_subjects, domain_snapshot_subject
from libs.telemetry.metrics import SNAPSHOTS_UNUSABLE

log = logging.getLogger(__name__)

S = TypeVar("S")
Fold = Callable[[S, StoredEvent], S]
Restore = Callable[[dict[str, Any]], S]

ROLLUP_SUBJECT = "sub"
# A snapshot whose chunks do not join is read again this many times when a newer snapshot
# replaced it meanwhile (its chunks' subject is reused by the snapshot after next).
_READ_ATTEMPTS = 3


@dataclass(frozen=True)
class Snapshot:
    seq: int
    up_to_seq: int
    state: dict[str, Any]
    epoch: int
    chunks_subject: str | None = None
    """Where its chunks are (None for a snapshot inside its ``snapshot.taken``)."""


@dataclass(frozen=True)
class Loaded(Generic[S]):
    state: S
    last_seq: int
    """The stream's last sequence when loading began: the point an appender fences on."""
    state_seq: int
    """Sequence of the last event folded into ``state`` (0 for the initial state)."""
    snapshot_seq: int | None
    events_replayed: int
    max_epoch: int
    """Highest producer epoch seen (snapshot and events): a leader with a lower one is stale."""
    snapshot_chunks: str | None = None
    """The chunk subject of the newest snapshot (the next chunked snapshot uses the other one)."""


@dataclass(frozen=True)
class _RawMessage:
    subject: str
    data: bytes
    headers: dict[str, str] | None


class Snapshots:
    def __init__(self, store: EventStore, domain: str, *, events_subject: str | None = None,
                 snapshot_subject: str | None = None) -> None:
        self.store = store
        self.domain = domain
        self.fold_subjects = [events_subject] if events_subject else domain_fold_subjects(domain)
        """What ``load`` replays: the events subject, and any other subject the domain folds."""
        self.events_subject = self.fold_subjects[0]
        self.snapshot_subject = snapshot_subject or domain_snapshot_subject(domain)

    async def _marker(self) -> tuple[int, SnapshotTakenV2, int] | None:
        """``(seq, snapshot.taken, epoch)`` of the newest snapshot message, or None. One that does
        not decode is dead-lettered and ignored: the caller then replays from the start, which
        is slower but equally correct."""
        try:
            raw = await self.store.js.get_msg(self.store.stream, subject=self.snapshot_subject)
        except NotFoundError:
            return None
        seq = int(raw.seq or 0)
        try:
            decoded = REGISTRY.decode(raw.data or b"")
            if not isinstance(decoded.event, SnapshotTakenV2):
                raise ContractError("unknown_type", f"{decoded.envelope.type} on the snapshot subject",
                                    type=decoded.envelope.type)
            if decoded.event.domain != self.domain:
                raise ContractError("invalid_data",
                                    f"snapshot of domain {decoded.event.domain!r}, expected {self.domain!r}")
        except ContractError as exc:
            msg = _RawMessage(subject=raw.subject or self.snapshot_subject, data=raw.data or b"",
                              headers=raw.headers)
            await dead_letter(self.store.js, msg, exc.reason, exc.kind, self.store.stream, seq=seq,
                              ack=False)
            return None
        return seq, decoded.event, decoded.envelope.epoch

    async def _raw(self, seq: int) -> RawChunk | None:
        raw = await self.store.get(seq)
        if raw is None:
            return None
        return raw.subject or "", dict(raw.headers or {}), raw.data or b""

    async def latest(self) -> Snapshot | None:
        """The newest complete snapshot, or None (none yet, or none this reader can trust)."""
        for _ in range(_READ_ATTEMPTS):
            marker = await self._marker()
            if marker is None:
                return None
            seq, snap, epoch = marker
            ref = snap.chunks
            if ref is None:
                assert snap.state is not None
                return Snapshot(seq=seq, up_to_seq=snap.up_to_seq, state=snap.state, epoch=epoch)
            found = [await self._raw(ref.first_seq + i) for i in range(ref.count)]
            try:
                state = assemble(snap, found)
            except TornSnapshot as exc:
                again = await self._marker()
                if again is not None and again[0] != seq:
                    continue  # replaced while we read it: read the newer one
                SNAPSHOTS_UNUSABLE.labels(stream=self.store.stream).inc()
                log.error("snapshot of %s at seq %d not used: %s; replaying the events instead",
                          self.store.stream, seq, exc)
                return None
            return Snapshot(seq=seq, up_to_seq=snap.up_to_seq, state=state, epoch=epoch,
                            chunks_subject=ref.subject)
        return None

    async def newest_chunks_subject(self) -> str | None:
        """The chunk subject the newest ``snapshot.taken`` names (None when it names none)."""
        marker = await self._marker()
        return marker[1].chunks.subject if marker is not None and marker[1].chunks is not None else None

    async def write(self, state: dict[str, Any], up_to_seq: int, *, epoch: int = 0,
                    expected_last_seq: int | None = None, max_payload: int | None = None) -> int:
        """Publish a snapshot of ``state`` covering every event with seq <= ``up_to_seq``;
        returns the sequence of its ``snapshot.taken``.

        A chunked one is appended chunk after chunk, each expecting the one before it as the
        stream's last message (the first ``expected_last_seq`` when given), so its messages are
        consecutive or the write fails with ``AppendConflict``, leaving no ``snapshot.taken``.
        """
        planned = plan(self.domain, self.snapshot_subject, up_to_seq, state, epoch=epoch,
                       newest_chunks=await self.newest_chunks_subject(),
                       max_payload=max_payload or self.store.max_payload())
        expected, first = expected_last_seq, 0
        for index, chunk in enumerate(planned.chunks):
            headers = dict(chunk.headers)
            if index == 0:
                headers[api.Header.ROLLUP.value] = ROLLUP_SUBJECT
            seq = await self.store.append_raw(planned.subject, chunk.data, chunk.msg_id,
                                              expected_last_seq=expected, headers=headers)
            first = first or seq
            expected = seq
        return await self.store.append(self.snapshot_subject, planned.marker(first), epoch=epoch,
                                       expected_last_seq=expected,
                                       headers={api.Header.ROLLUP.value: ROLLUP_SUBJECT})

    async def load(self, fold: Fold[S], initial: S, *, restore: Restore[S] | None = None,
                   until_seq: int | None = None) -> Loaded[S]:
        """Newest snapshot's state plus a replay of the events after it.

        ``restore`` turns the snapshot's JSON state back into ``S``; the default keeps the dict
        as it is, which suits folds over plain dict state. Gives the same state as folding
        every event from sequence 1.
        """
        snap = await self.latest()
        # Read the end after the snapshot: the snapshot is then always inside the range.
        end = await self.store.last_seq() if until_seq is None else until_seq
        if snap is not None and snap.seq > end:
            snap = None
        if snap is not None:
            state = restore(snap.state) if restore is not None else cast(S, snap.state)
            state_seq = snap.up_to_seq
        else:
            state, state_seq = initial, 0
        replayed = 0
        max_epoch = snap.epoch if snap is not None else 0
        async for stored in self.store.replay(self.fold_subjects, state_seq + 1, until_seq=end):
            state = fold(state, stored)
            state_seq = stored.seq
            max_epoch = max(max_epoch, stored.envelope.epoch)
            replayed += 1
        return Loaded(state=state, last_seq=end, state_seq=state_seq,
                      snapshot_seq=snap.seq if snap is not None else None, events_replayed=replayed,
                      max_epoch=max_epoch, snapshot_chunks=snap.chunks_subject if snap is not None else None)
