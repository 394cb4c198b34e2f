"""Where a sink-worker's memory goes: its process tree by process and the Spark JVM by part,
started, after an initial load, after a burst of writes, and idle after them.

    .venv/bin/python -m benchmarks.bench_worker_memory [--tables 20] [--rows 5000] [--idle 75]
        [--test-env] [--nmt] [--set SLUICE_X=V ...] [--json PATH]

One MariaDB source with ``--tables`` tables of ``--rows`` rows (sysbench's shape), one changefeed
(initial load, then streaming) into a MariaDB downstream, capture and ONE standalone sink-worker
as processes. By default the worker runs with the settings a user gets from the README (only
the NATS URL, the state database and standalone mode set); ``--test-env`` gives it the process
tests' Spark settings instead (``tests/helpers/worker_env.py``: local[2], a 1g driver, C1 and the
serial GC), as ``bench_large_txn`` runs it.

At each point the worker's tree is listed process by process (its Python, the Spark driver's
JVM, PySpark's daemon and its forked Python workers) with RSS, PSS and private memory. RSS sums
count a page shared by several processes (the forked workers share the daemon's, every JVM maps
the class archive) once per process: the sum is an upper bound, and the one the other benchmarks'
memory figures use. PSS divides each shared page among its processes, so the tree's PSS sum is
what the tree really holds. With ``--nmt`` the JVM runs with native memory tracking and its
committed memory is split into heap, class metadata, threads, code cache, GC and the rest.

The idle point comes ``--idle`` seconds after the writes are downstream: Spark ends a Python
worker idle for a minute, so a longer idle shows the tree a quiet worker settles to.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from benchmarks.memory import (  # noqa: E402
    MemorySampler,
    children_by_parent,
    descendants,
    jvm_native_memory,
    rss,
    rss_by_mapping,
    smaps_rollup,
    wait_while_alive,
    worker_tree_part,
)
from benchmarks.output import Figures, add_json_option  # noqa: E402
from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1  # noqa: E402
from libs.changefeeds import record_changefeed  # noqa: E402
from libs.localservers.mariadb import MariaDB  # noqa: E402
from libs.localservers.nats_server import NatsServer  # noqa: E402
from libs.localservers.service_process import ServiceProcess  # noqa: E402
from tests.helpers.worker_env import SINK_TEST_PACING, SPARK_TEST_JAVA_OPTIONS, SPARK_WORKER_ENV  # noqa: E402

MIB = 1024 * 1024
WORKER_TARGET = 1024 * MIB
DB = "wmem"
NMT = "-XX:NativeMemoryTracking=summary"


def _say(text: str) -> None:
    print(f"[bench_worker_memory {time.strftime('%H:%M:%S')}] {text}", flush=True)


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def role(pid: int, root: int, argv: list[bytes], parents: dict[int, int], jvms: set[int]) -> str:
    """Which part of a sink-worker's tree a process is."""
    if pid == root:
        return "worker python"
    if pid in jvms:
        return "spark jvm"
    parent = parents.get(pid, 0)
    # PySpark's daemon is the JVM's child; the workers it forks are the daemon's.
    if parent in jvms:
        return "pyspark daemon"
    if parents.get(parent) in jvms:
        return "pyspark worker"
    return "other child"


def _spark_environ(pid: int) -> list[str]:
    """The Spark-related environment a PySpark daemon was started with (Spark starts one daemon
    per distinct Python environment of its jobs)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().decode(errors="replace").split("\0")
    except OSError:
        return []
    return sorted(e for e in entries if e.startswith(("SPARK", "PYSPARK", "PYTHON")))


def tree_snapshot(root: int, nmt: bool) -> dict[str, Any]:
    """Every process of the tree under ``root`` with its memory; the JVM's parts."""
    children = children_by_parent()
    parents = {child: parent for parent, kids in children.items() for child in kids}
    procs: list[dict[str, Any]] = []
    pids = descendants(root, children)
    argvs = {pid: rss(pid) for pid in pids}
    jvms = {pid for pid, (argv, _) in argvs.items() if argv and argv[0].endswith(b"java")}
    jvm_pid = min(jvms) if jvms else None
    for pid in pids:
        argv, size = argvs[pid]
        if not size:
            continue
        part = role(pid, root, argv, parents, jvms)
        procs.append({"pid": pid, "role": part, **{k: round(v / MIB) for k, v in smaps_rollup(pid).items()}})
        if part in ("worker python", "spark jvm"):
            procs[-1]["mappings"] = {k: round(v / MIB) for k, v in rss_by_mapping(pid).items() if v >= MIB}
        if part == "pyspark daemon":
            procs[-1]["env"] = _spark_environ(pid)
    out: dict[str, Any] = {"processes": procs,
                           "rss_sum": sum(p.get("rss", 0) for p in procs),
                           "pss_sum": sum(p.get("pss", 0) for p in procs),
                           "load": _load()}
    if jvm_pid is not None:
        heap = subprocess.run(["jcmd", str(jvm_pid), "GC.heap_info"], capture_output=True, text=True,
                              timeout=60).stdout
        out["heap_info"] = [line.strip() for line in heap.splitlines()[1:4] if line.strip()]
        if nmt:
            out["jvm_nmt"] = {k: round(v / MIB) for k, v in jvm_native_memory(jvm_pid).items() if v >= MIB}
    return out


