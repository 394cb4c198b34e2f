"""The whole system on a 3-node NATS cluster that loses a node, then another.

Three nats-servers routed into one JetStream cluster (``libs.localservers.NatsCluster``: routes
that log in as their own user, every Sluice stream and bucket R3, every service as its own role
with the list of the three URLs), a MariaDB source and its capture, a MariaDB downstream, 2
replicas of member, scheduler, replication-manager and ddl-lock, 2 sink-workers. The source takes
inserts, updates and deletes on four tables while:

1. the node that leads the rows stream is killed with SIGKILL; replication goes on on the other
   two (the changefeed checkpoint passes the moment of the kill), then the node starts again and
   catches up;
2. the node that leads the rows stream now is stopped and started again (a rolling restart);
   replication goes on while it is down.

After the load stops: every downstream table equals the merged upstream, no changefeed
checkpoint and no span's start went backwards, no span had two writers at once, no set is in
error, no service process died, and there is no dead letter at all."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from libs.localservers.common import find_binary, free_port, wait_until
from libs.localservers.nats_server import NatsCluster, NatsServer
from libs.localservers.system import LocalSystem
from libs.nats_auth import ROUTE_USER
from libs.streams import ROWS_STREAM
from libs.ts import ts_seconds
from services.sink_worker.validation.verify import ShardRef, Verification, verify_target
from tests.helpers.chaos import ChaosWorkload, dead_letters, span_starts_going_back
from tests.helpers.control_plane import (
    Recorder,
    diagnostics,
    double_writes,
    eventually,
    health,
    read_writer_log,
)
from tests.helpers.worker_env import MEMBER_WORKER_ENV, SINK_TEST_PACING, SPARK_TEST_JAVA_OPTIONS

pytestmark = pytest.mark.integration

DB = "ncl"
CF = "ncl"
TABLES = ["t0", "t1", "t2", "t3"]
SOURCES = 1
SPANS = SOURCES * len(TABLES)
NODES = 3
TXNS_PER_SECOND = 20.0  # two tables a transaction


async def _rows_leader(js: JetStreamContext, cluster: NatsCluster) -> NatsServer:
    info = await js.stream_info(ROWS_STREAM)
    assert info.cluster is not None and info.cluster.leader, f"{ROWS_STREAM} has no leader: {info.cluster}"
    return next(n for n in cluster.nodes if n.server_name == info.cluster.leader)


@pytest.mark.timeout(420)
async def test_cluster_loses_a_node_then_restarts_another_and_every_table_stays_equal(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    began = time.monotonic()
    base: Path = tmp_path_factory.mktemp("nats-cluster")
    writer_log = base / "writers.jsonl"
    system = LocalSystem(
        base_dir=base, sources=SOURCES, downstream="mariadb", control_replicas=2, workers=2,
        nats_nodes=NODES, with_api=False, standalone_workers=False, initial_load="binlog-only",
        control_env={"SLUICE_SCHEDULER_BALANCE_INTERVAL_S": "2", "SLUICE_REPLICATION_TICK_S": "1"},
        worker_env={**MEMBER_WORKER_ENV, "SLUICE_SPARK_DRIVER_JAVA_OPTIONS": SPARK_TEST_JAVA_OPTIONS,
                    **SINK_TEST_PACING, "SLUICE_SINK_WRITER_LOG": str(writer_log)},
    )
    recorder = Recorder()
    workloads: list[ChaosWorkload] = []
    log: list[str] = []

    def note(what: str) -> None:
        line = f"[t={time.monotonic() - began:5.1f}s advances={len(recorder.advances)}] {what}"
        log.append(line)
        print(line, flush=True)

    async def wait(check: Callable[[], Any], within: float, what: str) -> Any:
        return await eventually(check, within, what, diagnostics=lambda: diagnostics(system, recorder))

    def checkpoint_ms() -> int:
        mine = [a for a in recorder.advances if a.changefeed == CF]
        return int(ts_seconds(max(a.checkpoint_ts for a in mine)) * 1000) if mine else 0

    async def replicating_past(moment_ms: int, within: float, what: str) -> None:
        # The changefeed checkpoint covers what the sources committed after ``moment_ms``:
        # every span applied rows committed after it.
        await wait(lambda: checkpoint_ms() > moment_ms, within, what)

    try:
        await asyncio.to_thread(system.start_infra)
        cluster = system.nats_cluster
        assert cluster is not None and len(cluster.nodes) == NODES
        await recorder.start(system.nats_urls)
        for i, db in enumerate(system.source_dbs):
            workloads.append(ChaosWorkload(db, DB, TABLES, seed=33 + i, first_id=(i + 1) * 10**9))
            workloads[-1].create()
        system.start_services()
        await asyncio.to_thread(system.wait_healthy, 120)

        async def capture_reading() -> bool:
            states = [(await health(p) or {}).get("state") for n, p in system.processes.items()
                      if n.startswith("capture")]
            return states == ["reading"] * SOURCES

        await wait(capture_reading, 60, "capture reading")
        await system.create_changefeed(system.changefeed_spec(CF, include=[f"{DB}.*"]))
        for w in workloads:
            for _ in range(3):
                w.transaction()
            w.start(per_second=TXNS_PER_SECOND)
        created_at = int(time.time() * 1000)
        await wait(lambda: recorder.all_replicating(SPANS) and checkpoint_ms() > created_at, 150,
                   f"{SPANS} spans replicating and the checkpoint past the changefeed's creation")
        note("replicating on the cluster")

        assert recorder.nc is not None
        js = recorder.nc.jetstream()
        # Every stream Sluice made (domain logs, rows, dead letters, KV buckets) has 3 replicas.
        streams = [s async for s in _stream_infos(js)]
        single = [s.config.name for s in streams if s.config.num_replicas != NODES]
        assert streams and not single, f"streams without {NODES} replicas: {single}"

        # 1. SIGKILL the node leading the rows stream; the other two carry on.
        victim = await _rows_leader(js, cluster)
        killed_at = int(time.time() * 1000)
        victim.kill()
        note(f"SIGKILL {victim.server_name} (leader of {ROWS_STREAM})")
        await replicating_past(killed_at, 90, f"replication past the SIGKILL of {victim.server_name}")
        new_leader = await _rows_leader(js, cluster)
        assert new_leader is not victim
        note(f"replicating without {victim.server_name}; {ROWS_STREAM} led by {new_leader.server_name}")
        await asyncio.to_thread(victim.start)
        await asyncio.to_thread(cluster.wait_healthy, 60)
        note(f"{victim.server_name} back and current")

        # 2. Restart (stop, start) the node leading the rows stream now.
        second = await _rows_leader(js, cluster)
        stopped_at = int(time.time() * 1000)
        await asyncio.to_thread(second.stop)
        note(f"stopped {second.server_name} (leader of {ROWS_STREAM})")
        await replicating_past(stopped_at, 90, f"replication past the stop of {second.server_name}")
        await asyncio.to_thread(second.start)
        await asyncio.to_thread(cluster.wait_healthy, 60)
        note(f"{second.server_name} back and current")
        restarted_at = int(time.time() * 1000)
        await replicating_past(restarted_at, 60, "replication with every node back")

        down = [n for n, p in system.processes.items() if not p.alive()]
        assert not down, f"service processes died: {down}"
        for w in workloads:
            w.stop()
        upstream_txns = sum(w.txns for w in workloads)
        caught_up_from = time.monotonic()
        results: list[Verification] = []
        last_error: list[str] = []

        def equal() -> bool:
            nonlocal results
            try:
                results = [verify_target([ShardRef(db.url, DB, t) for db in system.source_dbs],
                                         system.sink_url, DB, t) for t in TABLES]
            except Exception as exc:  # a target the sink has not created yet
                last_error[:] = [repr(exc)]
                return False
            last_error.clear()
            return all(v.ok for v in results)

        try:
            await wait(lambda: asyncio.to_thread(equal), 120,
                       "every downstream table to equal the merged upstream")
        except AssertionError as exc:
            # What differs (or why it could not be compared), so a failure says whether rows are
            # missing, extra or not comparable.
            differ = [f"{v.target}: {v.diff}" for v in results if not v.ok]
            raise AssertionError(f"{exc}\nlast comparison error: {last_error}\ndiffering: {differ}\n"
                                 f"checkpoint {checkpoint_ms()} ms") from None
        caught_up = time.monotonic() - caught_up_from
        for v in results:
            assert v.ok, f"{v.target}: {v.diff}"

        writes = read_writer_log(writer_log)
        overlaps = double_writes(writes)
        assert not overlaps, f"two writers at once: {overlaps}"
        regressions = span_starts_going_back(writes)
        assert not regressions, f"span checkpoints went backwards: {regressions}"
        advances = sorted((a for a in recorder.advances if a.changefeed == CF), key=lambda a: a.seq)
        for a, b in itertools.pairwise(advances):
            assert b.checkpoint_ts >= a.checkpoint_ts and b.resolved_ts >= a.resolved_ts, \
                f"checkpoint went backwards: {a} then {b}"
        assert not [s for s in recorder.sets.values() if s.error], "sets in error"
        letters = [(m.seq, m.subject, dict(m.headers or {})) for m in await dead_letters(js)]
        assert not letters, f"dead letters: {letters}"
        during = [a.at for a in advances if a.at >= killed_at / 1000]
        stall = max((b - a for a, b in itertools.pairwise(during)), default=0.0)
        print(f"nats cluster: {upstream_txns} transactions, caught up {caught_up:.0f}s after the load "
              f"stopped; {len(advances)} checkpoint advances, longest stall from the kill on {stall:.1f}s; "
              f"{sum(v.diff.upstream_count for v in results)} rows equal; {len(writes)} writer-log "
              f"entries; {time.monotonic() - began:.0f}s in all; load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    finally:
        for w in workloads:
            w.stop()
        await recorder.stop()
        for name, proc in system.processes.items():
            if name.startswith("sink-worker"):
                proc.kill()  # no drain at teardown: the control plane stops too
        await asyncio.to_thread(system.stop)


async def _stream_infos(js: JetStreamContext) -> Any:
    offset = 0
    while True:
        page = await js.streams_info(offset=offset)
        if not page:
            return
        for info in page:
            yield info
        offset += len(page)


def _routes(node: NatsServer) -> set[str]:
    """Names of the servers ``node`` has a route to (its monitoring port's ``/routez``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/routez", timeout=2) as resp:
        return {r.get("remote_name", "") for r in json.loads(resp.read()).get("routes") or []}


def test_a_route_without_the_route_password_is_refused(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "cluster").start()
    intruder: subprocess.Popen[bytes] | None = None
    try:
        first = cluster.nodes[0]
        names = {n.server_name for n in cluster.nodes}
        wait_until(lambda: _routes(first) == names - {first.server_name}, 30, "the cluster's own routes")
        # A server that knows the addresses but not the password: the route user with a wrong
        # one, and no user at all.
        config = tmp_path / "intruder.conf"
        config.write_text(json.dumps({
            "host": "127.0.0.1", "port": free_port(), "server_name": "intruder",
            "cluster": {"name": cluster.name, "host": "127.0.0.1", "port": free_port(), "routes": [
                f"nats://{ROUTE_USER}:wrong@127.0.0.1:{first.cluster_port}",
                f"nats://127.0.0.1:{cluster.nodes[1].cluster_port}"]}}))
        with open(tmp_path / "intruder.log", "wb") as out:
            intruder = subprocess.Popen([find_binary("nats-server"), "-c", str(config)], stdout=out,
                                        stderr=subprocess.STDOUT)
        logs = [n.log_path for n in cluster.nodes[:2]]
        wait_until(lambda: all(b"Router connection closed: Authentication Failure" in p.read_bytes()
                               for p in logs), 30,
                   "both nodes refusing the intruder's routes")
        assert intruder.poll() is None
        for node in cluster.nodes:
            assert "intruder" not in _routes(node)
    finally:
        if intruder is not None:
            intruder.kill()
            intruder.wait()
        cluster.stop()
