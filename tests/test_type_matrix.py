"""The type matrix: edge values of every column type MariaDB documents, through the real capture
process and a real sink-worker (Spark) into MariaDB, PostgreSQL and SQLite downstreams at once,
each compared with the upstream value normalised per type (``libs.checksum``).

One source database, set up once for the module: a wide table with one column per value case
(row i holds the case's i-th edge value, NULL past its last), tables keyed by one typed column
(deletes and updates find the row by that key downstream), a table with generated columns, and
one table per type no downstream can take faithfully, which capture must refuse visibly (a
``capture.rejected`` event naming the column) and no downstream may hold.

The parametrised test is the matrix: case x downstream.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import nats
import pymysql
import pymysql.cursors
import pytest

from contracts import REGISTRY
from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1
from contracts.events.rows import CaptureRejectedV2, ColumnV1, TableMetaV1
from libs.changefeeds import record_changefeed, record_state
from libs.checksum import TableDiff, compare_tables
from libs.codec.table_meta import load_table_info
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from libs.streams import ROWS_STREAM, rejected_subject
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from tests.helpers.definitions import (
    assert_follows_source,
    mysql_checksum,
    mysql_definition,
    mysql_query,
    pg_columns,
    pg_execute,
    pg_query,
    sqlite_columns,
    sqlite_query,
)
from tests.helpers.type_cases import (
    CHARSET_CASES,
    KEY_CASES,
    REFUSED_CHARSETS,
    VALUE_CASES,
    KeyCase,
    ValueCase,
    large_polygon,
)
from tests.helpers.worker_env import STANDALONE_WORKER_ENV

pytestmark = pytest.mark.integration

DB = "type_matrix"
SOURCE_ID = "typematrix"
WIDE = "wide"
CHARSETS = "charsets"


# Types capture cannot hand over faithfully to every downstream: refused, never stored wrong.
REFUSED = {
    "uuid": "uuid", "inet4": "inet4", "inet6": "inet6",
    # The binlog reader decodes ENUM/SET names as UTF-8: a latin1 'é' would arrive as ''.
    "enum_latin1": "enum('é','a') character set latin1",
    "set_latin1": "set('é','a') character set latin1",
    # Charsets capture cannot decode exactly: the table stops naming the column and charset.
    **{f"charset_{name}": f"varchar(10) character set {name}" for name in REFUSED_CHARSETS},
}
_REFUSED_VALUE = {
    "uuid": "'123e4567-e89b-12d3-a456-426614174000'", "inet4": "'192.168.0.1'", "inet6": "'::1'",
    "enum_latin1": "'é'", "set_latin1": "'a,é'",
    **{f"charset_{name}": value for name, value in REFUSED_CHARSETS.items()},
}

GENERATED = "generated"
# Spatial columns beside a SPATIAL index (NOT NULL, as the index needs) and declared SRIDs; the
# edge values themselves are in the wide table (``type_cases._spatial_cases``).
SPATIAL = "spatial"
SPATIAL_DDL = (f"CREATE TABLE {DB}.{SPATIAL} (id INT PRIMARY KEY, p POINT REF_SYSTEM_ID=4326 NOT NULL,"
               " g GEOMETRY REF_SYSTEM_ID=3857, c GEOMETRYCOLLECTION, SPATIAL KEY sp (p))")
SPATIAL_ROWS = (f"INSERT INTO {DB}.{SPATIAL} VALUES"
                " (1, ST_GeomFromText('POINT(13.4 52.5)', 4326), ST_GeomFromText('POINT(1 1)', 3857),"
                " ST_GeomFromText('GEOMETRYCOLLECTION EMPTY')),"
                " (2, ST_GeomFromText('POINT(0 0)', 4326), NULL, NULL),"
                f" (3, ST_GeomFromText('POINT(-1 -1)', 4326), ST_GeomFromText('{large_polygon(2000)}', 3857),"
                " ST_GeomFromText('GEOMETRYCOLLECTION(POINT(1 2))', 4326))",
                f"UPDATE {DB}.{SPATIAL} SET p = ST_GeomFromText('POINT(2 2)', 4326), g = NULL WHERE id = 1",
                f"DELETE FROM {DB}.{SPATIAL} WHERE id = 2")
SINKS = ("mariadb", "postgres", "sqlite")
# PostgreSQL with PostGIS in the target database: spatial columns land as geometry(Subtype,SRID).
# Its changefeed takes only the tables with spatial columns.
POSTGIS = "postgis"
GIS_DB = "type_matrix_gis"
SPATIAL_TYPES = ("point", "linestring", "polygon", "multipoint", "multilinestring", "multipolygon",
                 "geometry", "geometrycollection")
SPATIAL_CASES = [c for c in VALUE_CASES if c.sql_type.split()[0] in SPATIAL_TYPES]


def _setup_statements() -> list[str]:
    out = [f"DROP DATABASE IF EXISTS {DB}", f"CREATE DATABASE {DB}"]
    cols = ", ".join(f"c_{c.id} {c.sql_type}" for c in VALUE_CASES)
    out.append(f"CREATE TABLE {DB}.{WIDE} (id INT PRIMARY KEY, {cols})")
    cols = ", ".join(f"c_{c.id} {c.sql_type}" for c in CHARSET_CASES)
    out.append(f"CREATE TABLE {DB}.{CHARSETS} (id INT PRIMARY KEY, {cols})")
    for k in KEY_CASES:
        out.append(f"CREATE TABLE {DB}.{k.table} (k {k.sql_type} NOT NULL PRIMARY KEY, n INT)")
    out.append(f"CREATE TABLE {DB}.{GENERATED} (id INT PRIMARY KEY, a INT, s VARCHAR(10),"
               " gv INT AS (a * 2) VIRTUAL, gs INT AS (a * 3) STORED,"
               " gt VARCHAR(20) AS (CONCAT(s, '!')) PERSISTENT)")
    out.append(SPATIAL_DDL)
    for name, sql_type in REFUSED.items():
        out.append(f"CREATE TABLE {DB}.refused_{name} (id INT PRIMARY KEY, v {sql_type})")
    return out


def _change_statements() -> list[str]:
    """Inserts, then updates and deletes, in several transactions."""
    out = []
    rows = max(len(c.values) for c in VALUE_CASES) + 1
    names = ", ".join(f"c_{c.id}" for c in VALUE_CASES)
    for i in range(rows):
        values = ", ".join(c.values[i] if i < len(c.values) else "NULL" for c in VALUE_CASES)
        out.append(f"INSERT INTO {DB}.{WIDE} (id, {names}) VALUES ({i}, {values})")
    # The first edge values once more through an update's after image (a row of NULLs that
    # takes them), the last ones through an update's before image; one row goes.
    out.append(f"INSERT INTO {DB}.{WIDE} (id) VALUES ({rows}), ({rows + 1})")
    sets = ", ".join(f"c_{c.id} = {c.values[0]}" for c in VALUE_CASES)
    out.append(f"UPDATE {DB}.{WIDE} SET {sets} WHERE id = {rows}")
    out.append(f"UPDATE {DB}.{WIDE} SET id = {rows + 2} WHERE id = {len(VALUE_CASES[0].values) - 1}")
    out.append(f"DELETE FROM {DB}.{WIDE} WHERE id = {rows + 1}")
    # Every charset's text once as an insert, through an update's before and after images.
    names = ", ".join(f"c_{c.id}" for c in CHARSET_CASES)
    for i in range(_charset_rows()):
        values = ", ".join(c.values[i] if i < len(c.values) else "NULL" for c in CHARSET_CASES)
        out.append(f"INSERT INTO {DB}.{CHARSETS} (id, {names}) VALUES ({i}, {values})")
    sets = ", ".join(f"c_{c.id} = {c.values[0]}" for c in CHARSET_CASES)
    out.append(f"UPDATE {DB}.{CHARSETS} SET {sets} WHERE id = {_charset_rows() - 1}")
    out.append(f"UPDATE {DB}.{CHARSETS} SET id = 100 WHERE id = 0")
    for k in KEY_CASES:
        for n, v in enumerate(k.values):
            out.append(f"INSERT INTO {DB}.{k.table} (k, n) VALUES ({v}, {n})")
        # The first edge value is updated by its key (and stays), the last one deleted by it.
        out.append(f"UPDATE {DB}.{k.table} SET n = n + 100 WHERE k = {k.values[0]}")
        out.append(f"DELETE FROM {DB}.{k.table} WHERE k = {k.values[-1]}")
    out.append(f"INSERT INTO {DB}.{GENERATED} (id, a, s) VALUES (1, 5, 'x'), (2, NULL, NULL),"
               " (3, -7, '😀')")
    out.append(f"UPDATE {DB}.{GENERATED} SET a = a + 1, s = 'y' WHERE id = 1")
    out.extend(SPATIAL_ROWS)
    for name in REFUSED:
        out.append(f"INSERT INTO {DB}.refused_{name} (id, v) VALUES (1, {_REFUSED_VALUE[name]})")
    return out


def _charset_rows() -> int:
    """Rows of the charset table: one per edge value, and one of NULLs."""
    return max(len(c.values) for c in CHARSET_CASES) + 1


@dataclass
class Replicated:
    source: MariaDB
    sink_urls: dict[str, str]
    downstream: MariaDB | None = None
    rejections: list[CaptureRejectedV2] = field(default_factory=list)
    converged: dict[tuple[str, str], TableDiff] = field(default_factory=dict)
    logs: str = ""


_server_ids = itertools.count(4900)


def _source_rows(source: MariaDB, table: str) -> tuple[list[dict[str, Any]], TableMetaV1]:
    conn = source.connect()
    try:
        info = load_table_info(conn, DB, table)
        assert info is not None, f"{DB}.{table} is missing upstream"
        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute("SET time_zone = '+00:00'")
            cur.execute(f"SELECT * FROM {DB}.`{table}`")
            rows = [dict(r) for r in cur.fetchall()]
        return rows, info.meta()
    finally:
        conn.close()


def _diff(source: MariaDB, sink_url: str, table: str, columns: list[str] | None = None) -> TableDiff:
    """Upstream against downstream, over ``columns`` (default: all) plus the key."""
    rows, meta = _source_rows(source, table)
    key = tuple(meta.primary_key)
    target = TargetTable(schema=DB, name=table, meta=meta, key=key)
    down = open_sink(sink_url).fetch_rows(target)
    wanted = [c for c in meta.columns if columns is None or c.name in key or c.name in columns]
    return compare_tables(rows, down, key, columns=wanted)


def _tables(sink: str | None = None) -> list[str]:
    if sink == POSTGIS:
        return [WIDE, SPATIAL]
    return [WIDE, CHARSETS, GENERATED, SPATIAL, *(k.table for k in KEY_CASES)]


def _postgis_url(postgres: PostgreSQL) -> str | None:
    """A database of the test PostgreSQL with the postgis extension loaded; None when this
    machine's PostgreSQL has no PostGIS (``infra/dev.sh setup`` installs it)."""
    if not pg_query(postgres.url, "SELECT 1 FROM pg_available_extensions WHERE name = 'postgis'"):
        return None
    pg_execute(postgres.url, f"DROP DATABASE IF EXISTS {GIS_DB}", f"CREATE DATABASE {GIS_DB}")
    url = postgres.url_for(GIS_DB)
    pg_execute(url, "CREATE EXTENSION postgis")
    return url


