"""Many real tables: one source with ``--tables`` tables, one changefeed over all of them, the
whole system as processes with 3 sink-workers (issue 33, item 1).

    .venv/bin/python -m benchmarks.bench_tables [--tables 10000] [--per-schema 100] [--rows 3]
        [--workers 3] [--control-replicas 2] [--settle-s 20] [--idle-s 30] [--timeout-s 900]
        [--write-rows-s 2000] [--write-s 30] [--kill-timeout-s 300]
        [--dir .sluice/bench-tables] [--json PATH]

``LocalSystem`` as ``bench_e2e`` starts it (control plane on, the api, capture of one MariaDB
source, MariaDB downstream, sink-workers placed by the scheduler, Spark ``local[1]`` in each),
with ``--workers`` sink-workers. Before any service starts, the source gets ``--tables`` tables
in schemas of ``--per-schema`` (``bt000.t000`` ...: INT key, a VARCHAR, ``--rows`` rows each;
the time this takes is printed, not judged). Then one changefeed over ``bt*.*`` with an initial
load (``snapshot``: every table is a span at once, from the source's catalog). Figures:

1. create -> every span Replicating (the replication stream's ``set_changed``, as recorded);
2. create -> the initial load of every table done (the snapshots bucket: every span ``done``),
   checked against the downstream on a sample of tables (row counts);
3. with every span replicating and no writes, after ``--settle-s``: CPU of every service's
   process tree over ``--idle-s`` (% of one core; a sink-worker's tree holds its Spark JVM), its
   RSS then, and the peak RSS of each through the whole run; nats-server and the databases
   beside them, not judged;
4. where it goes: consumers on the ROWS stream, metric series each service exports, the
   processes' threads;
5. the operator's view: the api's answer for the first page (500) of ``changefeed tables`` and
   for every page, and the CLI's (``sluice --json changefeed tables``, a process) for the list;
6. lag under writes: single-row INSERT transactions at ``--write-rows-s`` over tables drawn
   uniformly from all of them for ``--write-s`` (4 connections, paced), the changefeed
   checkpoint's lag (the replication-manager leader's) sampled every 0.5 s: p50/p99/max, and
   the catch-up after the writes end;
7. kill -9 of the worker holding the most spans: the time until every span replicates on
   another member.

Targets (issue 33, this 2-core machine): every span replicating < 60 s after create (at 10,000
tables); idle CPU of the whole system < 10 % of one core; capture < 300 MiB; each worker < 1 GiB;
lag p99 < 2 s at 2,000 rows/s; a killed worker's spans replicating elsewhere < 5 s.
The load average is printed with every figure: other work on the machine shares its 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
from nats.js.errors import BucketNotFoundError, NotFoundError  # noqa: E402

from benchmarks.bench_e2e import _start_healthy  # noqa: E402
from benchmarks.e2e_figures import pct  # noqa: E402
from benchmarks.memory import MemorySampler, children_by_parent, descendants, rss, tree_cpu  # noqa: E402
from benchmarks.output import Figures, add_json_option  # noqa: E402
from contracts.events.members import MemberJoinedV2  # noqa: E402
from libs.localservers.mariadb import MariaDB  # noqa: E402
from libs.localservers.system import LocalSystem  # noqa: E402
from libs.streams import ROWS_STREAM, SNAPSHOT_BUCKET  # noqa: E402
from libs.ts import ts_seconds  # noqa: E402
from tests.helpers.control_plane import Recorder, eventually  # noqa: E402

CF = "tables"
PREFIX = "bt"
GIB = 2**30
MIB = 2**20


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _part(_pid: int, _root: int, argv: list[bytes]) -> str:
    return "Spark JVM" if b"java" in argv[0] else (
        "Python workers" if b"pyspark" in b" ".join(argv) else "service process")


# ----------------------------------------------------------------------------- the source


def table_names(tables: int, per_schema: int) -> list[tuple[str, str]]:
    return [(f"{PREFIX}{i // per_schema:03d}", f"t{i % per_schema:03d}") for i in range(tables)]


def create_tables(source: MariaDB, names: list[tuple[str, str]], rows: int, threads: int = 4) -> None:
    """Every schema and table, ``rows`` rows each, over a few connections (DDL is mostly fsync)."""
    schemas = sorted({s for s, _ in names})
    source.execute(*(f"CREATE DATABASE IF NOT EXISTS `{s}`" for s in schemas))
    values = ",".join(f"({i},'row {i}')" for i in range(1, rows + 1))

    def create(part: list[tuple[str, str]]) -> None:
        conn = source.connect()
        try:
            with conn.cursor() as cur:
                for schema, table in part:
                    cur.execute(f"CREATE TABLE IF NOT EXISTS `{schema}`.`{table}` "
                                "(id INT PRIMARY KEY, v VARCHAR(32) NOT NULL)")
                    if rows:
                        cur.execute(f"INSERT IGNORE INTO `{schema}`.`{table}` VALUES {values}")
                conn.commit()
        finally:
            conn.close()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(create, [names[i::threads] for i in range(threads)]))


# ----------------------------------------------------------------------------- progress


class LoadWatch:
    """The snapshots bucket watched: the newest initial-load state of every span."""

    def __init__(self) -> None:
        self.states: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def done(self) -> int:
        return sum(1 for s in self.states.values() if s == "done")

    def failed(self) -> list[str]:
        return [k for k, s in self.states.items() if s == "failed"]

    async def start(self, url: str) -> None:
        self._task = asyncio.create_task(self._run(url))

    async def _run(self, url: str) -> None:
        nc = await nats.connect(url, max_reconnect_attempts=-1)
        try:
            js = nc.jetstream()
            while not self._stop.is_set():
                try:
                    kv = await js.key_value(SNAPSHOT_BUCKET)
                except (BucketNotFoundError, NotFoundError):
                    await asyncio.sleep(0.5)  # no worker has created it yet: poll for it
                    continue
                watcher = await kv.watchall()
                while not self._stop.is_set():
                    try:
                        entry = await watcher.updates(timeout=1.0)
                    except TimeoutError:
                        continue
                    if entry is None or entry.value is None:
                        continue
                    try:
                        self.states[entry.key] = str(json.loads(entry.value).get("state"))
                    except ValueError:
                        continue
        finally:
            await nc.close()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


# ----------------------------------------------------------------------------- idle figures


def tree_rss(root: int, children: dict[int, list[int]]) -> tuple[int, int]:
    """(summed RSS, threads) of a process tree."""
    total = threads = 0
    for pid in descendants(root, children):
        total += rss(pid)[1]
        try:
            threads += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return total, threads


_STAGE = re.compile(r'^sluice_sink_round_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$')


def _metrics(port: int) -> str | None:
    """A service's /metrics text; None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return str(r.read().decode())
    except OSError:
        return None


