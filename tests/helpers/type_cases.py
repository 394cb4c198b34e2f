"""The type matrix's cases: MariaDB column types with their values, as keys and as values."""

from __future__ import annotations

from dataclasses import dataclass


def _fsp(text: str, fsp: int) -> str:
    """``text`` with its fraction cut to ``fsp`` digits (MariaDB truncates, it never rounds)."""
    whole, _, frac = text.partition(".")
    return whole + ("." + frac[:fsp].ljust(fsp, "0") if fsp else "")


@dataclass(frozen=True)
class ValueCase:
    """One column type and its edge values (SQL literals)."""

    id: str
    sql_type: str
    values: tuple[str, ...]


def _value_cases() -> list[ValueCase]:
    cases = [
        ValueCase("tinyint", "tinyint", ("-128", "127", "0")),
        ValueCase("tinyint_u", "tinyint unsigned", ("0", "255")),
        ValueCase("bool", "tinyint(1)", ("0", "1", "-1")),
        ValueCase("smallint", "smallint", ("-32768", "32767")),
        ValueCase("smallint_u", "smallint unsigned", ("0", "65535")),
        ValueCase("mediumint", "mediumint", ("-8388608", "8388607")),
        ValueCase("mediumint_u", "mediumint unsigned", ("0", "16777215")),
        ValueCase("int", "int", ("-2147483648", "2147483647", "0")),
        ValueCase("int_u", "int unsigned", ("0", "4294967295")),
        ValueCase("bigint", "bigint", ("-9223372036854775808", "9223372036854775807")),
        ValueCase("bigint_u", "bigint unsigned", ("0", "18446744073709551615", "9223372036854775808")),
        ValueCase("zerofill", "int(6) unsigned zerofill", ("42", "0")),
        ValueCase("decimal_65_30", "decimal(65,30)", (
            "'" + "9" * 35 + "." + "9" * 30 + "'", "'-" + "9" * 35 + "." + "9" * 30 + "'",
            "'0." + "0" * 29 + "1'", "0")),
        ValueCase("decimal_65_0", "decimal(65,0)", ("'" + "9" * 65 + "'", "'-" + "9" * 65 + "'")),
        ValueCase("decimal_5_2_u", "decimal(5,2) unsigned", ("'999.99'", "'0.01'", "0")),
        ValueCase("decimal_10_0", "decimal(10,0)", ("-9999999999", "9999999999")),
        ValueCase("float", "float", ("-3.40282e38", "3.40282e38", "1.17549e-38", "0", "0.1", "-1.5")),
        ValueCase("double", "double", ("1.7976931348623157e308", "-1.7976931348623157e308",
                                       "2.2250738585072014e-308", "0.1", "5e-324", "0")),
        ValueCase("bit1", "bit(1)", ("b'0'", "b'1'")),
        ValueCase("bit8", "bit(8)", ("b'10000001'", "b'0'", "b'11111111'")),
        ValueCase("bit63", "bit(63)", ("b'" + "1" * 63 + "'", "b'1'")),
        ValueCase("bit64", "bit(64)", ("b'" + "1" * 64 + "'", "b'1" + "0" * 63 + "'", "b'0'")),
        ValueCase("date", "date", ("'1000-01-01'", "'9999-12-31'", "'2024-02-29'", "'1970-01-01'")),
        ValueCase("year", "year", ("0", "1901", "2155", "2024")),
        ValueCase("char_utf8mb4", "char(10) character set utf8mb4",
                  ("'abc'", "''", "'😀x'", "'ab  '", "' lead'", "'ﬁÆß'")),
        ValueCase("varchar_utf8mb4", "varchar(20) character set utf8mb4",
                  ("'😀🎉'", "'a  '", "''", "'quote''s \\\\ back'", "'" + "é" * 20 + "'")),
        ValueCase("varchar_latin1", "varchar(20) character set latin1",
                  ("'é'", "'ÿ¤'", "''", "'a  '")),
        ValueCase("char_latin1", "char(5) character set latin1", ("'Ünï'", "''")),
        ValueCase("varchar_ascii", "varchar(10) character set ascii", ("'abc'", "'~'")),
        ValueCase("varchar_utf8mb3", "varchar(10) character set utf8mb3", ("'ä€'", "''")),
        ValueCase("tinytext", "tinytext", ("'😀'", "''")),
        ValueCase("text", "text", ("'line\\nbreak\\ttab'", "''", "'😀 " + "x" * 300 + "'")),
        ValueCase("mediumtext", "mediumtext", ("'ünï😀'", "''")),
        ValueCase("longtext", "longtext", ("'" + "long " * 2000 + "'", "''")),
        ValueCase("text_latin1", "text character set latin1", ("'çà'", "''")),
        ValueCase("binary4", "binary(4)", ("x'01000000'", "x'00000000'", "''", "x'FFFFFFFF'",
                                           "x'0001'")),
        ValueCase("binary16", "binary(16)", ("x'0123456789ABCDEF0000000000000000'", "x'00'")),
        ValueCase("varbinary", "varbinary(8)", ("x'6100'", "''", "x'00'", "x'FF00FF00'")),
        ValueCase("tinyblob", "tinyblob", ("x'00'", "''", "x'FF'")),
        ValueCase("blob", "blob", ("x'DEADBEEF0000'", "''", "x'00'")),
        ValueCase("mediumblob", "mediumblob", ("x'00FF00'", "''")),
        ValueCase("longblob", "longblob", ("x'" + "00AB" * 1000 + "'", "''")),
        ValueCase("enum", "enum('a','b','')", ("'a'", "'b'", "''")),
        ValueCase("enum_utf8", "enum('ä','😀','x y')", ("'😀'", "'x y'", "'ä'")),
        ValueCase("set", "set('a','b','c')", ("''", "'a'", "'a,c'", "'a,b,c'", "'c,b'")),
        ValueCase("set_utf8", "set('😀','ä','x')", ("'😀,x'", "''", "'ä'")),
        ValueCase("json", "json", ("'{\"a\": 1, \"b\": [true, null, \"😀\"]}'", "'[]'", "'\"str\"'",
                                   "'1.5'", "'{}'", "'{\"n\": 12345678901234567890}'")),
    ]
    cases += _spatial_cases()
    for fsp in range(7):
        cases.append(ValueCase(f"datetime{fsp}", f"datetime({fsp})", tuple(
            f"'{_fsp(v, fsp)}'" for v in ("1000-01-01 00:00:00.000000", "9999-12-31 23:59:59.999999",
                                          "2024-02-29 12:34:56.123456", "1970-01-01 00:00:01.000001"))))
        cases.append(ValueCase(f"timestamp{fsp}", f"timestamp({fsp}) NULL", tuple(
            f"'{_fsp(v, fsp)}'" for v in ("1970-01-01 00:00:01.000000", "2038-01-19 03:14:07.999999",
                                          "2024-02-29 00:00:00.654321", "1970-01-01 00:00:01.000001"))))
        cases.append(ValueCase(f"time{fsp}", f"time({fsp})", tuple(
            f"'{_fsp(v, fsp)}'" for v in ("-838:59:59.000000", "838:59:59.999999", "00:00:00.000000",
                                          "-00:00:01.000000", "25:00:00.000001", "-12:34:56.780000",
                                          "-00:00:00.500000"))))
    return cases