async def _record_feeds(nats_url: str, sink_urls: dict[str, str], source: MariaDB) -> list[str]:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        ids = []
        for name, url in sink_urls.items():
            include = [f"{DB}.{t}" for t in _tables(name)] if name == POSTGIS else [f"{DB}.*"]
            spec = ChangefeedSpecV2(id=f"typematrix-{name}",
                                    sources=[SourceRefV1(id=SOURCE_ID, url=source.url)],
                                    filter=TableFilterV1(include=include), sink_url=url,
                                    initial_load="binlog-only")
            await record_changefeed(js, spec, requested_by="test")
            ids.append(spec.id)
        return ids
    finally:
        await nc.drain()


async def _delete_feeds(nats_url: str, ids: list[str]) -> None:
    nc = await nats.connect(nats_url)
    try:
        for cf in ids:
            await record_state(nc.jetstream(), cf, "deleted", requested_by="test", reason="test over")
    finally:
        await nc.drain()


async def _rejections(nats_url: str) -> list[CaptureRejectedV2]:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(rejected_subject(SOURCE_ID), stream=ROWS_STREAM)
        out: list[CaptureRejectedV2] = []
        info = await sub.consumer_info()
        pending = info.num_pending or 0
        while pending > 0:
            for msg in await sub.fetch(min(pending, 100), timeout=5):
                event = REGISTRY.decode(msg.data).event
                assert isinstance(event, CaptureRejectedV2)
                out.append(event)
                pending -= 1
        await sub.unsubscribe()
        return out
    finally:
        await nc.drain()