def round_stages(port: int) -> dict[tuple[str, str], float]:
    """A sink-worker's round stage seconds so far: ``(stage, "sum"|"count") -> value``."""
    out: dict[tuple[str, str], float] = {}
    for line in (_metrics(port) or "").splitlines():
        m = _STAGE.match(line)
        if m:
            out[(m.group(2), m.group(1))] = float(m.group(3))
    return out


def stage_means(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> str:
    """Rounds between two ``round_stages`` and each stage's mean seconds a round."""
    stages = sorted({stage for stage, _ in after})
    rounds = after.get((stages[0], "count"), 0.0) - before.get((stages[0], "count"), 0.0) if stages else 0
    if not rounds:
        return "no round"
    means = ", ".join(f"{stage} {(after[(stage, 'sum')] - before.get((stage, 'sum'), 0.0)) / rounds:.2f} s"
                      for stage in stages)
    return f"{rounds:.0f} rounds, a round's mean: {means}"


def metric_series(port: int) -> int:
    """Sample lines a service's /metrics exports (one per label set): its label cardinality."""
    text = _metrics(port)
    if text is None:
        return -1
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def start_healthy(system: LocalSystem, within: float) -> None:
    """``bench_e2e``'s start (a service whose port was taken meanwhile is started again), also
    when the taken port answers with another protocol (a nats-server's INFO line)."""
    deadline = time.monotonic() + within
    while True:
        try:
            _start_healthy(system, max(1.0, deadline - time.monotonic()))
            return
        except http.client.HTTPException:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)  # the process behind that port is not ours: it exited; start it again


