"""Initial-load copy speed against the databases' own bulk loads (issues 8, 17): one run, the
same rows, the same downstream servers.

    .venv/bin/python -m benchmarks.bench_snapshot [--rows 2000000] [--chunk-rows 50000]
        [--parallelism 4] [--write-rows 5000] [--spark-master local[*]]

Starts private servers (MariaDB source, MariaDB downstream with the test servers' settings,
PostgreSQL downstream) and fills a source table with ``--rows`` rows (BIGINT key, VARCHAR,
DECIMAL, DATETIME(6), TINYINT, a nullable TEXT). Then:

- the initial load's copy into MariaDB: ``snapshot_job.plan_chunks`` and a ``CopyPool`` (the
  Spark jobs of a few chunks each the worker runs), ``--parallelism`` in flight as ``snapshot.InitialLoads``
  runs them, from the source through pymysql unbuffered reads and the sink's bulk path
  (``LOAD DATA LOCAL ... REPLACE`` streamed from memory). The clock starts after the target
  table is created and Spark is warm (a first tiny job ran), and includes the chunk planning;
- ``LOAD DATA LOCAL INFILE`` of the same rows into an identical table (``CREATE TABLE ... LIKE``
  the copy's target); the file is exported by the source (``SELECT ... INTO OUTFILE``) before
  the clock starts;
- the same copy into PostgreSQL (``COPY`` of the source's bytes straight into the target, which
  a fresh copy meets empty; a conflict would send it through a staging table and ``INSERT ...
  ON CONFLICT``), and PostgreSQL's ``COPY ... FROM STDIN`` of the exported file into an
  identical table (the file's format is also COPY's text format).

During each copy the process tree of the copy (this driver, the Spark JVM, its Python
workers; not the database servers) is sampled for its peak RSS, which stands for a worker's.
Each copy is checked against its baseline (row count and a checksum of every row): a wrong
copy fails the run instead of reporting a speed. Only the copies are timed: the watermarks
and the hand-over to streaming add two reads of the resolved mark.

``--profile``: afterwards, one chunk is copied again into a fresh table of each downstream, in
this process (no Spark), sampled by py-spy (the ``bench`` extra) attached to this process:
its CPU samples by function (own time, the C calls a line makes counted on that line) and by
thread (the source reader, the writer), and the chunk's wall time, are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.apply import RssSampler
from benchmarks.output import Figures, add_json_option
from libs.codec.table_meta import load_table_info
from libs.config import Settings
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.scheduling.model import Span
from libs.spark import get_spark, stop_spark
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.snapshot.initial_load import SnapshotOptions
from services.sink_worker.snapshot.job import (
    CopyJob,
    CopyPool,
    chunks_per_job,
    connect_source,
    copy_chunk,
    plan_chunks,
    run_copy,
)
from services.sink_worker.snapshot.plan import Chunk
from services.sink_worker.span.target import target_for

_SCHEMA = "bench"
_TABLE = "orders"


def _fill(source: MariaDB, rows: int) -> None:
    source.execute(
        f"CREATE DATABASE {_SCHEMA}",
        f"CREATE TABLE {_SCHEMA}.{_TABLE} (id BIGINT PRIMARY KEY, email VARCHAR(64) NOT NULL,"
        " amount DECIMAL(12,2) NULL, created DATETIME(6) NOT NULL, status TINYINT NOT NULL,"
        " note TEXT NULL) CHARACTER SET utf8mb4",
    )
    step = 500_000
    for start in range(1, rows + 1, step):
        end = min(rows, start + step - 1)
        source.execute(
            f"INSERT INTO {_SCHEMA}.{_TABLE} SELECT seq, CONCAT('customer', seq, '@example.com'),"
            " (seq % 100000) / 100, TIMESTAMP('2026-01-01') + INTERVAL seq SECOND"
            " + INTERVAL (seq % 1000000) MICROSECOND, seq % 5,"
            " IF(seq % 3 = 0, NULL, CONCAT('note ', seq, ' ünïcødé'))"
            f" FROM {_SCHEMA}.seq_{start}_to_{end}")


def _import_copy(batches: Iterator[Any]) -> Iterator[Any]:
    import services.sink_worker.sinks.factory
    import services.sink_worker.snapshot.job  # noqa: F401

    yield from batches


def _checksum(db: MariaDB, schema: str) -> tuple[int, int]:
    count = db.execute(f"SELECT COUNT(*) FROM {schema}.{_TABLE}")[0][0]
    checksum = db.execute(f"CHECKSUM TABLE {schema}.{_TABLE}")[0][1]
    return int(count), int(checksum)


def _pg_checksum(db: PostgreSQL, schema: str) -> tuple[int, str]:
    row = db.execute(f"SELECT count(*), md5(string_agg(t::text, ',' ORDER BY id))"
                     f" FROM {schema}.{_TABLE} t")[0]
    return int(row[0]), str(row[1])


def _snapshot(source: MariaDB, sink_url: str, schema: str, args: argparse.Namespace,
              spark: Any) -> tuple[float, int, int, int]:
    """The copy into ``schema`` of ``sink_url``: seconds, rows, chunks, peak RSS of the tree."""
    conn = connect_source(source.url)
    info = load_table_info(conn, _SCHEMA, _TABLE)
    assert info is not None
    meta = info.meta()
    span = Span.of("bench", "src", _SCHEMA, _TABLE)
    target = replace(target_for(span, _SCHEMA, _TABLE, meta, "primary"), schema=schema)
    open_sink(sink_url).ensure_table(target)
    job = CopyJob(source_url=source.url, database=_SCHEMA, table=_TABLE, chunk_key=tuple(meta.primary_key),
                  target=target, sink_url=sink_url, write_rows=args.write_rows)
    sampler = RssSampler(os.getpid(), only=frozenset({"driver", "jvm", "python workers"}))
    sampler.start()
    started = time.monotonic()
    chunks = plan_chunks(conn, _SCHEMA, _TABLE, job.chunk_key, meta, args.chunk_rows, args.rows)
    planned = time.monotonic() - started
    planned_chunks = len(chunks)
    copied = 0
    pool = CopyPool(lambda: spark, job, args.parallelism)
    try:
        if args.waves:
            # The former scheduling, for comparison: one job per wave of ``parallelism``
            # one-chunk tasks, each wave waiting for its slowest chunk.
            for first in range(0, len(chunks), args.parallelism):
                wave = [[c] for c in chunks[first:first + args.parallelism]]
                copied += sum(run_copy(spark, job, wave).values())
            chunks = []
        # As ``InitialLoads`` runs them: ``parallelism`` jobs of a few chunks in flight, the next
        # one started as soon as one ends.
        pending, running = list(chunks), set()
        while pending or running:
            while pending and len(running) < args.parallelism:
                take = chunks_per_job(len(pending), args.parallelism, args.chunk_rows,
                                      SnapshotOptions.job_rows)
                running.add(pool.submit(pending[:take]))
                del pending[:take]
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            copied += sum(sum(f.result().values()) for f in finished)
    finally:
        pool.close()
    elapsed = time.monotonic() - started
    sampler.done.set()
    sampler.join()
    conn.close()
    print(f"  copy into {sink_url.split(':')[0]}: {planned_chunks} chunks planned in {planned:.2f}s,"
          f" {copied} rows copied in {elapsed:.2f}s, peak RSS {sampler.peak / 2**20:,.0f} MiB"
          f" ({', '.join(f'{k} {v / 2**20:,.0f}' for k, v in sorted(sampler.peak_parts_of_tree.items()))})")
    return elapsed, copied, planned_chunks, sampler.peak


def _profile(source: MariaDB, sink_url: str, schema: str, chunk: Chunk, write_rows: int, tmp: Path) -> None:
    """One chunk copied into ``schema`` in this process under py-spy; prints its profile."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile needs py-spy: pip install -e '.[bench]'")
    conn = connect_source(source.url)
    info = load_table_info(conn, _SCHEMA, _TABLE)
    conn.close()
    assert info is not None
    meta = info.meta()
    span = Span.of("bench", "src", _SCHEMA, _TABLE)
    target = replace(target_for(span, _SCHEMA, _TABLE, meta, "primary"), schema=schema)
    open_sink(sink_url).ensure_table(target)
    job = CopyJob(source_url=source.url, database=_SCHEMA, table=_TABLE, chunk_key=tuple(meta.primary_key),
                  target=target, sink_url=sink_url, write_rows=write_rows)
    raw = tmp / f"profile-{schema}.txt"
    proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--rate", "200", "--threads",
                             "--format", "raw", "--output", str(raw), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches (no condition to wait on: it prints nothing until it ends)
    started = time.monotonic()
    rows = copy_chunk(job, chunk)
    elapsed = time.monotonic() - started
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if not raw.exists():
        raise SystemExit(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
    by_function: Counter[str] = Counter()
    by_thread: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or len(frames) < 2:
            continue
        n = int(count)
        total += n
        # The first frame names the thread (copy_chunk's reader is "snapshot-read-<chunk>"); the
        # leaf is where the sample's CPU went.
        thread = "source reader" if "snapshot-read-" in frames[0] else "writer"
        by_thread[thread] += n
        leaf = frames[-1]
        name, _, where = leaf.partition(" (")
        by_function[f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]}"] += n
    print(f"  profile of one chunk into {sink_url.split(':')[0]}: {rows:,} rows in {elapsed:.2f}s,"
          f" {total} CPU samples at 200/s ({total / 200:.2f} CPU s)")
    print("    by thread: " + ", ".join(f"{k} {v / max(1, total):.0%}" for k, v in by_thread.most_common()))
    for name, n in by_function.most_common(12):
        print(f"    {n / max(1, total):>5.1%}  {name}")


