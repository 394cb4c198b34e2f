"""Follow another domain's stream: newest snapshot plus the events after it, then every new
event in order, folded into ``state``.

The follower never writes and never creates the stream (its owner configures it); a stream
that does not exist yet reads as empty and is picked up once it appears. It reads with an
unacknowledged pull consumer from the sequence after the last one folded and re-creates the
consumer from there after any error, so every event is folded exactly once and in order.
Undecodable events are dead-lettered (once: the dead-letter id is the stream sequence).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar
from uuid import uuid4

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from contracts import ContractError
from libs.config import Settings
from libs.eventstore import EventStore, Snapshots, StoredEvent, dead_letter, decode_message, filter_fields
from libs.eventstore.snapshots import Fold, Restore
from libs.streams import domain_events_subject, domain_fold_subjects, domain_stream

log = logging.getLogger(__name__)

S = TypeVar("S")
OnEvent = Callable[[StoredEvent], Awaitable[None] | None]


class DomainFollower(Generic[S]):
    def __init__(self, js: JetStreamContext, domain: str, fold: Fold[S], initial: Callable[[], S], *,
                 restore: Restore[S] | None = None, on_event: OnEvent | None = None,
                 name: str = "", settings: Settings | None = None) -> None:
        self.js = js
        self.domain = domain
        self.stream = domain_stream(domain)
        self.subject = domain_events_subject(domain)
        self.subjects = domain_fold_subjects(domain)
        self.subject_seq: dict[str, int] = {}
        """Per folded subject, the sequence of its newest message processed (folded or
        dead-lettered): what an append to that subject expects as its last subject sequence."""
        self._fold = fold
        self._initial = initial
        self._restore = restore
        self.on_event = on_event
        self.name = name or domain
        self.state: S = initial()
        self.next_seq = 1
        self.loaded = False
        self.events_folded = 0
        self._settings = settings
        self.changed = asyncio.Event()
        """Set after every folded event; whoever waits for changes clears it."""

    async def load(self) -> S:
        """Newest snapshot + the events after it, up to the stream's end now."""
        store = EventStore(self.js, self.stream, f"follower/{self.name}", self._settings)
        seen: dict[str, int] = {}

        def fold(state: S, stored: StoredEvent) -> S:
            seen[stored.subject] = stored.seq
            return self._fold(state, stored)

        try:
            loaded = await Snapshots(store, self.domain).load(fold, self._initial(),
                                                              restore=self._restore)
        except NotFoundError:
            self.state, self.next_seq = self._initial(), 1
        else:
            self.state, self.next_seq = loaded.state, loaded.last_seq + 1
            self.events_folded += loaded.events_replayed
            # The replay skips what a snapshot covers and what it dead-lettered: ask the stream.
            for subject in self.subjects:
                seen[subject] = max(seen.get(subject, 0), await self._last_before(subject, self.next_seq))
        self.subject_seq = seen
        self.loaded = True
        self.changed.set()
        return self.state

    async def run(self, stopping: asyncio.Event) -> None:
        """Fold new events until ``stopping`` (load first if not loaded)."""
        if not self.loaded:
            while not stopping.is_set():
                try:
                    await self.load()
                    break
                except Exception:
                    log.warning("loading %s failed; retrying", self.stream, exc_info=True)
                    await _wait(stopping, 1.0)
        while not stopping.is_set():
            try:
                await self._follow(stopping)
            except asyncio.CancelledError:
                raise
            except NotFoundError:
                pass  # no stream yet
            except Exception:
                log.warning("following %s failed; resuming at seq %d", self.stream, self.next_seq,
                            exc_info=True)
            await _wait(stopping, 0.5)

    async def _follow(self, stopping: asyncio.Event) -> None:
        name = f"follow_{self.name}_{uuid4().hex[:12]}"
        await self.js.add_consumer(self.stream, api.ConsumerConfig(
            name=name, ack_policy=api.AckPolicy.NONE, **filter_fields(self.subjects),
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.next_seq,
            inactive_threshold=60.0, mem_storage=True, num_replicas=1))
        sub = await self.js.pull_subscribe_bind(name, stream=self.stream)
        try:
            while not stopping.is_set():
                try:
                    msgs = await sub.fetch(256, timeout=1.0)
                except (TimeoutError, NatsTimeoutError):
                    continue
                for msg in msgs:
                    seq = int(msg.metadata.sequence.stream)
                    if seq < self.next_seq:
                        continue
                    self.subject_seq[msg.subject] = seq
                    try:
                        stored = decode_message(msg)
                    except ContractError as exc:
                        await dead_letter(self.js, msg, exc.reason, exc.kind, self.stream, seq=seq, ack=False)
                        self.next_seq = seq + 1
                        continue
                    self.state = self._fold(self.state, stored)
                    self.next_seq = seq + 1
                    self.events_folded += 1
                    self.changed.set()
                    if self.on_event is not None:
                        result = self.on_event(stored)
                        if result is not None:
                            await result
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.stream, name)


    async def _last_before(self, subject: str, next_seq: int) -> int:
        """The newest message of ``subject`` before ``next_seq``; 0 when there is none, or it
        is not known to be before (the follower then meets it)."""
        try:
            last = await self.js.get_last_msg(self.stream, subject)
        except NotFoundError:
            return 0
        seq = int(last.seq or 0)
        return seq if seq < next_seq else 0

    def last_seq_of(self, subject: str) -> int:
        return self.subject_seq.get(subject, 0)


async def _wait(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
