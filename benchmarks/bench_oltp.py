"""Keep up with a real OLTP source: sysbench against a source, the whole system as processes.

    .venv/bin/python -m benchmarks.bench_oltp [--downstream mariadb postgres] [--tables 4]
        [--table-size 100000] [--write-threads 8] [--write-s 60] [--rw-threads 4] [--rw-s 60]
        [--json PATH]

For each downstream, one ``LocalSystem`` (nats-server, a MariaDB source, the control plane with
one replica per service, one sink-worker placed by the scheduler, capture, the api) as in
``bench_e2e``, and beside it a **native MariaDB replica** of the same source (GTID replication,
``libs/localservers``): the physical anchor, under the very same load.

1. ``sysbench oltp_write_only prepare`` (its default table shape) on the source, replicated
   natively; then ``oltp_write_only`` (``--write-threads``, ``--write-s``) *without* capture
   running: the source's TPS without Sluice.
2. The services start; a changefeed of ``sbtest.*`` with the README's defaults (initial load
   ``snapshot``, then streaming) into the downstream; wait until its checkpoint is within 2 s.
3. ``oltp_write_only`` again with capture running, then ``oltp_read_write`` (``--rw-threads``,
   ``--rw-s``). During each, every 0.5 s: Sluice's lag (now - the changefeed's checkpoint ts)
   and the replica's ``Seconds_Behind_Master``. After each: catch-up time, from the end of the
   load until the checkpoint passes it (Sluice) and until the replica's ``gtid_slave_pos`` is
   the source's ``gtid_binlog_pos`` (native).
4. Verdict: an ordered row hash of every table, source against downstream (EQUAL, or the
   differing ids).

Targets (issue 29): lag p99 < 2 s and catch-up < 5 s under ``oltp_write_only``, never more than
1 s behind the native replica's lag; upstream TPS with capture >= 0.9x without; EQUAL.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import sysbench  # noqa: E402
from benchmarks.memory import children_by_parent, tree_cpu  # noqa: E402
from benchmarks.output import Figures, add_json_option  # noqa: E402
from libs.localservers.common import wait_until  # noqa: E402
from libs.localservers.mariadb import MariaDB  # noqa: E402
from libs.localservers.postgres import PostgreSQL  # noqa: E402
from libs.localservers.system import LocalSystem  # noqa: E402
from libs.telemetry.metrics import lag_seconds  # noqa: E402
from services.capture.ts_clock import physical_ms  # noqa: E402
from tests.helpers.control_plane import Recorder  # noqa: E402

CF = "oltp"
LAG_P99_S = 2.0
CATCH_UP_S = 5.0
TPS_RATIO = 0.9


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Phase:
    script: str
    threads: int
    seconds: int
    result: sysbench.SysbenchResult
    lags: list[float]
    capture_lags: list[float]
    replica_lags: list[float]
    catch_up: float | None
    replica_catch_up: float | None
    cpu: dict[str, float]
    """% of one core over the load, by process tree (``cpu_split``)."""


class Run:
    def __init__(self, system: LocalSystem, replica: MariaDB, rec: Recorder,
                 args: argparse.Namespace) -> None:
        self.system = system
        self.source = system.source_dbs[0]
        self.replica = replica
        self.rec = rec
        self.args = args

    def checkpoint_ms(self) -> int | None:
        advances = [a for a in self.rec.advances if a.changefeed == CF]
        return physical_ms(max(a.checkpoint_ts for a in advances)) if advances else None

    def lag(self) -> float | None:
        advances = [a for a in self.rec.advances if a.changefeed == CF]
        return lag_seconds(max(a.checkpoint_ts for a in advances)) if advances else None

    def capture_lag(self) -> float | None:
        """now - the source's resolved ts as the replication-manager last saw it: capture's
        part of the lag."""
        advances = [a for a in self.rec.advances if a.changefeed == CF]
        return lag_seconds(max(a.resolved_ts for a in advances)) if advances else None

    def replica_lag(self) -> float | None:
        value = self.replica.replica_status().get("Seconds_Behind_Master")
        return float(value) if value is not None else None

    def replica_caught_up(self) -> bool:
        want = str(self.source.execute("SELECT @@gtid_binlog_pos")[0][0])
        have = str(self.replica.execute("SELECT @@gtid_slave_pos")[0][0])
        return want == have

    def cpu_roots(self, sysbench_pid: int) -> dict[str, int]:
        roots = self.system.process_pids()
        roots["sysbench"] = sysbench_pid
        if self.replica.proc is not None:
            roots["native replica"] = self.replica.proc.pid
        if isinstance(self.system.downstream_db, PostgreSQL) and self.system.downstream_db.proc is not None:
            roots["PostgreSQL downstream"] = self.system.downstream_db.proc.pid
        return roots

    async def load(self, script: str, threads: int, seconds: int) -> Phase:
        lags: list[float] = []
        capture_lags: list[float] = []
        replica_lags: list[float] = []
        proc = sysbench.start_run(self.source, script, tables=self.args.tables,
                                  table_size=self.args.table_size, threads=threads, seconds=seconds)
        roots = self.cpu_roots(proc.pid)
        cpu_start, cpu_t0 = tree_cpus(roots), time.monotonic()
        cpu_end, cpu_t1 = cpu_start, cpu_t0
        while proc.poll() is None:
            # The last sample before sysbench exits: its own CPU is lost with it after that.
            cpu_end, cpu_t1 = tree_cpus(roots), time.monotonic()
            lag = self.lag()
            if lag is not None:
                lags.append(lag)
            clag = self.capture_lag()
            if clag is not None:
                capture_lags.append(clag)
            rlag = await asyncio.to_thread(self.replica_lag)
            if rlag is not None:
                replica_lags.append(rlag)
            await asyncio.sleep(0.5)
        result = await asyncio.to_thread(sysbench.finish, proc, script, threads)
        ended = time.time()
        end_ms = int(ended * 1000)

        def sluice_done() -> bool:
            got = self.checkpoint_ms()
            return got is not None and got >= end_ms

        sluice_at = replica_at = None
        deadline = ended + self.args.catch_up_limit_s
        while time.time() < deadline and (sluice_at is None or replica_at is None):
            if sluice_at is None and sluice_done():
                sluice_at = time.time() - ended
            if replica_at is None and await asyncio.to_thread(self.replica_caught_up):
                replica_at = time.time() - ended
            await asyncio.sleep(0.1)
        wall = max(cpu_t1 - cpu_t0, 1e-9)
        cpu = {name: 100 * (cpu_end.get(name, 0.0) - cpu_start.get(name, 0.0)) / wall for name in roots}
        return Phase(script, threads, seconds, result, lags, capture_lags, replica_lags, sluice_at,
                     replica_at, cpu)


def tree_cpus(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds of each root's process tree (a process that exited meanwhile counts 0)."""
    children = children_by_parent()
    return {name: tree_cpu(root, children) for name, root in roots.items()}