@pytest.fixture(scope="module")
def replicated(mariadb: MariaDB, postgres: PostgreSQL, nats_server: NatsServer,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicated]:
    tmp = tmp_path_factory.mktemp("type_matrix")
    downstream = MariaDB(data_dir=tmp / "down_mariadb", server_id=next(_server_ids)).start()
    sink_urls = {"mariadb": downstream.url, "postgres": postgres.url,
                 "sqlite": f"sqlite:///{tmp / 'down.db'}"}
    gis = _postgis_url(postgres)
    if gis is not None:
        sink_urls[POSTGIS] = gis
    env = {"SLUICE_NATS_URL": nats_server.url, "SLUICE_LEASE_TTL_S": "1.5",
           "SLUICE_STATE_DB_URL": f"sqlite:///{tmp / 'state.db'}",
           "SLUICE_DOWNSTREAM_URL": f"sqlite:///{tmp / 'downstream.db'}", "SLUICE_LOG_JSON": "true"}
    logs = tmp / "logs"
    mariadb.execute(*_setup_statements())
    procs: list[ServiceProcess] = []
    feeds: list[str] = []
    try:
        capture = ServiceProcess("services.capture", {
            **env, "SLUICE_SOURCE_ID": SOURCE_ID,
            "SLUICE_SOURCE_URL": f"{mariadb.url_for(DB)}?heartbeat=0.5",
            "SLUICE_SOURCE_SERVER_ID": str(next(_server_ids)),
        }, logs, instance_id="capture-typematrix").start()
        procs.append(capture)
        capture.wait_healthy(60)
        feeds = asyncio.run(_record_feeds(nats_server.url, sink_urls, mariadb))
        worker = ServiceProcess("services.sink_worker", {
            **env, **STANDALONE_WORKER_ENV,
        }, logs, instance_id="worker-typematrix").start()
        procs.append(worker)
        worker.wait_healthy(60)
        conn = mariadb.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SET time_zone = '+00:00'")
                for statement in _change_statements():
                    cur.execute(statement)
            conn.commit()
        finally:
            conn.close()
        result = Replicated(mariadb, sink_urls, downstream)
        _wait_converged(result, procs, timeout=180)
        # Capture reads the refused tables' rows last: wait for their rejections too.
        deadline = time.monotonic() + 60
        while True:
            result.rejections = asyncio.run(_rejections(nats_server.url))
            seen = {r.table for r in result.rejections}
            if all(f"refused_{name}" in seen for name in REFUSED) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        result.logs = "\n".join(f"--- {p.instance_id}\n{p.tail_log(20)}" for p in procs)
        yield result
    finally:
        if feeds:
            asyncio.run(_delete_feeds(nats_server.url, feeds))
        for p in procs:
            p.kill()
        downstream.cleanup()


