"""Snapshots of a domain's folded state, so rebuild cost follows live state, not history.

A snapshot is a ``snapshot.taken`` event on the domain's snapshot subject, published with
``Nats-Rollup: sub``: the server then keeps only the newest one, and loading is "read the last
message of one subject, replay the events after its ``up_to_seq``". Events are never removed
by a snapshot, so a full replay stays possible and gives the same state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from nats.js import api
from nats.js.errors import NotFoundError

from contracts import REGISTRY, ContractError
from contracts.events.snapshots import SnapshotTakenV1
from libs.eventstore.deadletter import dead_letter
from libs.eventstore.store import EventStore, StoredEvent
from libs.streams import domain_fold_subjects, domain_snapshot_subject

S = TypeVar("S")
Fold = Callable[[S, StoredEvent], S]
Restore = Callable[[dict[str, Any]], S]

ROLLUP_SUBJECT = "sub"


@dataclass(frozen=True)
class Snapshot:
    seq: int
    up_to_seq: int
    state: dict[str, Any]
    epoch: int


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

    async def latest(self) -> Snapshot | None:
        """The newest snapshot, or None. A snapshot that does not decode is dead-lettered and
        ignored: the caller then replays from the start, which is slower but equally correct."""
        try:
            raw = await self.store.js.get_msg(self.store.stream, subject=self.snapshot_subject)
        except NotFoundError:
            return None
        seq = int(raw.seq or 0)
        try:
            decoded = REGISTRY.decode(raw.data or b"")
            if not isinstance(decoded.event, SnapshotTakenV1):
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
        snap = decoded.event
        return Snapshot(seq=seq, up_to_seq=snap.up_to_seq, state=snap.state, epoch=decoded.envelope.epoch)

    async def write(self, state: dict[str, Any], up_to_seq: int, *, epoch: int = 0,
                    expected_last_seq: int | None = None) -> int:
        """Publish a snapshot of ``state`` covering every event with seq <= ``up_to_seq``."""
        event = SnapshotTakenV1(domain=self.domain, up_to_seq=up_to_seq, state=state)
        return await self.store.append(self.snapshot_subject, event, epoch=epoch,
                                       expected_last_seq=expected_last_seq,
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
                      max_epoch=max_epoch)
