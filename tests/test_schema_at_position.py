"""The binlog decides a row's metadata; information_schema only enriches it when it describes the
same table (table_meta.describe), and only when no DDL of the table lies between the row and the
catalog read (ddl_lookahead). No servers."""

from __future__ import annotations

from pymysqlreplication.constants import FIELD_TYPE

from libs.codec.table_meta import BinlogColumn, ColumnSpec, TableInfo, agrees, binlog_primary_key, describe
from services.capture.binlog_reader import Position
from services.capture.ddl_lookahead import AheadDdl, DdlIndex, ddl_of

INT, TEXT, ENUM = FIELD_TYPE.LONG, FIELD_TYPE.BLOB, FIELD_TYPE.ENUM


def col(name: str, type_code: int = INT, *, nullable: bool = True, key_part: int | None = None,
        charset: str | None = None, enum_values: tuple[str, ...] | None = None) -> BinlogColumn:
    return BinlogColumn(name, type_code, charset=charset, nullable=nullable, key_part=key_part,
                        is_primary=key_part is not None, enum_values=enum_values)


def catalog(*specs: ColumnSpec, primary: tuple[str, ...] = (), uniques: tuple[tuple[str, ...], ...] = (),
            declared: bool = True) -> TableInfo:
    return TableInfo("db", "t", specs, primary, uniques, declared and bool(primary))


ID = ColumnSpec("id", "int", "int(11)", False)
CODE = ColumnSpec("code", "int", "int(11)", False)
DOC = ColumnSpec("doc", "json", "json", True)


def test_key_in_key_order_not_column_order() -> None:
    cols = (col("a", nullable=False, key_part=1), col("b"), col("c", nullable=False, key_part=0))
    assert binlog_primary_key(cols) == ("c", "a")
    info = describe("db", "t", cols, None)
    assert info.primary_key == ("c", "a") and info.from_binlog
    assert [c.nullable for c in info.columns] == [False, True, False]


def test_table_gone_from_information_schema_keeps_its_binlog_key() -> None:
    # The gh-ost ghost read after its cut-over: no catalog, and still a key.
    info = describe("db", "_t_gho", (col("id", nullable=False, key_part=0), col("n")), None)
    assert info.primary_key == ("id",) and info.meta().primary_key == ["id"]


def test_catalog_that_agrees_adds_types_json_and_unique_keys() -> None:
    cols = (col("id", nullable=False, key_part=0), col("code", nullable=False),
            col("doc", TEXT, charset="utf8mb4"))
    current = catalog(ID, CODE, DOC, primary=("id",), uniques=(("code",),))
    info = describe("db", "t", cols, current)
    assert not info.from_binlog and info.declared_primary_key
    assert info.primary_key == ("id",) and info.unique_keys == (("code",),)
    assert [c.kind for c in info.columns] == ["int", "int", "json"]


def test_catalog_with_a_later_key_is_not_used() -> None:
    # Rows written before ADD PRIMARY KEY (id): the unique NOT NULL key on code was the key.
    cols = (col("id", nullable=False), col("code", nullable=False, key_part=0))
    later = catalog(ID, CODE, primary=("id",), uniques=(("code",),))
    assert agrees(later, cols)  # the server's key is one of the catalog's unique keys
    assert describe("db", "t", cols, later).primary_key == ("code",)
    # Rows written before DROP PRIMARY KEY: the catalog shows no key any more.
    keyed = (col("id", nullable=False, key_part=0), col("v"))
    keyless = catalog(ID, ColumnSpec("v", "int", "int(11)"))
    assert not agrees(keyless, keyed)
    assert describe("db", "t", keyed, keyless).primary_key == ("id",)
    # And the other way round: keyless at the row, keyed in the catalog now.
    assert describe("db", "t", (col("id", nullable=False), col("v")),
                    catalog(ID, ColumnSpec("v", "int", "int(11)"), primary=("id",))).primary_key == ()


