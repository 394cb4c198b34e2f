"""Chunked control snapshots (``libs/eventstore/snapshot_chunks``) and the in-memory log that
writes and reads them as the JetStream one does: cutting, joining, torn writes, clean-up."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from nats.errors import MaxPayloadError

from contracts import REGISTRY
from contracts.events.snapshots import SnapshotTakenV1, SnapshotTakenV2
from libs.control.replication_state import ReplicationState, replication_fold
from libs.eventstore import MemoryDomainLog, MemoryStream
from libs.eventstore.domain_log import LeaseLost
from libs.eventstore.snapshot_chunks import (
    SNAPSHOT_UP_TO,
    RawChunk,
    TornSnapshot,
    assemble,
    chunk_subjects,
    plan,
)
from libs.streams import domain_events_subject, domain_snapshot_subject, domain_stream
from tests.helpers.snapshots import LeaseUntil, joined, joined_fold, noise

SUBJECT = "sluice.ctl.members.snapshot"
MAX_PAYLOAD = 16 * 1024  # chunks of 8 KiB (libs.chunks leaves 8 KiB for headers)


def big_state(kib: int) -> dict[str, Any]:
    rng = random.Random(kib)
    return {"rows": [noise(rng, 1000) for _ in range(kib)], "n": kib}


def written(state: dict[str, Any], up_to: int = 41,
            first_seq: int = 100) -> tuple[SnapshotTakenV2, list[RawChunk]]:
    """A snapshot planned as a leader would, its chunks as the stream would return them."""
    planned = plan("members", SUBJECT, up_to, state, epoch=3, newest_chunks=None, max_payload=MAX_PAYLOAD,
                   inline_max=1024)
    return planned.marker(first_seq), [(planned.subject, c.headers, c.data) for c in planned.chunks]


def test_a_small_state_stays_inside_its_snapshot_message() -> None:
    planned = plan("members", SUBJECT, 7, {"a": 1}, epoch=1, newest_chunks=None)
    assert planned.chunks == [] and planned.inline is not None
    assert assemble(planned.marker(0), []) == {"a": 1}


def test_a_large_state_is_cut_to_the_payload_limit_and_joins_back() -> None:
    state = big_state(40)  # ~40 KB of hex, ~20 KB compressed: 3 chunks of 8 KiB
    marker, chunks = written(state)
    ref = marker.chunks
    assert ref is not None and ref.count == len(chunks) == 3 and marker.state is None
    assert ref.subject == chunk_subjects(SUBJECT)[0]
    assert all(len(data) <= MAX_PAYLOAD for _s, _h, data in chunks)
    # Every chunk names its snapshot's stream sequence and its place in it.
    assert [(h[SNAPSHOT_UP_TO], h["Sluice-Chunk"].split("/")[:2]) for _s, h, _d in chunks] == [
        ("41", [str(i), "3"]) for i in range(3)]
    assert assemble(marker, chunks) == state
    # The marker survives the contract's JSON both ways.
    decoded = REGISTRY.decode(REGISTRY.encode(marker, producer="t")).event
    assert decoded == marker


def test_the_next_chunked_snapshot_uses_the_other_chunk_subject() -> None:
    a, b = chunk_subjects(SUBJECT)
    state = big_state(20)
    assert plan("m", SUBJECT, 1, state, epoch=1, newest_chunks=None, inline_max=1024).subject == a
    assert plan("m", SUBJECT, 1, state, epoch=1, newest_chunks=a, inline_max=1024).subject == b
    assert plan("m", SUBJECT, 1, state, epoch=1, newest_chunks=b, inline_max=1024).subject == a


@pytest.mark.parametrize("damage", ["missing", "gone", "swapped", "other_subject", "other_snapshot",
                                    "flipped_byte", "truncated", "extra"])
def test_a_snapshot_whose_chunks_are_not_exactly_its_own_is_not_trusted(damage: str) -> None:
    marker, chunks = written(big_state(40))
    found: list[RawChunk | None] = list(chunks)
    if damage == "missing":
        found = found[:-1]
    elif damage == "gone":
        found[1] = None
    elif damage == "swapped":
        found[0], found[1] = found[1], found[0]
    elif damage == "other_subject":
        s, h, d = chunks[1]
        found[1] = (chunk_subjects(SUBJECT)[1], h, d)
    elif damage == "other_snapshot":  # the same bytes, written for another up_to_seq
        _m, other = written(big_state(40), up_to=42)
        found[2] = other[2]
    elif damage == "flipped_byte":
        s, h, d = chunks[1]
        found[1] = (s, h, d[:10] + bytes([d[10] ^ 1]) + d[11:])
    elif damage == "truncated":
        s, h, d = chunks[2]
        found[2] = (s, h, d[:-1])
    elif damage == "extra":
        found.append(chunks[0])
    with pytest.raises(TornSnapshot):
        assemble(marker, found)


def test_a_chunk_ref_needs_its_state_or_its_chunks_not_both() -> None:
    marker, _ = written(big_state(20))
    with pytest.raises(ValueError):
        SnapshotTakenV2(domain="members", up_to_seq=1, state={"a": 1}, chunks=marker.chunks)
    with pytest.raises(ValueError):
        SnapshotTakenV2(domain="members", up_to_seq=1)


# ---------------------------------------------------------------- the in-memory log


async def _leader(stream: MemoryStream, epoch: int, lease: LeaseUntil | None = None) -> MemoryDomainLog[Any]:
    log: MemoryDomainLog[Any] = MemoryDomainLog("members", producer=f"members/e{epoch}", stream=stream,
                                                fold=joined_fold, initial={})
    lease = lease or LeaseUntil(epoch)
    await log.open("member", f"e{epoch}", epoch, lease)
    return log


def full_fold(stream: MemoryStream) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for stored in stream.read([domain_events_subject("members")]):
        state = joined_fold(state, stored)
    return state


async def test_memory_log_writes_a_snapshot_past_max_payload_in_chunks_and_a_new_leader_reads_it() -> None:
    stream = MemoryStream(domain_stream("members"), max_payload=64 * 1024)
    rng = random.Random(1)
    first = await _leader(stream, 1)
    for i in range(200):  # ~200 KB of noise, ~100 KB compressed: past one 64 KiB message
        await first.append(joined(rng, i, 1000))
    with pytest.raises(MaxPayloadError):  # the state would not fit in one message
        stream.append(domain_snapshot_subject("members"),
                      REGISTRY.envelope(SnapshotTakenV1(domain="members", up_to_seq=1, state=first.state),
                                        producer="t"))
    seq = await first.snapshot()
    stored = stream.get(seq)
    assert stored is not None and isinstance(stored.event, SnapshotTakenV2)
    ref = stored.event.chunks
    assert ref is not None and ref.count >= 2 and ref.first_seq + ref.count == seq
    await first.append(joined(rng, 999, 10))

    second = await _leader(stream, 2)
    assert second.loaded is not None and second.loaded.snapshot_seq == seq
    assert second.loaded.events_replayed == 1
    assert second.state == full_fold(stream)


async def test_a_leader_stopped_mid_snapshot_leaves_the_previous_one_and_its_successor_cleans_up() -> None:
    stream = MemoryStream(domain_stream("members"), max_payload=64 * 1024)
    a, b = chunk_subjects(domain_snapshot_subject("members"))
    rng = random.Random(2)
    lease = LeaseUntil(1)
    first = await _leader(stream, 1, lease)
    for i in range(200):
        await first.append(joined(rng, i, 1000))
    complete = await first.snapshot()
    assert stream.subject_counts()[a] >= 2
    for i in range(200, 260):
        await first.append(joined(rng, i, 1000))
    lease.checks = 1  # valid for the snapshot's start, gone after its first chunk
    with pytest.raises(LeaseLost):
        await first.snapshot()
    torn = stream.last_seq
    assert stream.get_raw(torn) is not None and stream.get_raw(torn)[0] == b  # type: ignore[index]
    assert stream.last_of(domain_snapshot_subject("members")).seq == complete  # type: ignore[union-attr]

    second = await _leader(stream, 2)
    loaded = second.loaded
    assert loaded is not None and loaded.snapshot_seq == complete  # not the torn one
    assert loaded.events_replayed == 60  # the events after the complete snapshot
    assert second.state == full_fold(stream)

    # The successor's snapshot goes where the torn chunks are, and they are gone with it.
    newest = await second.snapshot()
    counts = stream.subject_counts()
    ref = stream.get(newest).event.chunks  # type: ignore[union-attr]
    assert ref is not None and ref.subject == b and counts[b] == ref.count
    assert stream.get_raw(torn) is None
    # One more: it replaces the first snapshot's chunks; never more than two sets are kept.
    await second.append(joined(rng, 5000, 10))
    last = await second.snapshot()
    counts = stream.subject_counts()
    assert counts[domain_snapshot_subject("members")] == 1
    assert counts[a] == stream.get(last).event.chunks.count  # type: ignore[union-attr]
    assert counts[b] == ref.count
    third = await _leader(stream, 3)
    assert third.loaded is not None and third.loaded.snapshot_seq == last and third.state == full_fold(stream)


async def test_memory_log_replays_everything_when_the_newest_snapshots_chunks_are_damaged() -> None:
    stream = MemoryStream(domain_stream("members"), max_payload=64 * 1024)
    rng = random.Random(3)
    first = await _leader(stream, 1)
    for i in range(200):
        await first.append(joined(rng, i, 1000))
    seq = await first.snapshot()
    ref = stream.get(seq).event.chunks  # type: ignore[union-attr]
    assert ref is not None
    subject, headers, data = stream._messages[ref.first_seq]
    stream._messages[ref.first_seq] = (subject, headers, data[:-1])  # a damaged disk, say
    second = await _leader(stream, 2)
    assert second.loaded is not None and second.loaded.snapshot_seq is None
    assert second.state == full_fold(stream)


async def test_an_inline_snapshot_of_the_first_version_is_still_read() -> None:
    stream = MemoryStream(domain_stream("members"))
    first = await _leader(stream, 1)
    await first.append(joined(random.Random(4), 1, 10))
    old = SnapshotTakenV1(domain="members", up_to_seq=first.last_seq, state=first.state)
    seq = stream.append(domain_snapshot_subject("members"), REGISTRY.envelope(old, producer="t", epoch=1),
                        rollup=True)
    second = await _leader(stream, 2)
    assert second.loaded is not None and second.loaded.snapshot_seq == seq
    assert second.loaded.events_replayed == 0 and second.loaded.state == first.state


async def test_the_replication_state_of_many_spans_round_trips_through_a_chunked_snapshot() -> None:
    from benchmarks.bench_rebuild import set_changed
    from libs.scheduling import Span

    stream = MemoryStream(domain_stream("replication"), max_payload=32 * 1024)
    log: MemoryDomainLog[ReplicationState] = MemoryDomainLog(
        "replication", producer="rm/t", stream=stream, fold=replication_fold, initial=ReplicationState(),
        restore=ReplicationState.restore, dump=ReplicationState.dump)
    await log.open("replication-manager", "r1", 1, LeaseUntil(1))
    for i in range(3000):
        span = Span("cf", "src", "db", f"t{i}")
        await log.append(set_changed(span, "replicating", f"w{i % 3}", None, (1 << 40) + i * 7919))
    seq = await log.snapshot()
    assert stream.get(seq).event.chunks.count >= 2  # type: ignore[union-attr]
    again: MemoryDomainLog[ReplicationState] = MemoryDomainLog(
        "replication", producer="rm/t", stream=stream, fold=replication_fold, initial=ReplicationState(),
        restore=ReplicationState.restore, dump=ReplicationState.dump)
    await again.open("replication-manager", "r2", 2, LeaseUntil(2))
    assert again.loaded is not None and again.loaded.snapshot_seq == seq
    assert again.state.dump()["sets"] == log.state.dump()["sets"]
    assert replace(again.loaded, state=None).events_replayed == 0
