"""Syncpoints end to end with real processes: MariaDB -> capture -> a sink-worker under the
control plane -> SQLite, PostgreSQL and MariaDB, one changefeed each (interval 3 s, hold 1.5 s).

Money moves (paced: see PACE_S) between two tables (``bank.acct_a`` -> ``bank.acct_b``) and between
two shards merged into one target (``shop_1.wallet`` + ``shop_2.wallet`` -> ``merged.wallet``),
in the same source transactions. A reader that sums while a syncpoint holds always sees the
totals; one that reads between holds may see a transfer half applied (counted and shown, not
asserted: it depends on timing). Then a sink-worker and the replication-manager leader are
killed with SIGKILL: syncpoints go on, each downstream row is written once per T."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.kv import KeyValue

from contracts.events.changefeeds import ChangefeedSpecV7, RouteRuleV1, SourceRefV1, TableFilterV1
from contracts.events.rows import ColumnV1, TableMetaV1
from contracts.events.syncpoints import SyncpointEndedV1, SyncpointPlannedV1, SyncpointReachedV1
from libs.eventstore import EventStore
from libs.localservers.mariadb import MariaDB
from libs.localservers.system import LocalSystem
from libs.streams import domain_events_subject, domain_stream
from libs.syncpoints import SyncpointRecord, read_record, syncpoint_bucket
from libs.ts import ts_seconds
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.sinks.sql_common import SqlSink
from services.sink_worker.sinks.syncpoint_table import syncpoint_table_ref
from tests.helpers.control_plane import leader_of
from tests.helpers.worker_env import MEMBER_WORKER_ENV, SINK_TEST_PACING, SPARK_TEST_JAVA_OPTIONS

# The first test pays the system's start (four servers, six services, a JVM) besides its holds.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
# A worker busy starting its JVM on a loaded machine is neither taken for dead nor fences itself.
MEMBER_TTL_S = "15"

ACCOUNTS = 20
PACE_S = 0.05
"""Between two transfers (0: full speed). One worker applies the three changefeeds on a two-core
machine shared with other test runs: at full speed (about 150 transfers, 1,800 row changes a
second over the three feeds) it falls behind and no T is reached within its timeout."""
START = 1000
TOTAL = ACCOUNTS * START * 2
INTERVAL_S, HOLD_S = 3.0, 1.5
META = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="bigint"),
                            ColumnV1(name="bal", kind="int", sql_type="bigint")], primary_key=["id"])


def _balances(url: str, schema: str, table: str) -> int:
    try:
        rows = open_sink(url).fetch_rows(TargetTable(schema=schema, name=table, meta=META, key=("id",)))
    except Exception:
        return 0  # the target appears with its first batch
    return sum(int(r["bal"]) for r in rows)


def sums(url: str) -> tuple[int, int]:
    """(acct_a + acct_b, merged wallet), each table read on its own, as a reader would."""
    return (_balances(url, "bank", "acct_a") + _balances(url, "bank", "acct_b"),
            _balances(url, "merged", "wallet"))


def syncpoint_rows(url: str, changefeed: str) -> list[int]:
    sink = open_sink(url)
    assert isinstance(sink, SqlSink)
    sql = f"SELECT syncpoint_ts FROM {syncpoint_table_ref(sink)} WHERE changefeed = {sink.placeholder}"
    try:
        return sorted(sink._run(lambda cur: (cur.execute(sql, (changefeed,)), cur.fetchall())[1],
                                "read syncpoints"), key=lambda r: r[0])  # type: ignore[no-any-return]
    except Exception:
        return []


async def syncpoint_figures(js: Any) -> dict[str, dict[str, float]]:
    """Per changefeed, from the replication stream: how far behind its commit time each released
    T was reached (every span at T, row written) and released (after the hold): what a
    syncpoint adds to the changefeed's lag."""
    store = EventStore(js, domain_stream("replication"), producer="test")
    planned: dict[tuple[str, int], float] = {}
    reached: dict[tuple[str, int], float] = {}
    out: dict[str, dict[str, list[float]]] = {}
    async for stored in store.replay(domain_events_subject("replication")):
        ev = stored.event
        if isinstance(ev, SyncpointPlannedV1):
            planned[(ev.changefeed, ev.ts)] = ev.planned_at
        elif isinstance(ev, SyncpointReachedV1):
            reached[(ev.changefeed, ev.ts)] = ev.hold_until - HOLD_S
        elif isinstance(ev, SyncpointEndedV1):
            figures = out.setdefault(ev.changefeed, {"reached_behind_s": [], "released_behind_s": [],
                                                     "plan_to_reached_s": [], "abandoned": []})
            key = (ev.changefeed, ev.ts)
            if ev.outcome == "abandoned" or key not in reached:
                figures["abandoned"].append(1.0)
                continue
            figures["reached_behind_s"].append(reached[key] - ts_seconds(ev.ts))
            figures["released_behind_s"].append(ev.ended_at - ts_seconds(ev.ts))
            figures["plan_to_reached_s"].append(reached[key] - planned.get(key, reached[key]))
    return {cf: {name: (len(v) if name == "abandoned" else round(sum(v) / len(v), 2) if v else 0.0)
                 for name, v in f.items()} | {"released": len(f["released_behind_s"])}
            for cf, f in out.items()}


