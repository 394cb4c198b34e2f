"""Replication-manager rebuild after a leader change, from a replication stream that holds
1,000,000 control events (with the snapshots a leader writes every ``--snapshot-every``).

    .venv/bin/python -m benchmarks.bench_rebuild [--events 1000000] [--spans 10000] [--members 10]
                                                 [--snapshot-every 5000] [--skip-full-replay]

A private nats-server (JetStream on disk) gets a replication stream written the way the
replication-manager writes it: every span added (prepare, replicating), then a long history of
moves (prepare, commit, replicating), changefeed checkpoint advances, task results and leader
changes, with a snapshot of the folded state every ``--snapshot-every`` events. Then a new
leader's takeover is timed step by step, in process, with the service's own code:

1. ``DomainLog.open``: newest snapshot + the events after it, then its ``leader.elected``;
2. ``ReplicationCore`` from the replayed state (checkpoint floors, recorded sets);
3. every member's complete report (in-process, pre-built heartbeats of the recorded placement)
   until the sets are rebuilt and the first ``replication.rebuilt`` is due.

For comparison it also times a full replay of the whole stream without the snapshot.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
import time
from pathlib import Path

import nats
from nats.js import api
from pydantic import BaseModel

from benchmarks.output import Figures, add_json_option
from contracts import REGISTRY
from contracts.events.leadership import LeaderElectedV1
from contracts.events.scheduling import (
    CheckpointAdvancedV1,
    MemberHeartbeatV3,
    RebuiltV1,
    SetChangedV1,
    TableStatusV1,
    TaskResultV1,
)
from contracts.events.snapshots import SnapshotTakenV1
from libs.control.convert import span_ref
from libs.control.replication_state import ReplicationState, replication_fold
from libs.eventstore import DomainLog, EventStore
from libs.localservers.nats_server import NatsServer
from libs.scheduling import Span
from libs.streams import domain_events_subject, domain_snapshot_subject
from services.replication_manager.core import ReplicationCore

DOMAIN = "replication"
PRODUCER = "replication-manager/bench"


def set_changed(span: Span, state: str, primary: str | None, secondary: str | None, ts: int) -> SetChangedV1:
    """A ``replication.set_changed`` as the replication-manager records it."""
    members = {}
    if primary:
        members[primary] = "primary"
    if secondary:
        members[secondary] = "secondary"
    return SetChangedV1(span=span_ref(span), state=state, primary=primary, secondary=secondary,
                        members=members, checkpoint_ts=ts, resolved_ts=ts)


class Writer:
    """Publishes events and snapshots as a leader would, keeping the folded state alongside."""

    def __init__(self, js: nats.js.JetStreamContext, snapshot_every: int, max_payload: int) -> None:
        self.js = js
        self.snapshot_every = snapshot_every
        self.state = ReplicationState()
        self.seq = 0
        self.events = 0
        self.snapshots = 0
        self.snapshots_too_large = 0
        self.snapshot_bytes = 0
        self.max_payload = max_payload
        self.epoch = 1
        self._since = 0
        self.events_subject = domain_events_subject(DOMAIN)
        self.snapshot_subject = domain_snapshot_subject(DOMAIN)

    async def event(self, ev: BaseModel) -> None:
        payload = REGISTRY.encode(ev, producer=PRODUCER, epoch=self.epoch)
        await self.js.publish_async(self.events_subject, payload)
        self.seq += 1
        self.events += 1
        self.state.apply(ev)
        self._since += 1
        if self._since >= self.snapshot_every:
            await self.snapshot()

    async def snapshot(self) -> None:
        body = SnapshotTakenV1(domain=DOMAIN, up_to_seq=self.seq, state=self.state.dump())
        payload = REGISTRY.encode(body, producer=PRODUCER, epoch=self.epoch)
        self.snapshot_bytes = len(payload)
        self._since = 0
        if len(payload) > self.max_payload:
            # As the service's SnapshotPolicy: a snapshot is one message, and one past the
            # server's max_payload is not written (the next leader replays further back).
            self.snapshots_too_large += 1
            return
        await self.js.publish_async(self.snapshot_subject, payload, headers={api.Header.ROLLUP.value: "sub"})
        self.seq += 1
        self.snapshots += 1


async def generate(js: nats.js.JetStreamContext, args: argparse.Namespace,
                   max_payload: int) -> tuple[Writer, dict[Span, str]]:
    rng = random.Random(args.seed)
    members = [f"w{i:02d}" for i in range(args.members)]
    spans = [Span(f"cf{i % args.changefeeds}", f"src{i % 4}", f"db{i % 16}", f"t{i}")
             for i in range(args.spans)]
    placement = {s: members[i % len(members)] for i, s in enumerate(spans)}
    w = Writer(js, args.snapshot_every, max_payload)
    ts = 1 << 40
    await w.event(LeaderElectedV1(service="replication-manager", candidate="r1", epoch=w.epoch))
    for s in spans:
        await w.event(set_changed(s, "prepare", None, placement[s], ts))
        await w.event(set_changed(s, "replicating", placement[s], None, ts))
    await w.event(RebuiltV1(members={m: "inc" for m in members}, sets=len(spans), waited_s=0.0))
    cfs = sorted({s.changefeed for s in spans})
    started = time.perf_counter()
    next_report = 100_000
    while w.events < args.events:
        roll = rng.random()
        ts += rng.randint(1, 1 << 18)
        if roll < 0.40:
            await w.event(CheckpointAdvancedV1(changefeed=rng.choice(cfs), checkpoint_ts=ts, resolved_ts=ts))
        elif roll < 0.95:
            s = rng.choice(spans)
            old = placement[s]
            new = rng.choice([m for m in members if m != old])
            await w.event(set_changed(s, "prepare", old, new, ts))
            await w.event(set_changed(s, "commit", old, new, ts))
            await w.event(set_changed(s, "replicating", new, None, ts))
            placement[s] = new
        elif roll < 0.9995:
            s = rng.choice(spans)
            await w.event(TaskResultV1(task_id=f"{w.events}", span=span_ref(s), accepted=True))
        else:
            w.epoch += 1
            await w.event(LeaderElectedV1(service="replication-manager", candidate="r1", epoch=w.epoch))
            await w.event(RebuiltV1(members={m: "inc" for m in members}, sets=len(spans), waited_s=0.5))
        if w.events >= next_report:
            next_report += 100_000
            rate = w.events / max(time.perf_counter() - started, 1e-9)
            print(f"  ... {w.events:,} events written ({rate:,.0f}/s)", flush=True)
    # The worst case for the next leader: the longest tail a snapshot policy leaves behind.
    while w._since < w.snapshot_every - 1:
        ts += 1
        await w.event(CheckpointAdvancedV1(changefeed=rng.choice(cfs), checkpoint_ts=ts, resolved_ts=ts))
    await js.publish_async_completed()
    return w, placement


async def main_async(args: argparse.Namespace) -> None:
    out = Figures("bench_rebuild")
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-rebuild-"))
    server = NatsServer(data_dir=tmp / "nats").start()
    try:
        nc = await nats.connect(server.url, max_reconnect_attempts=0)
        js = nc.jetstream(publish_async_max_pending=8000)
        log: DomainLog[ReplicationState] = DomainLog(js, DOMAIN, producer=PRODUCER)
        await log.ensure()
        print(f"writing {args.events:,} replication events over {args.spans:,} spans and {args.members} "
              f"members, a snapshot every {args.snapshot_every:,} events ...", flush=True)
        t0 = time.perf_counter()
        writer, placement = await generate(js, args, nc.max_payload)
        info = await js.stream_info(log.stream)
        print(f"written in {time.perf_counter() - t0:.1f} s: stream last seq {info.state.last_seq:,}, "
              f"{writer.events:,} events, {writer.snapshots} snapshots, "
              f"{info.state.bytes / 2**20:.0f} MiB on disk")
        if writer.snapshots_too_large:
            print(f"  {writer.snapshots_too_large} snapshots not written: the newest is "
                  f"{writer.snapshot_bytes:,} bytes, over the server's max_payload of {nc.max_payload:,}")
        assert info.state.last_seq == writer.seq, "the server did not store every message"

        # --- the new leader's takeover --------------------------------------------------------
        epoch = writer.epoch + 1
        members = sorted(set(placement.values()))
        heartbeats = []
        for m in members:
            tables = [TableStatusV1(span=span_ref(s), state="replicating", checkpoint_ts=1 << 41,
                                    resolved_ts=1 << 41) for s, owner in placement.items() if owner == m]
            heartbeats.append(MemberHeartbeatV3(member_id=m, incarnation="inc", epoch=epoch, seq=1,
                                                tables=tables))
        leader: DomainLog[ReplicationState] = DomainLog(
            js, DOMAIN, producer=PRODUCER, fold=replication_fold, initial=ReplicationState(),
            restore=ReplicationState.restore, dump=ReplicationState.dump)
        t_start = time.perf_counter()
        await leader.open("replication-manager", "bench", epoch)
        t_open = time.perf_counter()
        state = leader.state
        assert state is not None and leader.loaded is not None
        core = ReplicationCore(epoch, alive={m: "inc" for m in members}, known_spans=state.known_spans(),
                               recorded=state.sets, checkpoints=state.checkpoints,
                               wanted={cf: [s for s in placement if s.changefeed == cf]
                                       for cf in {s.changefeed for s in placement}})
        t_core = time.perf_counter()
        for hb in heartbeats:
            core.on_heartbeat(hb, time.monotonic())
        t_ready = time.perf_counter()
        assert core.ready and len(core.manager.sets) == args.spans
        assert all(s.primary == placement[span] for span, s in state.sets.items())
        total = t_ready - t_start
        print()
        print(f"rebuild from {writer.events:,} events with snapshots: {total:.2f} s   (target < 10 s)")
        print(f"  snapshot + tail replay + leader.elected: {t_open - t_start:.2f} s "
              f"({leader.loaded.events_replayed:,} events replayed after the snapshot at seq "
              f"{leader.loaded.snapshot_seq or 0:,})")
        print(f"  core from the replayed state:            {t_core - t_open:.2f} s")
        print(f"  {len(members)} members' reports -> sets rebuilt:  {t_ready - t_core:.2f} s "
              f"({len(core.manager.sets):,} sets)")
        full_replay: str | None = None
        if not args.skip_full_replay:
            store = EventStore(js, log.stream, PRODUCER)
            t0 = time.perf_counter()
            full = ReplicationState()
            n = 0
            async for stored in store.replay(domain_events_subject(DOMAIN), 1):
                full = replication_fold(full, stored)
                n += 1
            took = time.perf_counter() - t0
            assert full.sets == state.sets
            print(f"compared with a full replay without the snapshot: {took:.1f} s ({n:,} events, "
                  f"{n / took:,.0f} events/s)")
            full_replay = f"full replay of the same {n:,} events without snapshots {took:.1f} s"
        out.add(f"new replication-manager leader rebuilds from {writer.events:,} control events "
                f"({args.spans:,} spans, {len(members)} members; snapshot every {args.snapshot_every:,}, "
                f"{leader.loaded.events_replayed:,}-event tail"
                + (f"; {writer.snapshots_too_large} snapshots of {writer.snapshot_bytes / 2**20:.1f} MiB "
                   f"over max_payload not written" if writer.snapshots_too_large else "") + ")", total, "s",
                baseline=full_replay, target="< 10 s", met=total < 10)
        out.write(args.json)
        await nc.close()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--spans", type=int, default=10_000)
    parser.add_argument("--members", type=int, default=10)
    parser.add_argument("--changefeeds", type=int, default=10)
    parser.add_argument("--snapshot-every", type=int, default=5000,
                        help="as SLUICE_CONTROL_SNAPSHOT_EVERY (its default)")
    parser.add_argument("--skip-full-replay", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    add_json_option(parser)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
