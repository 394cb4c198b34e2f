"""Chaos: the whole system as real processes under continuous load and a seeded fault schedule.

nats-server, two MariaDB sources with a capture each, a MariaDB downstream, 2 replicas of
member, scheduler, replication-manager and ddl-lock, 3 sink-workers. Both sources take inserts,
updates and deletes on four tables each (merged downstream: the sources' ids are disjoint)
while the schedule (``tests/helpers/chaos.py``) kills and restarts a sink-worker, a capture, a
leader, two processes at once, stops a leader past its lease and lets it go on (stale leader),
restarts the nats-server, a source and the downstream, and injects garbage. After the load
stops and replication catches up: every downstream table equals the merged upstream, no span
had two writers at once, no checkpoint went backwards, no deposed leader got an event into its
domain or a dispatch accepted, and the only dead letters are the injected garbage.

The seed is printed at the start and is in every failure message; ``SLUICE_CHAOS_SEED=<seed>``
repeats a run's schedule (order, victims, timings)."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from libs.localservers.system import LocalSystem
from services.sink_worker.validation.verify import ShardRef, Verification, verify_target
from tests.helpers.chaos import (
    FAULT_KINDS,
    GARBAGE_HEADER,
    LEADER_DOMAINS,
    ChaosWorkload,
    FaultSchedule,
    Garbage,
    chaos_seed,
    dead_letters,
    domain_events,
    epochs_going_back,
    rows_subjects,
    span_starts_going_back,
)
from tests.helpers.control_plane import (
    Recorder,
    diagnostics,
    double_writes,
    eventually,
    health,
    leader_of,
    read_writer_log,
)
from tests.helpers.worker_env import MEMBER_WORKER_ENV, SINK_TEST_PACING, SPARK_TEST_JAVA_OPTIONS

pytestmark = pytest.mark.integration

DB = "chaos"
CF = "chaos"
TABLES = ["t0", "t1", "t2", "t3"]
SOURCES = 2
SPANS = SOURCES * len(TABLES)
LEASE_TTL_S = 2.0
MEMBER_TTL_S = 3.0  # the default
TXNS_PER_SECOND = 5.0  # per source


def _verify(system: LocalSystem) -> list[Verification]:
    return [verify_target([ShardRef(db.url, DB, t) for db in system.source_dbs], system.sink_url, DB, t)
            for t in TABLES]


@pytest.mark.timeout(600)
async def test_chaos_schedule_under_load_keeps_every_invariant(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    seed = chaos_seed()
    tag = f"chaos seed {seed} (repeat: SLUICE_CHAOS_SEED={seed})"
    print(f"\n{tag}", flush=True)
    began = time.monotonic()
    base: Path = tmp_path_factory.mktemp("chaos")
    writer_log = base / "writers.jsonl"
    system = LocalSystem(
        base_dir=base, sources=SOURCES, downstream="mariadb", control_replicas=2, workers=3,
        lease_ttl_s=LEASE_TTL_S, with_api=False, standalone_workers=False, initial_load="binlog-only",
        control_env={"SLUICE_SCHEDULER_BALANCE_INTERVAL_S": "2", "SLUICE_REPLICATION_TICK_S": "1",
                     "SLUICE_MEMBER_TTL_S": str(MEMBER_TTL_S), "SLUICE_CONTROL_SNAPSHOT_EVERY": "20"},
        worker_env={**MEMBER_WORKER_ENV,
                    "SLUICE_SPARK_DRIVER_JAVA_OPTIONS": SPARK_TEST_JAVA_OPTIONS, **SINK_TEST_PACING,
                    "SLUICE_SINK_WRITER_LOG": str(writer_log), "SLUICE_MEMBER_TTL_S": str(MEMBER_TTL_S)},
    )
    recorder = Recorder()
    workloads: list[ChaosWorkload] = []

    async def wait(check: Callable[[], Any], within: float, what: str) -> Any:
        return await eventually(check, within, f"{what} [{tag}]",
                                diagnostics=lambda: diagnostics(system, recorder))

    try:
        system.start_infra()
        assert system.nats is not None
        await recorder.start(system.nats.url)
        for i, db in enumerate(system.source_dbs):
            # Disjoint ids: both sources' tables merge into one downstream table each.
            workloads.append(ChaosWorkload(db, DB, TABLES, seed=seed + i, first_id=(i + 1) * 10**9))
            workloads[-1].create()
        system.start_services()
        await asyncio.to_thread(system.wait_healthy, 120)

        async def captures_reading() -> bool:
            states = [(await health(p) or {}).get("state") for n, p in system.processes.items()
                      if n.startswith("capture")]
            return states == ["reading"] * SOURCES

        # Capture starts at the binlog's current end: the first rows go in once it reads.
        await wait(captures_reading, 60, "both captures reading")
        await system.create_changefeed(system.changefeed_spec(CF, include=[f"{DB}.*"]))
        for w in workloads:
            for _ in range(3):
                w.transaction()  # every table of every source gets a subject: 8 spans
            w.start(per_second=TXNS_PER_SECOND)
        first_advance = len(recorder.advances)
        await wait(lambda: recorder.all_replicating(SPANS) and len(recorder.advances) > first_advance,
                   180, f"{SPANS} spans replicating and a changefeed checkpoint advance")
        print(f"system up and replicating after {time.monotonic() - began:.0f}s", flush=True)

        assert recorder.nc is not None
        garbage = Garbage(recorder.nc, rows_subjects(system, DB, TABLES))
        schedule = FaultSchedule(system, recorder, garbage, seed, LEASE_TTL_S)
        faults_began, faults_at = time.monotonic(), time.time()
        await schedule.run()
        faults_took = time.monotonic() - faults_began

        # Everything the schedule stopped is back; the load stops; replication catches up.
        down = [n for n, p in system.processes.items() if not p.alive()]
        assert not down, f"processes down after the schedule: {down} [{tag}]"
        for w in workloads:
            w.stop()
        upstream_txns = sum(w.txns for w in workloads)
        caught_up_from = time.monotonic()
        results: list[Verification] = []

        def equal() -> bool:
            nonlocal results
            try:
                results = _verify(system)
            except Exception:  # a target the sink has not created yet, a restarting database
                return False
            return all(v.ok for v in results)

        await wait(lambda: asyncio.to_thread(equal), 240,
                   "every downstream table to equal the merged upstream")
        caught_up = time.monotonic() - caught_up_from
        for v in results:
            assert v.ok, f"{v.target}: {v.diff} [{tag}]"

        # Nothing stays broken: every control service has a leader again, both captures read,
        # and the changefeed checkpoint moves on after the load stopped.
        async def leaders() -> bool:
            return all([await leader_of(system, s) for s in LEADER_DOMAINS])

        await wait(leaders, 60, "a leader of every control service")
        await wait(captures_reading, 60, "both captures reading")
        settled = len(recorder.advances)
        await wait(lambda: len(recorder.advances) > settled, 60, "a checkpoint advance after the load")

        js = recorder.nc.jetstream()
        await garbage.wait_parked(js, 60, f"every injected garbage message dead-lettered [{tag}]")

        # No span ever had two writers at once.
        writes = read_writer_log(writer_log)
        overlaps = double_writes(writes)
        assert not overlaps, f"two writers at once: {overlaps} [{tag}]"
        # No checkpoint went backwards: no span started below an earlier start or hand-over,
        # and the changefeed checkpoints recorded in stream order never decrease.
        regressions = span_starts_going_back(writes)
        assert not regressions, f"span checkpoints went backwards: {regressions} [{tag}]"
        advances = sorted((a for a in recorder.advances if a.changefeed == CF), key=lambda a: a.seq)
        for a, b in itertools.pairwise(advances):
            assert b.checkpoint_ts >= a.checkpoint_ts and b.resolved_ts >= a.resolved_ts, \
                f"checkpoint went backwards: {a} then {b} [{tag}]"
        assert not [s for s in recorder.sets.values() if s.error], f"sets in error [{tag}]"
        # Fencing: no domain holds an event of a deposed leader after its successor's, and no
        # dispatch older than a rebuilt replication-manager epoch was accepted.
        for service, domain in LEADER_DOMAINS.items():
            events = await domain_events(js, domain)
            assert events, f"{service}: nothing in its domain stream [{tag}]"
            back = epochs_going_back(events)
            assert not back, f"{service}: a deposed leader appended: {back} [{tag}]"
        stale_accepted = [d for d in recorder.dispatches
                          if d.answer is not None and d.answer.verdict == "accepted"
                          and any(t < d.at and e > d.epoch for t, e, _ in recorder.rebuilt)]
        assert not stale_accepted, f"dispatches of a deposed epoch accepted: {stale_accepted} [{tag}]"
        for sp in schedule.stale:
            late = [d for d in recorder.dispatches if d.epoch == sp.epoch and d.at > sp.resumed_at
                    and d.answer is not None and d.answer.verdict == "accepted"]
            assert not late, f"stale {sp.service} leader {sp.name}: {late} [{tag}]"
        # The only dead letters are the injected garbage.
        ours = {i.gid for i in garbage.injected}
        unexpected = [(m.seq, m.subject, dict(m.headers or {})) for m in await dead_letters(js)
                      if (m.headers or {}).get(GARBAGE_HEADER) not in ours]
        assert not unexpected, f"dead letters the test did not inject: {unexpected} [{tag}]"

        assert set(schedule.done) == set(FAULT_KINDS), f"faults run: {schedule.done} [{tag}]"
        assert schedule.stale, f"no stale leader [{tag}]"
        epochs = sorted({a.epoch for a in advances})
        during = [a.at for a in advances if a.at >= faults_at]
        stall = max((b - a for a, b in itertools.pairwise(during)), default=0.0)
        print(f"{tag}: {upstream_txns} transactions ({sum(w.failures for w in workloads)} failed with "
              f"their source), {len(schedule.plan)} faults in {faults_took:.0f}s, caught up "
              f"{caught_up:.0f}s after the load stopped; {len(advances)} checkpoint advances by "
              f"replication-manager epochs {epochs}; {len(writes)} writer-log entries; "
              f"{len(garbage.injected)} garbage messages dead-lettered; "
              f"{sum(v.diff.upstream_count for v in results)} rows equal; longest changefeed "
              f"checkpoint stall {stall:.1f}s; {time.monotonic() - began:.0f}s in all; load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    except BaseException:
        print(f"FAILED {tag}", flush=True)
        raise
    finally:
        for w in workloads:
            w.stop()
        await recorder.stop()
        for name, proc in system.processes.items():
            if name.startswith("sink-worker"):
                proc.kill()  # no drain at teardown: the control plane stops too
        await asyncio.to_thread(system.stop)
