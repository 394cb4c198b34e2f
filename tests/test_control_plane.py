"""The control plane with real processes: nats-server, MariaDB with capture, 2 replicas each of
member, scheduler and replication-manager, 3 then 4 sink-workers (Spark), SQLite downstream.

One system for the module (starting it costs most of the time); the tests run in file order
and each leaves it healthy for the next. Throughout, a paced workload writes to 8 tables, and
a recorder keeps every checkpoint advance, set change, member event and dispatch. At the end:
downstream equals upstream, no checkpoint ever went backwards, and no two worker processes
wrote one span in overlapping rounds (each worker appends its writes to a writer log)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from contracts import REGISTRY
from contracts.events.members import MemberLeftV1
from contracts.events.scheduling import DispatchRequestV1, DispatchResponseV1, ScheduleRequestV1, SpanRefV1
from libs.localservers.service_process import ServiceProcess
from libs.localservers.system import LocalSystem
from libs.streams import dispatch_subject
from tests.helpers.control_plane import (
    TABLES,
    Recorder,
    Workload,
    diagnostics,
    double_writes,
    eventually,
    health,
    leader_of,
    read_writer_log,
    verify_all,
)
from tests.helpers.worker_env import MEMBER_WORKER_ENV, SINK_TEST_PACING, SPARK_TEST_JAVA_OPTIONS

pytestmark = pytest.mark.integration

DB = "cp"
CF = "cp"
SPANS = len(TABLES)
MEMBER_TTL_S = 3.0  # the default


class Cluster:
    def __init__(self, system: LocalSystem, recorder: Recorder, workload: Workload, writer_log: Path) -> None:
        self.system = system
        self.recorder = recorder
        self.workload = workload
        self.writer_log = writer_log
        self.next_worker = 4

    @property
    def workers(self) -> dict[str, ServiceProcess]:
        return {n: p for n, p in self.system.processes.items() if n.startswith("sink-worker") and p.alive()}

    def diagnostics(self) -> str:
        return diagnostics(self.system, self.recorder)

    async def wait(self, check: Any, within: float, what: str) -> Any:
        return await eventually(check, within, what, diagnostics=self.diagnostics)

    async def worker_tables(self) -> dict[str, dict[str, str]]:
        """member -> {span: agent state} as each live worker reports it."""
        out = {}
        for name, proc in self.workers.items():
            h = await health(proc) or {}
            out[name] = {k: v["state"] for k, v in h.get("agent", {}).get("tables", {}).items()}
        return out

    async def workers_agree(self) -> bool:
        """Every span Replicating on exactly the member the replication-manager recorded."""
        tables = await self.worker_tables()
        placement = self.recorder.placement()
        for span, primary in placement.items():
            writers = [m for m, t in tables.items() if t.get(span) == "replicating"]
            if writers != [primary]:
                return False
        return True

    async def balanced(self, members: int) -> bool:
        if not self.recorder.all_replicating(SPANS):
            return False
        loads = self.recorder.loads()
        return len(loads) == members and max(loads.values()) - min(loads.values()) <= 1

    async def checkpoint_moves(self, within: float = 30, epoch: int | None = None) -> None:
        """A checkpoint advance recorded after now (by ``epoch`` if given)."""
        before = len(self.recorder.advances)

        def moved() -> bool:
            return any(epoch is None or a.epoch == epoch for a in self.recorder.advances[before:])

        await self.wait(moved, within, f"a checkpoint advance{' by epoch ' + str(epoch) if epoch else ''}")

    async def move(self, span_key: str, dest: str) -> None:
        """Ask the scheduler leader to move a span, as an operator would: again while it is
        refused for a passing reason (the scheduler's view trails the replication stream a
        little, so a set the recorder just saw settle may still look mid-move there)."""
        cf, src, db, table = span_key.split("/")
        ref = SpanRefV1(changefeed=cf, source=src, database=db, table=table)
        req = ScheduleRequestV1(kind="move", span=ref, dest=dest, requested_by="test")
        reasons: list[str] = []

        async def accepted() -> bool:
            answer = await self.recorder.request(req)
            reasons.append(answer.reason)
            return answer.accepted

        await eventually(accepted, 20, f"the move of {span_key} to {dest} accepted",
                         interval=0.5, diagnostics=lambda: str(reasons[-3:]))

    async def restart(self, proc: ServiceProcess) -> None:
        name = proc.instance_id
        service, replica = name.rsplit("-", 1)
        new = self.system.start_control(service.replace("-", "_"), int(replica))
        await asyncio.to_thread(new.wait_healthy, 60)


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    base = tmp_path_factory.mktemp("control-plane")
    writer_log = base / "writers.jsonl"
    system = LocalSystem(
        base_dir=base, sources=1, control_replicas=2, workers=3, lease_ttl_s=2.0, with_api=False,
        control_services=("member", "scheduler", "replication_manager"), standalone_workers=False,
        initial_load="binlog-only",  # scheduling of streaming spans (the initial load: test_initial_load)
        # Snapshots every 20 events: every leader change here rebuilds from a snapshot plus a tail.
        control_env={"SLUICE_SCHEDULER_BALANCE_INTERVAL_S": "2", "SLUICE_REPLICATION_TICK_S": "1",
                     "SLUICE_MEMBER_TTL_S": str(MEMBER_TTL_S), "SLUICE_CONTROL_SNAPSHOT_EVERY": "20"},
        worker_env={**MEMBER_WORKER_ENV,
                    "SLUICE_SPARK_DRIVER_JAVA_OPTIONS": SPARK_TEST_JAVA_OPTIONS, **SINK_TEST_PACING,
                    "SLUICE_SINK_WRITER_LOG": str(writer_log), "SLUICE_MEMBER_TTL_S": str(MEMBER_TTL_S)},
    )
    recorder = Recorder()
    workload: Workload | None = None
    try:
        system.start_infra()
        assert system.nats is not None
        await recorder.start(system.nats.url)
        workload = Workload(system.source_dbs[0].connect(), DB)
        workload.create()
        system.start_services()
        await asyncio.to_thread(system.wait_healthy, 90)
        await system.create_changefeed(system.changefeed_spec(CF, include=[f"{DB}.*"]))
        for _ in range(3):
            workload.transaction()  # every table gets a subject in the ROWS stream: a span
        workload.start(per_second=8)
        yield Cluster(system, recorder, workload, writer_log)
    finally:
        if workload is not None:
            workload.stop()
        await recorder.stop()
        for name, proc in system.processes.items():
            if name.startswith("sink-worker"):
                proc.kill()  # no drain at teardown: the control plane stops too
        system.stop()


async def test_spans_spread_evenly(cluster: Cluster) -> None:
    await cluster.wait(lambda: cluster.balanced(3), 150, "8 spans replicating over 3 workers, balanced")
    assert sorted(cluster.recorder.loads().values()) == [2, 3, 3]
    # Each worker's own report agrees with the replication-manager's record (the two are read
    # a moment apart, so allow a moment for a dispatch in flight).
    await cluster.wait(cluster.workers_agree, 20, "the workers' reports to match the placement")
    # The changefeed checkpoint is the minimum over every span, so this waits for each of the
    # three workers' first Spark round: three JVMs starting at once on two cores can take ~30 s.
    await cluster.checkpoint_moves(within=120)


async def test_a_fourth_worker_gets_its_share(cluster: Cluster) -> None:
    proc = cluster.system.start_worker(4)
    await asyncio.to_thread(proc.wait_healthy, 60)
    await cluster.wait(lambda: cluster.balanced(4), 90, "8 spans balanced over 4 workers")
    assert sorted(cluster.recorder.loads().values()) == [2, 2, 2, 2]
    assert not double_writes(read_writer_log(cluster.writer_log))


async def test_operator_move_under_load_hands_over_exactly(cluster: Cluster) -> None:
    placement = cluster.recorder.placement()
    span_key, source = sorted(placement.items())[0]
    assert source is not None
    dest = next(m for m in sorted(cluster.workers) if m != source)
    asked = time.time()
    await cluster.move(span_key, dest)
    await cluster.wait(lambda: cluster.recorder.placement().get(span_key) == dest, 60,
                       f"{span_key} replicating on {dest}")

    def since_asked() -> list[dict[str, Any]]:
        return [e for e in read_writer_log(cluster.writer_log)
                if e["span"] == span_key and e.get("t", e.get("t1", 0)) >= asked]

    await cluster.wait(lambda: any(e["event"] == "wrote" and e["member"] == dest for e in since_asked()),
                       60, f"{dest} writing {span_key}")
    started = [e for e in since_asked() if e["event"] == "started" and e["member"] == dest][-1]
    # No gap and no re-apply: the new primary starts exactly where the last one that ran the
    # span stopped (that is the source, unless it never got to run it before it was moved
    # again: then it stopped with no checkpoint of its own and the one before it counts).
    history = [e for e in read_writer_log(cluster.writer_log) if e["span"] == span_key]
    stops = [e for e in history if e["event"] == "stopped" and e["checkpoint_ts"] is not None
             and e["t"] <= started["t"]]
    assert stops, history
    assert started["checkpoint_ts"] == stops[-1]["checkpoint_ts"], (stops[-1], started)
    assert any(e["event"] == "stopped" and e["member"] == source for e in since_asked())
    # Every earlier owner's last round ended before the new one's first round began.
    others = [e["t1"] for e in history if e["event"] == "wrote" and e["member"] != dest]
    first_new = min(e["t0"] for e in since_asked() if e["event"] == "wrote" and e["member"] == dest)
    assert not others or max(others) <= first_new
    assert not double_writes(read_writer_log(cluster.writer_log))


async def test_kill_9_a_worker_its_spans_run_elsewhere_within_10s(cluster: Cluster) -> None:
    loads = cluster.recorder.loads()
    victim_name = max(sorted(loads), key=lambda m: loads[m])
    victim = cluster.system.processes[victim_name]
    lost = [s for s, p in cluster.recorder.placement().items() if p == victim_name]
    assert lost
    victim.kill()
    killed_at = time.time()

    def moved() -> bool:
        p = cluster.recorder.placement()
        return all(p.get(s) not in (None, victim_name) for s in lost)

    await cluster.wait(moved, 30, f"{lost} replicating elsewhere")
    took = time.time() - killed_at
    print(f"worker kill -9 -> its {len(lost)} spans replicating elsewhere: {took:.2f}s "
          f"(member TTL {MEMBER_TTL_S}s; target 10s)")
    assert took < 10.0, f"took {took:.1f}s"
    await cluster.checkpoint_moves()


async def _kill_leader(cluster: Cluster, service: str) -> tuple[ServiceProcess, ServiceProcess, float]:
    leader = await leader_of(cluster.system, service)
    assert leader is not None, f"no {service} leader"
    old_epoch = (await health(leader) or {})["epoch"]
    leader.kill()
    killed = time.time()
    others = [p for n, p in cluster.system.processes.items() if n.rsplit("-", 1)[0] == service and p.alive()]

    async def took_over() -> ServiceProcess | None:
        for p in others:
            h = await health(p)
            if h and h.get("leader") and h["epoch"] > old_epoch:
                return p
        return None

    new = await cluster.wait(took_over, 20, f"a new {service} leader")
    return leader, new, killed


async def test_kill_9_member_and_scheduler_leaders_under_load(cluster: Cluster) -> None:
    old, _new, _ = await _kill_leader(cluster, "member")
    await cluster.checkpoint_moves()
    await cluster.restart(old)
    # The scheduler dies right after accepting an operator move: the move was recorded before
    # the answer, so it is carried out whether or not the old leader got to issue it.
    span_key, source = sorted(cluster.recorder.placement().items())[1]
    dest = next(m for m in sorted(cluster.workers) if m != source)
    await cluster.move(span_key, dest)
    old, _new, _ = await _kill_leader(cluster, "scheduler")
    await cluster.wait(lambda: cluster.recorder.placement().get(span_key) == dest, 60,
                       f"{span_key} moved to {dest} across the scheduler failover")
    await cluster.checkpoint_moves()
    await cluster.restart(old)
    # The new member leader rebuilt the live members by replay: nobody was declared gone.
    left = [e for _, e in cluster.recorder.member_events if isinstance(e, MemberLeftV1)]
    assert all(e.member_id not in cluster.workers for e in left), left


async def test_kill_9_replication_manager_leader_mid_move(cluster: Cluster) -> None:
    placement = cluster.recorder.placement()
    span_key, source = sorted(placement.items())[-1]
    dest = next(m for m in sorted(cluster.workers) if m != source)
    history_at = len(cluster.recorder.set_history)
    await cluster.move(span_key, dest)

    def moving() -> bool:
        return any(ev.state in ("prepare", "commit") and f"{ev.span.changefeed}/{ev.span.source}/"
                   f"{ev.span.database}/{ev.span.table}" == span_key
                   for _, _, ev in cluster.recorder.set_history[history_at:])

    await cluster.wait(moving, 30, f"the move of {span_key} in flight")
    old, new, killed = await _kill_leader(cluster, "replication-manager")
    new_epoch = (await health(new) or {})["epoch"]
    await cluster.wait(lambda: any(e == new_epoch for _, e, _ in cluster.recorder.rebuilt), 30,
                       "the new replication-manager leader to rebuild")
    rebuilt_at = next(t for t, e, _ in cluster.recorder.rebuilt if e == new_epoch)
    await cluster.checkpoint_moves(epoch=new_epoch)
    first = next(a for a in cluster.recorder.advances if a.epoch == new_epoch)
    print(f"replication-manager kill -9 mid-move -> rebuilt after {rebuilt_at - killed:.2f}s, first "
          f"checkpoint advance by the new leader after {first.at - killed:.2f}s (lease TTL 2s)")
    # The interrupted move ends one way or the other, with a single primary.
    await cluster.wait(lambda: cluster.recorder.all_replicating(SPANS), 60, "every span replicating")
    await cluster.restart(old)


async def test_a_stale_leader_resumed_after_sigstop_gets_no_dispatch_accepted(cluster: Cluster) -> None:
    rec = cluster.recorder
    leader = await leader_of(cluster.system, "replication-manager")
    assert leader is not None
    old_epoch = (await health(leader) or {})["epoch"]
    old_dispatch = next((d for d in reversed(rec.dispatches) if d.epoch == old_epoch), None)
    leader.pause()
    try:
        paused_at = time.time()
        await cluster.wait(lambda: any(e > old_epoch for _, e, _ in rec.rebuilt), 30,
                           "another replication-manager to lead and rebuild")
    finally:
        leader.resume()
    resumed_at = time.time()
    await cluster.wait(lambda: _not_leader(leader), 20, "the resumed leader to step down")
    await cluster.checkpoint_moves()
    # Nothing the old epoch sent after the new leader took over was accepted.
    late = [d for d in rec.dispatches if d.epoch == old_epoch and d.at > paused_at]
    assert all(d.answer is None or d.answer.verdict == "stale-epoch" for d in late), late
    # And the member's fence itself: a dispatch of the old epoch, sent now, is refused.
    if old_dispatch is None:
        member = sorted(cluster.workers)[0]
        span = next(iter(rec.sets.values())).span
        action = "remove"
    else:
        member, action = old_dispatch.member, old_dispatch.action
        cf, src, db, table = old_dispatch.span.split("/")
        span = SpanRefV1(changefeed=cf, source=src, database=db, table=table)
    health_member = await health(cluster.system.processes[member]) or {}
    incarnation = health_member["agent"]["incarnation"]
    assert rec.nc is not None
    req = DispatchRequestV1(member_id=member, incarnation=incarnation, span=span, action=action,
                            checkpoint_ts=0, epoch=old_epoch)
    msg = await rec.nc.request(dispatch_subject(member), REGISTRY.encode(req, producer="test/stale"),
                               timeout=5)
    answer = REGISTRY.decode(msg.data).event
    assert isinstance(answer, DispatchResponseV1)
    assert answer.verdict == "stale-epoch", answer
    assert answer.epoch > old_epoch
    print(f"stale leader paused {resumed_at - paused_at:.1f}s; dispatch of epoch {old_epoch} refused "
          f"(member at epoch {answer.epoch})")


async def _not_leader(proc: ServiceProcess) -> bool:
    h = await health(proc)
    return bool(h) and not h.get("leader")


async def test_sigterm_drains_a_worker_before_it_exits(cluster: Cluster) -> None:
    loads = cluster.recorder.loads()
    name = max(sorted(loads), key=lambda m: loads[m])
    held = [s for s, p in cluster.recorder.placement().items() if p == name]
    proc = cluster.system.processes[name]
    started = time.time()
    code = await asyncio.to_thread(proc.terminate, 20)
    took = time.time() - started
    assert code == 0, proc.tail_log(30)
    log = [e for e in read_writer_log(cluster.writer_log) if e["member"] == name]
    moved = [e["span"] for e in log if e["event"] == "stopped" and e["t"] >= started]
    print(f"SIGTERM drain of {name}: exited after {took:.1f}s, {len(held)} spans handed over")
    assert sorted(set(moved)) == sorted(held)
    await cluster.wait(lambda: any(isinstance(e, MemberLeftV1) and e.member_id == name and t >= started
                                   for t, e in cluster.recorder.member_events),
                       10, f"{name} recorded as left")
    left = [e for t, e in cluster.recorder.member_events if isinstance(e, MemberLeftV1)
            and e.member_id == name and t >= started]
    assert left[0].reason == "shutdown"
    await cluster.wait(lambda: cluster.recorder.all_replicating(SPANS), 60, "every span replicating")


async def test_downstream_equals_upstream_and_checkpoints_never_went_back(cluster: Cluster) -> None:
    await cluster.checkpoint_moves()
    cluster.workload.stop()
    source = cluster.system.source_dbs[0]

    def equal() -> bool:
        try:
            return all(v.ok for v in verify_all(source.url, DB, cluster.system.sink_url))
        except Exception:
            return False

    await cluster.wait(lambda: asyncio.to_thread(equal), 120, "downstream to equal upstream")
    advances = sorted(cluster.recorder.advances, key=lambda a: a.seq)
    epochs = {a.epoch for a in advances}
    assert len(epochs) >= 3, f"advances by {epochs}: expected several replication-manager leaders"
    for a, b in itertools.pairwise(advances):
        assert b.checkpoint_ts >= a.checkpoint_ts and b.resolved_ts >= a.resolved_ts, (a, b)
    assert not double_writes(read_writer_log(cluster.writer_log))
    assert not any(ev.error for ev in cluster.recorder.sets.values())
    print(f"{cluster.workload.txns} transactions, {len(advances)} checkpoint advances by epochs "
          f"{sorted(epochs)}, {len(cluster.recorder.dispatches)} dispatches")