def _wait_converged(result: Replicated, procs: list[ServiceProcess], timeout: float) -> None:
    """Until every table equals upstream on every downstream, or the deadline; what stays
    different is left in ``result.converged`` for the matrix to report per case."""
    deadline = time.monotonic() + timeout
    todo = {(sink, table) for sink in result.sink_urls for table in _tables(sink)}
    while todo and time.monotonic() < deadline:
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        for sink, table in sorted(todo):
            try:
                diff = _diff(result.source, result.sink_urls[sink], table)
            except Exception:  # the target table appears with its first batch
                continue
            result.converged[(sink, table)] = diff
            if diff.ok:
                todo.discard((sink, table))
        if todo:
            time.sleep(1.0)


def _report(replicated: Replicated, sink: str, table: str, diff: TableDiff | None) -> str:
    rejected = [f"{r.table}: {r.message}" for r in replicated.rejections if r.table == table]
    return (f"{sink} {DB}.{table}: {diff if diff is not None else 'target never readable'}\n"
            f"rejections: {rejected}\n{replicated.logs}")


@pytest.mark.parametrize("sink", SINKS)
@pytest.mark.parametrize("case", VALUE_CASES, ids=lambda c: c.id)
def test_edge_values_arrive_unchanged(replicated: Replicated, case: ValueCase, sink: str) -> None:
    diff = _diff(replicated.source, replicated.sink_urls[sink], WIDE, [f"c_{case.id}"])
    assert diff.ok, _report(replicated, sink, WIDE, diff)
    assert diff.upstream_count == max(len(c.values) for c in VALUE_CASES) + 2


