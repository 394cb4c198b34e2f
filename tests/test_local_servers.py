"""The private servers the other tests stand on: MariaDB with a ROW binlog, PostgreSQL, Spark."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from pymysqlreplication import BinLogStreamReader
from pymysqlreplication.row_event import WriteRowsEvent
from pyspark.sql import Row, SparkSession

from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.spark_class_archive import archive_for

pytestmark = pytest.mark.integration


def _write_rows(mariadb: MariaDB, schema: str, server_id: int) -> list[dict[str, Any]]:
    """Every WriteRowsEvent row of ``schema`` in the binlog, from the start of the oldest file.

    (Without ``log_file``, BinLogStreamReader starts at the beginning of the *current* file only,
    and every server start opens a new one.)
    """
    stream = BinLogStreamReader(
        connection_settings=mariadb.replication_settings(),
        server_id=server_id,
        blocking=False,
        resume_stream=True,
        log_file=mariadb.binlog_files()[0],
        log_pos=4,
        only_events=[WriteRowsEvent],
        only_schemas=[schema],
    )
    try:
        return [row["values"] for event in stream for row in event.rows]
    finally:
        stream.close()


# ---------------------------------------------------------------------------- MariaDB


def test_mariadb_has_a_full_row_binlog(mariadb: MariaDB) -> None:
    rows = mariadb.execute(
        "SELECT @@log_bin, @@binlog_format, @@binlog_row_image, @@server_id, "
        "@@character_set_server, @@local_infile, @@port"
    )
    assert rows == [(1, "ROW", "FULL", 1, "utf8mb4", 1, mariadb.port)]
    variables = dict(mariadb.execute("SHOW GLOBAL VARIABLES WHERE Variable_name IN "
                                     "('log_bin', 'binlog_format', 'binlog_row_image')"))
    assert variables == {"log_bin": "ON", "binlog_format": "ROW", "binlog_row_image": "FULL"}
    assert mariadb.url == f"mysql://root@127.0.0.1:{mariadb.port}/"


def test_committed_insert_is_a_write_rows_event(mariadb: MariaDB, replica_server_id: int) -> None:
    mariadb.execute(
        "DROP DATABASE IF EXISTS lsrv_binlog",
        "CREATE DATABASE lsrv_binlog",
        "CREATE TABLE lsrv_binlog.items (id INT PRIMARY KEY, name VARCHAR(40), qty INT NOT NULL)",
    )
    conn = mariadb.connect("lsrv_binlog")
    try:
        conn.begin()
        with conn.cursor() as cur:
            cur.execute("INSERT INTO items VALUES (1, %s, 3), (2, NULL, 4)", ("héllo ✓ 🚀",))
        conn.commit()
    finally:
        conn.close()

    rows = _write_rows(mariadb, "lsrv_binlog", replica_server_id)
    assert rows == [{"id": 1, "name": "héllo ✓ 🚀", "qty": 3}, {"id": 2, "name": None, "qty": 4}]


def test_mariadb_keeps_data_and_binlog_across_restart_and_crash(
    mariadb_factory: Callable[..., MariaDB], replica_server_id: int
) -> None:
    server = mariadb_factory()
    port, server_id = server.port, server.server_id
    server.execute("CREATE DATABASE lsrv_restart",
                   "CREATE TABLE lsrv_restart.t (id INT PRIMARY KEY, v VARCHAR(10))",
                   "INSERT INTO lsrv_restart.t VALUES (1, 'before')")

    server.restart()
    assert server.port == port
    assert server.execute("SELECT @@server_id, @@log_bin") == [(server_id, 1)]
    assert server.execute("SELECT id, v FROM lsrv_restart.t") == [(1, "before")]

    server.execute("INSERT INTO lsrv_restart.t VALUES (2, 'crash')")
    server.kill()
    assert not server.alive()
    server.start()
    assert server.port == port
    assert server.execute("SELECT id, v FROM lsrv_restart.t ORDER BY id") == [(1, "before"), (2, "crash")]
    assert len(server.binlog_files()) == 3  # one per server start
    # Crash recovery kept the committed rows in the binlog too, in commit order.
    assert _write_rows(server, "lsrv_restart", replica_server_id) == [
        {"id": 1, "v": "before"},
        {"id": 2, "v": "crash"},
    ]


# ---------------------------------------------------------------------------- PostgreSQL


def test_postgres_create_insert_select(postgres: PostgreSQL) -> None:
    assert postgres.url == f"postgresql://postgres@127.0.0.1:{postgres.port}/postgres"
    with postgres.connect() as conn:
        conn.execute("DROP TABLE IF EXISTS lsrv_items")
        conn.execute("CREATE TABLE lsrv_items (id int PRIMARY KEY, name text, at timestamptz)")
        conn.execute("INSERT INTO lsrv_items VALUES (1, %s, now()), (2, NULL, now())", ("héllo ✓ 🚀",))
        rows = conn.execute("SELECT id, name FROM lsrv_items ORDER BY id").fetchall()
        server_encoding = conn.execute("SHOW server_encoding").fetchone()
    assert rows == [(1, "héllo ✓ 🚀"), (2, None)]
    assert server_encoding == ("UTF8",)


def test_postgres_keeps_data_across_restart_and_crash(
    postgres_factory: Callable[..., PostgreSQL],
) -> None:
    server = postgres_factory()
    port = server.port
    server.execute("CREATE TABLE t (id int PRIMARY KEY, v text)", "INSERT INTO t VALUES (1, 'before')")

    server.restart()
    assert server.port == port
    assert server.execute("SELECT id, v FROM t") == [(1, "before")]

    idle = server.connect()  # an open session: its backend must go down with the server
    server.execute("INSERT INTO t VALUES (2, 'crash')")
    server.kill()
    assert not server.alive()
    server.start()
    assert server.port == port
    assert server.execute("SELECT id, v FROM t ORDER BY id") == [(1, "before"), (2, "crash")]
    idle.close()


# ---------------------------------------------------------------------------- Spark


def test_spark_group_by_count(spark: SparkSession) -> None:
    assert spark.conf.get("spark.sql.shuffle.partitions") == "2"
    assert spark.conf.get("spark.sql.session.timeZone") == "UTC"
    assert spark.conf.get("spark.ui.enabled") == "false"
    df = spark.createDataFrame([(i % 3, i) for i in range(100)], "k int, v int")
    counts = {row["k"]: (row["n"], row["total"]) for row in
              df.groupBy("k").agg({"*": "count", "v": "sum"})
              .withColumnRenamed("count(1)", "n").withColumnRenamed("sum(v)", "total").collect()}
    assert counts == {
        0: (34, sum(range(0, 100, 3))),
        1: (33, sum(range(1, 100, 3))),
        2: (33, sum(range(2, 100, 3))),
    }


def test_the_driver_maps_the_venvs_class_archive_when_setup_built_it(spark: SparkSession) -> None:
    archive = archive_for("auto")
    if archive is None:
        pytest.skip("no class archive in this venv (infra/dev.sh setup builds it)")
    args = list(spark.sparkContext._jvm.java.lang.management.ManagementFactory  # type: ignore[union-attr]
                .getRuntimeMXBean().getInputArguments())
    assert f"-XX:SharedArchiveFile={archive}" in args, args


def test_spark_executors_write_to_mariadb(
    spark: SparkSession, mariadb: MariaDB, replica_server_id: int
) -> None:
    """The apply path's shape: each partition opens its own connection and writes its rows."""
    mariadb.execute(
        "DROP DATABASE IF EXISTS lsrv_spark",
        "CREATE DATABASE lsrv_spark",
        "CREATE TABLE lsrv_spark.target (id BIGINT PRIMARY KEY, shard INT NOT NULL, v VARCHAR(20))",
    )
    url = mariadb.url_for("lsrv_spark")

    def write_partition(rows: Iterable[Row]) -> Iterator[tuple[int, int]]:
        # Runs in a Spark Python worker: project modules and pymysql must import there.
        import pymysql

        from libs.dburl import parse_database_url

        db = parse_database_url(url)
        batch = [(r["id"], r["shard"], r["v"]) for r in rows]
        conn = pymysql.connect(host=db.host, port=db.port, user=db.user, password=db.password,
                               database=db.database, charset="utf8mb4", autocommit=False)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT CONNECTION_ID()")
                row = cur.fetchone()
                assert row is not None
                connection_id = row[0]
                cur.executemany("REPLACE INTO target (id, shard, v) VALUES (%s, %s, %s)", batch)
            conn.commit()
        finally:
            conn.close()
        yield len(batch), int(connection_id)

    df = spark.createDataFrame([(i, i % 4, f"v{i}") for i in range(1000)], "id long, shard int, v string")
    # Twice: the second run re-applies the same rows and must converge to the same state.
    for _ in range(2):
        results = df.repartition(4, "shard").rdd.mapPartitions(write_partition).collect()
        assert sum(n for n, _ in results) == 1000
        assert len({cid for _, cid in results}) == 4  # one connection per partition

    assert mariadb.execute("SELECT COUNT(*), SUM(id), SUM(shard) FROM lsrv_spark.target") == [
        (1000, sum(range(1000)), sum(i % 4 for i in range(1000)))
    ]
    # The writes went through the binlog as row events, as a downstream MariaDB's would.
    assert len(_write_rows(mariadb, "lsrv_spark", replica_server_id)) == 1000
