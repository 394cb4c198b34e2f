"""Checks that need a Spark Connect client session, run in a process of their own.

PySpark refuses a Connect session (``SESSION_ALREADY_EXIST``) in a process that already holds a
classic one, and a pytest worker that ran a data-path module before holds one for the rest of
its life. ``python -m tests.helpers.spark_connect_checks CHECK URL [ARGS...]`` runs one check
and prints its result as one JSON line; the test asserts on that.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def copy_over_connect(connect_url: str, source_url: str, db: str, sink_url: str) -> dict[str, Any]:
    """The copy's jobs (``CopyPool``) over Spark Connect, which has no ``sparkContext``: there
    they are ``spark.range`` + ``mapInArrow``. Returns the rows each chunk copied."""
    from pyspark.sql import SparkSession

    from libs.codec.table_meta import load_table_info
    from services.sink_worker.sinks.base import TargetTable
    from services.sink_worker.sinks.factory import open_sink
    from services.sink_worker.snapshot.job import CopyJob, CopyPool, connect_source, plan_chunks

    conn = connect_source(source_url)
    info = load_table_info(conn, db, "t")
    assert info is not None, f"{db}.t is not in the source"
    meta = info.meta()
    chunks = plan_chunks(conn, db, "t", ("id",), meta, 1000, 3000)
    conn.close()
    target = TargetTable(schema=None, name="t", meta=meta, key=("id",))
    open_sink(sink_url).ensure_table(target)
    job = CopyJob(source_url=source_url, database=db, table="t", chunk_key=("id",), target=target,
                  sink_url=sink_url)
    spark = SparkSession.builder.remote(connect_url).getOrCreate()
    pool = CopyPool(lambda: spark, job, 2)
    try:
        futures = [pool.submit(chunks[:1]), pool.submit(chunks[1:])]
        counts = {k: v for f in futures for k, v in f.result(timeout=180).items()}
    finally:
        pool.close()
        spark.stop()
    return {"chunks": [c.id for c in chunks], "counts": counts}


def runtime_settings(connect_url: str) -> dict[str, Any]:
    """What a session built by ``libs.spark`` against the server reports for the settings this
    process decides (time zone, shuffle partitions 7)."""
    from libs.config import Settings
    from libs.spark import _build

    session = _build(Settings(spark_master=connect_url, spark_shuffle_partitions=7))
    try:
        return {"timeZone": session.conf.get("spark.sql.session.timeZone"),
                "shufflePartitions": session.conf.get("spark.sql.shuffle.partitions")}
    finally:
        session.stop()


CHECKS = {"copy": copy_over_connect, "settings": runtime_settings}

if __name__ == "__main__":
    print(json.dumps(CHECKS[sys.argv[1]](*sys.argv[2:])))
