"""One large transaction end to end: peak memory of capture and of the sink-worker's process
tree, and the time from the upstream commit to the downstream holding its result, against the
same statement run directly on the downstream.

    .venv/bin/python -m benchmarks.bench_large_txn [--rows 1000000] [--rows 10000000] [--sink mariadb]

Per size: a source table of ``--rows`` rows (``id INT PRIMARY KEY, k INT, c CHAR(60), pad
CHAR(40)``, sysbench's shape) is copied downstream by the changefeed's initial load; once the
downstream holds every row, one ``UPDATE t SET k = k + 1`` (one transaction of ``--rows`` row
changes) runs upstream, and the benchmark waits until the downstream's ``SUM(k)`` equals the
source's (then checks the checksums). Memory is sampled (``benchmarks.memory``) from just before
the UPDATE: capture's process tree (capture and its binlog reader child) and the sink-worker's
(its Python process, the Spark JVM, the Python task processes), each the peak of their summed
RSS, beside what they held just before. The baseline: the same UPDATE on the downstream's own
copy of the table (after the replicated one), timed.

Memory targets (issue 32): capture 300 MiB, the worker's process tree 1 GiB.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from benchmarks.memory import MemorySampler, wait_while_alive, worker_tree_part  # noqa: E402
from benchmarks.output import Figures, add_json_option  # noqa: E402
from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1  # noqa: E402
from libs.changefeeds import record_changefeed  # noqa: E402
from libs.localservers.mariadb import MariaDB  # noqa: E402
from libs.localservers.nats_server import NatsServer  # noqa: E402
from libs.localservers.service_process import ServiceProcess  # noqa: E402
from tests.helpers.worker_env import SINK_TEST_PACING, SPARK_TEST_JAVA_OPTIONS, STANDALONE_WORKER_ENV  # noqa: E402

MIB = 1024 * 1024
CAPTURE_TARGET = 300 * MIB
WORKER_TARGET = 1024 * MIB
DB = "bigtxn"


def _say(text: str) -> None:
    print(f"[bench_large_txn {time.strftime('%H:%M:%S')}] {text}", flush=True)


def _fill(server: MariaDB, rows: int) -> None:
    server.execute(f"DROP DATABASE IF EXISTS {DB}", f"CREATE DATABASE {DB}")
    server.execute("CREATE TABLE t (id INT PRIMARY KEY, k INT NOT NULL, c CHAR(60) NOT NULL, "
                   "pad CHAR(40) NOT NULL)", database=DB)
    step = 200_000
    for lo in range(1, rows + 1, step):
        hi = min(rows, lo + step - 1)
        server.execute(f"INSERT INTO t SELECT seq, seq % 1000, LPAD(seq, 60, 'c'), LPAD(seq, 40, 'p') "
                       f"FROM seq_{lo}_to_{hi}", database=DB)


def _sum_k(server: MariaDB) -> tuple[int, int]:
    (count, total), = server.execute("SELECT COUNT(*), COALESCE(SUM(k), 0) FROM t", database=DB)
    return int(count), int(total)


async def _one(rows: int, work: Path, figures: Figures, env_extra: dict[str, str], within: float) -> None:
    nats_server = NatsServer(data_dir=work / "nats").start()
    source = MariaDB(data_dir=work / "source", server_id=11).start()
    down = MariaDB(data_dir=work / "down", server_id=12).start()
    procs: list[ServiceProcess] = []
    try:
        _say(f"{rows:,} rows: filling the source table")
        _fill(source, rows)
        down.execute(f"CREATE DATABASE IF NOT EXISTS {DB}")
        # A 10 s capture lease: capture encodes a reader batch on its event loop between lease
        # renewals, and on a machine loaded far past its cores a short lease expires meanwhile,
        # so capture starts the transaction over from its last mark (seen with 3 s at load 45).
        env = {"SLUICE_NATS_URL": nats_server.url, "SLUICE_LEASE_TTL_S": "10",
               "SLUICE_STATE_DB_URL": f"sqlite:///{work / 'state.db'}", "SLUICE_LOG_JSON": "true",
               "SLUICE_SPARK_DRIVER_JAVA_OPTIONS": SPARK_TEST_JAVA_OPTIONS, **SINK_TEST_PACING}
        logs = work / "logs"
        capture = ServiceProcess("services.capture", {
            **env, "SLUICE_SOURCE_ID": "big", "SLUICE_SOURCE_URL": f"{source.url_for(DB)}?heartbeat=0.5",
            "SLUICE_SOURCE_SERVER_ID": "4900", **env_extra}, logs, instance_id="capture-big").start()
        procs.append(capture)
        capture.wait_healthy(120)
        nc = await nats.connect(**nats_server.client_options())
        spec = ChangefeedSpecV2(id="big", sources=[SourceRefV1(id="big", url=source.url)],
                                filter=TableFilterV1(include=[f"{DB}.t"]), sink_url=down.url_for(DB),
                                initial_load="snapshot")
        await record_changefeed(nc.jetstream(), spec, requested_by="bench")
        await nc.close()
        worker = ServiceProcess("services.sink_worker", {**env, **STANDALONE_WORKER_ENV, **env_extra},
                                logs, instance_id="worker-big").start()
        procs.append(worker)
        worker.wait_healthy(180)
        want = _sum_k(source)
        took = wait_while_alive(lambda: _sum_k(down) == want, within, "initial load", procs)
        _say(f"initial load of {rows:,} rows done in {took:.0f}s")
        # Let the worker settle into idle rounds after the copy before the memory baseline.
        await asyncio.sleep(3)
        sampler = MemorySampler(lambda: {"capture": capture.proc.pid, "worker": worker.proc.pid},  # type: ignore[union-attr]
                                worker_tree_part, interval=0.25)
        sampler.sample()
        before = dict(sampler.peaks)
        sampler.peaks, sampler.peak_parts = {}, {}
        sampler.start()
        t0 = time.monotonic()
        source.execute("UPDATE t SET k = k + 1", database=DB)
        upstream_s = time.monotonic() - t0
        want = _sum_k(source)
        _say(f"UPDATE of {rows:,} rows committed upstream in {upstream_s:.1f}s; waiting for the downstream")
        wait_while_alive(lambda: _sum_k(down) == want, within, "the UPDATE downstream", procs)
        replicated_s = time.monotonic() - t0
        sampler.done.set()
        sampler.join()
        peaks = sampler.peaks
        (src_sum,), = source.execute("CHECKSUM TABLE t EXTENDED", database=DB)[0][1:],
        (down_sum,), = down.execute("CHECKSUM TABLE t EXTENDED", database=DB)[0][1:],
        equal = src_sum == down_sum
        t1 = time.monotonic()
        down.execute("UPDATE t SET k = k + 1", database=DB)
        direct_s = time.monotonic() - t1
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        _say(f"{rows:,}: replicated in {replicated_s:.1f}s (direct {direct_s:.1f}s), equal={equal}, "
             f"peaks {({k: round(v / MIB) for k, v in peaks.items()})} MiB, before "
             f"{({k: round(v / MIB) for k, v in before.items()})} MiB, load {load}")
        label = f"one UPDATE of {rows:,} rows ({rows:,} row changes, one transaction)"
        verdict = "equal" if equal else "DIFFER"
        figures.add(f"{label}: commit upstream -> result downstream (checksums {verdict})", replicated_s, "s",
                    baseline=f"the same UPDATE on the downstream directly {direct_s:.1f} s "
                    f"({replicated_s / max(direct_s, 1e-9):.1f}x); upstream {upstream_s:.1f} s")
        figures.add(f"{label}: capture peak RSS (capture + binlog reader child)", peaks["capture"] / MIB,
                    "MiB", baseline=f"{before['capture'] / MIB:.0f} MiB before the UPDATE",
                    target="< 300 MiB", met=peaks["capture"] < CAPTURE_TARGET)
        figures.add(f"{label}: sink-worker process tree peak RSS (Python, Spark JVM, Python tasks)",
                    peaks["worker"] / MIB, "MiB",
                    baseline=f"{before['worker'] / MIB:.0f} MiB before the UPDATE",
                    target="< 1024 MiB", met=peaks["worker"] < WORKER_TARGET)
        figures.extra.setdefault("parts", {})[str(rows)] = {
            tree: {k: round(v / MIB) for k, v in parts.items()} for tree, parts in sampler.peak_parts.items()}
        if not equal:
            raise RuntimeError("checksums differ after the UPDATE")
    finally:
        for p in procs:
            p.kill()
        down.stop()
        source.stop()
        nats_server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, action="append", help="transaction size(s); default 1,000,000")
    parser.add_argument("--within", type=float, default=3600, help="seconds each phase may take")
    parser.add_argument("--set", action="append", default=[], metavar="SLUICE_X=V",
                        help="a setting for capture and the worker (repeatable)")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    add_json_option(parser)
    args = parser.parse_args()
    figures = Figures("bench_large_txn")
    extra = dict(s.split("=", 1) for s in args.set)
    figures.extra["settings"] = extra
    for rows in args.rows or [1_000_000]:
        work = args.dir / str(rows) if args.dir else Path(tempfile.mkdtemp(prefix="sluice-bigtxn-"))
        shutil.rmtree(work, ignore_errors=True)
        asyncio.run(_one(rows, work, figures, extra, args.within))
        shutil.rmtree(work, ignore_errors=True)
    figures.write(args.json)


if __name__ == "__main__":
    main()
