"""Replication-manager rebuild with 100,000 spans, in process: the replication domain log that
100,000 replicating spans leave behind, held by the event store's in-memory twin
(``libs.eventstore.MemoryStream``), and a new leader's takeover timed with the service's own
code (no NATS: the figure is the leader's CPU cost, not the server's).

    .venv/bin/python -m benchmarks.bench_rebuild_memory [--spans 100000] [--members 10]
                                                        [--snapshot-every 5000]

The log: ``leader.elected``, then for every span ``set_changed`` prepare (secondary) and
replicating (primary), ``rebuilt``, as the replication-manager records an add. Two copies:

- as the leader leaves it with snapshots (``SLUICE_CONTROL_SNAPSHOT_EVERY``): the newest
  snapshot of every set, then the longest tail the policy allows (``--snapshot-every`` - 1
  checkpoint advances); earlier snapshots would be rolled up, so only the newest is written;
- without any snapshot (every event replayed): the worst case.

A takeover, as ``ReplicationService.lead`` does it: ``MemoryDomainLog.open`` (newest snapshot +
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
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel

from benchmarks.bench_rebuild import set_changed
from benchmarks.output import Figures, add_json_option
from contracts import REGISTRY
from contracts.events.leadership import LeaderElectedV1
from contracts.events.members import MemberJoinedV2
from contracts.events.scheduling import (
    CheckpointAdvancedV1,
    MemberHeartbeatV1,
    RebuiltV1,
    SpansChangedV1,
    TableStatusV1,
)
from contracts.events.snapshots import SnapshotTakenV1
from libs.config import Settings
from libs.control.convert import span_ref
from libs.control.members import MembersState
from libs.control.replication_state import ReplicationState, SetSummary, replication_fold
from libs.control.schedule_state import ScheduleState
from libs.eventstore import MemoryDomainLog, MemoryStream
from libs.leader_service import Entry
from libs.scheduling import SetState, Span
from libs.streams import domain_events_subject, domain_fold_subjects, domain_snapshot_subject, domain_stream
from services.replication_manager.service import DOMAIN, ReplicationHandlers

PRODUCER = "replication-manager/bench"
DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's, and every stack Sluice starts keeps it
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
    for s in spans:
        yield set_changed(s, "prepare", None, placement[s], TS)
        yield set_changed(s, "replicating", placement[s], None, TS)
    yield RebuiltV1(members={m: f"inc-{m}" for m in members}, sets=len(spans), waited_s=0.0)


def write_logs(spans: list[Span], placement: dict[Span, str], members: list[str],
               snapshot_every: int) -> tuple[MemoryStream, MemoryStream, int, int]:
    """(log with the newest snapshot and the longest tail, log without a snapshot, events, bytes of
    the snapshot message with a checkpoint of its own for every span)."""
    name = domain_stream(DOMAIN)
    events_subject = domain_events_subject(DOMAIN)
    with_snapshot, without = MemoryStream(name), MemoryStream(name)
    state = ReplicationState()
    n = 0
    for event in domain_events(spans, placement, members):
        envelope = REGISTRY.envelope(event, producer=PRODUCER, epoch=1)
        with_snapshot.append(events_subject, envelope)
        without.append(events_subject, envelope)
        state.apply(event)
        n += 1
    snapshot = SnapshotTakenV1(domain=DOMAIN, up_to_seq=with_snapshot.last_seq, state=state.dump())
    snapshot_bytes = len(REGISTRY.encode(snapshot, producer=PRODUCER, epoch=1))
    # Here every span has the same checkpoint, which compresses far better than a live system's
    # (each span's own); the size of that one, for the max_payload comparison.
    for i, summary in enumerate(state.sets.values()):
        summary.checkpoint_ts = summary.resolved_ts = TS + i * 7919
    varied = SnapshotTakenV1(domain=DOMAIN, up_to_seq=with_snapshot.last_seq, state=state.dump())
    varied_bytes = len(REGISTRY.encode(varied, producer=PRODUCER, epoch=1))
    with_snapshot.append(domain_snapshot_subject(DOMAIN),
                         REGISTRY.envelope(snapshot, producer=PRODUCER, epoch=1), rollup=True)
    rng = random.Random(1)
    cfs = sorted({s.changefeed for s in spans})
    for i in range(snapshot_every - 1):
        advance = CheckpointAdvancedV1(changefeed=rng.choice(cfs), checkpoint_ts=TS + i + 1,
                                       resolved_ts=TS + i + 1)
        envelope = REGISTRY.envelope(advance, producer=PRODUCER, epoch=1)
        with_snapshot.append(events_subject, envelope)
        without.append(events_subject, envelope)
        n += 1
    return with_snapshot, without, n, max(snapshot_bytes, varied_bytes)


@dataclass
class Takeover:
    total_s: float
    cpu_s: float
    open_s: float
    handlers_s: float
    reports_s: float
    replayed: int
    sets: int


async def take_over(stream: MemoryStream, placement: dict[Span, str], members: list[str],
                    heartbeats: list[bytes], epoch: int) -> Takeover:
    """A new leader's rebuild over ``stream``, step by step as ``ReplicationService.lead``."""
    alive = MembersState()
    for m in members:
        alive.apply(MemberJoinedV2(member_id=m, incarnation=f"inc-{m}"))
    schedule = ScheduleState()
    by_cf: dict[str, list[Span]] = {}
    for s in placement:
        by_cf.setdefault(s.changefeed, []).append(s)
    for cf, spans in by_cf.items():
        schedule.apply(SpansChangedV1(changefeed=cf, spans=[span_ref(s) for s in spans]))
    leader: MemoryDomainLog[ReplicationState] = MemoryDomainLog(
        DOMAIN, producer=PRODUCER, stream=stream, fold=replication_fold, initial=ReplicationState(),
        restore=ReplicationState.restore, dump=ReplicationState.dump)
    sent: list[object] = []
    t0, cpu = time.perf_counter(), time.process_time()
    await leader.open(SERVICE, "r2", epoch)
    t_open = time.perf_counter()
    handlers = ReplicationHandlers(Lease(epoch), leader, Settings(), alive, schedule,
                                   started=time.monotonic(), send=sent.append,
                                   publish_status=lambda _s: None)
    await handlers.start()
    t_handlers = time.perf_counter()
    for raw in heartbeats:
        hb = REGISTRY.decode(raw).event  # as the service's heartbeat subscription does
        assert isinstance(hb, MemberHeartbeatV1)
        await handlers.handle(Entry(hb))
    t_ready, cpu = time.perf_counter(), time.process_time() - cpu
    core = handlers.core
    assert core.ready and core.rebuilt_recorded, "the rebuild did not finish"
    assert len(core.manager.sets) == len(placement)
    assert all(rs.state is SetState.REPLICATING and rs.primary == placement[span]
               for span, rs in core.manager.sets.items()), "a set was not rebuilt as the members report it"
    last = leader.memory.get(leader.last_seq)
    assert last is not None and isinstance(last.event, RebuiltV1)
    assert leader.loaded is not None
    return Takeover(t_ready - t0, cpu, t_open - t0, t_handlers - t_open, t_ready - t_handlers,
                    leader.loaded.events_replayed, len(core.manager.sets))


