"""Spatial columns through each SQL sink without the pipeline: the target created from the
source's metadata, an initial load's bulk write, a streamed upsert and delete, then the
verifier (``verify_target``: checksums and diff) against the source. MariaDB, PostgreSQL with
``bytea`` (no PostGIS in the target database), PostgreSQL with PostGIS when this machine's
PostgreSQL has the extension (skipped, saying so, otherwise) and SQLite.

The full path (capture, Spark apply) is the type matrix's (``tests/test_type_matrix.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pymysql.cursors
import pytest

from libs.codec.geometry import internal_from, split_internal
from libs.codec.table_meta import load_table_info
from libs.dburl import parse_database_url
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from services.sink_worker.sinks.base import Delete, TargetTable, Upsert
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.validation.verify import ShardRef, verify_target
from tests.helpers.definitions import pg_query
from tests.helpers.type_cases import large_polygon

pytestmark = pytest.mark.integration

SRC = "spatial_src"
TABLE = "places"
GIS_DB = "spatial_gis"
DOWN = "spatial_down"

_DDL = (f"CREATE TABLE {SRC}.{TABLE} (id INT PRIMARY KEY, p POINT REF_SYSTEM_ID=4326 NOT NULL,"
        " g GEOMETRY, c GEOMETRYCOLLECTION, SPATIAL KEY sp (p))")
_ROWS = [
    "(1, ST_GeomFromText('POINT(13.4 52.5)', 4326), ST_GeomFromText('POINT(1 2)', 0),"
    " ST_GeomFromText('GEOMETRYCOLLECTION EMPTY'))",
    "(2, ST_GeomFromText('POINT(-180 -90)', 4326),"
    f" ST_GeomFromText('{large_polygon(4000)}', 4326), ST_GeomFromText('GEOMETRYCOLLECTION EMPTY', 4326))",
    "(3, ST_GeomFromText('POINT(0 0)', 4326), NULL, NULL)",
    "(4, ST_GeomFromText('POINT(1e300 1)', 4326), ST_GeomFromText('MULTILINESTRING((0 0, 1 1))', 3857),"
    " ST_GeomFromText('GEOMETRYCOLLECTION(POINT(1 1), GEOMETRYCOLLECTION(LINESTRING(0 0, 2 2)))', 4326))",
]


def _postgis_available(postgres: PostgreSQL) -> bool:
    return bool(pg_query(postgres.url, "SELECT 1 FROM pg_available_extensions WHERE name = 'postgis'"))


@pytest.fixture
def source(mariadb: MariaDB) -> Iterator[MariaDB]:
    mariadb.execute(f"DROP DATABASE IF EXISTS {SRC}", f"CREATE DATABASE {SRC}", _DDL,
                    f"INSERT INTO {SRC}.{TABLE} VALUES {', '.join(_ROWS)}")
    yield mariadb
    mariadb.execute(f"DROP DATABASE IF EXISTS {SRC}")


def _sink_url(name: str, mariadb: MariaDB, postgres: PostgreSQL, tmp: Path) -> str:
    if name == "mariadb":
        mariadb.execute(f"DROP DATABASE IF EXISTS {DOWN}", f"CREATE DATABASE {DOWN}")
        return mariadb.url_for(DOWN)
    if name == "postgres-bytea":
        _pg_exec(postgres.url, f'DROP SCHEMA IF EXISTS "{SRC}" CASCADE')
        return postgres.url
    if name == "postgres-postgis":
        if not _postgis_available(postgres):
            pytest.skip("PostGIS is not installed for this machine's PostgreSQL (no 'postgis' in "
                        "pg_available_extensions; e.g. apt package postgresql-15-postgis-3): the "
                        "geometry-column path is not tested here, the bytea fallback is")
        _pg_exec(postgres.url, f"DROP DATABASE IF EXISTS {GIS_DB}")
        _pg_exec(postgres.url, f"CREATE DATABASE {GIS_DB}")
        _pg_exec(postgres.url_for(GIS_DB), "CREATE EXTENSION postgis")
        return postgres.url_for(GIS_DB)
    return f"sqlite:///{tmp / 'spatial.db'}"


def _pg_exec(url: str, sql: str) -> None:
    db = parse_database_url(url)
    with psycopg.connect(host=db.host, port=db.port, user=db.user or None,
                         dbname=db.database or "postgres", autocommit=True) as conn:
        conn.execute(sql.encode())


def _source_rows(source: MariaDB, schema: str) -> tuple[list[tuple[Any, ...]], TargetTable]:
    conn = source.connect()
    try:
        info = load_table_info(conn, SRC, TABLE)
        assert info is not None
        with conn.cursor() as cur:
            cur.execute(f"SELECT id, p, g, c FROM {SRC}.{TABLE} ORDER BY id")
            rows = [tuple(r) for r in cur.fetchall()]
    finally:
        conn.close()
    meta = info.meta()
    return rows, TargetTable(schema=schema, name=TABLE, meta=meta, key=tuple(meta.primary_key))


@pytest.mark.parametrize("sink_name", ["mariadb", "postgres-bytea", "postgres-postgis", "sqlite"])
def test_spatial_rows_load_stream_and_verify(source: MariaDB, postgres: PostgreSQL, sink_name: str,
                                              tmp_path: Path) -> None:
    url = _sink_url(sink_name, source, postgres, tmp_path)
    # A MariaDB target in a database of its own on the same server; a schema of that name elsewhere.
    schema = DOWN if sink_name == "mariadb" else SRC
    rows, target = _source_rows(source, schema)
    kinds = {c.name: (c.kind, c.sql_type) for c in target.meta.columns}
    assert kinds["p"] == ("geometry", "point srid 4326") and kinds["c"] == ("geometry", "geometrycollection")
    sink = open_sink(url)
    sink.ensure_table(target)
    assert sink.load_rows(target, ["id", "p", "g", "c"], rows) == len(rows)

    # The stream's way: an update that moves a point and changes SRIDs, a delete; the source
    # takes the same change, so the verifier compares like with like.
    moved = internal_from(4326, split_internal(rows[0][1])[1])
    regrid = internal_from(3857, split_internal(rows[1][2])[1])
    source.execute(f"UPDATE {SRC}.{TABLE} SET p = ST_GeomFromText('POINT(13.4 52.5)', 4326),"
                   f" g = ST_GeomFromWKB(ST_AsWKB(g), 3857) WHERE id = 2",
                   f"DELETE FROM {SRC}.{TABLE} WHERE id = 3")
    sink.apply_partition(target, [Upsert(key=(2,), row={"id": 2, "p": moved, "g": regrid, "c": rows[1][3]}),
                                  Delete(key=(3,))])

    result = verify_target([ShardRef(source.url, SRC, TABLE)], url, schema, TABLE)
    assert result.ok, result.diff
    assert result.diff.upstream_count == 3
    down = {r["id"]: r for r in sink.fetch_rows(target)}
    assert split_internal(down[2]["g"])[0] == 3857 and split_internal(down[1]["g"])[0] == 0
    assert len(down[2]["p"]) == 25 and down[1]["c"] == bytes.fromhex("00000000010700000000000000")

    if sink_name == "mariadb":
        conn = source.connect()
        try:
            with conn.cursor(pymysql.cursors.DictCursor) as cur:
                cur.execute("SELECT G_GEOMETRY_COLUMN AS c, SRID AS s"
                            " FROM information_schema.GEOMETRY_COLUMNS"
                            " WHERE G_TABLE_SCHEMA = %s AND G_TABLE_NAME = %s", (DOWN, TABLE))
                assert {r["c"]: r["s"] for r in cur.fetchall()} == {"p": 4326, "g": 0, "c": 0}
                cur.execute("SELECT INDEX_TYPE FROM information_schema.STATISTICS"
                            " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s AND INDEX_NAME = 'sp'",
                            (DOWN, TABLE))
                assert [r["INDEX_TYPE"] for r in cur.fetchall()] == ["SPATIAL"]
        finally:
            conn.close()
    if sink_name == "postgres-postgis":
        types = dict(pg_query(url, "SELECT a.attname, format_type(a.atttypid, a.atttypmod)"
                                   " FROM pg_attribute a WHERE a.attrelid = %s::regclass AND a.attnum > 0",
                              (f'"{SRC}"."{TABLE}"',)))
        assert types["p"] == "geometry(Point,4326)" and types["g"] == "geometry"
        assert pg_query(url, f'SELECT ST_SRID(g) FROM "{SRC}"."{TABLE}" WHERE id = 2') == [(3857,)]
        assert any("gist" in d for (d,) in pg_query(
            url, "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND tablename = %s", (SRC, TABLE)))
    if sink_name == "postgres-bytea":
        types = dict(pg_query(url, "SELECT column_name, data_type FROM information_schema.columns"
                                   " WHERE table_schema = %s AND table_name = %s", (SRC, TABLE)))
        assert types == {"id": "integer", "p": "bytea", "g": "bytea", "c": "bytea"}
