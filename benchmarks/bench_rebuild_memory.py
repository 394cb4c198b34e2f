"""Replication-manager rebuild with 100,000 spans: the replication domain log that 100,000
replicating spans leave behind, and a new leader's takeover timed with the service's own code.

    .venv/bin/python -m benchmarks.bench_rebuild_memory [--spans 100000] [--members 10]
                                                        [--snapshot-every 5000]
                                                        [--store jetstream|memory] [--skip-full-replay]

The log: ``leader.elected``, then for every span ``set_changed`` prepare (secondary) and
replicating (primary, with a checkpoint of its own, as a live system has), ``rebuilt``, as the
replication-manager records an add. Two copies:

- as the leader leaves it with snapshots (``SLUICE_CONTROL_SNAPSHOT_EVERY``): the newest
  snapshot of every set, written as the leader writes it (chunked when it is larger than one
  message, ``libs/eventstore/snapshot_chunks``), then the longest tail the policy allows
  (``--snapshot-every`` - 1 checkpoint advances); earlier snapshots would be rolled up, so only
  the newest is written;
- without any snapshot (every event replayed): the worst case, what a leader faced before
  snapshots were chunked once the state passed max_payload (``--skip-full-replay`` skips it).

``--store jetstream`` (the default): the log is written to a private nats-server (JetStream on
disk, the default 1 MiB max_payload) and the takeover opens a ``DomainLog`` on it, so the figure
includes reading the snapshot's chunks and the tail from the server. ``--store memory``: the
event store's in-memory twin (``MemoryStream``, the same max_payload and chunking), the leader's
CPU cost without the server.

A takeover, as ``ReplicationService.lead`` does it: the domain log's ``open`` (newest snapshot +
the events after it folded by ``replication_fold``, then ``leader.elected``), the term's
``ReplicationHandlers`` (the ``ReplicationCore`` from the replayed state), then each member's
complete heartbeat, decoded from its bytes, through ``handlers.handle`` until the sets are
rebuilt and ``rebuilt`` is recorded. Baselines in the same run: decoding the same events
without folding them, and a plain dict of the same number of set summaries.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import BaseModel

from benchmarks.bench_rebuild import set_changed
from benchmarks.output import Figures, add_json_option
from contracts import REGISTRY
from contracts.events.leadership import LeaderElectedV1
from contracts.events.members import MemberJoinedV2
from contracts.events.scheduling import (
    CheckpointAdvancedV1,
    MemberHeartbeatV3,
    RebuiltV1,
    SpansChangedV1,
    TableStatusV1,
)
from contracts.events.snapshots import SnapshotTakenV2
from libs.chunks import chunk_size_for
from libs.config import Settings
from libs.control.convert import span_ref
from libs.control.members import MembersState
from libs.control.replication_state import ReplicationState, SetSummary, replication_fold
from libs.control.schedule_state import ScheduleState
from libs.eventstore import DomainLog, EventStore, MemoryDomainLog, MemoryStream, Snapshots
from libs.eventstore.snapshot_chunks import DEFAULT_MAX_PAYLOAD, plan
from libs.leader_service import Entry
from libs.localservers.nats_server import NatsServer
from libs.scheduling import SetState, Span
from libs.streams import domain_events_subject, domain_snapshot_subject, domain_stream
from services.replication_manager.service import DOMAIN, ReplicationHandlers

PRODUCER = "replication-manager/bench"
SERVICE = "replication-manager"
TS = 1 << 40


@dataclass
class Lease:
    epoch: int

    def valid(self) -> bool:
        return True


def domain_events(spans: list[Span], placement: dict[Span, str], members: list[str]) -> Iterator[BaseModel]:
    """What the replication-manager records while it adds every span once."""
    yield LeaderElectedV1(service=SERVICE, candidate="r1", epoch=1)
    for i, s in enumerate(spans):
        yield set_changed(s, "prepare", None, placement[s], TS)
        # Each span its own checkpoint, as in a live system (the snapshot compresses less).
        yield set_changed(s, "replicating", placement[s], None, TS + i * 7919)
    yield RebuiltV1(members={m: f"inc-{m}" for m in members}, sets=len(spans), waited_s=0.0)


@dataclass
class Log:
    """The replication log as a list of messages: ``(subject, envelope bytes)`` of the events
    before the snapshot, the snapshot's state and ``up_to_seq``, the tail after it."""

    head: list[bytes]
    state: dict[str, Any]
    tail: list[bytes]

    @property
    def events(self) -> int:
        return len(self.head) + len(self.tail)


