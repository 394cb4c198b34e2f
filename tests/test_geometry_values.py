"""Spatial values between MariaDB's internal format, the contract and each downstream's
storage (``libs.codec.geometry`` and the codec functions that use it): pure conversions."""

from __future__ import annotations

import base64
import struct

import pytest
from pymysqlreplication.constants import FIELD_TYPE

from contracts.events.rows import ColumnV1, IndexPartV1, IndexV1, TableMetaV1, TableMetaV2, TableShapeV1
from libs.checksum import compare_tables, normalize
from libs.codec.decode import (
    decode_value,
    normalize_fetched,
    parse_sql_type,
    postgis_type_for,
    sql_type_for,
)
from libs.codec.encode import UnsupportedValue, encode_value, kind_for_binlog_type, kind_for_data_type
from libs.codec.geometry import (
    GeometryError,
    ewkb_to_internal,
    internal_from,
    internal_to_ewkb,
    split_internal,
)
from libs.codec.table_shape import shape_from_rows
from libs.target_fit import narrower
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.shape_ddl import mysql_index_clause, pg_index_statement

# What MariaDB stores for ST_GeomFromText('POINT(1 2)', 4326), and PostGIS's
# ST_AsEWKB('SRID=4326;POINT(1 2)') of the same point.
POINT_4326 = bytes.fromhex("E61000000101000000000000000000F03F0000000000000040")
POINT_EWKB = bytes.fromhex("0101000020E6100000000000000000F03F0000000000000040")
EMPTY_COLLECTION = bytes.fromhex("00000000010700000000000000")  # GEOMETRYCOLLECTION EMPTY, SRID 0


def _polygon(points: int, srid: int) -> bytes:
    ring = [(float(i), float(i * i % 97)) for i in range(points - 1)]
    ring.append(ring[0])
    wkb = struct.pack("<BIII", 1, 3, 1, len(ring)) + b"".join(struct.pack("<dd", x, y) for x, y in ring)
    return internal_from(srid, wkb)


def _big_endian_point(srid: int) -> bytes:
    return internal_from(srid, struct.pack(">BIdd", 0, 1, -1.5, 2.25))


def _column(sql_type: str, name: str = "g") -> ColumnV1:
    return ColumnV1(name=name, kind="geometry", sql_type=sql_type)


CASES = [POINT_4326, EMPTY_COLLECTION, _polygon(5000, 4326), _polygon(4, 0), _big_endian_point(3857),
         _big_endian_point(0), internal_from(4294967295, POINT_4326[4:])]


@pytest.mark.parametrize("value", CASES, ids=range(len(CASES)))
def test_ewkb_and_back_is_the_same_value(value: bytes) -> None:
    ewkb = internal_to_ewkb(value)
    assert ewkb_to_internal(ewkb) == value
    assert ewkb_to_internal(ewkb.hex()) == value  # PostGIS hands geometry back as hex text
    assert ewkb_to_internal("\\x" + ewkb.hex()) == value


def test_ewkb_is_what_postgis_writes_and_plain_wkb_for_srid_0() -> None:
    assert internal_to_ewkb(POINT_4326) == POINT_EWKB
    assert internal_to_ewkb(EMPTY_COLLECTION) == EMPTY_COLLECTION[4:]
    # The SRID follows the type in the WKB's own byte order.
    ewkb = internal_to_ewkb(_big_endian_point(3857))
    assert ewkb[:9] == bytes([0]) + struct.pack(">II", 0x20000001, 3857)
    assert split_internal(POINT_4326) == (4326, POINT_4326[4:])


@pytest.mark.parametrize("bad", [b"", b"\x00" * 8, b"\x00\x00\x00\x00\x02\x01\x00\x00\x00",
                                 b"\x00\x00\x00\x00\x01\x08\x00\x00\x00" + b"\x00" * 16])
def test_what_is_not_a_geometry_is_refused(bad: bytes) -> None:
    with pytest.raises(GeometryError):
        split_internal(bad)
    with pytest.raises(UnsupportedValue):
        encode_value("geometry", bad)


def test_ewkb_with_z_or_m_is_refused() -> None:
    with pytest.raises(GeometryError):
        ewkb_to_internal(struct.pack("<BIddd", 1, 0x80000001, 1, 2, 3))


def test_spatial_columns_are_the_geometry_kind_from_the_catalog_and_the_binlog() -> None:
    for name in ("point", "LINESTRING", "polygon", "multipoint", "multilinestring", "multipolygon",
                 "geometry", "geometrycollection", "geomcollection"):
        assert kind_for_data_type(name) == "geometry", name
    assert kind_for_binlog_type(FIELD_TYPE.GEOMETRY, None) == "geometry"
    assert kind_for_binlog_type(FIELD_TYPE.GEOMETRY, "binary") == "geometry"
    assert kind_for_data_type("inet6") is None  # still refused


@pytest.mark.parametrize("value", CASES, ids=range(len(CASES)))
def test_the_contract_carries_the_internal_format_as_base64(value: bytes) -> None:
    encoded = encode_value("geometry", value)
    assert base64.b64decode(encoded) == value
    assert decode_value("geometry", "point", encoded) == value
    assert encode_value("geometry", None) is None