def _export(source: MariaDB, tmp: Path) -> Path:
    path = tmp / "orders.tsv"
    source.execute(f"SELECT * FROM {_SCHEMA}.{_TABLE} INTO OUTFILE '{path}' CHARACTER SET utf8mb4")
    return path


def _load_data(down: MariaDB, path: Path) -> float:
    down.execute("CREATE DATABASE `load`", f"CREATE TABLE `load`.{_TABLE} LIKE snap.{_TABLE}")
    conn: Any = down.connect("load")
    try:
        with conn.cursor() as cur:
            started = time.monotonic()
            cur.execute(f"LOAD DATA LOCAL INFILE '{path}' INTO TABLE {_TABLE} CHARACTER SET utf8mb4")
            conn.commit()
            return time.monotonic() - started
    finally:
        conn.close()


def _pg_copy(pg: PostgreSQL, path: Path) -> float:
    """COPY FROM STDIN of the exported file (MariaDB's OUTFILE text is COPY's text format)."""
    pg.execute("CREATE SCHEMA pgload", f"CREATE TABLE pgload.{_TABLE} (LIKE snap.{_TABLE} INCLUDING ALL)")
    conn = pg.connect()
    try:
        started = time.monotonic()
        with conn.cursor() as cur, cur.copy(f"COPY pgload.{_TABLE} FROM STDIN") as copy, \
                open(path, "rb") as f:
            while data := f.read(1 << 20):
                copy.write(data)
        conn.commit()
        return time.monotonic() - started
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--chunk-rows", type=int, default=50_000)
    parser.add_argument("--parallelism", type=int, default=4)
    parser.add_argument("--write-rows", type=int, default=5000)
    parser.add_argument("--spark-master", default="local[*]")
    parser.add_argument("--waves", action="store_true",
                        help="copy in waves (one job per --parallelism chunks), the former scheduling")
    parser.add_argument("--profile", action="store_true",
                        help="afterwards, profile one chunk's copy into each downstream (py-spy)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    out = Figures("bench_snapshot")
    with tempfile.TemporaryDirectory(prefix="sluice-bench-snapshot-") as tmpdir:
        tmp = Path(tmpdir)
        source = MariaDB(data_dir=tmp / "source", server_id=11).start()
        down = MariaDB(data_dir=tmp / "down", server_id=12,
                       extra_args=("--innodb-buffer-pool-size=512M",)).start()
        pg = PostgreSQL(data_dir=Path(tempfile.mkdtemp(prefix="sluice-bench-pg-"))).start()
        try:
            t0 = time.monotonic()
            _fill(source, args.rows)
            print(f"source filled with {args.rows} rows in {time.monotonic() - t0:.1f}s")
            spark = get_spark(Settings(spark_master=args.spark_master,
                                       spark_shuffle_partitions=args.parallelism, spark_driver_memory="1g"))
            # Warm Python workers that imported the copy's modules: a sink-worker pays that once
            # in its life, not per copy.
            warm = spark.sparkContext.parallelize(range(args.parallelism), args.parallelism)
            warm.mapPartitions(_import_copy).collect()
            my_s, my_rows, chunks, my_rss = _snapshot(source, down.url_for("snap"), "snap", args, spark)
            path = _export(source, tmp)
            load_s = _load_data(down, path)
            pg_s, pg_rows, _, pg_rss = _snapshot(source, pg.url, "snap", args, spark)
            copy_s = _pg_copy(pg, path)
            snap, load = _checksum(down, "snap"), _checksum(down, "`load`")
            pg_snap, pg_load = _pg_checksum(pg, "snap"), _pg_checksum(pg, "pgload")
            if (my_rows != args.rows or snap != load or snap[0] != args.rows or pg_rows != args.rows
                    or pg_snap != pg_load or pg_snap[0] != args.rows):
                print(f"MISMATCH: MariaDB copied {my_rows}, (rows, checksum) {snap} vs LOAD DATA {load};"
                      f" PostgreSQL copied {pg_rows}, {pg_snap} vs COPY {pg_load}")
                return 1
            rate = {"my": args.rows / my_s, "load": args.rows / load_s, "pg": args.rows / pg_s,
                    "copy": args.rows / copy_s}
            my_ratio, pg_ratio = rate["my"] / rate["load"], rate["pg"] / rate["copy"]
            peak = max(my_rss, pg_rss)
            print(f"rows: {args.rows}  (chunk_rows {args.chunk_rows}, parallelism {args.parallelism}, "
                  f"write_rows {args.write_rows}, {chunks} chunks, spark {args.spark_master})")
            print(f"{'path':<34}{'seconds':>10}{'rows/s':>12}{'vs baseline':>14}")
            print(f"{'MariaDB LOAD DATA LOCAL INFILE':<34}{load_s:>10.2f}{rate['load']:>12,.0f}{'1.00':>14}")
            print(f"{'initial load into MariaDB':<34}{my_s:>10.2f}{rate['my']:>12,.0f}{my_ratio:>14.2f}")
            print(f"{'PostgreSQL COPY FROM STDIN':<34}{copy_s:>10.2f}{rate['copy']:>12,.0f}{'1.00':>14}")
            print(f"{'initial load into PostgreSQL':<34}{pg_s:>10.2f}{rate['pg']:>12,.0f}{pg_ratio:>14.2f}")
            print(f"peak RSS of the copying worker (driver, JVM, Python workers): {peak / 2**20:,.0f} MiB")
            print("checksums equal: True")
            setup = f"({chunks} chunks of {args.chunk_rows:,}, {args.parallelism} in flight)"
            out.add(f"initial load copy of {args.rows:,} rows into MariaDB {setup}, checksums equal to"
                    " LOAD DATA's", rate["my"], "rows/s",
                    baseline=f"LOAD DATA LOCAL INFILE of the same rows {rate['load']:,.0f} rows/s "
                             f"({my_ratio:.2f}x of it)",
                    target=f">= half of LOAD DATA ({rate['load'] / 2:,.0f} rows/s)",
                    met=rate["my"] >= rate["load"] / 2)
            out.add(f"initial load copy of {args.rows:,} rows into PostgreSQL {setup}, checksums equal to"
                    " COPY's", rate["pg"], "rows/s",
                    baseline=f"COPY FROM STDIN of the same rows {rate['copy']:,.0f} rows/s "
                             f"({pg_ratio:.2f}x of it)",
                    target=f">= half of COPY ({rate['copy'] / 2:,.0f} rows/s)",
                    met=rate["pg"] >= rate["copy"] / 2)
            out.add(f"peak RSS of the copying worker (driver, Spark JVM, Python workers), {args.rows:,} rows",
                    peak / 2**20, "MiB", target="<= 1 GiB", met=peak <= 2**30)
            out.write(args.json)
            if args.profile:
                conn = connect_source(source.url)
                info = load_table_info(conn, _SCHEMA, _TABLE)
                assert info is not None
                first = plan_chunks(conn, _SCHEMA, _TABLE, tuple(info.meta().primary_key), info.meta(),
                                    args.chunk_rows, args.rows)[0]
                conn.close()
                _profile(source, down.url_for("prof"), "prof", first, args.write_rows, tmp)
                _profile(source, pg.url, "prof", first, args.write_rows, tmp)
        finally:
            stop_spark()
            for server in (source, down):
                server.stop()
            pg.cleanup(remove_data=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
