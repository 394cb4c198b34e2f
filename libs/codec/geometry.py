"""Spatial values (POINT ... GEOMETRYCOLLECTION) between MariaDB/MySQL and the other downstreams.

MariaDB and MySQL store a geometry, send it over the wire and write it to the binlog in one
*internal format*: the SRID as a 4-byte little-endian integer, then the geometry's WKB. That
format is the contract's value (base64, kind ``geometry``) and the Python value every sink
decodes to, so upstream and downstream rows compare byte for byte.

Where a downstream has no MySQL geometry, the value is stored as EWKB (PostGIS's extended WKB):
the WKB with the SRID flag (``0x20000000``) set in the top-level type and the SRID after it, in
the WKB's own byte order. An SRID of 0 is left out, so such a value is plain WKB, byte for
byte; any EWKB reader (PostGIS ``ST_GeomFromEWKB``, GEOS, shapely) reads the others. Both
conversions only touch the top-level header, so they are exact inverses.

A column's declared SRID (MariaDB ``REF_SYSTEM_ID``, MySQL 8 ``SRID``) travels in the column's
``sql_type`` as ``<type> srid <n>`` (``point srid 4326``); ``libs.codec.decode.parse_sql_type``
reads it back.
"""

from __future__ import annotations

import struct

SPATIAL_TYPES = frozenset(("geometry", "point", "linestring", "polygon", "multipoint",
                           "multilinestring", "multipolygon", "geometrycollection", "geomcollection"))
"""information_schema DATA_TYPE names of spatial columns (MySQL 8 also says geomcollection)."""

# WKB geometry type codes (2D: MariaDB and MySQL store no Z or M).
_WKB_TYPES = {1: "Point", 2: "LineString", 3: "Polygon", 4: "MultiPoint", 5: "MultiLineString",
              6: "MultiPolygon", 7: "GeometryCollection"}
_PG_SUBTYPES = {"point": "Point", "linestring": "LineString", "polygon": "Polygon",
                "multipoint": "MultiPoint", "multilinestring": "MultiLineString",
                "multipolygon": "MultiPolygon", "geometrycollection": "GeometryCollection",
                "geomcollection": "GeometryCollection", "geometry": "Geometry"}
# The binlog table map's geometry type (FULL row metadata), 0 = any geometry.
BINLOG_SUBTYPES = {0: "geometry", 1: "point", 2: "linestring", 3: "polygon", 4: "multipoint",
                   5: "multilinestring", 6: "multipolygon", 7: "geometrycollection"}

EWKB_SRID_FLAG = 0x20000000
_EWKB_FLAGS = 0xE0000000  # Z, M and SRID flags of EWKB
MAX_SRID = 0xFFFFFFFF


class GeometryError(ValueError):
    """Bytes that are not a geometry in the expected format."""


def _order(wkb: bytes | memoryview, at: int = 0) -> str:
    if len(wkb) < at + 5:
        raise GeometryError(f"a geometry of {len(wkb) - at} bytes is shorter than a WKB header")
    byte_order = wkb[at]
    if byte_order not in (0, 1):
        raise GeometryError(f"WKB byte order {byte_order} (0 or 1 expected)")
    return "<" if byte_order == 1 else ">"


def split_internal(value: bytes) -> tuple[int, bytes]:
    """``(srid, wkb)`` of a value in MariaDB's internal format; raises GeometryError."""
    value = bytes(value)
    if len(value) < 9:
        raise GeometryError(f"a geometry of {len(value)} bytes (at least 9: SRID and WKB header)")
    order = _order(value, 4)
    (code,) = struct.unpack_from(order + "I", value, 5)
    if code not in _WKB_TYPES:
        raise GeometryError(f"WKB geometry type {code} (MariaDB stores 2D types 1..7)")
    return struct.unpack_from("<I", value)[0], value[4:]


def check_internal(value: bytes) -> bytes:
    """``value`` itself, after checking it is a geometry in MariaDB's internal format."""
    split_internal(value)
    return bytes(value)


def internal_from(srid: int, wkb: bytes) -> bytes:
    if not 0 <= srid <= MAX_SRID:
        raise GeometryError(f"SRID {srid} outside 0..{MAX_SRID}")
    return struct.pack("<I", srid) + bytes(wkb)


def internal_to_ewkb(value: bytes) -> bytes:
    """MariaDB's internal format to EWKB (plain WKB when the SRID is 0)."""
    srid, wkb = split_internal(value)
    if srid == 0:
        return wkb
    order = _order(wkb)
    (code,) = struct.unpack_from(order + "I", wkb, 1)
    return wkb[:1] + struct.pack(order + "II", code | EWKB_SRID_FLAG, srid) + wkb[5:]


def ewkb_to_internal(value: bytes | str) -> bytes:
    """EWKB (or plain WKB: SRID 0), as bytes or PostGIS's hex text, to MariaDB's internal format."""
    data = bytes.fromhex(value.removeprefix("\\x")) if isinstance(value, str) else bytes(value)
    order = _order(data)
    (code,) = struct.unpack_from(order + "I", data, 1)
    if code & ~_EWKB_FLAGS not in _WKB_TYPES or code & (_EWKB_FLAGS & ~EWKB_SRID_FLAG):
        raise GeometryError(f"EWKB geometry type {code:#x} (2D types 1..7 expected)")
    if not code & EWKB_SRID_FLAG:
        return internal_from(0, data)
    if len(data) < 9:
        raise GeometryError("EWKB with the SRID flag but no SRID")
    (srid,) = struct.unpack_from(order + "I", data, 5)
    return internal_from(srid, data[:1] + struct.pack(order + "I", code & ~EWKB_SRID_FLAG) + data[9:])


def pg_geometry_type(base: str, srid: int | None) -> str:
    """The PostGIS column type of a MySQL spatial type: ``geometry(Point,4326)``; the subtype
    is kept (MariaDB enforces it too), the SRID only where the source declares one."""
    subtype = _PG_SUBTYPES.get(base, "Geometry")
    if srid:
        return f"geometry({subtype},{srid})"
    return "geometry" if subtype == "Geometry" else f"geometry({subtype})"


def mysql_srid_clause(srid: int | None) -> str:
    """The column attribute that declares ``srid`` on either server, as executable comments:
    MySQL 8 reads ``SRID n`` (MariaDB ignores MySQL's 5.7+ comments), MariaDB reads
    ``REF_SYSTEM_ID=n`` (MySQL ignores ``/*M!``)."""
    if not srid:
        return ""
    return f" /*!80003 SRID {int(srid)} */ /*M!100100 REF_SYSTEM_ID={int(srid)} */"
