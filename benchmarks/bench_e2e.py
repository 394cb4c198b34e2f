"""End to end, with the whole system as real processes: upstream commit to downstream visible.

    .venv/bin/python -m benchmarks.bench_e2e [--rows 100000] [--rate 5000] [--steady-s 20]
        [--spark local|shared] [--fault-rate 2000] [--chart benchmarks/lag_through_faults.png]
        [--json PATH]

``LocalSystem`` with the control plane on (2 replicas of member, scheduler, replication-manager
and ddl-lock, the api, capture of one MariaDB source, sink-workers placed by the scheduler) and
a MariaDB downstream, so that the baselines run on the same database the workers write to.
Eight tables ``e2e.t0`` .. ``e2e.t7`` (BIGINT key, INT, VARCHAR, and the commit's wall-clock ms).

``--spark local`` (the default): each sink-worker runs Spark ``local[1]`` in its own JVM.
``--spark shared``: one Spark Connect server on this host (``local[2]``) and every sink-worker
pointed at it (``SLUICE_SPARK_MASTER=sc://...``), so several workers share one JVM instead of
one each on 2 cores; the server's RSS is reported on its own line. Every figure says which ran.

One system, phases in order (targets from issue 15):

1. **Throughput, 1 sink-worker**: ``--rows`` inserts committed upstream as fast as one
   connection can (500-row transactions, tables in turn); measured from the first commit until
   every table downstream holds every row (the downstream is polled every 0.1 s). Baseline: the
   same rows bulk-inserted straight into the downstream (one connection, 5,000-row multi-row
   INSERTs, one commit), in the same run. Target >= 30,000 rows/s.
2. **Latency at a steady ``--rate`` rows/s, 1 sink-worker** for ``--steady-s`` (after 10 s not
   measured): 250-row transactions paced by the clock, each one's commit time recorded when
   COMMIT returns; the downstream is polled in one query a cycle (``id DIV batch`` counts the
   rows of each transaction: a transaction is visible when all its rows are). Latency = first
   poll that sees it - commit time: the figures carry the poll cycle (interval + query) as their
   resolution. Baseline: the same transactions seen on NATS (a subscriber on the ROWS subjects):
   source -> capture -> NATS alone. If the system cannot carry the rate, the latency grows
   during the window and the figures say so. Targets p50 < 0.5 s, p99 < 1 s.
3. Two more workers start; the scheduler balances the spans (3, 3, 2); **throughput, 3 workers**,
   the same way with fresh rows of the same shape and number. Target >= the 1-worker figure.
4. **Latency, 3 workers**, as in 2. Target p99 < 1.5 s (3 workers on this 2-core machine).
5. **Move-table lag spike** under a paced load the system can carry (``--fault-rate``, at most
   half of what 3 workers carried in phase 3; 40 transactions a second, so every table gets
   one every 0.2 s): after ``--before-move-s`` (and once at least 5 ``t0`` transactions are
   visible, time-boxed) the scheduler leader is asked to move ``t0``'s span to another worker
   (the operator's move command); the figure is the highest latency of a ``t0`` transaction
   committed from the request until ``--after-move-s`` after the span replicates on its new
   worker, minus ``t0``'s median latency before the request (its first seconds of load left
   out). Too few transactions for either side: the figure is reported as not measured, with
   why. Target < 1 s.
6. **Lag through faults** under the same paced load: kill -9 the sink-worker with the most
   spans (started again once the lag is back), kill -9 the replication-manager leader (its
   replica started again), restart nats-server; ``--fault-gap-s`` of calm load between them.
   The lag is sampled every 0.5 s as now - changefeed checkpoint ts (the replication stream's
   checkpoint advances) and as the age of the oldest committed transaction not yet visible
   downstream. The next fault waits until the lag is back to its level before (at least 10 s,
   time-boxed by ``--recover-s``). Per fault, from the samples: the peak lag until the next
   fault, against the highest lag in the 15 s before it, and when the lag was back at that
   level after the peak. The chart goes to ``--chart``.

Throughout, the RSS of every service's process tree (a sink-worker with its Spark JVM and Python
workers), of nats-server and of the shared Spark Connect server is sampled from /proc every
0.5 s; the peak per service is reported (a sink-worker's against the 1 GiB target).
At the end the load stops and every table's downstream rows are compared with upstream's (count
and a CRC32 sum over all columns).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
from nats.aio.msg import Msg  # noqa: E402

from benchmarks import e2e_figures as figs  # noqa: E402
from benchmarks.memory import MemorySampler  # noqa: E402
from benchmarks.output import Figures, add_json_option  # noqa: E402
from contracts import REGISTRY, ContractError  # noqa: E402
from contracts.events.rows import RowsChangedV2, parts_of  # noqa: E402
from contracts.events.scheduling import ScheduleRequestV1, SpanRefV1  # noqa: E402
from libs.localservers.mariadb import MariaDB  # noqa: E402
from libs.localservers.service_process import ServiceProcess  # noqa: E402
from libs.localservers.spark_cluster import SparkConnect  # noqa: E402
from libs.localservers.system import LocalSystem  # noqa: E402
from libs.streams import rows_subject  # noqa: E402
from libs.telemetry.metrics import lag_seconds  # noqa: E402
from tests.helpers.control_plane import TABLES, Recorder, eventually, health, leader_of  # noqa: E402

DB = "e2e"
CF = "e2e"
SOURCE = "src1"
STEADY_BATCH = 250
BURST_BATCH = 500
STEADY_BASE = 1_000_000_000  # steady-load ids start here; bursts use ids below
SHARED_SPARK_MASTER = "local[2]"  # the shared Spark Connect server's jobs: this host's 2 cores


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _ddl(db: str) -> list[str]:
    return [f"CREATE DATABASE IF NOT EXISTS `{db}`"] + [
        f"CREATE TABLE IF NOT EXISTS `{db}`.`{t}` (id BIGINT PRIMARY KEY, v INT NOT NULL, "
        "note VARCHAR(40) NULL, at_ms BIGINT NOT NULL)" for t in TABLES]


def _values(ids: range, at_ms: int) -> str:
    return ",".join(f"({i},{i % 1000},'n{i % 97}',{at_ms})" for i in ids)


# ----------------------------------------------------------------------------- memory


def _part(_pid: int, _root: int, argv: list[bytes]) -> str:
    return "Spark JVM" if b"java" in argv[0] else (
        "Python workers" if b"pyspark" in b" ".join(argv) else "service process")


# ----------------------------------------------------------------------------- steady load


@dataclass
class Txn:
    k: int  # ids k*batch .. +batch-1
    table: str
    committed: float
    on_nats: float | None = None
    visible: float | None = None

    @property
    def latency(self) -> float | None:
        return None if self.visible is None else self.visible - self.committed


@dataclass
class Steady:
    """Paced 250-row insert transactions, and a poller that sees each one become visible."""

    source: MariaDB
    down: MariaDB
    base: int = STEADY_BASE
    batch: int = STEADY_BATCH
    rate: float = 5000.0
    txns: list[Txn] = field(default_factory=list)
    pending: dict[str, dict[int, Txn]] = field(default_factory=lambda: {t: {} for t in TABLES})
    cycles: list[float] = field(default_factory=list)
    poll_interval: float = 0.05
    next_k: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    _stop_writer: threading.Event = field(default_factory=threading.Event)
    _stop_poller: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _poller: threading.Thread | None = None
    behind: int = 0  # transactions committed later than their slot by more than one interval

    def __post_init__(self) -> None:
        self.next_k = self.base // self.batch

    def start_poller(self) -> None:
        self._poller = threading.Thread(target=self._poll, daemon=True, name="steady-poller")
        self._poller.start()

    def start(self, rate: float) -> None:
        self.rate = rate
        self._stop_writer.clear()
        t = threading.Thread(target=self._write, daemon=True, name="steady-writer")
        self._threads = [t]
        t.start()

    def stop(self) -> None:
        self._stop_writer.set()
        for t in self._threads:
            t.join(30)

    def stop_poller(self) -> None:
        self._stop_poller.set()
        if self._poller is not None:
            self._poller.join(30)

    def _write(self) -> None:
        conn = self.source.connect(DB)
        interval = self.batch / self.rate
        started = time.monotonic()
        n = 0
        try:
            with conn.cursor() as cur:
                while not self._stop_writer.is_set():
                    slot = started + n * interval
                    wait = slot - time.monotonic()
                    if wait > 0:
                        self._stop_writer.wait(wait)  # pacing, not synchronisation
                        if self._stop_writer.is_set():
                            break
                    elif -wait > interval:
                        self.behind += 1
                    k = self.next_k
                    table = TABLES[k % len(TABLES)]
                    ids = range(k * self.batch, (k + 1) * self.batch)
                    cur.execute("BEGIN")
                    cur.execute(f"INSERT INTO `{table}` VALUES {_values(ids, int(time.time() * 1000))}")
                    cur.execute("COMMIT")
                    txn = Txn(k, table, time.time())
                    with self.lock:
                        self.txns.append(txn)
                        self.pending[table][k] = txn
                    self.next_k += 1
                    n += 1
        finally:
            conn.close()

    def _poll(self) -> None:
        conn = self.down.connect()
        try:
            with conn.cursor() as cur:
                while not self._stop_poller.is_set():
                    t0 = time.monotonic()
                    with self.lock:
                        lows = {t: min(p) for t, p in self.pending.items() if p}
                    if lows:
                        sql = " UNION ALL ".join(
                            f"SELECT '{t}', id DIV {self.batch}, COUNT(*) FROM `{DB}`.`{t}` "
                            f"WHERE id >= {k * self.batch} GROUP BY 2" for t, k in lows.items())
                        try:
                            cur.execute(sql)
                            rows = cur.fetchall()
                        except Exception as exc:  # a table not created downstream yet
                            _say(f"poll failed: {exc!r}")
                            rows = ()
                        seen = time.time()
                        with self.lock:
                            for table, k, count in rows:
                                txn = self.pending[table].get(int(k))
                                if txn is not None and int(count) == self.batch:
                                    txn.visible = seen
                                    del self.pending[table][int(k)]
                    self.cycles.append(time.monotonic() - t0)
                    self._stop_poller.wait(self.poll_interval)  # the poll period
        finally:
            conn.close()

    def oldest_pending_age(self) -> float:
        now = time.time()
        with self.lock:
            oldest = [min(x.committed for x in p.values()) for p in self.pending.values() if p]
        return max(0.0, now - min(oldest)) if oldest else 0.0

    def drained(self) -> bool:
        with self.lock:
            return not any(self.pending.values())

    def resolution_ms(self) -> float:
        recent = self.cycles[-2000:]
        return statistics.mean(recent) * 1000 if recent else 0.0


class NatsWatch:
    """When each steady transaction's rows reach NATS (capture's rows.changed on the ROWS
    subjects), counted per table in commit order: source -> capture -> NATS alone."""

    def __init__(self, steady: Steady) -> None:
        self.steady = steady
        self.rows: dict[str, int] = {t: 0 for t in TABLES}
        self.base: dict[str, int] = {}
        self.nc: Any = None

    async def start(self, url: str) -> None:
        # Only transactions committed from now on are matched: counts start at zero here.
        with self.steady.lock:
            self.first_k = self.steady.next_k
        self.nc = await nats.connect(url)
        for t in TABLES:
            await self.nc.subscribe(rows_subject(SOURCE, DB, t), cb=self._on_msg)

    async def _on_msg(self, msg: Msg) -> None:
        now = time.time()
        try:
            ev = REGISTRY.decode(msg.data).event
        except ContractError:
            return
        if not isinstance(ev, RowsChangedV2) or ev.table not in self.rows:
            return
        # A message may carry several transactions of the table (rows.changed v4).
        self.rows[ev.table] += sum(len(part.rows) for _, part in parts_of(ev, ""))
        with self.steady.lock:
            done = self.rows[ev.table] // self.steady.batch
            mine = [x for x in self.steady.txns if x.table == ev.table and x.k >= self.first_k]
        for txn in mine[:done]:
            if txn.on_nats is None:
                txn.on_nats = now

    async def stop(self) -> None:
        if self.nc is not None:
            await self.nc.close()


# ----------------------------------------------------------------------------- phases


def _burst(source: MariaDB, rows: int, base: int) -> tuple[float, float, dict[str, int]]:
    """Commit ``rows`` inserts as fast as one connection can; returns (first commit, last commit,
    rows per table)."""
    conn = source.connect(DB)
    per_table = {t: 0 for t in TABLES}
    first = 0.0
    try:
        with conn.cursor() as cur:
            for n, start in enumerate(range(base, base + rows, BURST_BATCH)):
                ids = range(start, min(base + rows, start + BURST_BATCH))
                table = TABLES[n % len(TABLES)]
                cur.execute("BEGIN")
                cur.execute(f"INSERT INTO `{table}` VALUES {_values(ids, int(time.time() * 1000))}")
                cur.execute("COMMIT")
                per_table[table] += len(ids)
                if not first:
                    first = time.time()
        return first, time.time(), per_table
    finally:
        conn.close()


async def _visible(down: MariaDB, base: int, per_table: dict[str, int], within: float) -> float:
    conn = down.connect()
    sql = " UNION ALL ".join(f"SELECT '{t}', COUNT(*) FROM `{DB}`.`{t}` WHERE id >= {base} "
                             f"AND id < {base + 10**8}" for t in TABLES)

    def check() -> float | None:
        try:
            with conn.cursor() as cur:
                cur.execute(sql)
                got = {t: int(c) for t, c in cur.fetchall()}
        except Exception:  # a target table not created yet
            return None
        return time.time() if all(got.get(t, 0) >= n for t, n in per_table.items()) else None

    try:
        return float(await eventually(lambda: asyncio.to_thread(check), within,
                                      f"{sum(per_table.values()):,} rows visible downstream", interval=0.1))
    finally:
        conn.close()


def _direct_insert(down: MariaDB, rows: int, schema: str) -> float:
    down.execute(f"DROP DATABASE IF EXISTS `{schema}`", *_ddl(schema))
    conn = down.connect(schema, autocommit=False)
    try:
        stamp = int(time.time() * 1000)
        statements = []
        for n, start in enumerate(range(0, rows, BURST_BATCH * 10)):
            ids = range(start, min(rows, start + BURST_BATCH * 10))
            statements.append(f"INSERT INTO `{TABLES[n % len(TABLES)]}` VALUES {_values(ids, stamp)}")
        with conn.cursor() as cur:
            started = time.perf_counter()
            for s in statements:
                cur.execute(s)
            conn.commit()
            return time.perf_counter() - started
    finally:
        conn.close()
        down.execute(f"DROP DATABASE IF EXISTS `{schema}`")


@dataclass
class Run:
    system: LocalSystem
    rec: Recorder
    out: Figures
    args: argparse.Namespace
    spark: str  # which Spark the workers ran on, as the figures say it
    steady: Steady | None = None
    capacity: float = 0.0  # rows/s 3 workers carried in the throughput phase
    one_worker_rate: float | None = None  # rows/s 1 worker carried: the 3-worker target

    @property
    def source(self) -> MariaDB:
        return self.system.source_dbs[0]

    @property
    def down(self) -> MariaDB:
        db = self.system.downstream_db
        assert isinstance(db, MariaDB)
        return db

    def workers(self) -> list[str]:
        return sorted(n for n, p in self.system.processes.items()
                      if n.startswith("sink-worker") and p.alive())

    async def wait_balanced(self, n: int, within: float) -> None:
        def ok() -> bool:
            loads = self.rec.loads()
            return (self.rec.all_replicating(len(TABLES)) and len(loads) == n
                    and max(loads.values()) - min(loads.values()) <= 1)

        await eventually(ok, within, f"{len(TABLES)} spans balanced over {n} workers",
                         diagnostics=lambda: str(self.rec.loads()))

    async def throughput(self, workers: int, base: int) -> None:
        # A small burst first: every worker has had its first (cold) Spark round before the clock.
        _, _, warm = _burst(self.source, BURST_BATCH * len(TABLES), base)
        await _visible(self.down, base, warm, 600)
        rows = self.args.rows
        base += 10**7
        _say(f"throughput, {workers} worker(s): {rows:,} rows")
        first, last, per_table = await asyncio.to_thread(_burst, self.source, rows, base)
        visible = await _visible(self.down, base, per_table, 1800)
        seconds = visible - first
        direct = await asyncio.to_thread(_direct_insert, self.down, rows, f"{DB}_direct")
        rate, direct_rate = rows / seconds, rows / direct
        if workers == 1:
            self.one_worker_rate = rate
        else:
            self.capacity = rate
        target, met = figs.throughput_target(workers, rate, self.one_worker_rate)
        _say(f"  {seconds:.1f} s from first commit to last row visible: {rate:,.0f} rows/s (upstream "
             f"commits took {last - first:.1f} s); direct multi-row INSERT {direct_rate:,.0f} rows/s")
        # Every burst has the same shape (rows, transactions, tables in turn), so the figures of
        # 1 and 3 workers compare the same work.
        self.out.add(f"end to end, {workers} sink-worker{'s' if workers > 1 else ''} ({self.spark}): "
                     f"{rows:,} inserts in {BURST_BATCH}-row transactions over {len(TABLES)} tables "
                     f"committed upstream as fast as possible (upstream commits took {last - first:.1f} s), "
                     f"first commit -> last row visible downstream", rate, "rows/s",
                     baseline=f"the same rows multi-row INSERTed straight into the downstream "
                              f"{direct_rate:,.0f} rows/s ({rate / direct_rate:.2f}x of it)",
                     target=target, met=met)

    def new_steady(self, base: int, rate: float, per_second: float) -> Steady:
        """A paced load of ``per_second`` transactions a second (at least one row each)."""
        batch = max(1, round(rate / per_second))
        steady = Steady(self.source, self.down, base=base, batch=batch, rate=rate)
        steady.start_poller()
        self.steady = steady
        return steady

    async def finish(self, steady: Steady, within: float = 900) -> None:
        steady.stop()
        await eventually(steady.drained, within, "every paced transaction visible downstream", interval=0.5)
        steady.stop_poller()

    async def latency(self, workers: int, base: int) -> None:
        args = self.args
        steady = self.new_steady(base, args.rate, 20)
        watch = NatsWatch(steady)
        assert self.system.nats is not None
        await watch.start(self.system.nats.url)
        _say(f"steady load {args.rate:,.0f} rows/s for {args.steady_s:.0f} s with {workers} worker(s) "
             "(first 10 s not measured)")
        steady.start(args.rate)
        window_from = time.time() + 10
        await asyncio.sleep(10 + args.steady_s)  # the measurement window under load
        window_to = time.time()
        await self.finish(steady)
        await watch.stop()
        resolution = steady.resolution_ms()
        measured = [x for x in steady.txns if window_from <= x.committed < window_to]
        got = figs.latency([x.latency for x in measured if x.latency is not None],
                           [x.on_nats - x.committed for x in measured if x.on_nats is not None])
        achieved = len(measured) * steady.batch / (window_to - window_from)
        targets = figs.latency_targets(workers)
        if got.p50 is not None and got.p99 is not None and got.max is not None:
            _say(f"  latency over {got.count} transactions ({achieved:,.0f} rows/s): p50 {got.p50:.3f} s, "
                 f"p99 {got.p99:.3f} s, max {got.max:.3f} s; {got.nats_text}; poll cycle "
                 f"{resolution:.0f} ms; {steady.behind} commits late")
        else:
            _say(f"  latency not measured: {got.reason}")
        base_text = f"{got.nats_text}; downstream poll cycle (resolution) {resolution:.0f} ms"
        what = (f"at a steady {achieved:,.0f} rows/s ({args.rate:,.0f} asked; {steady.batch}-row "
                f"transactions over {len(TABLES)} tables), {workers} sink-worker{'s' if workers > 1 else ''} "
                f"({self.spark}); {got.count} transactions over {args.steady_s:.0f} s")
        for name, value, target in (("p50", got.p50, targets.p50), ("p99", got.p99, targets.p99)):
            measure = f"end-to-end latency {name}, commit -> visible downstream, {what}"
            if value is None:
                self.out.not_measured(measure, "s", got.reason or "no figure", baseline=base_text,
                                      target=figs.latency_target(target, 0.0, args.rate)[0])
            else:
                target_text, met = figs.latency_target(target, value, args.rate)
                self.out.add(measure, value, "s", baseline=base_text, target=target_text, met=met)

    def sustainable(self) -> float:
        """The paced load for the move and the faults: at most ``--fault-rate``, and at most half
        of what 3 workers carried in the throughput phase, so the lag has a level to return to."""
        return min(self.args.fault_rate, 0.5 * self.capacity) if self.capacity else self.args.fault_rate

    async def move_spike(self) -> None:
        args = self.args
        rate = self.sustainable()
        steady = self.new_steady(2 * STEADY_BASE, rate, 40)
        table = "t0"
        span_key = f"{CF}/{SOURCE}/{DB}/{table}"
        _say(f"move of {table} under {rate:,.0f} rows/s ({steady.batch}-row transactions)")
        steady.start(rate)
        load_from = time.time()
        await asyncio.sleep(args.before_move_s)  # the lag before the move, under load
        before_from = figs.before_move_from(load_from, args.before_move_s)

        def before() -> list[float]:
            with steady.lock:
                return [lat for x in steady.txns if x.table == table and x.committed >= before_from
                        and (lat := x.latency) is not None]

        # A short window (or slow rounds) may not have shown enough of the table's transactions
        # yet: the "before" median needs some, so the request waits for them, time-boxed.
        try:
            await eventually(lambda: len(before()) >= figs.MIN_BEFORE_MOVE, max(60.0, args.before_move_s),
                             f"{figs.MIN_BEFORE_MOVE} {table} transactions visible before the move",
                             interval=0.1)
        except AssertionError:
            _say(f"  only {len(before())} {table} transactions visible before the move; moving anyway")
        owner = self.rec.placement().get(span_key)
        dest = next(w for w in self.workers() if w != owner)
        asked = time.time()
        await self.move(span_key, dest)
        await eventually(lambda: self.rec.placement().get(span_key) == dest, 120,
                         f"{span_key} replicating on {dest}")
        moved = time.time()
        await asyncio.sleep(args.after_move_s)  # keep the load on after the hand-over
        move_to = time.time()
        await self.finish(steady)
        lat_before = [lat for x in steady.txns if x.table == table and before_from <= x.committed < asked
                      and (lat := x.latency) is not None]
        during = [(x.table, lat) for x in steady.txns
                  if asked - 1 <= x.committed < move_to and (lat := x.latency) is not None]
        spike = figs.move_spike(lat_before, [lat for t, lat in during if t == table],
                                [lat for t, lat in during if t != table])
        peak = "-" if spike.during_max is None else f"{spike.during_max:.3f}"
        _say(f"  {owner} -> {dest}: replicating after {moved - asked:.2f} s; {spike.baseline}; "
             f"{table} during the move max {peak}")
        measure = (f"move-table lag spike ({self.spark}): {table} moved {owner} -> {dest} under "
                   f"{rate:,.0f} rows/s (replicating on {dest} {moved - asked:.1f} s after the request); "
                   "max latency of its transactions during the move minus its median before")
        if spike.value is None:
            _say(f"  move-table spike not measured: {spike.reason}")
            self.out.not_measured(measure, "s", spike.reason or "no figure", baseline=spike.baseline,
                                  target="< 1 s")
        else:
            self.out.add(measure, spike.value, "s", baseline=spike.baseline, target="< 1 s",
                         met=spike.value < 1.0)

    async def move(self, span_key: str, dest: str) -> None:
        cf, src, db, table = span_key.split("/")
        ref = SpanRefV1(changefeed=cf, source=src, database=db, table=table)
        req = ScheduleRequestV1(kind="move", span=ref, dest=dest, requested_by="bench")
        reasons: list[str] = []

        async def accepted() -> bool:
            answer = await self.rec.request(req)
            reasons.append(answer.reason)
            return answer.accepted

        await eventually(accepted, 30, f"the move of {span_key} accepted", interval=0.5,
                         diagnostics=lambda: str(reasons[-3:]))

    def checkpoint_lag(self) -> float | None:
        advances = [a for a in self.rec.advances if a.changefeed == CF]
        if not advances:
            return None
        return lag_seconds(max(a.checkpoint_ts for a in advances))

    async def faults(self) -> None:
        nats_server = self.system.nats
        assert nats_server is not None
        args, system = self.args, self.system
        rate = self.sustainable()
        steady = self.new_steady(3 * STEADY_BASE, rate, 40)
        samples: list[tuple[float, float | None, float]] = []
        marks: list[tuple[float, str, bool]] = []  # (t, label, is a fault)
        t0 = time.time()
        stop = asyncio.Event()

        async def sample() -> None:
            while not stop.is_set():
                samples.append((time.time() - t0, self.checkpoint_lag(), steady.oldest_pending_age()))
                await asyncio.sleep(0.5)  # the sampling period

        sampler = asyncio.create_task(sample())
        steady.start(rate)
        _say(f"faults under {rate:,.0f} rows/s ({steady.batch}-row transactions)")
        async def settle(label: str, at: float) -> None:
            """Paces the schedule: the next fault waits until this one's lag is back to its level
            before (the figures are taken afterwards from the samples, see ``fault_figures``)."""
            before = [s[2] for s in samples if at - 15 <= s[0] + t0 < at]
            level = max(1.0, max(before, default=0.0))

            def recovered() -> bool:
                return time.time() - at > 10 and steady.oldest_pending_age() <= level

            try:
                await eventually(recovered, args.recover_s, f"the lag back under {level:.1f} s after {label}",
                                 interval=0.25)
                _say(f"  {label}: lag back under {level:.1f} s after {time.time() - at:.1f} s")
            except AssertionError:
                _say(f"  {label}: lag not back under {level:.1f} s within {args.recover_s:.0f} s")

        async def schedule() -> None:
            await asyncio.sleep(args.fault_gap_s)  # lag under load before the first fault
            loads = self.rec.loads()
            victim = max(sorted(loads), key=lambda m: loads[m])
            at = time.time()
            system.processes[victim].kill()
            marks.append((at - t0, f"kill -9 {victim}", True))
            await settle(f"kill -9 {victim}", at)
            system.start_worker(int(victim.rsplit("-", 1)[1]))
            await asyncio.to_thread(_start_healthy, system, 180, [victim])
            marks.append((time.time() - t0, f"{victim} started again", False))
            await asyncio.sleep(args.fault_gap_s)

            leader = await leader_of(system, "replication-manager")
            assert leader is not None, "no replication-manager leader"
            old_epoch = int((await health(leader) or {})["epoch"])
            at = time.time()
            leader.kill()
            marks.append((at - t0, f"kill -9 {leader.instance_id} (leader)", True))
            await eventually(lambda: any(a.epoch > old_epoch and a.at > at for a in self.rec.advances), 120,
                             "a checkpoint advance by the new replication-manager leader")
            await settle(f"kill -9 {leader.instance_id}", at)
            svc, replica = leader.instance_id.rsplit("-", 1)
            system.start_control(svc.replace("-", "_"), int(replica))
            await asyncio.to_thread(_start_healthy, system, 180, [leader.instance_id])
            marks.append((time.time() - t0, f"{leader.instance_id} started again", False))
            await asyncio.sleep(args.fault_gap_s)

            at = time.time()
            await asyncio.to_thread(nats_server.restart)
            marks.append((at - t0, "nats-server restart", True))
            await settle("nats-server restart", at)
            await eventually(lambda: any(a.at > at for a in self.rec.advances), 120,
                             "a checkpoint advance after the nats-server restart")
            await asyncio.sleep(args.fault_gap_s)

        try:
            await schedule()
        finally:
            # The chart shows whatever ran, also when a fault's recovery failed the benchmark.
            steady.stop()
            stop.set()
            await sampler
            if args.chart is not None and samples:
                chart(samples, marks, rate, args.chart)
                _say(f"  chart written to {args.chart}")
            for f in fault_figures(samples, marks):
                _say(f"  {f.label}: peak end-to-end lag {f.peak:.1f} s (checkpoint lag "
                     f"{f.peak_checkpoint:.1f} s), level before {f.level:.1f} s, back after {f.back_text}")
                self.out.add(f"through faults at {rate:,.0f} rows/s: {f.label} -> peak end-to-end lag until "
                             f"the next fault (peak checkpoint lag {f.peak_checkpoint:.1f} s; end-to-end lag "
                             f"back to its level before after {f.back_text})", f.peak, "s",
                             baseline=f"end-to-end lag in the 15 s before the fault: max {f.level:.1f} s")
            self.out.extra["lag_through_faults"] = {"samples": samples, "marks": marks, "rate": rate}
            self.out.write(args.json)


@dataclass
class FaultFigure:
    label: str
    level: float  # highest end-to-end lag in the 15 s before the fault
    peak: float  # highest end-to-end lag from the fault until the next one (or the end)
    peak_checkpoint: float
    back: float | None  # from the fault until the lag is at or under ``level`` again, after its peak

    @property
    def back_text(self) -> str:
        return f"{self.back:.1f} s" if self.back is not None else "- (not before the next fault or the end)"


def fault_figures(samples: list[tuple[float, float | None, float]],
                  marks: list[tuple[float, str, bool]]) -> list[FaultFigure]:
    faults = [(t, label) for t, label, is_fault in marks if is_fault]
    out = []
    for i, (at, label) in enumerate(faults):
        until = faults[i + 1][0] if i + 1 < len(faults) else float("inf")
        before = [s[2] for s in samples if at - 15 <= s[0] < at]
        window = [s for s in samples if at <= s[0] < until]
        if not window:
            continue
        level = max(before, default=0.0)
        peak_at, _, peak = max(window, key=lambda s: s[2])
        back = next((s[0] - at for s in window if s[0] > peak_at and s[2] <= level), None)
        cps = [s[1] for s in window if s[1] is not None]
        out.append(FaultFigure(label, level, peak, max(cps, default=0.0), back))
    return out


def chart(samples: list[tuple[float, float | None, float]], marks: list[tuple[float, str, bool]],
          rate: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8), dpi=110)
    t = [s[0] for s in samples]
    ax.plot(t, [s[1] if s[1] is not None else float("nan") for s in samples],
            label="checkpoint lag (now - changefeed checkpoint ts)", color="tab:blue", linewidth=1.4)
    ax.plot(t, [s[2] for s in samples], label="end-to-end lag (oldest committed row not yet downstream)",
            color="tab:orange", linewidth=1.2)
    top = max([s[2] for s in samples] + [s[1] or 0 for s in samples] + [1.0])
    for x, label, fault in marks:
        ax.axvline(x, color="tab:red" if fault else "tab:gray", linestyle="-" if fault else ":", linewidth=1)
        ax.text(x, top * 0.97, " " + label, rotation=90, va="top", ha="left", fontsize=8,
                color="tab:red" if fault else "tab:gray")
    ax.set_xlabel("seconds")
    ax.set_ylabel("lag (s)")
    ax.set_title(f"Lag through faults, steady {rate:,.0f} rows/s over 8 tables, 3 sink-workers "
                 "(sampled every 0.5 s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _start_healthy(system: LocalSystem, within: float, names: list[str] | None = None) -> None:
    """Wait until every service (or ``names``) answers its own /healthz. A process whose HTTP
    port was taken between choosing it and binding it (free ports race on a busy machine)
    exits; it is started again on another port. A health answer from another process on a
    reused port does not count: the process must still be alive after the answer."""
    deadline = time.monotonic() + within
    while True:
        procs = {n: p for n, p in system.processes.items() if names is None or n in names}
        dead = [n for n, p in procs.items() if not p.alive()]
        for name in dead:
            old = procs[name]
            _say(f"{name} exited at start ({old.tail_log(1)[-160:]}); starting it again")
            system.processes[name] = ServiceProcess(old.module, old.env, old.log_dir,
                                                    instance_id=name).start()
        if not dead:
            try:
                for p in procs.values():
                    p.wait_healthy(max(1.0, deadline - time.monotonic()))
            except RuntimeError:  # exited while we waited: start it again above
                continue
            if all(p.alive() for p in procs.values()):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"services not healthy within {within:.0f} s: {dead}")
        time.sleep(1.0)  # a process just started needs a moment before its health check


def _compare(source: MariaDB, down: MariaDB) -> list[str]:
    sql = ("SELECT COUNT(*), COALESCE(SUM(CRC32(CONCAT_WS('|', id, v, IFNULL(note, '~'), at_ms))), 0) "
           "FROM `{db}`.`{t}`")
    bad = []
    for t in TABLES:
        up = source.execute(sql.format(db=DB, t=t))[0]
        dn = down.execute(sql.format(db=DB, t=t))[0]
        if tuple(map(int, up)) != tuple(map(int, dn)):
            bad.append(f"{t}: upstream {up}, downstream {dn}")
    return bad


SPARK_CONNECT = "Spark Connect server"


def _rss_what(service: str, shared: bool) -> str:
    if service == SPARK_CONNECT:
        return "shared by every sink-worker, process tree"
    if service.startswith(("nats", "MariaDB")):
        return "infrastructure"
    if service == "sink-worker":
        return ("highest replica, process tree; its Spark on the shared Spark Connect server, reported "
                "on its own line" if shared else "highest replica, process tree with its own Spark")
    return "highest replica, process tree"


async def main_async(args: argparse.Namespace) -> int:
    out = Figures("bench_e2e")
    # Absolute: mariadb-install-db resolves a relative data directory against its own basedir.
    args.dir = args.dir.resolve()
    shutil.rmtree(args.dir, ignore_errors=True)
    connect: SparkConnect | None = None
    if args.spark == "shared":
        # One Spark for every worker: its JVM and Python workers are this server's, not theirs.
        connect = SparkConnect(args.dir / "spark-connect", master=SHARED_SPARK_MASTER)
        worker_env = {"SLUICE_SPARK_MASTER": connect.url, "SLUICE_SINK_APPLY_PARTITIONS": "2"}
        spark = f"Spark: one shared Spark Connect server, {SHARED_SPARK_MASTER}"
    else:
        worker_env = {"SLUICE_SPARK_MASTER": "local[1]", "SLUICE_SPARK_SHUFFLE_PARTITIONS": "2",
                      "SLUICE_SPARK_DRIVER_MEMORY": "1g", "SLUICE_SINK_APPLY_PARTITIONS": "2"}
        spark = "Spark: local[1] in each worker"
    out.extra["spark"] = args.spark
    system = LocalSystem(
        base_dir=args.dir, sources=1, downstream="mariadb", control_replicas=2, workers=1, with_api=True,
        standalone_workers=False, initial_load="binlog-only",
        control_env={"SLUICE_SCHEDULER_BALANCE_INTERVAL_S": "2"}, worker_env=worker_env,
    )
    rec = Recorder()
    run = Run(system, rec, out, args, spark)

    def targets() -> dict[str, int]:
        pids = system.process_pids()
        if connect is not None and connect.processes and connect.processes[0].proc is not None:
            pids[SPARK_CONNECT] = connect.processes[0].proc.pid
        return pids

    memory = MemorySampler(targets, _part, on_error=lambda exc: _say(f"rss sample skipped: {exc!r}"))
    try:
        _say("starting nats-server, MariaDB source and downstream, every service")
        system.start_infra()
        assert system.nats is not None
        if connect is not None:
            _say(f"starting the shared Spark Connect server ({SHARED_SPARK_MASTER}) at {connect.url}")
            await asyncio.to_thread(connect.start)
        system.source_dbs[0].execute(*_ddl(DB))
        await rec.start(system.nats.url)
        memory.start()
        system.start_services()
        await asyncio.to_thread(_start_healthy, system, 240)
        await system.create_changefeed(system.changefeed_spec(CF, include=[f"{DB}.*"]), "bench")
        # A first row in every table: each gets its subject in the ROWS stream, hence a span.
        for i, t in enumerate(TABLES):
            system.source_dbs[0].execute(f"INSERT INTO `{DB}`.`{t}` VALUES {_values(range(i + 1, i + 2), 0)}")
        await run.wait_balanced(1, 300)
        await run.throughput(1, 10**7)
        out.write(args.json)
        await run.latency(1, STEADY_BASE)
        out.write(args.json)

        for n in (2, 3):
            system.start_worker(n)
        await asyncio.to_thread(_start_healthy, system, 180, ["sink-worker-2", "sink-worker-3"])
        await run.wait_balanced(3, 300)
        _say(f"3 workers: {rec.loads()}")
        await run.throughput(3, 10**8)
        out.write(args.json)
        await run.latency(3, STEADY_BASE + STEADY_BASE // 2)
        out.write(args.json)
        await run.move_spike()
        out.write(args.json)
        if not args.skip_faults:
            await run.faults()
            assert run.steady is not None
            await run.finish(run.steady)
        memory.done.set()
        memory.join(5)
        mismatches = await asyncio.to_thread(_compare, system.source_dbs[0], run.down)
        out.extra["downstream_equals_upstream"] = not mismatches
        _say("downstream equals upstream (count and CRC32 sum per table)" if not mismatches
             else f"MISMATCH: {mismatches}")
        services: dict[str, tuple[int, dict[str, int], str]] = {}
        for name, peak in memory.peaks.items():
            service = name if name.startswith(("nats", "MariaDB", SPARK_CONNECT)) else name.rsplit("-", 1)[0]
            if peak > services.get(service, (0, {}, ""))[0]:
                services[service] = (peak, memory.peak_parts[name], name)
        _say(f"peak RSS per service ({memory.samples} samples):")
        for service, (peak, parts, name) in sorted(services.items(), key=lambda kv: -kv[1][0]):
            split = ", ".join(f"{k} {v / 2**20:,.0f}" for k, v in sorted(parts.items()) if len(parts) > 1)
            _say(f"  {service:<22} {peak / 2**20:8,.0f} MiB  ({name}{'; ' + split if split else ''})")
            what = _rss_what(service, connect is not None)
            # Issue 15's worker figure counts the worker's own Spark: not judged when Spark is shared.
            judged = service == "sink-worker" and connect is None
            target, met = figs.worker_rss_target(peak / 2**20) if judged else (None, None)
            out.add(f"peak RSS, {service} ({what}{': ' + split + ' MiB' if split else ''})",
                    peak / 2**20, "MiB", target=target, met=met)
        out.extra["memory_samples"] = memory.samples
        out.write(args.json)
        return 0 if not mismatches else 1
    finally:
        memory.done.set()
        if run.steady is not None:
            run.steady.stop()
            run.steady.stop_poller()
        await rec.stop()
        for name, proc in system.processes.items():
            if name.startswith("sink-worker"):
                proc.kill()  # no drain at teardown: the control plane stops too
        system.stop()
        if connect is not None:
            connect.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows of each throughput burst")
    parser.add_argument("--rate", type=float, default=5000.0, help="steady load, rows/s")
    parser.add_argument("--steady-s", type=float, default=20.0, help="latency measurement window")
    parser.add_argument("--before-move-s", type=float, default=25.0)
    parser.add_argument("--after-move-s", type=float, default=15.0)
    parser.add_argument("--fault-rate", type=float, default=2000.0,
                        help="load during the move and the faults, rows/s (at most half of 3 workers' rate)")
    parser.add_argument("--recover-s", type=float, default=180.0, help="time box of a recovery")
    parser.add_argument("--fault-gap-s", type=float, default=20.0, help="calm load between faults")
    parser.add_argument("--skip-faults", action="store_true")
    parser.add_argument("--spark", choices=("local", "shared"), default="local",
                        help="local: Spark local[1] inside each sink-worker; shared: one Spark Connect "
                             f"server ({SHARED_SPARK_MASTER}) on this host for every sink-worker")
    parser.add_argument("--chart", type=Path, default=None, help="PNG of the lag through faults")
    parser.add_argument("--dir", type=Path, default=ROOT / ".sluice" / "bench-e2e")
    add_json_option(parser)
    sys.exit(asyncio.run(main_async(parser.parse_args())))


if __name__ == "__main__":
    main()