@pytest.mark.parametrize("sink", SINKS)
@pytest.mark.parametrize("case", CHARSET_CASES, ids=lambda c: c.id)
def test_every_charset_arrives_unchanged(replicated: Replicated, case: ValueCase, sink: str) -> None:
    diff = _diff(replicated.source, replicated.sink_urls[sink], CHARSETS, [f"c_{case.id}"])
    assert diff.ok, _report(replicated, sink, CHARSETS, diff)
    assert diff.upstream_count == _charset_rows()
    assert not [r for r in replicated.rejections if r.table == CHARSETS]


@pytest.mark.parametrize("sink", SINKS)
@pytest.mark.parametrize("case", KEY_CASES, ids=lambda c: c.id)
def test_typed_keys_find_their_rows(replicated: Replicated, case: KeyCase, sink: str) -> None:
    diff = _diff(replicated.source, replicated.sink_urls[sink], case.table)
    assert diff.ok, _report(replicated, sink, case.table, diff)
    assert diff.upstream_count == len(case.values) - 1  # one deleted by its key


@pytest.mark.parametrize("sink", SINKS)
def test_generated_columns_hold_the_source_values(replicated: Replicated, sink: str) -> None:
    diff = _diff(replicated.source, replicated.sink_urls[sink], GENERATED)
    assert diff.ok, _report(replicated, sink, GENERATED, diff)
    assert diff.upstream_count == 3


@pytest.mark.parametrize("sql_type", sorted(REFUSED))
def test_unrepresentable_types_are_refused_visibly(replicated: Replicated, sql_type: str) -> None:
    table = f"refused_{sql_type}"
    mine = [r for r in replicated.rejections if r.table == table]
    assert [r.kind for r in mine] == ["unsupported_type"], \
        f"expected one unsupported_type rejection for {table}, got {mine}"
    assert f"v {REFUSED[sql_type].split(' character set')[0]}" in mine[0].message, mine[0].message
    if sql_type.startswith("charset_"):
        assert f"character set {sql_type.removeprefix('charset_')}" in mine[0].message, mine[0].message
    for sink, url in replicated.sink_urls.items():
        meta = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False)],
                           primary_key=["id"])
        target = TargetTable(schema=DB, name=table, meta=meta, key=("id",))
        try:
            rows = open_sink(url).fetch_rows(target)
        except Exception:  # no such table downstream: nothing was stored
            continue
        assert rows == [], f"{sink} holds rows of a refused {sql_type} table: {rows}"