def _show(label: str, snap: dict[str, Any]) -> None:
    _say(f"{label}: tree RSS sum {snap['rss_sum']} MiB, PSS sum {snap['pss_sum']} MiB (load {snap['load']})")
    for p in snap["processes"]:
        print(f"    {p['role']:16s} pid {p['pid']:>7}: RSS {p.get('rss', 0):5d}  PSS {p.get('pss', 0):5d}  "
              f"private {p.get('private', 0):5d} MiB", flush=True)
        if p.get("mappings"):
            mapped = ", ".join(f"{k} {v}" for k, v in p["mappings"].items())
            print(f"      resident by mapping (MiB): {mapped}", flush=True)
    daemons = [p for p in snap["processes"] if p["role"] == "pyspark daemon"]
    if len(daemons) > 1:
        first = set(daemons[0].get("env", []))
        for d in daemons[1:]:
            print(f"    daemon {d['pid']} env differs from {daemons[0]['pid']}'s: "
                  f"{sorted(set(d.get('env', [])) ^ first)}", flush=True)
    for line in snap.get("heap_info", []):
        print(f"    heap: {line}", flush=True)
    if snap.get("jvm_nmt"):
        print("    jvm committed (NMT, MiB): " + ", ".join(f"{k} {v}" for k, v in snap["jvm_nmt"].items()),
              flush=True)


def _fill(server: MariaDB, tables: int, rows: int) -> None:
    server.execute(f"DROP DATABASE IF EXISTS {DB}", f"CREATE DATABASE {DB}")
    for i in range(tables):
        server.execute(f"CREATE TABLE t{i} (id INT PRIMARY KEY, k INT NOT NULL, c CHAR(60) NOT NULL, "
                       f"pad CHAR(40) NOT NULL)",
                       f"INSERT INTO t{i} SELECT seq, seq % 1000, LPAD(seq, 60, 'c'), LPAD(seq, 40, 'p') "
                       f"FROM seq_1_to_{rows}", database=DB)


def _sums(server: MariaDB, tables: int) -> list[tuple[int, int]]:
    out = []
    for i in range(tables):
        (count, total), = server.execute(f"SELECT COUNT(*), COALESCE(SUM(k), 0) FROM t{i}", database=DB)
        out.append((int(count), int(total)))
    return out


