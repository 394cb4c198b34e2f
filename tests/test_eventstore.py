"""The event store against the session's real nats-server: fencing, dedup, replay, snapshots,
dead letters. Every test uses its own stream and subjects, so tests never see each other."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from uuid import uuid4

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from contracts import REGISTRY
from contracts.envelope import new_event_id, utc_now
from contracts.events.members import MemberJoinedV1, MemberJoinedV2, MemberLeftV1
from contracts.events.snapshots import SnapshotChunksV1, SnapshotTakenV2
from libs.control.follow import DomainFollower
from libs.eventstore import AppendConflict, DomainLog, EventStore, Snapshots, StoredEvent, consume
from libs.eventstore.deadletter import H_KIND, H_REASON, H_SEQ, H_SUBJECT
from libs.eventstore.domain_log import LeaseLost
from libs.eventstore.snapshot_chunks import chunk_subjects
from libs.localservers.nats_server import NatsServer
from libs.streams import (
    DEADLETTER_STREAM,
    deadletter_subject,
    domain_events_subject,
    domain_snapshot_subject,
    domain_stream,
)
from tests.helpers.snapshots import LeaseUntil, joined_fold
from tests.helpers.snapshots import joined as joined_with_noise

pytestmark = pytest.mark.integration


async def eventually(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {within}s waiting for {what}")


@pytest.fixture
async def store(js: JetStreamContext) -> AsyncIterator[EventStore]:
    uid = uuid4().hex[:10]
    es = EventStore(js, f"T_{uid}", producer="test/eventstore")
    await es.ensure([f"{root(es)}.>"], allow_rollup_hdrs=True)
    yield es
    await js.delete_stream(es.stream)


def root(es: EventStore) -> str:
    """The subject root of a test store: stream T_<uid> holds subjects t<uid>.>."""
    return "t" + es.stream.removeprefix("T_")


def joined(member: str) -> MemberJoinedV2:
    return MemberJoinedV2(member_id=member, incarnation=f"inc-{member}", address=f"{member}:1")


def fold_members(state: dict[str, Any], ev: StoredEvent) -> dict[str, Any]:
    """A pure fold: members currently joined, with the sequence they joined at."""
    members = dict(state.get("members", {}))
    if isinstance(ev.event, MemberJoinedV2):
        members[ev.event.member_id] = ev.seq
    elif isinstance(ev.event, MemberLeftV1):
        members.pop(ev.event.member_id, None)
    return {"members": members, "count": int(state.get("count", 0)) + 1}


async def collect(it: AsyncIterator[StoredEvent]) -> list[StoredEvent]:
    return [ev async for ev in it]


async def test_concurrent_appenders_with_same_expected_seq_exactly_one_wins(
        store: EventStore, nats_server: NatsServer) -> None:
    subject = f"{root(store)}.events"
    first = await store.append(subject, joined("m0"))
    # Separate connections, so the appends really race at the server, not in one socket buffer.
    clients: list[Client] = [await nats.connect(nats_server.url) for _ in range(6)]
    try:
        stores = [EventStore(c.jetstream(), store.stream, producer=f"w{i}") for i, c in enumerate(clients)]
        results = await asyncio.gather(
            *(s.append(subject, joined(f"m{i + 1}"), expected_last_seq=first) for i, s in enumerate(stores)),
            return_exceptions=True)
    finally:
        for c in clients:
            await c.close()
    wins = [r for r in results if isinstance(r, int)]
    conflicts = [r for r in results if isinstance(r, AppendConflict)]
    assert len(wins) == 1, results
    assert len(conflicts) == len(stores) - 1, results
    assert wins[0] == first + 1
    assert all(c.actual_last_seq == wins[0] and c.expected == first for c in conflicts)
    assert await store.last_seq() == first + 1


async def test_expected_last_subject_seq_conflict(store: EventStore) -> None:
    a, b = f"{root(store)}.a", f"{root(store)}.b"
    s1 = await store.append(a, joined("x"), expected_last_subject_seq=0)
    await store.append(b, joined("y"))
    # Another subject moved on; this subject did not: still accepted.
    await store.append(a, joined("z"), expected_last_subject_seq=s1)
    with pytest.raises(AppendConflict):
        await store.append(a, joined("w"), expected_last_subject_seq=s1)


async def test_msg_id_duplicate_is_not_appended_twice(store: EventStore) -> None:
    subject = f"{root(store)}.events"
    s1 = await store.append(subject, joined("a"), msg_id="evt-1")
    s2 = await store.append(subject, joined("a"), msg_id="evt-1")
    s3 = await store.append(subject, joined("b"), msg_id="evt-2")
    assert s1 == s2 and s3 == s1 + 1
    events = await collect(store.replay(subject))
    assert [e.envelope.id for e in events] == ["evt-1", "evt-2"]


async def test_replay_upcasts_old_versions(store: EventStore, js: JetStreamContext) -> None:
    subject = f"{root(store)}.events"
    old = REGISTRY.encode(MemberJoinedV1(member_id="old", address="h:1"), producer="legacy")
    await js.publish(subject, old)
    [ev] = await collect(store.replay(subject))
    assert isinstance(ev.event, MemberJoinedV2)
    assert ev.event.incarnation == "" and ev.envelope.version == 2 and ev.original_version == 1


async def test_replay_of_empty_ranges_ends(store: EventStore) -> None:
    events, other = f"{root(store)}.events", f"{root(store)}.other"
    # Empty stream.
    assert await asyncio.wait_for(collect(store.replay(events)), 5) == []
    for i in range(3):
        await store.append(other, joined(f"o{i}"))
    # Messages exist, none on the filter.
    assert await asyncio.wait_for(collect(store.replay(events)), 5) == []
    # Start past the end.
    await store.append(events, joined("e"))
    assert await asyncio.wait_for(collect(store.replay(events, from_seq=100)), 5) == []
    # A range that ends before the only matching message.
    assert await asyncio.wait_for(collect(store.replay(events, until_seq=3)), 5) == []
    got = await asyncio.wait_for(collect(store.replay(events)), 5)
    assert [e.seq for e in got] == [4]


async def test_replay_ends_at_the_last_message_present_when_it_began(store: EventStore) -> None:
    subject = f"{root(store)}.events"
    for i in range(50):
        await store.append(subject, joined(f"m{i}"))
    end = await store.last_seq()
    stop = asyncio.Event()

    async def keep_appending() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            await store.append(subject, joined(f"late{i}"))
            await asyncio.sleep(0)

    writer: asyncio.Task[None] | None = None
    seen = []
    try:
        async for ev in store.replay(subject):
            # The replay has begun (its end is fixed): from now on the stream keeps growing.
            writer = writer or asyncio.create_task(keep_appending())
            seen.append(ev.seq)
            await asyncio.sleep(0.001)  # let the writer in between reads
    finally:
        stop.set()
        if writer is not None:
            await writer
    assert seen == list(range(1, end + 1))
    assert await store.last_seq() > end


async def test_load_from_snapshot_equals_full_replay(store: EventStore) -> None:
    domain = root(store)
    snaps = Snapshots(store, domain, events_subject=f"{domain}.events",
                      snapshot_subject=f"{domain}.snapshot")
    subject = snaps.events_subject

    async def append_batch(prefix: str, n: int) -> None:
        for i in range(n):
            await store.append(subject, joined(f"{prefix}{i}"))
            if i % 3 == 2:
                await store.append(subject, MemberLeftV1(member_id=f"{prefix}{i - 1}",
                                                         incarnation="x", reason="ttl-expired"))

    empty: dict[str, Any] = {}
    await append_batch("a", 9)
    first = await snaps.load(fold_members, empty)
    await snaps.write(first.state, first.state_seq, epoch=1)
    await append_batch("b", 9)
    second = await snaps.load(fold_members, empty)
    await snaps.write(second.state, second.state_seq, epoch=1)
    await append_batch("c", 6)

    loaded = await snaps.load(fold_members, empty)
    full: dict[str, Any] = {}
    async for ev in store.replay(subject):
        full = fold_members(full, ev)
    assert loaded.state == full
    assert loaded.snapshot_seq is not None and loaded.events_replayed < full["count"]
    assert loaded.last_seq == await store.last_seq()
    # Rollup keeps only the newest snapshot.
    info = await store.js.stream_info(store.stream, subjects_filter=snaps.snapshot_subject)
    assert info.state.subjects == {snaps.snapshot_subject: 1}


async def dead_letters(js: JetStreamContext, origin: str, expect: int) -> list[Any]:
    """The raw messages parked for ``origin`` (they are garbage: read them raw, not decoded)."""
    sub = await js.pull_subscribe(deadletter_subject(origin), stream=DEADLETTER_STREAM,
                                  config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE,
                                                            inactive_threshold=10.0))
    got: list[Any] = []
    deadline = time.monotonic() + 10
    try:
        while len(got) < expect and time.monotonic() < deadline:
            try:
                got.extend(await sub.fetch(expect - len(got), timeout=0.5))
            except TimeoutError:
                continue
        # Nothing beyond what was expected (no duplicates).
        with pytest.raises(TimeoutError):
            await sub.fetch(1, timeout=0.3)
    finally:
        await sub.unsubscribe()
    return got


async def test_garbage_is_dead_lettered_and_consumer_keeps_going(store: EventStore,
                                                                 js: JetStreamContext) -> None:
    subject = f"{root(store)}.events"

    def envelope(type_: str, version: int, data: dict[str, Any]) -> bytes:
        return json.dumps({"type": type_, "version": version, "id": new_event_id(),
                           "time": utc_now().isoformat(), "producer": "evil", "epoch": 0,
                           "data": data}).encode()

    garbage = {
        "malformed": b"\x00not json{",
        "unknown_type": envelope("no.such.type", 1, {}),
        "unknown_version": envelope("member.joined", 99, {"member_id": "m"}),
        "invalid_data": envelope("member.joined", 2, {"member_id": ""}),
    }
    handled: list[str] = []

    async def handler(ev: StoredEvent) -> None:
        assert isinstance(ev.event, MemberJoinedV2)
        handled.append(ev.event.member_id)

    stopping = asyncio.Event()
    consumer = asyncio.create_task(consume(js, stream=store.stream, durable="c1", subject_filter=subject,
                                           handler=handler, stopping=stopping, fetch_timeout=0.2))
    try:
        await store.append(subject, joined("before"))
        bad_seqs = {}
        for kind, payload in garbage.items():
            ack = await js.publish(subject, payload, headers={"X-Test": kind, "Nats-Msg-Id": f"bad-{kind}"})
            bad_seqs[kind] = ack.seq
        await store.append(subject, joined("after"))

        async def both_handled() -> bool:
            return handled == ["before", "after"]

        await eventually(both_handled, 10, "good events on both sides of the garbage")

        async def all_acked() -> bool:
            ci = await js.consumer_info(store.stream, "c1")
            return ci.num_ack_pending == 0 and ci.num_pending == 0

        await eventually(all_acked, 10, "every message acked, the bad ones included")
    finally:
        stopping.set()
        await asyncio.wait_for(consumer, 5)

    parked = await dead_letters(js, store.stream, expect=len(garbage))
    by_kind = {m.headers[H_KIND]: m for m in parked}
    assert set(by_kind) == set(garbage)
    for kind, m in by_kind.items():
        assert m.data == garbage[kind]
        assert m.headers["X-Test"] == kind
        assert m.headers["Sluice-Original-Nats-Msg-Id"] == f"bad-{kind}"
        assert m.headers[H_SUBJECT] == subject
        assert m.headers[H_SEQ] == str(bad_seqs[kind])
        assert m.headers[H_REASON]

    # A replay meets the same garbage: skipped, and not parked a second time.
    replayed = await collect(store.replay(subject))
    assert [e.event.member_id for e in replayed] == ["before", "after"]  # type: ignore[attr-defined]
    assert len(await dead_letters(js, store.stream, expect=len(garbage))) == len(garbage)


async def test_handler_failures_are_retried_then_dead_lettered(store: EventStore,
                                                               js: JetStreamContext) -> None:
    subject = f"{root(store)}.events"
    attempts: dict[str, int] = {}

    async def handler(ev: StoredEvent) -> None:
        member = ev.event.member_id  # type: ignore[attr-defined]
        attempts[member] = attempts.get(member, 0) + 1
        if member == "poison":
            raise RuntimeError("cannot handle this one")

    stopping = asyncio.Event()
    consumer = asyncio.create_task(consume(js, stream=store.stream, durable="c2", subject_filter=subject,
                                           handler=handler, stopping=stopping, fetch_timeout=0.2,
                                           max_attempts=2))
    try:
        await store.append(subject, joined("poison"))
        await store.append(subject, joined("fine"))

        async def parked() -> bool:
            try:
                info = await js.stream_info(DEADLETTER_STREAM,
                                            subjects_filter=deadletter_subject(store.stream))
            except NotFoundError:
                return False
            return bool(info.state.subjects) and "fine" in attempts

        await eventually(parked, 15, "the poison event parked after its retries")
    finally:
        stopping.set()
        await asyncio.wait_for(consumer, 5)
    assert attempts == {"poison": 2, "fine": 1}
    [m] = await dead_letters(js, store.stream, expect=1)
    assert m.headers[H_KIND] == "handler_error"


# ---------------------------------------------------------------- chunked snapshots


@pytest.fixture
async def big_domain(js: JetStreamContext) -> AsyncIterator[str]:
    """A control domain of its own (stream SLUICE_<DOMAIN>), deleted afterwards."""
    domain = f"snap{uuid4().hex[:8]}"
    yield domain
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(domain_stream(domain))


async def _leader(js: JetStreamContext, domain: str, lease: LeaseUntil) -> DomainLog[dict[str, Any]]:
    log: DomainLog[dict[str, Any]] = DomainLog(js, domain, producer=f"{domain}/e{lease.epoch}",
                                               fold=joined_fold, initial={})
    await log.open("test", f"e{lease.epoch}", lease.epoch, lease)
    return log


async def _full_fold(js: JetStreamContext, domain: str) -> dict[str, Any]:
    state: dict[str, Any] = {}
    async for ev in EventStore(js, domain_stream(domain), "test").replay(domain_events_subject(domain)):
        state = joined_fold(state, ev)
    return state


async def _marker(js: JetStreamContext, domain: str, seq: int) -> SnapshotChunksV1:
    raw = await js.get_msg(domain_stream(domain), seq=seq)
    event = REGISTRY.decode(raw.data or b"").event
    assert isinstance(event, SnapshotTakenV2) and event.chunks is not None
    return event.chunks


async def test_a_snapshot_larger_than_max_payload_round_trips_in_chunks(js: JetStreamContext, nc: Client,
                                                                       big_domain: str) -> None:
    rng = random.Random(7)
    leader = await _leader(js, big_domain, LeaseUntil(1))
    # ~2.2 MB of hex that compresses to about 1.2 MB: more than one 1 MiB message.
    for i in range(1100):
        await leader.append(joined_with_noise(rng, i, 2000))
    seq = await leader.snapshot()
    ref = await _marker(js, big_domain, seq)
    assert ref.size > nc.max_payload and ref.count >= 2 and ref.first_seq + ref.count == seq
    await leader.append(joined_with_noise(rng, 5000, 10))

    successor = await _leader(js, big_domain, LeaseUntil(2))
    assert successor.loaded is not None and successor.loaded.snapshot_seq == seq
    assert successor.loaded.events_replayed == 1
    assert successor.state == await _full_fold(js, big_domain)
    # A follower (the api's read models, the scheduler) reads the same snapshot.
    follower = DomainFollower(js, big_domain, joined_fold, dict)
    assert await follower.load() == successor.state and follower.events_folded == 2


async def test_a_torn_snapshot_is_ignored_and_its_chunks_are_cleaned_up(js: JetStreamContext,
                                                                        big_domain: str) -> None:
    rng = random.Random(8)
    stream, snapshot_subject = domain_stream(big_domain), domain_snapshot_subject(big_domain)
    a, b = chunk_subjects(snapshot_subject)
    lease = LeaseUntil(1)
    leader = await _leader(js, big_domain, lease)
    for i in range(1100):
        await leader.append(joined_with_noise(rng, i, 2000))
    complete = await leader.snapshot()
    first_ref = await _marker(js, big_domain, complete)
    for i in range(1100, 1200):
        await leader.append(joined_with_noise(rng, i, 2000))
    lease.checks = 1  # the leader is gone right after the first chunk of its next snapshot
    with pytest.raises(LeaseLost):
        await leader.snapshot()
    torn = await EventStore(js, stream, "test").last_seq()
    torn_msg = await js.get_msg(stream, seq=torn)
    assert torn_msg.subject == b and torn_msg.headers and torn_msg.headers["Sluice-Chunk"].startswith("0/")
    newest = await js.get_msg(stream, subject=snapshot_subject)
    assert newest.seq == complete  # no snapshot.taken for the torn chunks

    successor = await _leader(js, big_domain, LeaseUntil(2))
    assert successor.loaded is not None and successor.loaded.snapshot_seq == complete
    assert successor.loaded.events_replayed == 100
    assert successor.state == await _full_fold(js, big_domain)

    # The successor's snapshot takes the torn chunks' subject and drops them.
    taken = await successor.snapshot()
    ref = await _marker(js, big_domain, taken)
    assert ref.subject == b
    with pytest.raises(NotFoundError):
        await js.get_msg(stream, seq=torn)
    info = await js.stream_info(stream, subjects_filter=f"{snapshot_subject}.>")
    assert info.state.subjects == {a: first_ref.count, b: ref.count}
    info = await js.stream_info(stream, subjects_filter=snapshot_subject)
    assert info.state.subjects == {snapshot_subject: 1}
    third = await _leader(js, big_domain, LeaseUntil(3))
    assert third.loaded is not None and third.loaded.snapshot_seq == taken
    assert third.loaded.events_replayed == 0