def test_mariadb_targets_keep_each_columns_definition_and_checksum(replicated: Replicated) -> None:
    """NOT NULL, default, charset and collation of every column as upstream; ``CHECKSUM TABLE``
    equal for every table whose columns all keep their type downstream (a TIMESTAMP is a UTC
    DATETIME there, a text key column a VARCHAR; generated columns are plain)."""
    assert replicated.downstream is not None
    compared = []
    for table in _tables():
        source = mysql_definition(replicated.source, DB, table)
        target = mysql_definition(replicated.downstream, DB, table)
        def columns(d: dict[str, list[tuple[Any, ...]]]) -> list[tuple[Any, ...]]:
            return [(name, nullable, default, charset, collation)
                    for name, _, nullable, default, charset, collation, _, _ in d["columns"]]
        assert columns(target) == columns(source), table
        same_types = [c[:2] for c in target["columns"]] == [c[:2] for c in source["columns"]]
        if same_types and not any("GENERATED" in str(c[7]) for c in source["columns"]):
            down_sum = mysql_checksum(replicated.downstream, DB, table)
            assert down_sum == mysql_checksum(replicated.source, DB, table), table
            compared.append(table)
    assert len(compared) >= len(_tables()) // 2, f"checksums compared only for {compared}"


def test_postgres_and_sqlite_targets_keep_not_null_defaults_and_keys(replicated: Replicated) -> None:
    """NOT NULL, literal defaults, primary key and secondary indexes of every table without a
    SPATIAL index (that one: ``test_spatial_columns_...``), as upstream."""
    for table in _tables():
        if table != SPATIAL:
            assert_follows_source(mysql_definition(replicated.source, DB, table), table,
                                  replicated.sink_urls["postgres"], DB, replicated.sink_urls["sqlite"])


@pytest.mark.parametrize("sink", ["postgres", "sqlite"])
def test_postgres_and_sqlite_targets_keep_not_null(replicated: Replicated, sink: str) -> None:
    url = replicated.sink_urls[sink]
    for table in _tables():
        source = mysql_definition(replicated.source, DB, table)
        upstream = {str(c[0]) for c in source["columns"] if c[2] == "NO"}
        if sink == "postgres":
            down = {n for n, c in pg_columns(url, DB, table).items() if c[0] == "NO"}
        else:
            down = {n for n, c in sqlite_columns(url, table).items() if c[0] == 1}
        assert down == upstream, table


def test_spatial_columns_keep_their_type_srid_and_index_on_each_downstream(replicated: Replicated) -> None:
    """MariaDB: the same spatial types, declared SRIDs and SPATIAL index, and CHECKSUM TABLE
    equal (rows checked above). PostgreSQL without PostGIS: EWKB in bytea; SQLite: EWKB BLOBs."""
    diff = _diff(replicated.source, replicated.sink_urls["mariadb"], SPATIAL)
    assert diff.ok and diff.upstream_count == 2, _report(replicated, "mariadb", SPATIAL, diff)
    assert replicated.downstream is not None
    srids = ("SELECT G_GEOMETRY_COLUMN, GEOMETRY_TYPE, SRID FROM information_schema.GEOMETRY_COLUMNS"
             " WHERE G_TABLE_SCHEMA = %s AND G_TABLE_NAME = %s ORDER BY G_GEOMETRY_COLUMN")
    upstream = mysql_query(replicated.source, srids, (DB, SPATIAL))
    assert ("p", 1, 4326) in upstream and ("g", 0, 3857) in upstream
    assert mysql_query(replicated.downstream, srids, (DB, SPATIAL)) == upstream
    wide = mysql_query(replicated.source, srids, (DB, WIDE))
    assert ("c_point_4326", 1, 4326) in wide
    assert mysql_query(replicated.downstream, srids, (DB, WIDE)) == wide
    source, target = (mysql_definition(s, DB, SPATIAL) for s in (replicated.source, replicated.downstream))
    assert [c[:2] for c in target["columns"]] == [c[:2] for c in source["columns"]]
    assert [(i[0], i[3], i[6]) for i in target["indexes"] if i[0] == "sp"] == [("sp", "p", "SPATIAL")]
    assert mysql_checksum(replicated.downstream, DB, SPATIAL) == \
        mysql_checksum(replicated.source, DB, SPATIAL)

    postgis = bool(pg_query(replicated.sink_urls["postgres"],
                            "SELECT 1 FROM pg_extension WHERE extname = 'postgis'"))
    types = dict(pg_query(replicated.sink_urls["postgres"],
                          "SELECT column_name, data_type FROM information_schema.columns"
                          " WHERE table_schema = %s AND table_name = %s", (DB, SPATIAL)))
    assert types == {"id": "integer", "p": "USER-DEFINED" if postgis else "bytea",
                     "g": "USER-DEFINED" if postgis else "bytea", "c": "USER-DEFINED" if postgis else "bytea"}
    # Stored as EWKB: the SRID in the header (flag 0x20000000), little-endian as MariaDB wrote it.
    if not postgis:
        [(ewkb,)] = pg_query(replicated.sink_urls["postgres"],
                             f'SELECT p FROM "{DB}"."{SPATIAL}" WHERE id = 1')
        assert bytes(ewkb).hex() == "0101000020e6100000" + "0000000000000040" * 2
    sqlite_types = {r[1]: r[2] for r in sqlite_query(replicated.sink_urls["sqlite"],
                                                      f"PRAGMA table_info('{SPATIAL}')")}
    assert sqlite_types == {"id": "INTEGER", "p": "BLOB", "g": "BLOB", "c": "BLOB"}
    [(blob,)] = sqlite_query(replicated.sink_urls["sqlite"], f"SELECT c FROM {SPATIAL} WHERE id = 1")
    assert blob == bytes.fromhex("010700000000000000")  # empty collection, SRID 0: plain WKB