async def run(args: argparse.Namespace, work: Path, figures: Figures) -> None:
    nats_server = NatsServer(data_dir=work / "nats").start()
    source = MariaDB(data_dir=work / "source", server_id=11).start()
    down = MariaDB(data_dir=work / "down", server_id=12).start()
    procs: list[ServiceProcess] = []
    try:
        _fill(source, args.tables, args.rows)
        down.execute(f"CREATE DATABASE IF NOT EXISTS {DB}")
        env = {"SLUICE_NATS_URL": nats_server.url, "SLUICE_LEASE_TTL_S": "10",
               "SLUICE_STATE_DB_URL": f"sqlite:///{work / 'state.db'}", "SLUICE_LOG_JSON": "true"}
        worker_env: dict[str, str] = {**env, "SLUICE_SINK_STANDALONE": "true"}
        java_options = ""
        if args.test_env:
            worker_env |= {**SPARK_WORKER_ENV, **SINK_TEST_PACING}
            java_options = SPARK_TEST_JAVA_OPTIONS
        extra = dict(s.split("=", 1) for s in args.set)
        java_options = extra.pop("SLUICE_SPARK_DRIVER_JAVA_OPTIONS", java_options)
        if args.nmt:
            java_options = f"{java_options} {NMT}".strip()
        if java_options:
            worker_env["SLUICE_SPARK_DRIVER_JAVA_OPTIONS"] = java_options
        worker_env |= extra
        logs = work / "logs"
        capture = ServiceProcess("services.capture", {
            **env, "SLUICE_SOURCE_ID": "wm", "SLUICE_SOURCE_URL": f"{source.url_for(DB)}?heartbeat=0.5",
            "SLUICE_SOURCE_SERVER_ID": "4901"}, logs, instance_id="capture-wm").start()
        procs.append(capture)
        capture.wait_healthy(120)
        nc = await nats.connect(**nats_server.client_options())
        spec = ChangefeedSpecV2(id="wm", sources=[SourceRefV1(id="wm", url=source.url)],
                                filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=down.url_for(DB),
                                initial_load="snapshot")
        await record_changefeed(nc.jetstream(), spec, requested_by="bench")
        await nc.close()
        worker = ServiceProcess("services.sink_worker", worker_env, logs, instance_id="worker-wm").start()
        procs.append(worker)
        worker.wait_healthy(180)
        assert worker.proc is not None
        root = worker.proc.pid
        sampler = MemorySampler(lambda: {"worker": root}, worker_tree_part, interval=0.5,
                                on_error=lambda exc: None)
        sampler.start()
        snaps: dict[str, dict[str, Any]] = {}
        snaps["healthy"] = tree_snapshot(root, args.nmt)
        _show("healthy", snaps["healthy"])
        want = _sums(source, args.tables)
        took = wait_while_alive(lambda: _sums(down, args.tables) == want, args.within, "initial load", procs)
        snaps["after initial load"] = tree_snapshot(root, args.nmt)
        _show(f"initial load of {args.tables} x {args.rows:,} rows downstream in {took:.0f}s",
              snaps["after initial load"])
        t0 = time.monotonic()
        step = 100
        with source.connect(DB) as conn, conn.cursor() as cur:
            for lo in range(1, args.rows + 1, step):
                for i in range(args.tables):
                    cur.execute(f"UPDATE t{i} SET k = k + 1 WHERE id BETWEEN {lo} AND {lo + step - 1}")
                    conn.commit()
        want = _sums(source, args.tables)
        took = wait_while_alive(lambda: _sums(down, args.tables) == want, args.within, "the writes", procs)
        changes = args.tables * args.rows
        snaps["after writes"] = tree_snapshot(root, args.nmt)
        _show(f"{changes:,} row changes in {changes // step:,} transactions downstream "
              f"{time.monotonic() - t0:.0f}s after the first", snaps["after writes"])
        figures.add(f"{changes:,} row changes ({step}-row transactions over {args.tables} tables): "
                    f"first write upstream -> all downstream", time.monotonic() - t0, "s")
        idle_done = threading.Event()
        idle_done.wait(args.idle)  # the idle period is what is measured, not a synchronisation
        snaps[f"idle {args.idle:.0f}s"] = tree_snapshot(root, args.nmt)
        _show(f"idle {args.idle:.0f}s after the writes", snaps[f"idle {args.idle:.0f}s"])
        sampler.done.set()
        sampler.join()
        trims = [line.strip()[:300] for line in worker.log_path.read_text(errors="replace").splitlines()
                 if "memory given back" in line or "giving memory back" in line]
        _say(f"the worker gave memory back {len(trims)} times" + "".join(f"\n    {t}" for t in trims))
        figures.extra["trims"] = trims
        peak = sampler.peaks.get("worker", 0)
        _say(f"peak tree RSS sum {peak / MIB:.0f} MiB by part "
             f"{ {k: round(v / MIB) for k, v in sampler.peak_parts.get('worker', {}).items()} }")
        for label, snap in snaps.items():
            figures.add(f"sink-worker tree {label}: RSS sum (PSS sum {snap['pss_sum']} MiB)", snap["rss_sum"],
                        "MiB", target="< 1024 MiB", met=snap["rss_sum"] * MIB < WORKER_TARGET)
        figures.add("sink-worker tree peak RSS sum (sampled every 0.5 s)", peak / MIB, "MiB",
                    target="< 1024 MiB", met=peak < WORKER_TARGET)
        figures.extra["snapshots"] = snaps
        figures.extra["settings"] = {k: v for k, v in worker_env.items() if k.startswith("SLUICE_SPARK")
                                     or k.startswith("SLUICE_SINK")}
    finally:
        for p in procs:
            p.kill()
        down.stop()
        source.stop()
        nats_server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=20)
    parser.add_argument("--rows", type=int, default=5000, help="rows per table")
    parser.add_argument("--idle", type=float, default=75, help="seconds idle after the writes")
    parser.add_argument("--within", type=float, default=900, help="seconds each phase may take")
    parser.add_argument("--test-env", action="store_true", help="the process tests' Spark settings")
    parser.add_argument("--nmt", action="store_true", help="JVM native memory tracking (jcmd)")
    parser.add_argument("--set", action="append", default=[], metavar="SLUICE_X=V",
                        help="a setting of the worker (repeatable; java options replace the default ones)")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    add_json_option(parser)
    args = parser.parse_args()
    figures = Figures("bench_worker_memory")
    work = args.dir or Path(tempfile.mkdtemp(prefix="sluice-wmem-"))
    shutil.rmtree(work, ignore_errors=True)
    _say(f"load {_load()}")
    asyncio.run(run(args, work, figures))
    shutil.rmtree(work, ignore_errors=True)
    figures.write(args.json)


if __name__ == "__main__":
    main()