def _geom(wkt: str, srid: int = 0) -> str:
    return f"ST_GeomFromText('{wkt}', {srid})"


def large_polygon(points: int) -> str:
    """A polygon's WKT with ``points`` vertices on a circle (closed: the first one again)."""
    import math

    angles = [2 * math.pi * i / points for i in range(points)]
    ring = [(round(100 * math.cos(a), 9), round(100 * math.sin(a), 9)) for a in angles]
    ring.append(ring[0])
    return "POLYGON((" + ", ".join(f"{x!r} {y!r}" for x, y in ring) + "))"


def _spatial_cases() -> list[ValueCase]:
    """Every spatial type, SRIDs 0 and 4326 (per value and declared on the column), empty
    collections and a polygon of thousands of points."""
    return [
        ValueCase("point", "point", (_geom("POINT(1 2)"), _geom("POINT(-180 90)", 4326),
                                     _geom("POINT(1e300 -2.5e-300)"), _geom("POINT(0 -0)", 3857))),
        ValueCase("point_4326", "point REF_SYSTEM_ID=4326", (_geom("POINT(13.4 52.5)", 4326),
                                                            _geom("POINT(0 0)", 4326))),
        ValueCase("linestring", "linestring", (_geom("LINESTRING(0 0, 1 1, 2 0.5)", 4326),
                                               _geom("LINESTRING(-1 -1, 1e10 1e10)"))),
        ValueCase("polygon", "polygon", (
            _geom("POLYGON((0 0, 10 0, 10 10, 0 10, 0 0), (2 2, 2 3, 3 3, 2 2))", 4326),
            _geom(large_polygon(5000), 4326), _geom(large_polygon(3000)))),
        ValueCase("multipoint", "multipoint", (_geom("MULTIPOINT(0 0, 1 1, 1 1)"),
                                               _geom("MULTIPOINT(5 5)", 4326))),
        ValueCase("multilinestring", "multilinestring", (
            _geom("MULTILINESTRING((0 0, 1 1), (2 2, 3 3, 4 2))", 4326),)),
        ValueCase("multipolygon", "multipolygon", (
            _geom("MULTIPOLYGON(((0 0, 1 0, 1 1, 0 0)),"
                  " ((5 5, 6 5, 6 6, 5 5), (5.2 5.1, 5.8 5.1, 5.8 5.7, 5.2 5.1)))"),
            _geom("MULTIPOLYGON(((0 0, 1 0, 1 1, 0 0)))", 4326))),
        ValueCase("geometry", "geometry", (
            _geom("POINT(3 4)", 4326), _geom("GEOMETRYCOLLECTION EMPTY"),
            _geom("POLYGON((0 0, 1 0, 1 1, 0 0))", 3857), _geom("MULTIPOINT(1 1)"))),
        ValueCase("geometrycollection", "geometrycollection", (
            _geom("GEOMETRYCOLLECTION EMPTY"), _geom("GEOMETRYCOLLECTION EMPTY", 4326),
            _geom("GEOMETRYCOLLECTION(POINT(0 0), LINESTRING(0 0, 1 1),"
                  " GEOMETRYCOLLECTION(POINT(2 2)), POLYGON((0 0, 1 0, 1 1, 0 0)))", 4326))),
    ]