def table_digests(rows_of: Any, tables: int) -> dict[str, dict[int, str]]:
    """Per table, each row's hash by id (CHAR values compared without trailing spaces: a
    PostgreSQL ``character(n)`` pads them, MariaDB's does not)."""
    out: dict[str, dict[int, str]] = {}
    for n in range(1, tables + 1):
        table = f"sbtest{n}"
        out[table] = {int(r[0]): hashlib.sha256(repr((int(r[0]), int(r[1]), str(r[2]).rstrip(),
                                                      str(r[3]).rstrip())).encode()).hexdigest()
                      for r in rows_of(table)}
    return out


def verdict(source: MariaDB, down: MariaDB | PostgreSQL, tables: int) -> tuple[bool, str]:
    query = "SELECT id, k, c, pad FROM sbtest.{t} ORDER BY id"
    up = table_digests(lambda t: source.execute(query.format(t=t)), tables)
    dn = table_digests(lambda t: down.execute(query.format(t=t)), tables)
    problems = []
    for table, rows in up.items():
        other = dn.get(table, {})
        whole_up = hashlib.sha256("".join(rows[k] for k in sorted(rows)).encode()).hexdigest()
        whole_dn = hashlib.sha256("".join(other[k] for k in sorted(other)).encode()).hexdigest()
        if whole_up != whole_dn:
            ids = sorted(k for k in set(rows) | set(other) if rows.get(k) != other.get(k))
            problems.append(f"{table}: {len(ids)} rows differ (ids {ids[:10]})")
    return not problems, "EQUAL" if not problems else "; ".join(problems)