async def main_async(args: argparse.Namespace) -> None:
    out = Figures("bench_rebuild_memory")
    members = [f"w{i:02d}" for i in range(args.members)]
    spans = [Span(f"cf{i % args.changefeeds}", f"src{i % 4}", f"db{i % 16}", f"t{i}")
             for i in range(args.spans)]
    placement = {s: members[i % len(members)] for i, s in enumerate(spans)}
    t0 = time.perf_counter()
    with_snapshot, without, n_events, snapshot_bytes = write_logs(spans, placement, members,
                                                                  args.snapshot_every)
    print(f"logs written in {time.perf_counter() - t0:.1f} s: {n_events:,} events over {args.spans:,} spans "
          f"and {args.members} members (one copy with a snapshot and a "
          f"{args.snapshot_every - 1:,}-event tail)",
          flush=True)
    # The store here has no message size limit; JetStream has (a snapshot is one message).
    fits = snapshot_bytes <= DEFAULT_MAX_PAYLOAD
    print(f"the snapshot message, every span with a checkpoint of its own: {snapshot_bytes:,} bytes ("
          f"{'within' if fits else 'OVER'} nats-server's default max_payload of {DEFAULT_MAX_PAYLOAD:,})")
    epoch = 2
    heartbeats = [
        REGISTRY.encode(MemberHeartbeatV1(
            member_id=m, incarnation=f"inc-{m}", epoch=epoch, seq=1,
            tables=[TableStatusV1(span=span_ref(s), state="replicating", checkpoint_ts=TS + 1,
                                  resolved_ts=TS + 1)
                    for s, owner in placement.items() if owner == m]), producer=f"sink-worker/{m}")
        for m in members]

    # Baselines: reading (decoding) every event of the full log, and a dict of set summaries.
    t0 = time.process_time()
    decoded = len(without.read(domain_fold_subjects(DOMAIN)))
    decode_s = time.process_time() - t0
    t0 = time.perf_counter()
    plain = {s: SetSummary(s, SetState.REPLICATING, placement[s]) for s in spans}
    dict_s = time.perf_counter() - t0
    assert decoded == n_events and len(plain) == args.spans
    print(f"baseline: decode the {decoded:,} events of the full log {decode_s:.2f} s CPU; "
          f"a dict of {len(plain):,} set summaries {dict_s:.3f} s")

    snap = await take_over(with_snapshot, placement, members, heartbeats, epoch)
    full = await take_over(without, placement, members, heartbeats, epoch)
    for name, t in (("with the snapshot", snap), ("without a snapshot", full)):
        print(f"rebuild {name}: {t.total_s:.2f} s, CPU {t.cpu_s:.2f} s (target < 10 s): "
              f"open (replay {t.replayed:,} events) "
              f"{t.open_s:.2f} s, core {t.handlers_s:.2f} s, {args.members} members' reports -> "
              f"{t.sets:,} sets rebuilt {t.reports_s:.2f} s")
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average now {load}")
    over = "" if fits else (f"; a snapshot of {snapshot_bytes / 2**20:.1f} MiB, over nats-server's default "
                            "max_payload: a leader on JetStream cannot write it")
    out.add(f"new replication-manager leader rebuilds {args.spans:,} spans over {args.members} members "
            f"(snapshot + {snap.replayed:,}-event tail, then every member's report; CPU {snap.cpu_s:.1f} s"
            f"{over})",
            snap.total_s, "s",
            baseline=f"a dict of {args.spans:,} set summaries {dict_s:.2f} s", target="< 10 s",
            met=snap.total_s < 10)
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
    add_json_option(parser)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