def replication_status(system: LocalSystem) -> dict[str, Any]:
    """The replication-manager leader's status (its /healthz), or {} when none answers."""
    for name, proc in list(system.processes.items()):
        if name.startswith("replication-manager") and proc.alive():
            health = proc.health() or {}
            if health.get("leader"):
                return dict(health.get("replication") or {})
    return {}


def joined_members(rec: Recorder) -> set[str]:
    return {e.member_id for _t, e in rec.member_events if isinstance(e, MemberJoinedV2)}


def service_of(name: str) -> str:
    if name.startswith(("nats", "MariaDB")):
        return name
    return name.rsplit("-", 1)[0]


# ----------------------------------------------------------------------------- operator, kill


def time_tables_listing(system: LocalSystem, out: Figures, tag: str, tables: int) -> bool:
    """The api's answer for the first page of ``changefeed tables`` and for every page, and the
    CLI's for the whole list (a process, as an operator runs it); True when each listed every
    table."""
    api = system.processes["api-1"]
    base = f"http://127.0.0.1:{api.port}/api/v1/changefeeds/{CF}/tables"
    auth = {"Authorization": f"Bearer {system.api_token}"}

    def page(after: str | None) -> tuple[list[Any], str | None]:
        query = f"?limit=500&after={urllib.parse.quote(after)}" if after else "?limit=500"
        req = urllib.request.Request(base + query, headers=auth)
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read()), resp.headers.get("X-Next-After")

    t0 = time.perf_counter()
    rows, cursor = page(None)
    first_s = time.perf_counter() - t0
    pages = 1
    while cursor:
        more, cursor = page(cursor)
        rows += more
        pages += 1
    all_s = time.perf_counter() - t0
    env = {**os.environ, "SLUICE_API_URL": f"http://127.0.0.1:{api.port}",
           "SLUICE_API_TOKEN": system.api_token}
    t0 = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / "sluice"), "--json", "changefeed", "tables", CF],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    cli_s = time.perf_counter() - t0
    cli_rows = len(json.loads(done.stdout)) if done.returncode == 0 else -1
    _say(f"changefeed tables: api first page (500) {first_s:.2f} s, all {pages} pages {all_s:.2f} s "
         f"({len(rows):,} tables); CLI --json {cli_s:.2f} s ({cli_rows:,} tables) (load {_load()})")
    out.add(f"api GET changefeed tables, first page of 500 ({tag}; load {_load()})", first_s, "s")
    out.add(f"api GET changefeed tables, all {pages} pages ({tag})", all_s, "s")
    out.add(f"CLI `sluice --json changefeed tables` as a process ({tag})", cli_s, "s")
    return len(rows) == tables and cli_rows == tables


def _checkpoint_s(system: LocalSystem) -> float | None:
    """The changefeed's checkpoint (Unix seconds) as the replication-manager leader has it."""
    found = (replication_status(system).get("checkpoints") or {}).get(CF) or {}
    ts = found.get("checkpoint_ts")
    return ts_seconds(int(ts)) if ts else None


