"""The initial load's bulk write paths (``Sink.load_rows``: LOAD DATA LOCAL into MariaDB, COPY
into PostgreSQL, straight or through a staging table, executemany into SQLite), in process
against real servers: the type matrix's edge values and typed keys copied by ``copy_chunk``
arrive unchanged (into MariaDB and, for the kinds it reads so, PostgreSQL both as the source's
undecoded bytes and as decoded values); the source read (mysqlclient) decodes every edge value
as pymysql does and keeps its batches within their row and byte bounds;
a re-copied chunk converges over stale rows, a unique value moved to another key replaces its
old holder, and a value the target cannot hold fails the load instead of being stored wrong."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pymysql
import pymysql.cursors
import pytest

from contracts.events.rows import ColumnV1, TableMetaV1
from libs.checksum import compare_tables
from libs.codec.table_meta import load_table_info
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.nats_tls import issue_tls
from services.sink_worker.sinks.base import TargetTable, Upsert
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.sinks.mysql import MySQLSink
from services.sink_worker.sinks.postgres import PostgresSink
from services.sink_worker.snapshot import source_read
from services.sink_worker.snapshot.job import CopyJob, _converter, _read_batches, connect_source, copy_chunk
from services.sink_worker.snapshot.plan import Chunk
from tests.helpers.type_cases import KEY_CASES, VALUE_CASES

pytestmark = pytest.mark.integration

SRC = "bulk_src"
DOWN = "bulk_down"
SINKS = ("mariadb", "postgres", "sqlite")
# ENUM/SET members with 4-byte characters: information_schema spells them '?', and only the
# binlog's metadata has them right (capture's ``reconcile_members``); the copy reads the table's
# metadata from information_schema, so such a target refuses the value whatever the write path.
CASES = [c for c in VALUE_CASES if c.id not in ("enum_utf8", "set_utf8")]
# Source types whose kinds PostgreSQL's COPY does not take as the source spells them.
_NOT_PLAIN = {"bit", "set", "time", "json"}


@pytest.fixture(scope="module")
def sink_urls(mariadb: MariaDB, postgres: PostgreSQL,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp: Path = tmp_path_factory.mktemp("bulk_load")
    return {"mariadb": mariadb.url_for(DOWN), "postgres": postgres.url,
            "sqlite": f"sqlite:///{tmp / 'down.db'}"}


@pytest.fixture(scope="module")
def source(mariadb: MariaDB) -> Iterator[MariaDB]:
    statements = [f"DROP DATABASE IF EXISTS {SRC}", f"CREATE DATABASE {SRC}",
                  f"DROP DATABASE IF EXISTS {DOWN}"]
    cols = ", ".join(f"c_{c.id} {c.sql_type}" for c in CASES)
    statements.append(f"CREATE TABLE {SRC}.wide (id INT PRIMARY KEY, {cols})")
    names = ", ".join(f"c_{c.id}" for c in CASES)
    for i in range(max(len(c.values) for c in CASES) + 1):
        values = ", ".join(c.values[i] if i < len(c.values) else "NULL" for c in CASES)
        statements.append(f"INSERT INTO {SRC}.wide (id, {names}) VALUES ({i}, {values})")
    # The edge values of the kinds PostgreSQL's COPY takes as the source spells them: the copy
    # into PostgreSQL loads this table's undecoded bytes (the wide one has other kinds too).
    plain = [c for c in CASES if c.sql_type.split("(")[0].split()[0] not in _NOT_PLAIN]
    statements.append(f"CREATE TABLE {SRC}.plain (id INT PRIMARY KEY, "
                      + ", ".join(f"c_{c.id} {c.sql_type}" for c in plain) + ")")
    statements.append(f"INSERT INTO {SRC}.plain SELECT id, " + ", ".join(f"c_{c.id}" for c in plain)
                      + f" FROM {SRC}.wide")
    for k in KEY_CASES:
        statements.append(f"CREATE TABLE {SRC}.{k.table} (k {k.sql_type} NOT NULL PRIMARY KEY, n INT)")
        statements += [f"INSERT INTO {SRC}.{k.table} (k, n) VALUES ({v}, {n})"
                       for n, v in enumerate(k.values)]
    conn = mariadb.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SET time_zone = '+00:00'")
            for sql in statements:
                cur.execute(sql)
        conn.commit()
    finally:
        conn.close()
    yield mariadb
    mariadb.execute(f"DROP DATABASE IF EXISTS {SRC}", f"DROP DATABASE IF EXISTS {DOWN}")


def _source_rows(source: MariaDB, table: str) -> tuple[list[dict[str, Any]], TableMetaV1]:
    # The copy's own connection settings (utf8mb4, UTC): the test server's client defaults
    # would show an emoji enum member as '?'.
    conn = connect_source(source.url)
    try:
        info = load_table_info(conn, SRC, table)
        assert info is not None
        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute(f"SELECT * FROM {SRC}.`{table}`")
            return [dict(r) for r in cur.fetchall()], info.meta()
    finally:
        conn.close()


def _decoded_rows(source: MariaDB, table: str, meta: TableMetaV1) -> list[list[Any]]:
    converters = [_converter(c) for c in meta.columns]
    conn = connect_source(source.url)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT {', '.join(f'`{c.name}`' for c in meta.columns)} FROM {SRC}.`{table}`")
            return [[None if v is None else conv(v) for v, conv in zip(raw, converters, strict=True)]
                    for raw in cur.fetchall()]
    finally:
        conn.close()


@pytest.mark.parametrize("sink", SINKS)
def test_copied_edge_values_and_typed_keys_arrive_unchanged_and_a_recopy_converges(
    source: MariaDB, sink_urls: dict[str, str], sink: str,
) -> None:
    url = sink_urls[sink]
    down = open_sink(url)
    problems = []
    for table in ["wide", "plain", *(k.table for k in KEY_CASES)]:
        rows, meta = _source_rows(source, table)
        key = tuple(meta.primary_key)
        target = TargetTable(schema=DOWN, name=table, meta=meta, key=key)
        down.drop_table(target)
        down.ensure_table(target)
        # Small write batches: a chunk is several loads, each its own transaction.
        job = CopyJob(source_url=source.url, database=SRC, table=table, chunk_key=key, target=target,
                      sink_url=url, write_rows=3)
        assert copy_chunk(job, Chunk(0, None, None)) == len(rows)
        # The chunk copied again (resumed after a crash) over a stale image of one of its rows
        # and a row it does not have (streaming deletes that one): both converge.
        first = down.fetch_rows(target)[0]
        stale = {c.name: (first[c.name] if c.name in key else None) for c in meta.columns}
        down.apply_partition(target, [Upsert(key=tuple(stale[k] for k in key), row=stale)])
        assert copy_chunk(job, Chunk(0, None, None)) == len(rows)
        diff = compare_tables(rows, down.fetch_rows(target), key, columns=meta.columns)
        if not diff.ok:
            problems.append(f"{table}: {diff}")
        if sink == "postgres" and table == "plain":
            assert isinstance(down, PostgresSink)
            assert down.takes_source_bytes(target, [c.name for c in meta.columns])  # the bytes path ran
        if sink == "mariadb" or (sink == "postgres" and table == "plain"):
            if sink == "mariadb":
                # So the copy took the bytes path.
                assert isinstance(down, MySQLSink) and down.local_infile_on()
            # The copy loads the source's bytes as they are; the decoded values (what a
            # non-MySQL source or another caller hands ``load_rows``) must load the same.
            down.truncate_table(target)
            down.load_rows(target, [c.name for c in meta.columns], _decoded_rows(source, table, meta))
            diff = compare_tables(rows, down.fetch_rows(target), key, columns=meta.columns)
            if not diff.ok:
                problems.append(f"{table} (decoded values): {diff}")
    assert not problems, "\n".join(problems)


def _people(sink: str) -> TargetTable:
    meta = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int"),
                                ColumnV1(name="login", kind="string", sql_type="varchar(8)"),
                                ColumnV1(name="note", kind="string", sql_type="text")],
                       primary_key=["id"])
    return TargetTable(schema=DOWN, name=f"people_{sink}", meta=meta, key=("id",), unique_keys=(("login",),))


@pytest.mark.parametrize("sink", SINKS)
def test_a_moved_unique_value_replaces_its_old_holder_and_bad_values_fail(
    source: MariaDB, sink_urls: dict[str, str], sink: str,
) -> None:
    down = open_sink(sink_urls[sink])
    if isinstance(down, MySQLSink):
        down.load_file_chars = 16  # a file per row or two: one load's several files, one transaction
    target = _people(sink)
    down.drop_table(target)
    down.ensure_table(target)
    cols = ["id", "login", "note"]
    down.load_rows(target, cols, [(1, "lucy", "first"), (2, "bob", ""), (3, None, None)])
    # A later chunk read after `lucy` moved from 1 to 4 (row 1 is copied again from its chunk
    # later, or deleted by the stream): 4 takes the value, 1 goes. NULLs never conflict.
    assert down.load_rows(target, cols, [(4, "lucy", "tab\there\nnew line \\N \\"), (5, None, "NULL")]) == 2
    # Repeated keys in one load (a copy keyed by something other than the target key): the last wins.
    down.load_rows(target, cols, [(2, "bob", "old"), (2, "bob", "new")], keys_unique=False)
    # The bulk path itself ran, not the upsert it falls back to when LOCAL INFILE is refused.
    assert not getattr(down, "_local_infile_refused", False)
    got = {r["id"]: (r["login"], r["note"]) for r in down.fetch_rows(target)}
    assert got == {2: ("bob", "new"), 3: (None, None), 4: ("lucy", "tab\there\nnew line \\N \\"),
                   5: (None, "NULL")}
    if isinstance(down, MySQLSink):
        # The server asks for a file the client did not offer: refused, never read from disk.
        conn = down._connect_load()
        try:
            with pytest.raises(pymysql.err.OperationalError, match="refused"), conn.cursor() as cur:
                cur.execute(f"LOAD DATA LOCAL INFILE '/etc/hostname' INTO TABLE {DOWN}.{target.name}")
            with conn.cursor() as cur:  # and the connection is still in step with the server
                cur.execute("SELECT 1")
                assert cur.fetchone() == (1,)
        finally:
            conn.close()
    if sink != "sqlite":  # SQLite does not enforce varchar lengths
        with pytest.raises(Exception, match=r"(?i)too long|data truncated|warned"):
            down.load_rows(target, cols, [(6, "far too long for eight", None)])
        assert 6 not in {r["id"] for r in down.fetch_rows(target)}


def test_the_source_read_decodes_as_pymysql_and_keeps_its_batches_bounded(source: MariaDB) -> None:
    rows, meta = _source_rows(source, "wide")
    conn = connect_source(source.url)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT {', '.join(f'`{c.name}`' for c in meta.columns)} FROM {SRC}.wide")
            expected = [tuple(r) for r in cur.fetchall()]
    finally:
        conn.close()
    target = TargetTable(schema=DOWN, name="wide", meta=meta, key=("id",))
    job = CopyJob(source_url=source.url, database=SRC, table="wide", chunk_key=("id",), target=target,
                  sink_url="sqlite:///unused.db", write_rows=2)
    batches = list(_read_batches(job, Chunk(0, None, None), meta.columns, mode=source_read.TYPED))
    assert [len(b) for b in batches[:-1]] == [2] * (len(batches) - 1)
    got = [r for b in batches for r in b]
    # Same values and the same Python types (a str where pymysql gives str, bytes for bytes).
    assert [[(type(v), v) for v in r] for r in got] == [[(type(v), v) for v in r] for r in expected]
    # A byte bound smaller than one row: every row comes alone, none is held back or split.
    tiny = replace(job, write_rows=1000, write_bytes=1)
    batches = list(_read_batches(tiny, Chunk(0, None, None), meta.columns, mode=source_read.RAW))
    assert [len(b) for b in batches] == [1] * len(rows)
    # A key range reads only its rows, with typed key values bound into the query.
    ranged = _read_batches(job, Chunk(1, (0,), (2,)), meta.columns, mode=source_read.RAW)
    assert [r[0] for b in ranged for r in b] == [b"1", b"2"]


def test_the_source_read_uses_tls_when_the_server_offers_it(source: MariaDB, tmp_path: Path) -> None:
    def tls_version(url: str) -> str:
        conn = source_read.connect(url, source_read.RAW)
        try:
            conn.query("SHOW SESSION STATUS LIKE 'Ssl_version'")
            return bytes(conn.store_result().fetch_row()[0][1]).decode()
        finally:
            conn.close()

    # A server without TLS (the module's source) is still read, in clear text as it must be.
    assert tls_version(source.url) == ""
    files = issue_tls(tmp_path / "tls")
    secured = MariaDB(tmp_path / "tls-db", extra_args=(f"--ssl-cert={files.server_cert}",
                                                      f"--ssl-key={files.server_key}")).start()
    try:
        assert secured.execute("SELECT @@have_ssl")[0][0] == "YES"
        version = tls_version(secured.url)
        assert version.startswith("TLS"), f"the copy read a TLS-capable source in clear text ({version!r})"
    finally:
        secured.stop()
        secured.cleanup()
