"""The event log of one control domain, written only by that domain's current leader.

Fencing (DESIGN "Leadership, fencing, replay"): a new leader replays the log, then appends
``LeaderElected{epoch}`` expecting the last sequence it replayed. From then on every append
expects the last sequence this log knows. If anybody else appended in between, whoever it was,
the server refuses and the append raises ``Fenced``: the caller must step down, because its
view of the domain is no longer the log's. Before each append the lease is checked as well, so
a leader that could not renew stops before the server even has to refuse it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from pydantic import BaseModel

from contracts import REGISTRY, Envelope
from contracts.envelope import new_event_id
from contracts.events.leadership import LeaderElectedV1
from libs.config import Settings
from libs.eventstore.snapshot_chunks import compress, encode_state, inline_fits, plan
from libs.eventstore.snapshots import ROLLUP_SUBJECT, Fold, Loaded, Restore, Snapshots
from libs.eventstore.store import AppendConflict, EventStore, StoredEvent
from libs.streams import domain_events_subject, domain_stream, domain_subjects

log = logging.getLogger(__name__)

S = TypeVar("S")

# A publish whose ack got lost is retried with the same Nats-Msg-Id; this many times at most.
_APPEND_ATTEMPTS = 3
_PIPELINE_TIMEOUT_S = 5.0
"""How long ``append_many`` waits for its acks before settling the rest one by one."""


class Fenced(AppendConflict):
    """Somebody else wrote to the domain log (or our lease is gone): stop acting as leader."""


class LeaseLost(Fenced):
    """Raised before publishing when the lease can no longer be trusted locally."""


class LeaseView(Protocol):
    """What the log needs of a leadership: its epoch and whether it may still act."""

    @property
    def epoch(self) -> int: ...

    def valid(self) -> bool: ...


class LeaderLog(Protocol):
    """What a leader's handlers use of their domain log: ``DomainLog`` on JetStream, or
    ``MemoryDomainLog`` in unit tests."""

    state: Any
    loaded: Loaded[Any] | None
    last_seq: int
    events_subject: str

    @property
    def stream(self) -> str: ...

    async def append(self, event: BaseModel, *, msg_id: str | None = None,
                     headers: Mapping[str, str] | None = None) -> int: ...

    async def append_many(self, events: Sequence[BaseModel]) -> list[int]: ...

    async def snapshot(self, state: dict[str, Any] | None = None) -> int: ...


def _keep(state: Any, _event: StoredEvent) -> Any:
    return state


class DomainLog(Generic[S]):
    """One domain's stream (``domain_stream(domain)``, subjects ``sluice.<domain>.>``).

    With ``fold``/``initial`` the log keeps ``state`` current: the replayed state at ``open`` and
    every event this log appends afterwards. ``dump``/``restore`` convert ``state`` to and from
    the JSON dict a snapshot stores; the defaults suit plain dict state.
    """

    def __init__(self, js: JetStreamContext, domain: str, *, producer: str,
                 fold: Fold[S] | None = None, initial: S | None = None,
                 restore: Restore[S] | None = None,
                 dump: Callable[[S], dict[str, Any]] | None = None,
                 settings: Settings | None = None) -> None:
        self.domain = domain
        self.store = EventStore(js, domain_stream(domain), producer, settings)
        self.snapshots = Snapshots(self.store, domain)
        self.events_subject = domain_events_subject(domain)
        self._fold: Fold[Any] = fold if fold is not None else _keep
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
        self._lock = asyncio.Lock()
        self._chunks_subject: str | None = None
        """The chunk subject of the newest snapshot: the next chunked one goes to the other."""

    @property
    def stream(self) -> str:
        return self.store.stream

    async def ensure(self) -> None:
        # Rollup headers for snapshots; no message deletes: the log is append-only.
        await self.store.ensure(domain_subjects(self.domain), allow_rollup_hdrs=True, deny_delete=True)

    async def open(self, service: str, candidate: str, epoch: int,
                   leadership: LeaseView | None = None) -> int:
        """Rebuild state from snapshot + events, then append ``LeaderElected``; returns its seq.

        Raises ``Fenced`` when the log already holds a newer epoch or someone appended after the
        replay ended.
        """
        await self.ensure()
        self.epoch = epoch
        self.leadership = leadership
        loaded = await self.snapshots.load(self._fold, self._initial, restore=self._restore)
        self.loaded = loaded
        self.state = cast(S, loaded.state)
        self.last_seq = loaded.last_seq
        self._chunks_subject = loaded.snapshot_chunks
        self._opened = True
        if loaded.max_epoch > epoch:
            self.fenced = True
            # Normally a stale candidate that lost a race. If it repeats for every candidate, the
            # lease bucket was recreated and its revisions restarted below the log's epochs.
            log.error("domain log holds a newer epoch than ours; not leading",
                      extra={"domain": self.domain, "epoch": epoch, "log_epoch": loaded.max_epoch})
            raise Fenced(self.stream, self.events_subject, self.last_seq,
                         f"log already holds epoch {loaded.max_epoch} > {epoch}")
        seq = await self.append(LeaderElectedV1(service=service, candidate=candidate, epoch=epoch))
        log.info("domain log opened", extra={
            "domain": self.domain, "epoch": epoch, "leader_elected_seq": seq,
            "snapshot_seq": loaded.snapshot_seq, "events_replayed": loaded.events_replayed})
        return seq

    def _check_can_append(self) -> None:
        if not self._opened:
            raise RuntimeError("DomainLog.open() first")
        if self.fenced:
            raise Fenced(self.stream, self.events_subject, self.last_seq, "fenced earlier")
        if self.leadership is not None and not self.leadership.valid():
            self.fenced = True
            raise LeaseLost(self.stream, self.events_subject, self.last_seq, "lease no longer valid")

    async def append(self, event: BaseModel, *, msg_id: str | None = None,
                     headers: Mapping[str, str] | None = None) -> int:
        """Append ``event`` to the events subject, fenced on the last sequence this log knows."""
        async with self._lock:
            self._check_can_append()
            envelope = REGISTRY.envelope(event, producer=self.store.producer, epoch=self.epoch,
                                         event_id=msg_id or new_event_id())
            seq = await self._fenced_publish(self.events_subject, envelope, headers=headers)
            self._folded(envelope, seq, headers)
            return seq

    async def append_many(self, events: Sequence[BaseModel]) -> list[int]:
        """Append ``events`` in order, as ``append`` would one by one, with their publishes
        pipelined (``EventStore.append_raw_pipelined``): each is fenced on the sequence right
        before it, so they land in this order right after the last sequence this log knows, or
        not at all. Whatever did not land as planned (an ack lost or late, a refusal) is settled
        one by one as ``append`` does: one that landed after all is found by its message id at
        the next sequence; a writer in between fences this log."""
        if len(events) <= 1:
            return [await self.append(event) for event in events]
        async with self._lock:
            self._check_can_append()
            envelopes = [REGISTRY.envelope(event, producer=self.store.producer, epoch=self.epoch,
                                           event_id=new_event_id()) for event in events]
            expected = self.last_seq
            results = await self.store.append_raw_pipelined(
                [(self.events_subject, env.model_dump_json().encode(), env.id) for env in envelopes],
                expected_last_seq=expected, ack_within_s=_PIPELINE_TIMEOUT_S)
            seqs: list[int] = []
            for i, (env, result) in enumerate(zip(envelopes, results, strict=True)):
                if result != expected + i + 1:
                    break
                self.last_seq = expected + i + 1
                seqs.append(self.last_seq)
                self._folded(env, self.last_seq)
            for env in envelopes[len(seqs):]:
                self._check_can_append()
                if await self._landed(self.last_seq + 1, env.id):
                    self.last_seq += 1
                    seq = self.last_seq
                else:
                    seq = await self._fenced_publish(self.events_subject, env)
                seqs.append(seq)
                self._folded(env, seq)
            return seqs

    def _folded(self, envelope: Envelope, seq: int, headers: Mapping[str, str] | None = None) -> None:
        if self._fold is not _keep:
            stored = StoredEvent(seq=seq, subject=self.events_subject, headers=dict(headers or {}),
                                 envelope=envelope,
                                 event=REGISTRY.decode_envelope(envelope).event,
                                 original_version=envelope.version)
            self.state = self._fold(self.state, stored)

    async def snapshot(self, state: dict[str, Any] | None = None) -> int:
        """Write a snapshot covering everything up to the last sequence this log knows; returns
        the sequence of its ``snapshot.taken``.

        Without ``state`` the log's own folded state is dumped; a caller that keeps its state
        outside the log passes it, and it must include every event up to ``last_seq``. A large
        state goes as chunks first (``snapshot_chunks``), each fenced like any append: a leader
        deposed or stopped part-way leaves chunks without a ``snapshot.taken``, which nobody reads.
        """
        async with self._lock:
            self._check_can_append()
            if state is None:
                if self._fold is _keep:
                    raise ValueError("this DomainLog keeps no state: pass the state to snapshot")
                state = self._dump(cast(S, self.state)) if self._dump else cast(dict[str, Any], self.state)
            raw = encode_state(state)
            # zlib frees the GIL: the leader's loop keeps serving while a large state compresses.
            max_payload = self.store.max_payload()
            compressed = None if inline_fits(raw, max_payload) else await asyncio.to_thread(compress, raw)
            planned = plan(self.domain, self.snapshots.snapshot_subject, self.last_seq, state,
                           epoch=self.epoch, newest_chunks=self._chunks_subject,
                           max_payload=max_payload, raw=raw, compressed=compressed)
            first = 0
            for index, chunk in enumerate(planned.chunks):
                headers = dict(chunk.headers)
                if index == 0:
                    # Drops what the subject held: the snapshot before the newest, or a torn write.
                    headers[api.Header.ROLLUP.value] = ROLLUP_SUBJECT
                seq = await self._fenced_publish(planned.subject, chunk.data, chunk.msg_id, headers)
                first = first or seq
                self._check_can_append()
            envelope = REGISTRY.envelope(planned.marker(first), producer=self.store.producer,
                                         epoch=self.epoch)
            seq = await self._fenced_publish(self.snapshots.snapshot_subject, envelope,
                                             headers={api.Header.ROLLUP.value: ROLLUP_SUBJECT})
            if planned.chunks:
                self._chunks_subject = planned.subject
            return seq

    async def _fenced_publish(self, subject: str, payload: bytes | Envelope, msg_id: str | None = None,
                              headers: Mapping[str, str] | None = None) -> int:
        if isinstance(payload, Envelope):
            msg_id, payload = payload.id, payload.model_dump_json().encode()
        assert msg_id is not None
        expected = self.last_seq
        for attempt in range(1, _APPEND_ATTEMPTS + 1):
            try:
                seq = await self.store.append_raw(subject, payload, msg_id, expected_last_seq=expected,
                                                  headers=headers)
            except AppendConflict as exc:
                # Our own earlier attempt may have landed with its ack lost: then the message
                # right after `expected` carries our Nats-Msg-Id and nobody else wrote.
                if attempt > 1 and await self._landed(expected + 1, msg_id):
                    seq = expected + 1
                else:
                    self.fenced = True
                    raise Fenced(exc.stream, exc.subject, expected, exc.detail,
                                 exc.actual_last_seq) from None
            except (TimeoutError, NatsTimeoutError):
                if attempt == _APPEND_ATTEMPTS:
                    raise
                self._check_can_append()
                continue
            self.last_seq = seq
            return seq
        raise AssertionError("unreachable")

    async def _landed(self, seq: int, msg_id: str) -> bool:
        raw = await self.store.get(seq)
        return raw is not None and (raw.headers or {}).get(api.Header.MSG_ID.value) == msg_id