async def lag_under_writes(system: LocalSystem, out: Figures, tag: str, names: list[tuple[str, str]],
                           rate: float, seconds: float) -> None:
    """Single-row INSERT transactions at ``rate`` rows/s, each into a table drawn uniformly from
    every table, for ``seconds``: the changefeed checkpoint's lag sampled every 0.5 s, and the
    catch-up once the writes end."""
    source = system.source_dbs[0]
    threads = 4
    stop = threading.Event()
    written = [0] * threads

    def write(n: int) -> None:
        rng = random.Random(n)
        conn = source.connect()
        next_id = 1_000_000 * (n + 1)
        interval = threads / rate
        due = time.perf_counter()
        try:
            with conn.cursor() as cur:
                while not stop.is_set():
                    schema, table = rng.choice(names)
                    next_id += 1
                    cur.execute(f"INSERT INTO `{schema}`.`{table}` VALUES (%s, 'w')", (next_id,))
                    conn.commit()
                    written[n] += 1
                    due += interval
                    pause = due - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)  # pacing the writer to its rate
        finally:
            conn.close()

    pool = [threading.Thread(target=write, args=(n,), daemon=True) for n in range(threads)]
    workers = {n: p.port for n, p in system.processes.items() if n.startswith("sink-worker")}
    stages_before = {n: await asyncio.to_thread(round_stages, port) for n, port in workers.items()}
    load_at_start = _load()
    started = time.time()
    for t in pool:
        t.start()
    lags: list[float] = []
    while time.time() - started < seconds:
        checkpoint = await asyncio.to_thread(_checkpoint_s, system)
        if checkpoint is not None:
            lags.append(max(0.0, time.time() - checkpoint))
        await asyncio.sleep(0.5)  # the sampling interval
    stop.set()
    ended = time.time()
    for t in pool:
        await asyncio.to_thread(t.join, 30)
    for n, port in workers.items():  # where a round's time goes under the writes
        _say(f"  {n} under the writes: "
             f"{stage_means(stages_before[n], await asyncio.to_thread(round_stages, port))}")
    achieved = sum(written) / (ended - started)
    caught = None
    while time.time() - ended < 120:
        checkpoint = await asyncio.to_thread(_checkpoint_s, system)
        if checkpoint is not None and checkpoint >= ended:
            caught = time.time() - ended
            break
        await asyncio.sleep(0.2)  # polling the leader's checkpoint for the catch-up
    what = (f"{tag}; single-row transactions at {achieved:,.0f} rows/s (asked {rate:,.0f}) over every table, "
            f"{seconds:.0f} s; load {load_at_start} -> {_load()}")
    if lags:
        p50, p99 = pct(lags, 0.5), pct(lags, 0.99)
        out.add(f"changefeed checkpoint lag p50 ({what})", p50, "s")
        out.add(f"changefeed checkpoint lag p99 ({what})", p99, "s", target="< 2 s", met=p99 < 2)
    else:
        p50 = p99 = float("nan")
    if caught is None:
        out.not_measured(f"catch-up after the writes ({what})", "s", "not within 120 s")
    else:
        out.add(f"catch-up after the writes ({what})", caught, "s")
    _say(f"under writes ({what}): lag p50 {p50:.2f} s, p99 {p99:.2f} s, max "
         f"{max(lags, default=float('nan')):.2f} s over {len(lags)} samples; caught up "
         f"{'not within 120 s' if caught is None else f'{caught:.1f} s'} after")


