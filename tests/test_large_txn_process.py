"""A transaction larger than the sink-worker's round, end to end with real processes: MariaDB
binlog -> capture -> JetStream -> one sink-worker (streamed, ``round/large_txn``) -> MariaDB,
PostgreSQL and SQLite (one changefeed each), and a second SQLite whose changefeed splits large
transactions (``large_txn_split_rows``).

An INSERT of 24,000 rows and two UPDATEs of all of them, each one transaction, with the
worker's round and window settings turned low (about a MiB); the worker is killed (SIGKILL) in
the middle of writing the second UPDATE and another one started. Each transaction reaches the
downstream whole and at once (a reader polling each downstream never sees part of one, nor any
of the killed write; on the split feed's downstream it does, and that one converges too),
every target equals the source by checksum, the worker applied them by the streamed path, and
the first worker process' peak resident memory stays under the worker's 1 GiB target (about
4 MB of messages for an UPDATE here, 10 MB for 60,000 rows; 2.6 GB of worker memory and a
Spark driver out of heap for 1M changes before it was streamed)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from services.sink_worker.validation.verify import ShardRef, verify_targets
from tests.helpers.e2e import _capture, _changefeed, _delete_changefeeds_afterwards, downstream_mariadb  # noqa: F401 - fixtures
from tests.helpers.worker_env import STANDALONE_WORKER_ENV

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
ROWS = 24_000
# The fourth feed commits every SPLIT_ROWS row changes (large_txn_split_rows): a reader of its
# downstream may see part of a transaction, and everything still converges after the kill.
SPLIT_ROWS = 4_000
DB = "bigtxn"
# Low memory targets, so that each transaction is several times a round: a span's reader keeps
# 1 MiB of bodies, a window 4 messages / 1 MiB (the least each may be). The transactions' sizes
# and these bounds scale together: 60,000 rows with 4 MiB bounds took this test four times as
# long to prove the same.
LOW_MEMORY = {
    "SLUICE_SINK_PULL_MAX_BYTES": str(MIB),
    "SLUICE_SINK_ROUND_MAX_BYTES": str(MIB),
    "SLUICE_SINK_LARGE_TXN_WINDOW_EVENTS": "4",
    "SLUICE_SINK_LARGE_TXN_WINDOW_BYTES": str(MIB),
}
# The worker process' peak RSS while three spans apply the transactions, against the worker's
# memory target (issue: 1 GiB). Its growth over what it held before is load-dependent (measured
# with 100,000 rows and three spans: +55 MiB streamed alone, +159 alone, +266 beside the fast
# lane, +416 in a CI run; held whole, SLUICE_SINK_LARGE_TXN_STREAM=false, +496 alone), so a
# growth bound flaked; that the streamed path ran is asserted from the worker's log.
PEAK_TARGET = 1024 * MIB


def _status(pid: int) -> dict[str, int]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


class Watcher(threading.Thread):
    """Polls ``COUNT(*), SUM(k)`` of one downstream's table: every distinct answer seen."""

    def __init__(self, name: str, connect: Callable[[], Any], table: str) -> None:
        super().__init__(daemon=True, name=f"watch-{name}")
        self.connect = connect
        self.sql = f"SELECT COUNT(*), COALESCE(SUM(k), 0) FROM {table}"
        self.seen: list[tuple[int, int]] = []
        self.stop = threading.Event()

    def read(self, conn: Any) -> tuple[int, int]:
        cur = conn.cursor()
        try:
            cur.execute(self.sql)
            count, total = cur.fetchone()
        finally:
            cur.close()
        return int(count), int(total)

    def run(self) -> None:
        conn = self.connect()
        try:
            while not self.stop.is_set():
                try:
                    got = self.read(conn)
                except sqlite3.OperationalError:  # SQLite: the writer's commit holds the file
                    self.stop.wait(0.01)
                    continue
                if not self.seen or self.seen[-1] != got:
                    self.seen.append(got)
                self.stop.wait(0.05)
        finally:
            conn.close()


def _wait_for(watchers: list[Watcher], want: tuple[int, int], procs: list[ServiceProcess],
              within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log(30)}"
        if all(w.seen and w.seen[-1] == want for w in watchers):
            return
        time.sleep(0.2)
    logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(20)}" for p in procs)
    seen = [(w.name, w.seen[-3:]) for w in watchers]
    pytest.fail(f"downstreams never all showed {want}; saw {seen}\n{logs}")


def _log_count(proc: ServiceProcess, text: str) -> int:
    return proc.log_path.read_text(errors="replace").count(text)