def build_log(spans: list[Span], placement: dict[Span, str], members: list[str], snapshot_every: int) -> Log:
    state = ReplicationState()
    head = []
    for event in domain_events(spans, placement, members):
        head.append(REGISTRY.encode(event, producer=PRODUCER, epoch=1))
        state.apply(event)
    rng = random.Random(1)
    cfs = sorted({s.changefeed for s in spans})
    tail = [REGISTRY.encode(CheckpointAdvancedV1(changefeed=rng.choice(cfs), checkpoint_ts=TS + i + 1,
                                                 resolved_ts=TS + i + 1), producer=PRODUCER, epoch=1)
            for i in range(snapshot_every - 1)]
    return Log(head, state.dump(), tail)


def write_memory(log: Log) -> tuple[MemoryStream, MemoryStream, int, int]:
    """(stream with the newest snapshot and the longest tail, stream without a snapshot, bytes
    of the snapshot as stored: its chunks, or its one message; its chunks, 0 when inline)."""
    name, events_subject = domain_stream(DOMAIN), domain_events_subject(DOMAIN)
    with_snapshot, without = MemoryStream(name), MemoryStream(name)
    for raw in log.head:
        envelope = REGISTRY.decode(raw).envelope
        with_snapshot.append(events_subject, envelope)
        without.append(events_subject, envelope)
    planned = plan(DOMAIN, domain_snapshot_subject(DOMAIN), with_snapshot.last_seq, log.state, epoch=1,
                   newest_chunks=None, max_payload=with_snapshot.max_payload)
    first = 0
    for index, chunk in enumerate(planned.chunks):
        seq = with_snapshot.append_raw(planned.subject, chunk.data, headers=chunk.headers, rollup=index == 0)
        first = first or seq
    marker = REGISTRY.envelope(planned.marker(first), producer=PRODUCER, epoch=1)
    with_snapshot.append(domain_snapshot_subject(DOMAIN), marker, rollup=True)
    for raw in log.tail:
        envelope = REGISTRY.decode(raw).envelope
        with_snapshot.append(events_subject, envelope)
        without.append(events_subject, envelope)
    stored = planned.size if planned.chunks else len(marker.model_dump_json())
    return with_snapshot, without, stored, len(planned.chunks)


async def write_jetstream(js: JetStreamContext, log: Log, with_snapshot: bool) -> tuple[int, int]:
    """The log into a fresh replication stream (events published in order, pipelined); with
    ``with_snapshot`` the snapshot in between, written by ``Snapshots.write`` as a leader's is
    (chunks, then ``snapshot.taken``). Returns the bytes of the snapshot's payload (0 without)
    and its chunks (0 when inline)."""
    domain_log: DomainLog[Any] = DomainLog(js, DOMAIN, producer=PRODUCER)
    try:
        await js.delete_stream(domain_log.stream)
    except NotFoundError:
        pass
    await domain_log.ensure()
    events_subject = domain_events_subject(DOMAIN)

    async def publish(messages: list[bytes]) -> None:
        for raw in messages:
            await js.publish_async(events_subject, raw)
        await js.publish_async_completed()

    await publish(log.head)
    size, count, stored = 0, 0, log.events
    if with_snapshot:
        store = EventStore(js, domain_log.stream, PRODUCER)
        up_to = await store.last_seq()
        seq = await Snapshots(store, DOMAIN).write(log.state, up_to, epoch=1, expected_last_seq=up_to)
        raw = await js.get_msg(domain_log.stream, seq=seq)
        marker = REGISTRY.decode(raw.data or b"").event
        assert isinstance(marker, SnapshotTakenV2)
        size = marker.chunks.size if marker.chunks is not None else len(raw.data or b"")
        count = marker.chunks.count if marker.chunks is not None else 0
        stored += 1 + count
    await publish(log.tail)
    info = await js.stream_info(domain_log.stream)
    assert info.state.messages == stored, f"the server holds {info.state.messages:,} of {stored:,} messages"
    return size, count