VALUE_CASES = _value_cases()


def sql_text(text: str) -> str:
    """``text`` as a SQL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


# Per character set of MariaDB 10.11's SHOW CHARACTER SET (but binary, and those capture
# refuses), the characters of a sample the charset holds (``tests/test_charsets_server.py``
# round-trips the same sample): letters of many scripts, the characters Japanese charsets map in
# more than one way, quote and backslash, C1 controls, supplementary-plane characters.
CHARSET_TEXTS: dict[str, str] = {
    'armscii8': "a~\\'Ա\x81",
    'ascii': "a~\\'",
    'big5': "a~\\'¥‾Жα中ア①",
    'cp1250': "a~\\'é€¬üßčąőď",
    'cp1251': "a~\\'€Ж¬",
    'cp1256': "a~\\'¥é€ع¬ü",
    'cp1257': "a~\\'é€Ø¬Åüßčąā",
    'cp850': "a~\\'¥éñÿØ¬Åüßñ",
    'cp852': "a~\\'é¬üßčąőď",
    'cp866': "a~\\'Ж",
    'cp932': "a~\\'Жα中アｱ～①髙",  # noqa: RUF001
    'dec8': "a~\\'¥éñÿØ\x81Åüßñ",
    'euckr': "a~\\'€ØЖα中한ア～①ß",  # noqa: RUF001
    'gb2312': "a~\\'éЖα中ア～‖①üā",  # noqa: RUF001
    'gbk': "a~\\'éЖα中ア～‖①髙üā",  # noqa: RUF001
    'geostd8': "a~\\'¥€ა¬",
    'greek': "a~\\'α¬\x81",  # noqa: RUF001
    'hebrew': "a~\\'¥‾ש¬\x81",
    'hp8': "a~\\'¥éñÿØ\x81Åüßñ",
    'keybcs2': "a~\\'éαüßčď",
    'koi8r': "a~\\'Ж",
    'koi8u': "a~\\'Ж",
    'latin1': "a~\\'¥éñÿ€Ø¬\x81Åüßñ",
    'latin2': "a~\\'é\x81üßčąőď",
    'latin5': "a~\\'¥éñÿØ¬\x81Åüßğñ",
    'latin7': "a~\\'éØ¬\x81Åüßčąā",
    'macce': "a~\\'é¬üßčąőāď",
    'macroman': "a~\\'¥éñÿ€Ø¬Åüßñ",
    'sjis': "a~\\'Жα中アｱ〜−¬‖",  # noqa: RUF001
    'swe7': "a'éÅü",
    'tis620': "a~\\'ก\x81",
    'ucs2': "a~\\'¥‾éñÿ€ØЖαשعกԱა中한アｱ〜～−¬‖①髙\x81Åüßčąğőāďñ",  # noqa: RUF001
    'ujis': "a~\\'éñÿØЖα中アｱ〜−¬‖Åüßčąğőāďñ",  # noqa: RUF001
    'utf16': "a~\\'¥‾éñÿ€ØЖαשعกԱა中한アｱ〜～−¬‖①髙😀𠀋\U0010ffff\x81Åüßčąğőāďñ",  # noqa: RUF001
    'utf16le': "a~\\'¥‾éñÿ€ØЖαשعกԱა中한アｱ〜～−¬‖①髙😀𠀋\U0010ffff\x81Åüßčąğőāďñ",  # noqa: RUF001
    'utf32': "a~\\'¥‾éñÿ€ØЖαשعกԱა中한アｱ〜～−¬‖①髙😀𠀋\U0010ffff\x81Åüßčąğőāďñ",  # noqa: RUF001
    'utf8mb3': "a~\\'¥‾éñÿ€ØЖαשعกԱა中한アｱ〜～−¬‖①髙\x81Åüßčąğőāďñ",  # noqa: RUF001
    'utf8mb4': "a~\\'¥‾éñÿ€ØЖαשعกԱა中한アｱ〜～−¬‖①髙😀𠀋\U0010ffff\x81Åüßčąğőāďñ",  # noqa: RUF001
}


def _charset_cases() -> list[ValueCase]:
    cases = [ValueCase(f"cs_{name}", f"varchar(80) character set {name}",
                       (sql_text(text), "''", sql_text(text[0] + "  ")))
             for name, text in CHARSET_TEXTS.items()]
    # The other string types, and ENUM/SET members, in charsets the binlog library got wrong.
    cases += [
        ValueCase("char_ucs2", "char(5) character set ucs2", ("'aØ€'", "''")),
        ValueCase("text_utf16", "text character set utf16", ("'Ø😀 x'", "''")),
        ValueCase("tinytext_utf32", "tinytext character set utf32", ("'añ😀'", "''")),
        ValueCase("enum_utf16", "enum('a','b c') character set utf16", ("'b c'", "'a'")),
        ValueCase("set_ucs2", "set('x','y') character set ucs2", ("'x,y'", "''")),
        ValueCase("enum_swe7", "enum('Å','ä') character set swe7", ("'Å'", "'ä'")),
    ]
    return cases


CHARSET_CASES = _charset_cases()
"""Text in every character set capture decodes: one table, one column per case."""

REFUSED_CHARSETS = {"eucjpms": "'ア'"}
"""Character sets capture cannot decode exactly (``libs.codec.charset_tables.INEXACT``), with a
value: a table with such a column is stopped, never replicated wrong."""


@dataclass(frozen=True)
class KeyCase:
    """A table keyed by one column of this type: deletes and updates address rows by it."""

    id: str
    sql_type: str
    values: tuple[str, ...]

    @property
    def table(self) -> str:
        return f"key_{self.id}"


KEY_CASES = [
    KeyCase("bigint_u", "bigint unsigned", ("0", "18446744073709551615", "9223372036854775808")),
    KeyCase("decimal", "decimal(10,2)", ("'-1.50'", "'99999999.99'", "'0.01'")),
    KeyCase("varchar", "varchar(10) character set utf8mb4", ("'😀'", "'a'", "'ünï'")),
    KeyCase("char", "char(4)", ("'ab'", "'x'", "'abcd'")),
    KeyCase("binary", "binary(4)", ("x'01000000'", "x'00000000'", "x'FF000000'")),
    KeyCase("varbinary", "varbinary(6)", ("x'0100'", "x'01'", "x'00'")),
    KeyCase("date", "date", ("'1000-01-01'", "'9999-12-31'", "'2024-02-29'")),
    KeyCase("datetime", "datetime(6)", ("'1000-01-01 00:00:00'", "'9999-12-31 23:59:59.999999'",
                                        "'2024-02-29 12:00:00.5'")),
    KeyCase("timestamp", "timestamp(3)", ("'1970-01-01 00:00:01'", "'2038-01-19 03:14:07.999'",
                                          "'2024-02-29 00:00:00'")),
    KeyCase("time", "time(2)", ("'-838:59:59'", "'838:59:59.99'", "'-00:00:00.50'")),
    KeyCase("year", "year", ("0", "1901", "2155")),
    KeyCase("bit", "bit(8)", ("b'0'", "b'11111111'", "b'1'")),
    KeyCase("enum", "enum('x','y','z')", ("'x'", "'z'", "'y'")),
]