def test_the_declared_srid_travels_in_the_sql_type() -> None:
    parsed = parse_sql_type("point srid 4326")
    assert (parsed.base, parsed.srid) == ("point", 4326)
    assert parse_sql_type("geometry").srid is None
    mysql = sql_type_for("mysql", _column("point srid 4326"))
    # MySQL 8 reads SRID, MariaDB REF_SYSTEM_ID; each skips the other's comment.
    assert mysql == "point /*!80003 SRID 4326 */ /*M!100100 REF_SYSTEM_ID=4326 */"
    assert sql_type_for("mysql", _column("multipolygon")) == "multipolygon"
    assert sql_type_for("postgresql", _column("point srid 4326")) == "bytea"
    assert sql_type_for("sqlite", _column("point srid 4326")) == "BLOB"
    assert postgis_type_for(_column("point srid 4326")) == "geometry(Point,4326)"
    assert postgis_type_for(_column("geometrycollection")) == "geometry(GeometryCollection)"
    assert postgis_type_for(_column("geometry")) == "geometry"
    assert postgis_type_for(_column("geometry srid 3857")) == "geometry(Geometry,3857)"


def test_each_downstream_reads_back_the_internal_format() -> None:
    column = _column("point srid 4326")
    assert normalize_fetched(column, POINT_4326, "mysql") == POINT_4326
    assert normalize_fetched(column, POINT_EWKB, "postgresql") == POINT_4326  # bytea
    assert normalize_fetched(column, memoryview(POINT_EWKB), "postgresql") == POINT_4326
    assert normalize_fetched(column, POINT_EWKB.hex().upper(), "postgresql") == POINT_4326  # PostGIS
    assert normalize_fetched(column, POINT_EWKB, "sqlite") == POINT_4326
    assert normalize_fetched(column, None, "sqlite") is None


def test_checksums_tell_the_srid_and_the_shape_apart() -> None:
    column = _column("geometry")
    assert normalize(POINT_4326, column) == "G4326:" + POINT_4326[4:].hex()
    other_srid = internal_from(0, POINT_4326[4:])
    assert normalize(other_srid, column) != normalize(POINT_4326, column)
    big = _polygon(5000, 4326)
    assert normalize(big, column).startswith("G4326:#")  # long WKB: digested
    assert normalize(big, column) != normalize(_polygon(5000, 0), column)
    columns = [ColumnV1(name="id", kind="int", sql_type="int"), column]
    up = [{"id": 1, "g": POINT_4326}, {"id": 2, "g": None}]
    assert compare_tables(up, [dict(r) for r in up], ["id"], columns=columns).ok
    down = [{"id": 1, "g": other_srid}, {"id": 2, "g": None}]
    diff = compare_tables(up, down, ["id"], columns=columns)
    assert not diff.ok


def test_a_spatial_index_has_no_prefix_and_is_gist_on_postgis() -> None:
    shape = shape_from_rows([], [("sp", 1, "p", 32, "SPATIAL", "A", "")], None, mariadb=True)
    index = shape.indexes[0]
    assert index.kind == "spatial" and index.parts[0].prefix is None
    assert mysql_index_clause(lambda n: f"`{n}`", index) == "SPATIAL KEY `sp` (`p`)"
    meta = TableMetaV2(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                                ColumnV1(name="p", kind="geometry", sql_type="point", nullable=False)],
                       primary_key=["id"], shape=TableShapeV1(indexes=[index]))
    table = TargetTable(schema="s", name="t", meta=meta, key=("id",))
    quote = lambda n: f'"{n}"'  # noqa: E731
    assert pg_index_statement(quote, '"s"."t"', table, index) is None  # bytea: nothing to index
    assert pg_index_statement(quote, '"s"."t"', table, index, gist=True) == \
        'CREATE INDEX IF NOT EXISTS "t__sp" ON "s"."t" USING GIST ("p")'
    assert isinstance(meta, TableMetaV1)


def test_a_user_made_target_must_hold_every_subtype_the_source_may_send() -> None:
    assert narrower("geometry", "point /*!80003 SRID 4326 */ /*M!100100 REF_SYSTEM_ID=4326 */") is None
    assert narrower("point", "point") is None
    assert narrower("geometry(Point,4326)", "point") is None
    assert narrower("point", "geometry") == "point holds only point values, not every geometry"
    assert narrower("polygon", "multipolygon") is not None
    assert narrower("longtext", "point") == "longtext cannot hold point values"
    assert IndexV1(name="x", kind="spatial", parts=[IndexPartV1(column="p")]).kind == "spatial"


def test_the_initial_loads_postgres_copy_spells_ewkb() -> None:
    from services.sink_worker.sinks.postgres import _source_bytes_encoder

    column = _column("point srid 4326")
    bytea = _source_bytes_encoder(column)
    postgis = _source_bytes_encoder(column, postgis=True)
    assert bytea is not None and postgis is not None
    assert bytea(POINT_4326) == b"\\\\x" + POINT_EWKB.hex().encode()  # bytea hex, backslash escaped
    assert postgis(POINT_4326) == POINT_EWKB.hex().encode()