class Transfers:
    """Money moved at full speed: each transaction moves between the two tables and between the
    two shards; the totals never change upstream."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.rng = random.Random(7)
        self.txns = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = self.rng
        with self.conn.cursor() as cur:
            while not self._stop.is_set():
                x, y = rng.randint(-50, 50), rng.randint(-50, 50)
                a, b, c, d = (rng.randint(1, ACCOUNTS) for _ in range(4))
                cur.execute("UPDATE bank.acct_a SET bal = bal - %s WHERE id = %s", (x, a))
                cur.execute("UPDATE bank.acct_b SET bal = bal + %s WHERE id = %s", (x, b))
                cur.execute("UPDATE shop_1.wallet SET bal = bal - %s WHERE id = %s", (y, c))
                cur.execute("UPDATE shop_2.wallet SET bal = bal + %s WHERE id = %s", (y, 100 + d))
                self.conn.commit()
                self.txns += 1
                if PACE_S:
                    self._stop.wait(PACE_S)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class Readers:
    kv: KeyValue
    feeds: dict[str, str]
    held: dict[str, list[tuple[int, tuple[int, int]]]] = field(default_factory=dict)
    free_right: dict[str, int] = field(default_factory=dict)
    free_wrong: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for cf in self.feeds:
            self.held[cf], self.free_right[cf], self.free_wrong[cf] = [], 0, 0

    async def _record(self, cf: str) -> SyncpointRecord | None:
        return await read_record(self.kv, cf)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for cf, url in self.feeds.items():
                before = await self._record(cf)
                held = before is not None and before.holding and before.cap_ts is not None
                if held and before is not None and any(t == before.cap_ts for t, _ in self.held[cf]):
                    continue  # this hold is read already
                got = await asyncio.to_thread(sums, url)
                after = await self._record(cf)
                if held and before is not None:
                    # Counted only when the hold was on from before the read to after it: the
                    # workers read the cap every round, so nothing passed T meanwhile.
                    if after is not None and after.holding and after.cap_ts == before.cap_ts:
                        self.held[cf].append((before.cap_ts or 0, got))
                elif after is None or not after.holding:
                    if got in ((TOTAL, TOTAL), (0, 0)):
                        self.free_right[cf] += 1
                    else:
                        self.free_wrong[cf] += 1
            await asyncio.sleep(0.02)

    def full_holds(self, cf: str) -> int:
        return sum(1 for _, s in self.held[cf] if s != (0, 0))


@dataclass
class Feeds:
    system: LocalSystem
    urls: dict[str, str]
    readers: Readers
    transfers: Transfers
    kv: KeyValue
    js: Any

    async def wait_full_holds(self, more: int, within: float, what: str) -> None:
        want = {cf: self.readers.full_holds(cf) + more for cf in self.urls}

        async def enough() -> bool:
            return all(self.readers.full_holds(cf) >= n for cf, n in want.items())

        deadline = time.monotonic() + within
        while not await enough():
            if time.monotonic() > deadline:
                records = {cf: await read_record(self.kv, cf) for cf in self.urls}
                leader = await leader_of(self.system, "replication-manager")
                status = await asyncio.to_thread(leader.health) if leader is not None else None
                raise AssertionError(f"{what}: held reads {self.readers.held}\nrecords {records}\n"
                                     f"leader status {status}\n"
                                     + "\n".join(f"--- {n}\n{p.tail_log(8)}"
                                                 for n, p in self.system.processes.items()))
            await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
async def feeds(request: pytest.FixtureRequest) -> AsyncIterator[Feeds]:
    # Not pytest's tmp_path: PostgreSQL's OS user must traverse every directory above its data.
    base = Path(tempfile.mkdtemp(prefix="sluice-syncpoints-"))
    os.chmod(base, 0o755)
    system = LocalSystem(
        base_dir=base, sources=1, downstream="postgres", control_replicas=1, workers=1, lease_ttl_s=2.0,
        with_api=False, control_services=("member", "scheduler", "replication_manager"),
        standalone_workers=False, initial_load="binlog-only",
        control_env={"SLUICE_REPLICATION_TICK_S": "1", "SLUICE_MEMBER_TTL_S": MEMBER_TTL_S},
        worker_env={**MEMBER_WORKER_ENV, "SLUICE_SPARK_DRIVER_JAVA_OPTIONS": SPARK_TEST_JAVA_OPTIONS,
                    **SINK_TEST_PACING, "SLUICE_MEMBER_TTL_S": MEMBER_TTL_S, "SLUICE_MEMBER_FENCE_S": "5"})
    down_mariadb: MariaDB | None = None
    transfers: Transfers | None = None
    stop = asyncio.Event()
    reading: asyncio.Task[None] | None = None
    nc = None
    try:
        system.start_infra()
        assert system.nats is not None and system.downstream_db is not None
        down_mariadb = MariaDB(data_dir=base / "downstream-mariadb", server_id=90).start()
        source = system.source_dbs[0]
        conn = source.connect(autocommit=False)  # a transfer is one transaction upstream
        with conn.cursor() as cur:
            for db, table in (("bank", "acct_a"), ("bank", "acct_b"), ("shop_1", "wallet"),
                              ("shop_2", "wallet")):
                cur.execute(f"CREATE DATABASE IF NOT EXISTS {db}")
                cur.execute(f"CREATE TABLE {db}.{table} (id BIGINT PRIMARY KEY, bal BIGINT NOT NULL)")
        system.start_services()
        system.start_control("replication_manager", 2)  # the one whose leader change is tested
        await asyncio.to_thread(system.wait_healthy, 120)
        urls = {"sp-sqlite": f"sqlite:///{base / 'down.db'}", "sp-pg": system.downstream_db.url,
                "sp-mariadb": down_mariadb.url}
        for cf, url in urls.items():
            spec = ChangefeedSpecV7(
                id=cf, sources=[SourceRefV1(id=system.source_id(0), url=source.url)],
                filter=TableFilterV1(include=["bank.*", "shop_*.wallet"]), sink_url=url,
                routes=[RouteRuleV1(database="shop_*", table="wallet", target_schema="merged",
                                    target_table="wallet")],
                initial_load="binlog-only", syncpoint_interval=INTERVAL_S, syncpoint_hold_s=HOLD_S)
            await system.create_changefeed(spec, requested_by="test")
        # Every account in one transaction: any consistent downstream state holds all or none.
        with conn.cursor() as cur:
            for i in range(1, ACCOUNTS + 1):
                cur.execute("INSERT INTO bank.acct_a VALUES (%s, %s)", (i, START))
                cur.execute("INSERT INTO bank.acct_b VALUES (%s, %s)", (i, START))
                cur.execute("INSERT INTO shop_1.wallet VALUES (%s, %s)", (i, START))
                cur.execute("INSERT INTO shop_2.wallet VALUES (%s, %s)", (100 + i, START))
        conn.commit()
        transfers = Transfers(source.connect(autocommit=False))
        transfers.start()
        nc = await nats.connect(**system.nats.client_options())
        kv = await syncpoint_bucket(nc.jetstream())
        assert kv is not None
        readers = Readers(kv, urls)
        reading = asyncio.ensure_future(readers.run(stop))
        yield Feeds(system, urls, readers, transfers, kv, nc.jetstream())
    finally:
        stop.set()
        if reading is not None:
            await asyncio.wait_for(reading, 30)
        if transfers is not None:
            transfers.stop()
        if nc is not None:
            await nc.close()
        for name, proc in system.processes.items():
            if name.startswith("sink-worker"):
                proc.kill()
        system.stop()
        if down_mariadb is not None:
            down_mariadb.stop()
        if request.session.testsfailed:
            print(f"logs kept in {base / 'logs'}")
        else:
            shutil.rmtree(base, ignore_errors=True)


async def test_reads_during_holds_see_the_totals_on_three_downstreams(feeds: Feeds) -> None:
    # Three JVMs' worth of first rounds on two cores, then three full holds per changefeed.
    await feeds.wait_full_holds(3, 300, "three held reads of the full totals per changefeed")
    r = feeds.readers
    for cf in feeds.urls:
        assert r.held[cf] and all(s in ((TOTAL, TOTAL), (0, 0)) for _, s in r.held[cf]), (cf, r.held[cf])
    print(f"\ntransfers: {feeds.transfers.txns}; held reads: "
          f"{ {cf: len(v) for cf, v in r.held.items()} }; reads between holds right/wrong: "
          f"{ {cf: (r.free_right[cf], r.free_wrong[cf]) for cf in feeds.urls} }")
    print(f"syncpoint figures: {await syncpoint_figures(feeds.js)}")
    for cf, url in feeds.urls.items():
        rows = await asyncio.to_thread(syncpoint_rows, url, cf)
        ts = [t for (t,) in rows]
        assert len(ts) == len(set(ts))
        assert {t for t, _ in r.held[cf]} <= set(ts), (cf, ts, r.held[cf])
        record = await read_record(feeds.kv, cf)
        # The third hold read may still be on: released or holding, each has its row.
        assert record is not None and record.released + record.holding >= 3 and record.last_ts in ts


async def test_syncpoints_go_on_after_a_worker_and_the_leader_are_killed(feeds: Feeds) -> None:
    system = feeds.system
    system.processes["sink-worker-1"].kill()
    # Its spans go to the next member with their stored checkpoints (never past a cap).
    await asyncio.to_thread(system.start_worker(2).wait_healthy, 120)
    await feeds.wait_full_holds(1, 240, "a full hold per changefeed after a worker's SIGKILL")
    leader = await leader_of(system, "replication-manager")
    assert leader is not None
    leader.kill()
    await feeds.wait_full_holds(2, 180, "two full holds per changefeed after the leader's SIGKILL")
    r = feeds.readers
    for cf, url in feeds.urls.items():
        assert all(s in ((TOTAL, TOTAL), (0, 0)) for _, s in r.held[cf]), (cf, r.held[cf])
        rows = await asyncio.to_thread(syncpoint_rows, url, cf)
        ts = [t for (t,) in rows]
        assert len(ts) == len(set(ts))
        assert {t for t, _ in r.held[cf]} <= set(ts)
    print(f"\ntransfers: {feeds.transfers.txns}; held reads: "
          f"{ {cf: len(v) for cf, v in r.held.items()} }; reads between holds right/wrong: "
          f"{ {cf: (r.free_right[cf], r.free_wrong[cf]) for cf in feeds.urls} }")
    print(f"syncpoint figures: {await syncpoint_figures(feeds.js)}")