@dataclass
class Takeover:
    total_s: float
    cpu_s: float
    open_s: float
    handlers_s: float
    reports_s: float
    replayed: int
    sets: int
    from_snapshot: bool
    hb_decode_s: float = 0.0
    """CPU per steady complete heartbeat after the rebuild: decoding it, and handling it."""
    hb_handle_s: float = 0.0
    hb_count: int = 0


LeaderFactory = Callable[[], DomainLog[ReplicationState] | MemoryDomainLog[ReplicationState]]


def memory_leader(stream: MemoryStream) -> LeaderFactory:
    return lambda: MemoryDomainLog(DOMAIN, producer=PRODUCER, stream=stream, fold=replication_fold,
                                   initial=ReplicationState(), restore=ReplicationState.restore,
                                   dump=ReplicationState.dump)


def jetstream_leader(js: JetStreamContext) -> LeaderFactory:
    return lambda: DomainLog(js, DOMAIN, producer=PRODUCER, fold=replication_fold, initial=ReplicationState(),
                             restore=ReplicationState.restore, dump=ReplicationState.dump)


async def last_event(leader: DomainLog[ReplicationState] | MemoryDomainLog[ReplicationState]) -> BaseModel:
    if isinstance(leader, MemoryDomainLog):
        stored = leader.memory.get(leader.last_seq)
        assert stored is not None
        return stored.event
    raw = await leader.store.get(leader.last_seq)
    assert raw is not None
    return REGISTRY.decode(raw.data or b"").event


async def take_over(make_leader: LeaderFactory, placement: dict[Span, str], members: list[str],
                    heartbeats: list[bytes], epoch: int, steady: list[bytes] | None = None) -> Takeover:
    """A new leader's rebuild, step by step as ``ReplicationService.lead``."""
    alive = MembersState()
    for m in members:
        alive.apply(MemberJoinedV2(member_id=m, incarnation=f"inc-{m}"))
    schedule = ScheduleState()
    by_cf: dict[str, list[Span]] = {}
    for s in placement:
        by_cf.setdefault(s.changefeed, []).append(s)
    for cf, spans in by_cf.items():
        schedule.apply(SpansChangedV1(changefeed=cf, spans=[span_ref(s) for s in spans]))
    leader = make_leader()
    sent: list[object] = []
    t0, cpu = time.perf_counter(), time.process_time()
    await leader.open(SERVICE, "r2", epoch, Lease(epoch))
    t_open = time.perf_counter()
    handlers = ReplicationHandlers(Lease(epoch), leader, Settings(), alive, schedule,
                                   started=time.monotonic(), send=sent.append,
                                   publish_status=lambda _s: None)
    await handlers.start()
    t_handlers = time.perf_counter()
    for raw in heartbeats:
        hb = REGISTRY.decode(raw).event  # as the service's heartbeat subscription does
        assert isinstance(hb, MemberHeartbeatV3)
        await handlers.handle(Entry(hb))
    t_ready, cpu = time.perf_counter(), time.process_time() - cpu
    core = handlers.core
    assert core.ready and core.rebuilt_recorded, "the rebuild did not finish"
    assert len(core.manager.sets) == len(placement)
    assert all(rs.state is SetState.REPLICATING and rs.primary == placement[span]
               for span, rs in core.manager.sets.items()), "a set was not rebuilt as the members report it"
    assert isinstance(await last_event(leader), RebuiltV1)
    assert leader.loaded is not None
    decode_s = handle_s = 0.0
    for raw in steady or []:
        c0 = time.process_time()
        hb = REGISTRY.decode(raw).event
        c1 = time.process_time()
        await handlers.handle(Entry(hb))  # type: ignore[arg-type]
        decode_s, handle_s = decode_s + c1 - c0, handle_s + time.process_time() - c1
    n = max(1, len(steady or []))
    return Takeover(t_ready - t0, cpu, t_open - t0, t_handlers - t_open, t_ready - t_handlers,
                    leader.loaded.events_replayed, len(core.manager.sets),
                    leader.loaded.snapshot_seq is not None, decode_s / n, handle_s / n, len(steady or []))