async def one_downstream(downstream: str, args: argparse.Namespace, out: Figures) -> None:
    base = args.dir / downstream
    shutil.rmtree(base, ignore_errors=True)
    system = LocalSystem(base_dir=base, sources=1, downstream=downstream,  # type: ignore[arg-type]
                         control_replicas=1, workers=1, with_api=True, standalone_workers=False,
                         initial_load="snapshot")
    replica = MariaDB(data_dir=base / "native-replica", server_id=900)
    rec = Recorder()
    try:
        system.start_infra()
        assert system.nats is not None and system.downstream_db is not None
        source = system.source_dbs[0]
        replica.start()
        replica.replicate_from(source)
        _say(f"[{downstream}] sysbench prepare: {args.tables} tables of {args.table_size:,} rows")
        await asyncio.to_thread(sysbench.prepare, source, args.tables, args.table_size)
        _say(f"[{downstream}] oltp_write_only without capture ({args.write_threads} threads, "
             f"{args.write_s} s)")
        alone = await asyncio.to_thread(sysbench.run, source, "oltp_write_only", tables=args.tables,
                                        table_size=args.table_size, threads=args.write_threads,
                                        seconds=args.write_s)
        _say(f"[{downstream}]   {alone.tps:,.0f} TPS, {alone.rows_per_s:,.0f} row changes/s")
        await rec.start(system.nats.url)
        system.start_services()
        await asyncio.to_thread(system.wait_healthy, 240)
        await system.create_changefeed(system.changefeed_spec(CF, include=["sbtest.*"]), "bench")
        run = Run(system, replica, rec, args)
        started = time.time()

        def near() -> bool:
            lag = run.lag()
            return lag is not None and lag < 2.0

        await asyncio.to_thread(wait_until, near, args.catch_up_limit_s,
                                "initial load and checkpoint within 2 s", 0.5)
        _say(f"[{downstream}] initial load done, checkpoint within 2 s after {time.time() - started:.1f} s")
        phases = [await run.load("oltp_write_only", args.write_threads, args.write_s)]
        if args.rw_s > 0:
            phases.append(await run.load("oltp_read_write", args.rw_threads, args.rw_s))
        equal, said = await asyncio.to_thread(verdict, source, system.downstream_db, args.tables)
        _say(f"[{downstream}] verdict: {said}")
        into = "MariaDB" if downstream == "mariadb" else "PostgreSQL"
        for phase in phases:
            what = f"{phase.script}, {phase.threads} threads, {phase.seconds} s, into {into}"
            res = phase.result
            _say(f"[{downstream}] {what}: {res.tps:,.0f} TPS; lag p50 {_pct(phase.lags, .5):.2f} p99 "
                 f"{_pct(phase.lags, .99):.2f} max {max(phase.lags, default=float('nan')):.2f} s; catch-up "
                 f"{phase.catch_up}; replica lag max {max(phase.replica_lags, default=float('nan'))}, "
                 f"catch-up {phase.replica_catch_up}")
            by_cpu = sorted(phase.cpu.items(), key=lambda kv: -kv[1])
            _say(f"[{downstream}]   CPU during it, % of one core by process tree (2 cores = 200): "
                 + ", ".join(f"{name} {pct:.0f}" for name, pct in by_cpu))
            write_only = phase.script == "oltp_write_only"
            native = (f"native GTID replica, same run: Seconds_Behind_Master p50 "
                      f"{_pct(phase.replica_lags, .5):.0f} s, p99 {_pct(phase.replica_lags, .99):.0f} s, "
                      f"max {max(phase.replica_lags, default=float('nan')):.0f} s")
            out.add(f"upstream {what}, capture running: {res.transactions:,} transactions, "
                    f"{res.row_changes:,} row changes ({res.rows_per_s:,.0f}/s)", res.tps, "transactions/s",
                    baseline=(f"capture stopped: {alone.tps:,.0f} TPS ({res.tps / alone.tps:.2f}x)"
                              if write_only else None),
                    target=f">= {TPS_RATIO}x without capture" if write_only else None,
                    met=res.tps >= TPS_RATIO * alone.tps if write_only else None)
            if phase.lags:
                p99 = _pct(phase.lags, .99)
                out.add(f"Sluice lag p99 (now - changefeed checkpoint, sampled every 0.5 s; p50 "
                        f"{_pct(phase.lags, .5):.2f} s, max {max(phase.lags):.2f} s), {what}", p99, "s",
                        baseline=(f"{native}; capture's own lag (now - resolved ts) p99 "
                                  f"{_pct(phase.capture_lags, .99):.2f} s"),
                        target=f"< {LAG_P99_S:.0f} s and <= native + 1 s" if write_only else None,
                        met=(p99 < LAG_P99_S and p99 <= _pct(phase.replica_lags, .99) + 1) if write_only
                        else None)
            else:
                out.not_measured(f"Sluice lag p99, {what}", "s", "no checkpoint during the load",
                                 baseline=native)
            native_catch = (f"native replica: {phase.replica_catch_up:.2f} s"
                            if phase.replica_catch_up is not None
                            else f"native replica: not within {args.catch_up_limit_s:.0f} s")
            if phase.catch_up is not None:
                out.add(f"catch-up after the load ends (checkpoint past its end), {what}",
                        phase.catch_up, "s",
                        baseline=native_catch, target=f"< {CATCH_UP_S:.0f} s" if write_only else None,
                        met=phase.catch_up < CATCH_UP_S if write_only else None)
            else:
                out.not_measured(f"catch-up after the load ends, {what}", "s",
                                 f"not within {args.catch_up_limit_s:.0f} s", baseline=native_catch)
        out.add(f"verdict into {into}: ordered row hash of every table, source against downstream "
                f"({said})", 1.0 if equal else 0.0, "equal", target="EQUAL", met=equal)
        out.extra.setdefault("phases", {})[downstream] = [
            {"script": p.script, "threads": p.threads, "tps": p.result.tps, "lags": p.lags, "cpu": p.cpu,
             "capture_lags": p.capture_lags,
             "replica_lags": p.replica_lags, "catch_up": p.catch_up, "replica_catch_up": p.replica_catch_up}
            for p in phases]
        out.extra.setdefault("tps_without_capture", {})[downstream] = alone.tps
    finally:
        await rec.stop()
        for name, proc in system.processes.items():
            if name.startswith("sink-worker"):
                proc.kill()
        system.stop()
        replica.stop()


async def main_async(args: argparse.Namespace) -> None:
    args.dir = args.dir.resolve()
    out = Figures("bench_oltp")
    sysbench.ensure_sysbench()
    for downstream in args.downstream:
        await one_downstream(downstream, args, out)
        out.write(args.json)
    out.write(args.json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--downstream", nargs="+", choices=("mariadb", "postgres"),
                        default=["mariadb", "postgres"])
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--table-size", type=int, default=100_000)
    parser.add_argument("--write-threads", type=int, default=8)
    parser.add_argument("--write-s", type=int, default=60)
    parser.add_argument("--rw-threads", type=int, default=4)
    parser.add_argument("--rw-s", type=int, default=60, help="0: no oltp_read_write phase")
    parser.add_argument("--catch-up-limit-s", type=float, default=600.0,
                        help="time box of the initial load and of each catch-up")
    parser.add_argument("--dir", type=Path, default=ROOT / ".sluice" / "bench-oltp")
    add_json_option(parser)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
