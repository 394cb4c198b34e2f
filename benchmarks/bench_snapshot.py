"""Initial-load copy speed against ``LOAD DATA`` (issue 8): one run, the same rows, the same
downstream database.

    .venv/bin/python -m benchmarks.bench_snapshot [--rows 2000000] [--chunk-rows 50000]
        [--parallelism 4] [--write-rows 5000] [--spark-master local[*]]

Starts two private MariaDB servers (source and downstream, the test servers' settings) and
fills a source table with ``--rows`` rows (BIGINT key, VARCHAR, DECIMAL, DATETIME(6), TINYINT,
a nullable TEXT). Then, into two databases of the downstream server:

- the initial load's copy: ``snapshot_job.plan_chunks`` and ``run_copy`` (the Spark job the
  worker runs), in waves of ``--parallelism`` chunks as ``snapshot.InitialLoads`` runs them,
  from the source through pymysql unbuffered reads and the sink's idempotent upsert. The clock
  starts after the target table is created and Spark is warm (a first tiny job ran), and
  includes the chunk planning;
- ``LOAD DATA LOCAL INFILE`` of the same rows into an identical table (``CREATE TABLE ... LIKE``
  the copy's target); the file is exported by the source (``SELECT ... INTO OUTFILE``) before
  the clock starts.

Both results are checked against each other (row count and ``CHECKSUM TABLE``): a wrong copy
fails the run instead of reporting a speed. Only the copy is timed: the watermarks and the
hand-over to streaming add two reads of the resolved mark.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.output import Figures, add_json_option
from libs.config import Settings
from libs.localservers.mariadb import MariaDB
from libs.spark import get_spark, stop_spark
from services.capture.table_meta import load_table_info
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.snapshot_job import CopyJob, connect_source, plan_chunks, run_copy
from services.sink_worker.span import Span, target_for

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


def _checksum(db: MariaDB, schema: str) -> tuple[int, int]:
    count = db.execute(f"SELECT COUNT(*) FROM {schema}.{_TABLE}")[0][0]
    checksum = db.execute(f"CHECKSUM TABLE {schema}.{_TABLE}")[0][1]
    return int(count), int(checksum)


def _snapshot(source: MariaDB, down: MariaDB, args: argparse.Namespace) -> tuple[float, int, int]:
    spark = get_spark(Settings(spark_master=args.spark_master, spark_shuffle_partitions=args.parallelism,
                               spark_driver_memory="1g"))
    spark.sparkContext.parallelize(range(4), 4).map(lambda x: x * 2).collect()  # warm workers
    sink_url = down.url_for("snap")
    conn = connect_source(source.url)
    info = load_table_info(conn, _SCHEMA, _TABLE)
    assert info is not None
    meta = info.meta()
    span = Span.of("bench", "src", _SCHEMA, _TABLE)
    # The copy's target is the sink's table in the `snap` database.
    target = replace(target_for(span, _SCHEMA, _TABLE, meta, "primary"), schema="snap")
    open_sink(sink_url).ensure_table(target)
    job = CopyJob(source_url=source.url, database=_SCHEMA, table=_TABLE, chunk_key=tuple(meta.primary_key),
                  target=target, sink_url=sink_url, write_rows=args.write_rows)
    started = time.monotonic()
    chunks = plan_chunks(conn, _SCHEMA, _TABLE, job.chunk_key, meta, args.chunk_rows, args.rows)
    planned = time.monotonic() - started
    copied = 0
    for first in range(0, len(chunks), args.parallelism):
        copied += sum(run_copy(spark, job, chunks[first:first + args.parallelism]).values())
    elapsed = time.monotonic() - started
    conn.close()
    print(f"  snapshot: {len(chunks)} chunks planned in {planned:.2f}s, {copied} rows copied")
    return elapsed, copied, len(chunks)


def _load_data(source: MariaDB, down: MariaDB, tmp: Path) -> float:
    path = tmp / "orders.tsv"
    source.execute(f"SELECT * FROM {_SCHEMA}.{_TABLE} INTO OUTFILE '{path}' CHARACTER SET utf8mb4")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--chunk-rows", type=int, default=50_000)
    parser.add_argument("--parallelism", type=int, default=4)
    parser.add_argument("--write-rows", type=int, default=5000)
    parser.add_argument("--spark-master", default="local[*]")
    add_json_option(parser)
    args = parser.parse_args(argv)
    out = Figures("bench_snapshot")
    with tempfile.TemporaryDirectory(prefix="sluice-bench-snapshot-") as tmpdir:
        tmp = Path(tmpdir)
        source = MariaDB(data_dir=tmp / "source", server_id=11).start()
        down = MariaDB(data_dir=tmp / "down", server_id=12,
                       extra_args=("--innodb-buffer-pool-size=512M",)).start()
        try:
            t0 = time.monotonic()
            _fill(source, args.rows)
            print(f"source filled with {args.rows} rows in {time.monotonic() - t0:.1f}s")
            snap_s, copied, chunks = _snapshot(source, down, args)
            load_s = _load_data(source, down, tmp)
            snap, load = _checksum(down, "snap"), _checksum(down, "`load`")
            if copied != args.rows or snap != load or snap[0] != args.rows:
                print(f"MISMATCH: copied {copied}, snapshot (rows, checksum) {snap}, LOAD DATA {load}")
                return 1
            snap_rate, load_rate = args.rows / snap_s, args.rows / load_s
            print(f"rows: {args.rows}  (chunk_rows {args.chunk_rows}, parallelism {args.parallelism}, "
                  f"write_rows {args.write_rows}, {chunks} chunks, spark {args.spark_master})")
            print(f"{'path':<28}{'seconds':>10}{'rows/s':>12}{'vs LOAD DATA':>15}")
            print(f"{'LOAD DATA LOCAL INFILE':<28}{load_s:>10.2f}{load_rate:>12,.0f}{'1.00':>15}")
            ratio = snap_rate / load_rate
            print(f"{'initial load (Spark copy)':<28}{snap_s:>10.2f}{snap_rate:>12,.0f}{ratio:>15.2f}")
            print("checksums equal: " + str(snap == load))
            out.add(f"initial load copy of {args.rows:,} rows ({chunks} chunks of {args.chunk_rows:,}, "
                    f"{args.parallelism} per wave), checksums equal to LOAD DATA's", snap_rate, "rows/s",
                    baseline=f"LOAD DATA LOCAL INFILE of the same rows {load_rate:,.0f} rows/s "
                             f"({ratio:.2f}x of it)",
                    target=f">= half of LOAD DATA ({load_rate / 2:,.0f} rows/s)",
                    met=snap_rate >= load_rate / 2)
            out.write(args.json)
        finally:
            stop_spark()
            for server in (source, down):
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