def test_catalog_that_differs_in_shape_is_not_used() -> None:
    cols = (col("id", nullable=False, key_part=0), col("v"))
    renamed = catalog(ID, ColumnSpec("w", "int", "int(11)"), primary=("id",))
    now_not_null = catalog(ID, ColumnSpec("v", "int", "int(11)", False), primary=("id",))
    other_kind = catalog(ID, ColumnSpec("v", "string", "varchar(5)"), primary=("id",))
    for current in (renamed, now_not_null, other_kind):
        assert not agrees(current, cols)
        info = describe("db", "t", cols, current)
        assert info.from_binlog and info.names == ("id", "v") and info.primary_key == ("id",)


def test_enum_members_must_match_the_binlog() -> None:
    cols = (col("id", nullable=False, key_part=0), col("e", ENUM, enum_values=("", "a", "b")))
    same = catalog(ID, ColumnSpec("e", "string", "enum('a','b')"), primary=("id",))
    more = catalog(ID, ColumnSpec("e", "string", "enum('a','b','c')"), primary=("id",))
    assert agrees(same, cols) and not agrees(more, cols)
    assert describe("db", "t", cols, more).columns[1].sql_type == "enum('a','b')"


def test_ddl_of_reads_the_default_schema_of_show_binlog_events() -> None:
    at = Position("binlog.000001", 500)
    ddl = ddl_of(at, "use `db`; RENAME TABLE t TO _t_del, _t_gho TO t")
    assert ddl is not None and ddl.tables == {("db", "t"), ("db", "_t_del"), ("db", "_t_gho")}
    assert ddl_of(at, "use `db`; INSERT INTO t VALUES (1)") is None
    assert ddl_of(at, "BEGIN") is None
    dropped = ddl_of(at, "DROP DATABASE `x`")
    assert dropped is not None and dropped.names(("x", "any")) and not dropped.names(("db", "t"))


def test_ddl_index_lists_each_stretch_once() -> None:
    def p(file: int, pos: int) -> Position:
        return Position(f"binlog.{file:06d}", pos)

    index = DdlIndex()
    assert index.missing(p(1, 100), p(1, 100)) is None
    assert index.missing(p(1, 100), p(1, 900)) == (p(1, 100), p(1, 900))
    index.add(p(1, 100), p(1, 900), [AheadDdl(p(1, 400), frozenset({("db", "t")}))])
    assert index.missing(p(1, 200), p(1, 800)) is None
    assert index.missing(p(1, 200), p(2, 50)) == (p(1, 900), p(2, 50))  # only the new part
    index.add(p(1, 900), p(2, 50), [AheadDdl(p(2, 10), frozenset({("db", "u")}))])
    assert index.names_between(("db", "t"), p(1, 100), p(2, 50))
    assert not index.names_between(("db", "t"), p(1, 401), p(2, 50))  # the DDL is behind
    assert index.names_between(("db", "u"), p(1, 401), p(2, 50))
    assert not index.names_between(("db", "u"), p(1, 100), p(2, 10))  # starts at the read's end
    index.forget_before(p(1, 500))
    assert index.found == [AheadDdl(p(2, 10), frozenset({("db", "u")}))]
    assert index.missing(p(1, 100), p(1, 600)) == (p(1, 100), p(1, 600))  # forgotten: listed again


def test_a_type_capture_cannot_carry_is_refused_even_from_a_later_catalog() -> None:
    # INET4 is BINARY(4) in the table map: only information_schema knows capture cannot carry it.
    cols = (col("id", nullable=False, key_part=0), col("v", FIELD_TYPE.STRING, charset="binary"))
    inet = catalog(ID, ColumnSpec("v", None, "inet4"), primary=("id",))
    assert agrees(inet, cols)
    assert [c.sql_type for c in describe("db", "t", cols, inet).unsupported()] == ["inet4"]
    assert [c.sql_type for c in describe("db", "t", cols, None, inet).unsupported()] == ["inet4"]
    assert describe("db", "t", cols, None).unsupported() == []