async def kill_busiest_worker(system: LocalSystem, rec: Recorder, out: Figures, tag: str, tables: int,
                              timeout_s: float) -> bool:
    """SIGKILL the worker that holds the most spans; the time until every span replicates on
    another member (the member service finds it gone, the scheduler and replication-manager
    place its spans elsewhere, those workers prepare and start them)."""
    loads = rec.loads()
    if len(loads) < 2:
        _say("kill: fewer than two workers hold spans; not measured")
        return True
    victim = max(loads, key=lambda m: loads[m])
    proc = system.processes.get(victim)
    if proc is None:
        _say(f"kill: no process named {victim}; not measured")
        return True
    held = loads[victim]
    killed = time.perf_counter()
    proc.kill()

    def moved() -> bool:
        placement = rec.placement()
        return rec.all_replicating(tables) and victim not in placement.values()

    try:
        await eventually(moved, timeout_s, f"every span of {victim} replicating elsewhere")
    except AssertionError:
        out.not_measured(f"kill -9 of {victim} holding {held:,} spans -> all replicating elsewhere ({tag})",
                         "s", f"not within {timeout_s:.0f} s", target="< 5 s")
        _say(f"kill -9 of {victim} ({held:,} spans): NOT all replicating elsewhere within {timeout_s:.0f} s")
        return False
    took = time.perf_counter() - killed
    _say(f"kill -9 of {victim} ({held:,} spans): every span replicating elsewhere {took:.1f} s later "
         f"{rec.loads()} (load {_load()})")
    out.add(f"kill -9 of the worker holding the most spans ({held:,}) -> all replicating elsewhere "
            f"({tag}; load {_load()})", took, "s", target="< 5 s", met=took < 5)
    return True


# ----------------------------------------------------------------------------- run