@pytest.mark.timeout(1500)
async def test_large_transactions_arrive_whole_in_bounded_worker_memory(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path, mariadb: MariaDB,
    postgres: PostgreSQL, downstream_mariadb: MariaDB, processes: list[ServiceProcess],  # noqa: F811
) -> None:
    mariadb.execute(f"DROP DATABASE IF EXISTS {DB}", f"CREATE DATABASE {DB}")
    mariadb.execute("CREATE TABLE t (id INT PRIMARY KEY, k INT NOT NULL, c CHAR(60) NOT NULL)", database=DB)
    downstream_mariadb.execute(f"CREATE DATABASE IF NOT EXISTS {DB}")
    sqlite_path = tmp_path / "down.db"
    split_path = tmp_path / "split.db"
    sinks = {"mariadb": downstream_mariadb.url_for(DB), "postgres": postgres.url,
             "sqlite": f"sqlite:///{sqlite_path}", "split": f"sqlite:///{split_path}"}
    watchers = [
        Watcher("mariadb", lambda: downstream_mariadb.connect(DB, autocommit=True), "t"),
        Watcher("postgres", lambda: postgres.connect(), f"{DB}.t"),
        Watcher("sqlite", lambda: sqlite3.connect(sqlite_path, timeout=0.2), "t"),
        Watcher("split", lambda: sqlite3.connect(split_path, timeout=0.2), "t"),
    ]
    logs = tmp_path / "logs"
    # Capture encodes a reader batch (up to 500 rows events) on its event loop between lease
    # renewals; on a machine loaded far past its cores that outlasts the tests' 1.5 s lease and
    # capture starts the transaction over from its last mark, again and again.
    service_env = {**service_env, "SLUICE_LEASE_TTL_S": "10"}
    capture = _capture(service_env, logs, mariadb, "bigtxn", DB)
    processes.append(capture)
    capture.wait_healthy(60)
    for kind, url in sinks.items():
        extra = {"large_txn_split_rows": SPLIT_ROWS} if kind == "split" else {}
        await _changefeed(js, f"bigtxn-{kind}", "bigtxn", mariadb, DB, url, **extra)

    def start(name: str) -> ServiceProcess:
        proc = ServiceProcess("services.sink_worker", {**service_env, **STANDALONE_WORKER_ENV, **LOW_MEMORY},
                              logs, instance_id=name).start()
        processes.append(proc)
        return proc

    worker = start("worker-bigtxn")
    worker.wait_healthy(60)
    await asyncio.to_thread(_transactions, mariadb, sinks, watchers, capture, worker,
                            lambda: start("worker-bigtxn-2"))


def _transactions(mariadb: MariaDB, sinks: dict[str, str], watchers: list[Watcher], capture: ServiceProcess,
                  worker: ServiceProcess, restart: Callable[[], ServiceProcess]) -> None:
    assert worker.proc is not None
    procs = [capture, worker]
    spans = len(sinks)

    # A small transaction first: the targets exist and the worker's rounds and Spark are warm.
    mariadb.execute("INSERT INTO t VALUES (0, 0, 'warm')", database=DB)
    deadline = time.monotonic() + 180
    while not all(_count(w) == 1 for w in watchers):
        assert time.monotonic() < deadline, worker.tail_log(30)
        time.sleep(0.2)
    for w in watchers:
        w.start()
    try:
        time.sleep(1)  # let the worker's memory settle after the warm-up round
        Path(f"/proc/{worker.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status(worker.proc.pid)["VmRSS"]

        mariadb.execute(f"INSERT INTO t SELECT seq, seq % 1000, LPAD(seq, 60, 'c') FROM seq_1_to_{ROWS}",
                        database=DB)
        inserted = (ROWS + 1, sum(i % 1000 for i in range(1, ROWS + 1)))
        _wait_for(watchers, inserted, procs, 600)
        mariadb.execute("UPDATE t SET k = k + 1", database=DB)
        updated = (inserted[0], inserted[1] + inserted[0])
        _wait_for(watchers, updated, procs, 600)
        peak = _status(worker.proc.pid)["VmHWM"]
        print(f"worker RSS before {before / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB")  # shown with -s
        assert _log_count(worker, "large transaction applied") >= 2 * spans, "not applied streamed"
        assert peak < PEAK_TARGET, (
            f"worker peak RSS {peak / MIB:.0f} MiB over its {PEAK_TARGET / MIB:.0f} MiB target "
            f"(grew by {(peak - before) / MIB:.0f} MiB from {before / MIB:.0f} MiB)")

        # kill -9 while the next one is written: the downstream rolls it back, the checkpoint
        # has not moved, and the next worker applies all of it again.
        applied = _log_count(worker, "large transaction applied")
        mariadb.execute("UPDATE t SET k = k + 1", database=DB)
        again = (updated[0], updated[1] + updated[0])
        deadline = time.monotonic() + 600
        while _log_count(worker, "applying a large transaction") <= applied:
            assert worker.alive() and time.monotonic() < deadline, worker.tail_log(30)
            time.sleep(0.02)
        worker.kill()
        finished = _log_count(worker, "large transaction applied")
        assert finished < applied + spans, "every span finished before the kill"
        second = restart()
        _wait_for(watchers, again, [capture, second], 600)
    finally:
        for w in watchers:
            w.stop.set()
            w.join()

    # Each transaction arrived at once: only the states between whole transactions were seen;
    # the split feed's reader saw some in between (its commits of SPLIT_ROWS changes each).
    whole = {(1, 0), inserted, updated, again}
    for w in watchers:
        if w.name == "watch-split":
            assert set(w.seen) - whole, (w.name, w.seen)
        else:
            assert set(w.seen) <= whole, (w.name, w.seen)
    assert _log_count(worker, f'"split_rows": {SPLIT_ROWS}') >= 2, "the split feed not applied split"
    results = verify_targets([ShardRef(mariadb.url, DB, "t")], list(sinks.values()), DB, "t")
    assert all(r.ok for r in results), [r.diff for r in results if not r.ok]


def _count(w: Watcher) -> int | None:
    try:
        conn = w.connect()
    except Exception:
        return None
    try:
        return w.read(conn)[0]
    except Exception:  # the target appears with the first batch
        return None
    finally:
        conn.close()