async def main_async(args: argparse.Namespace) -> None:
    out = Figures("bench_rebuild_memory")
    members = [f"w{i:02d}" for i in range(args.members)]
    spans = [Span(f"cf{i % args.changefeeds}", f"src{i % 4}", f"db{i % 16}", f"t{i}")
             for i in range(args.spans)]
    placement = {s: members[i % len(members)] for i, s in enumerate(spans)}
    t0 = time.perf_counter()
    log = build_log(spans, placement, members, args.snapshot_every)
    print(f"log built in {time.perf_counter() - t0:.1f} s: {log.events:,} events over {args.spans:,} spans "
          f"and {args.members} members (a snapshot after the adds, then a {len(log.tail):,}-event tail)",
          flush=True)
    epoch = 2
    own_ts = {s: TS + i * 7919 for i, s in enumerate(spans)}

    def heartbeats_at(seq: int) -> list[bytes]:
        return [
            REGISTRY.encode(MemberHeartbeatV3(
                member_id=m, incarnation=f"inc-{m}", epoch=epoch, seq=seq,
                tables=[TableStatusV1(span=span_ref(s), state="replicating", checkpoint_ts=own_ts[s] + seq,
                                      resolved_ts=own_ts[s] + seq)
                        for s, owner in placement.items() if owner == m]), producer=f"sink-worker/{m}")
            for m in members]

    heartbeats = heartbeats_at(1)
    # After the rebuild: complete heartbeats as a steady system sends them (every span a little
    # further), timed decode and handling apart: the leader's cost per heartbeat at this size.
    steady = [raw for seq in range(2, 2 + args.steady_rounds) for raw in heartbeats_at(seq)]

    # Baselines: decoding every event of the full log, and a dict of set summaries.
    t0 = time.process_time()
    decoded = sum(1 for raw in (*log.head, *log.tail) if REGISTRY.decode(raw) is not None)
    decode_s = time.process_time() - t0
    t0 = time.perf_counter()
    plain = {s: SetSummary(s, SetState.REPLICATING, placement[s]) for s in spans}
    dict_s = time.perf_counter() - t0
    assert decoded == log.events and len(plain) == args.spans
    print(f"baseline: decode the {decoded:,} events of the full log {decode_s:.2f} s CPU; "
          f"a dict of {len(plain):,} set summaries {dict_s:.3f} s", flush=True)

    full: Takeover | None = None
    if args.store == "memory":
        with_snapshot, without, snapshot_bytes, chunks = write_memory(log)
        snap = await take_over(memory_leader(with_snapshot), placement, members, heartbeats, epoch, steady)
        if not args.skip_full_replay:
            full = await take_over(memory_leader(without), placement, members, heartbeats, epoch)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-rebuild-"))
        server = NatsServer(data_dir=tmp / "nats").start()
        try:
            nc = await nats.connect(server.url, max_reconnect_attempts=0)
            js = nc.jetstream(publish_async_max_pending=8000)
            t0 = time.perf_counter()
            snapshot_bytes, chunks = await write_jetstream(js, log, with_snapshot=True)
            print(f"written to JetStream in {time.perf_counter() - t0:.1f} s", flush=True)
            snap = await take_over(jetstream_leader(js), placement, members, heartbeats, epoch, steady)
            if not args.skip_full_replay:
                await write_jetstream(js, log, with_snapshot=False)
                full = await take_over(jetstream_leader(js), placement, members, heartbeats, epoch)
            await nc.close()
        finally:
            server.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    assert snap.from_snapshot, "the new leader did not start from the snapshot"
    shape = (f"{snapshot_bytes:,} bytes compressed in {chunks} chunks of at most "
             f"{chunk_size_for(DEFAULT_MAX_PAYLOAD):,}" if chunks
             else f"one message of {snapshot_bytes:,} bytes")
    print(f"the snapshot, every span with a checkpoint of its own: {shape}")
    for name, t in (("with the snapshot", snap), ("without a snapshot", full)):
        if t is None:
            continue
        print(f"rebuild {name} ({args.store}): {t.total_s:.2f} s, CPU {t.cpu_s:.2f} s (target < 10 s): "
              f"open (replay {t.replayed:,} events) "
              f"{t.open_s:.2f} s, core {t.handlers_s:.2f} s, {args.members} members' reports -> "
              f"{t.sets:,} sets rebuilt {t.reports_s:.2f} s")
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    per = args.spans // args.members
    beat = 5 * args.members * (snap.hb_decode_s + snap.hb_handle_s)
    print(f"steady complete heartbeats of {per:,} spans ({snap.hb_count}): "
          f"decode {snap.hb_decode_s * 1000:.1f} ms, handle {snap.hb_handle_s * 1000:.1f} ms CPU each; "
          f"at 5 a second from {args.members} members {100 * beat:.0f} % of a core")
    print(f"load average now {load}")
    where = "JetStream (a private nats-server)" if args.store == "jetstream" else "the in-memory store"
    out.add(f"new replication-manager leader rebuilds {args.spans:,} spans over {args.members} members from "
            f"{where}: snapshot ({snapshot_bytes / 2**20:.2f} MiB, {chunks or 'no'} chunks) + "
            f"{snap.replayed:,}-event tail, then every member's report; CPU {snap.cpu_s:.1f} s; load {load}",
            snap.total_s, "s",
            baseline=f"a dict of {args.spans:,} set summaries {dict_s:.2f} s", target="< 10 s",
            met=snap.total_s < 10)
    if snap.hb_count:
        out.add(f"replication-manager CPU per steady complete heartbeat of {per:,} spans after the rebuild "
                f"(decode {snap.hb_decode_s * 1000:.1f} ms + handle {snap.hb_handle_s * 1000:.1f} ms; at "
                f"SLUICE_HEARTBEAT_INTERVAL_S 0.2 from {args.members} members {100 * beat:.0f} % of a core; "
                f"load {load})", 1000 * (snap.hb_decode_s + snap.hb_handle_s), "ms")
    if full is not None:
        out.add(f"the same rebuild without a snapshot ({full.replayed:,} events replayed; "
                f"CPU {full.cpu_s:.1f} s)",
                full.total_s, "s",
                baseline=f"decoding the same {decoded:,} events only: CPU {decode_s:.1f} s", target="< 10 s",
                met=full.total_s < 10)
    out.write(args.json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--members", type=int, default=10)
    parser.add_argument("--changefeeds", type=int, default=10)
    parser.add_argument("--snapshot-every", type=int, default=5000,
                        help="as SLUICE_CONTROL_SNAPSHOT_EVERY (its default)")
    parser.add_argument("--store", choices=("jetstream", "memory"), default="jetstream",
                        help="where the log is: a private nats-server (default) or the in-memory twin")
    parser.add_argument("--steady-rounds", type=int, default=3,
                        help="complete heartbeats of every member timed after the rebuild")
    parser.add_argument("--skip-full-replay", action="store_true",
                        help="do not time the rebuild without a snapshot")
    add_json_option(parser)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