async def main_async(args: argparse.Namespace) -> int:
    out = Figures("bench_tables")
    args.dir = args.dir.resolve()
    shutil.rmtree(args.dir, ignore_errors=True)
    names = table_names(args.tables, args.per_schema)
    worker_env = {"SLUICE_SPARK_MASTER": "local[1]", "SLUICE_SPARK_SHUFFLE_PARTITIONS": "2",
                  "SLUICE_SPARK_DRIVER_MEMORY": "1g", "SLUICE_SINK_APPLY_PARTITIONS": "2"}
    system = LocalSystem(
        base_dir=args.dir, sources=1, downstream="mariadb", control_replicas=args.control_replicas,
        workers=args.workers, with_api=True, standalone_workers=False, initial_load="snapshot",
        worker_env=worker_env,
    )
    rec = Recorder()
    watch = LoadWatch()

    memory = MemorySampler(system.process_pids, _part, interval=1.0, on_error=lambda exc: None)
    tag = f"{args.tables:,} tables, {args.workers} sink-workers"
    try:
        _say(f"starting nats-server, MariaDB source and downstream (load {_load()})")
        system.start_infra()
        assert system.nats is not None
        t0 = time.perf_counter()
        await asyncio.to_thread(create_tables, system.source_dbs[0], names, args.rows)
        _say(f"{args.tables:,} tables in {len({s for s, _ in names})} schemas, {args.rows} rows each, "
             f"created in {time.perf_counter() - t0:.0f} s (load {_load()})")
        await rec.start(system.nats.url)
        await watch.start(system.nats.url)
        memory.start()
        system.start_services()
        await asyncio.to_thread(start_healthy, system, 300)
        _say(f"every service healthy (load {_load()})")
        # A worker joins once its Spark is up (a minute or more on a loaded machine): the clock
        # starts at create with every worker a member, so it measures the tables, not Spark.
        t0 = time.perf_counter()
        await eventually(lambda: len(joined_members(rec)) >= args.workers, 600, "every sink-worker joined")
        _say(f"every sink-worker a member {time.perf_counter() - t0:.0f} s later (load {_load()})")

        created = time.perf_counter()
        await system.create_changefeed(system.changefeed_spec(CF, include=[f"{PREFIX}*.*"]), "bench")
        replicating_s = loaded_s = None
        last_report = 0.0
        deadline = created + args.timeout_s
        while time.perf_counter() < deadline:
            now = time.perf_counter() - created
            placement = rec.placement()
            running = sum(1 for v in placement.values() if v is not None)
            if replicating_s is None and rec.all_replicating(args.tables):
                replicating_s = now
                _say(f"every span replicating {now:.1f} s after create (load {_load()}): {rec.loads()}")
            if loaded_s is None and watch.done() >= args.tables:
                loaded_s = now
                _say(f"initial load of every table done {now:.1f} s after create (load {_load()})")
            if replicating_s is not None and loaded_s is not None:
                break
            if now - last_report >= 15:
                last_report = now
                rm = await asyncio.to_thread(replication_status, system)
                _say(f"  {now:.0f} s: {len(placement):,} sets recorded, {running:,} replicating, "
                     f"initial load done {watch.done():,}, failed {len(watch.failed())}; replication-manager "
                     f"terms {len(rec.elected)}, leader's sets {rm.get('sets')}, prepare timeouts "
                     f"{rm.get('prepare_timeouts')} (load {_load()})")
            await asyncio.sleep(1.0)  # polling the recorders against the deadline
        judged = args.tables >= 10_000
        why = f"not reached within --timeout-s {args.timeout_s:.0f} s"
        what = f"create -> every span replicating ({tag}; load {_load()})"
        if replicating_s is None:
            out.not_measured(what, "s", why, target="< 60 s at 10,000 tables")
        else:
            out.add(what, replicating_s, "s", target="< 60 s at 10,000 tables",
                    met=replicating_s < 60 if judged else None)
        what = f"create -> initial load of every table done ({tag}, {args.rows} rows each; load {_load()})"
        if loaded_s is None:
            out.not_measured(what, "s", why)
        else:
            out.add(what, loaded_s, "s")
        rm = await asyncio.to_thread(replication_status, system)
        out.extra["replication_manager_terms"] = len(rec.elected)
        out.extra["prepare_timeouts"] = rm.get("prepare_timeouts")
        _say(f"replication-manager terms during the run: {len(rec.elected)}; the leader's prepare timeouts "
             f"{rm.get('prepare_timeouts')}, stale reports {rm.get('stale_reports')}")
        out.write(args.json)
        if replicating_s is None or loaded_s is None:
            _say(f"NOT DONE within {args.timeout_s:.0f} s: {len(rec.placement()):,} sets, "
                 f"{sum(1 for v in rec.placement().values() if v):,} replicating, "
                 f"{watch.done():,} loaded, failed {watch.failed()[:5]}")

        sample = random.Random(1).sample(names, min(50, len(names)))
        down = system.downstream_db
        assert isinstance(down, MariaDB)
        wrong = []
        for schema, table in sample:
            try:
                got = down.execute(f"SELECT COUNT(*) FROM `{schema}`.`{table}`")[0][0]
            except Exception as exc:  # not created downstream
                got = repr(exc)[:80]
            if got != args.rows:
                wrong.append(f"{schema}.{table}: {got}")
        _say(f"downstream rows on a sample of {len(sample)} tables: "
             f"{'all equal' if not wrong else 'WRONG ' + ', '.join(wrong[:5])}")
        out.extra["sample_equal"] = not wrong

        # --- idle ------------------------------------------------------------------------------
        _say(f"idle: settling {args.settle_s:.0f} s, then CPU over {args.idle_s:.0f} s")
        await asyncio.sleep(args.settle_s)  # the figure is of a system left alone: that is the wait
        pids = system.process_pids()
        children = children_by_parent()
        before = {n: tree_cpu(pid, children) for n, pid in pids.items()}
        t_idle = time.perf_counter()
        load_before = _load()
        await asyncio.sleep(args.idle_s)  # the measurement window
        children = children_by_parent()
        wall = time.perf_counter() - t_idle
        after = {n: tree_cpu(pid, children) for n, pid in pids.items()}
        sizes = {n: tree_rss(pid, children) for n, pid in pids.items()}
        load_after = _load()
        series = {n: metric_series(p.port) for n, p in system.processes.items()}
        nc = await nats.connect(system.nats.url)
        try:
            info = await nc.jetstream().stream_info(ROWS_STREAM)
            consumers = info.state.consumer_count
        finally:
            await nc.close()
        _say(f"ROWS stream: {consumers:,} consumers, {info.state.messages:,} messages, "
             f"{len(info.state.subjects or {}) if info.state.subjects else 'n/a'} subjects")
        out.extra["rows_consumers"] = consumers

        sluice_cpu = 0.0
        _say(f"idle over {wall:.0f} s (load {load_before} -> {load_after}):")
        for name in sorted(pids):
            pct = 100 * (after[name] - before[name]) / wall
            size, threads = sizes[name]
            peak = memory.peaks.get(name, size)
            own = not name.startswith(("nats", "MariaDB"))
            if own:
                sluice_cpu += pct
            _say(f"  {name:<24} CPU {pct:6.1f} % of a core  RSS {size / MIB:7,.0f} MiB "
                 f"(peak {peak / MIB:,.0f})  threads {threads:4}  metric series {series.get(name, '-')}")
            target = met = None
            if service_of(name) == "capture":
                target, met = "< 300 MiB", peak < 300 * MIB
            elif service_of(name) == "sink-worker":
                target, met = "< 1 GiB", peak < GIB
            out.add(f"idle RSS of {name} ({tag}; peak through the run {peak / MIB:,.0f} MiB; "
                    f"{threads} threads; {series.get(name, '-')} metric series)", size / MIB, "MiB",
                    target=target, met=met)
            out.add(f"idle CPU of {name} ({tag}; over {wall:.0f} s, load {load_before} -> {load_after})",
                    pct, "% of a core")
        out.add(f"idle CPU of every Sluice service together ({tag}; nats-server and the databases not "
                f"counted; load {load_before} -> {load_after})", sluice_cpu, "% of a core",
                target="< 10 %", met=sluice_cpu < 10 if judged else None)
        out.extra["rows_stream_consumers"] = consumers
        out.write(args.json)

        # --- the operator's view of every table -----------------------------------------------
        listed = await asyncio.to_thread(time_tables_listing, system, out, tag, args.tables)

        # --- lag under writes spread over every table -----------------------------------------
        await lag_under_writes(system, out, tag, names, args.write_rows_s, args.write_s)
        for name in sorted(n for n in memory.peaks if service_of(n) == "sink-worker"):
            peak = memory.peaks[name]
            _say(f"  {name}: peak RSS through the run, writes included, {peak / MIB:,.0f} MiB")
            out.add(f"peak RSS of {name} through the run, writes included ({tag})", peak / MIB, "MiB",
                    target="< 1 GiB", met=peak < GIB)

        # --- kill -9 of the worker holding the most spans --------------------------------------
        moved = await kill_busiest_worker(system, rec, out, tag, args.tables, args.kill_timeout_s)
        out.write(args.json)
        return 0 if (replicating_s is not None and loaded_s is not None and not wrong and listed
                     and moved) else 1
    finally:
        memory.done.set()
        await watch.stop()
        await rec.stop()
        for name, proc in system.processes.items():
            if name.startswith("sink-worker"):
                proc.kill()  # no drain at teardown: the control plane stops too
        await asyncio.to_thread(system.stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=10_000)
    parser.add_argument("--per-schema", type=int, default=100, help="tables per schema")
    parser.add_argument("--rows", type=int, default=3, help="rows in each table")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--control-replicas", type=int, default=2)
    parser.add_argument("--settle-s", type=float, default=20.0)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="time box for every span replicating and every initial load done")
    parser.add_argument("--write-rows-s", type=float, default=2000.0,
                        help="rows/s of single-row transactions over every table for the lag figures")
    parser.add_argument("--write-s", type=float, default=30.0)
    parser.add_argument("--kill-timeout-s", type=float, default=300.0,
                        help="time box for a killed worker's spans to replicate elsewhere")
    parser.add_argument("--dir", type=Path, default=ROOT / ".sluice" / "bench-tables")
    add_json_option(parser)
    sys.exit(asyncio.run(main_async(parser.parse_args())))


if __name__ == "__main__":
    main()