def _postgis(replicated: Replicated) -> str:
    url = replicated.sink_urls.get(POSTGIS)
    if url is None:
        pytest.skip("PostGIS is not installed for this machine's PostgreSQL (no 'postgis' in "
                    "pg_available_extensions; infra/dev.sh setup installs postgresql-<major>-postgis-3)")
    return url


@pytest.mark.parametrize("case", SPATIAL_CASES, ids=lambda c: c.id)
def test_spatial_edge_values_arrive_in_postgis(replicated: Replicated, case: ValueCase) -> None:
    url = _postgis(replicated)
    diff = _diff(replicated.source, url, WIDE, [f"c_{case.id}"])
    assert diff.ok, _report(replicated, POSTGIS, WIDE, diff)
    assert diff.upstream_count == max(len(c.values) for c in VALUE_CASES) + 2


def test_postgis_target_has_geometry_columns_srids_not_null_and_a_gist_index(replicated: Replicated) -> None:
    """Where the target database has PostGIS: geometry(Subtype,SRID) per column (the declared
    SRID, the subtype), NOT NULL as upstream, the SPATIAL index as GiST, each value's SRID."""
    url = _postgis(replicated)
    diff = _diff(replicated.source, url, SPATIAL)
    assert diff.ok and diff.upstream_count == 2, _report(replicated, POSTGIS, SPATIAL, diff)
    types = dict(pg_query(url, "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a"
                               " WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped",
                          (f'"{DB}"."{SPATIAL}"',)))
    assert types == {"id": "integer", "p": "geometry(Point,4326)", "g": "geometry(Geometry,3857)",
                     "c": "geometry(GeometryCollection)"}
    assert {n for n, c in pg_columns(url, DB, SPATIAL).items() if c[0] == "NO"} == {"id", "p"}
    indexes = pg_query(url, "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND tablename = %s",
                       (DB, SPATIAL))
    assert any("USING gist (p)" in str(d) for (d,) in indexes), indexes
    srids = pg_query(url, "SELECT id, ST_SRID(p), ST_SRID(g), ST_AsText(c), ST_SRID(c)"
                          f' FROM "{DB}"."{SPATIAL}" ORDER BY id')
    assert srids == [(1, 4326, None, "GEOMETRYCOLLECTION EMPTY", 0),
                     (3, 4326, 3857, "GEOMETRYCOLLECTION(POINT(1 2))", 4326)]
    wide = dict(pg_query(url, "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a"
                              " WHERE a.attrelid = %s::regclass AND a.attnum > 0", (f'"{DB}"."{WIDE}"',)))
    assert wide["c_point_4326"] == "geometry(Point,4326)" and wide["c_geometry"] == "geometry"
