"""The source table's shape (``libs.codec.table_shape``) and what each downstream makes of it
(``services.sink_worker.sinks.shape_ddl`` and the SQL sinks' CREATE statements): pure, no server."""

from __future__ import annotations

from contracts.events.rows import (
    ColumnShapeV1,
    ColumnV1,
    IndexPartV1,
    IndexV1,
    TableMetaV1,
    TableMetaV2,
    TableShapeV1,
    shape_of,
)
from libs.codec.table_shape import parse_default, shape_from_rows
from libs.routing import OriginColumn, rewrite_meta
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.mysql import MySQLSink
from services.sink_worker.sinks.postgres import PostgresSink
from services.sink_worker.sinks.shape_ddl import (
    derived_index_name,
    index_changes,
    is_case_insensitive,
    mysql_default,
    owned_index_drops,
    pg_default,
    sqlite_default,
    target_indexes,
)
from services.sink_worker.sinks.sqlite import SQLiteSink

SYSBENCH_COLUMNS = [
    ("id", None, None, None, "", "auto_increment"),
    ("k", "0", None, None, "", ""),
    ("c", "''", "utf8mb4", "utf8mb4_general_ci", "", ""),
    ("pad", "''", "utf8mb4", "utf8mb4_general_ci", "pad's comment", ""),
]
SYSBENCH_INDEXES = [
    ("PRIMARY", 0, "id", None, "BTREE", "A", ""),
    ("k_1", 1, "k", None, "BTREE", "A", ""),
]


def _sysbench() -> TargetTable:
    shape = shape_from_rows(SYSBENCH_COLUMNS, SYSBENCH_INDEXES,
                            ("utf8mb4_general_ci", "", "utf8mb4"), mariadb=True)
    meta = TableMetaV2(columns=[
        ColumnV1(name="id", kind="int", sql_type="int(11)", nullable=False),
        ColumnV1(name="k", kind="int", sql_type="int(11)", nullable=False),
        ColumnV1(name="c", kind="string", sql_type="char(120)", nullable=False),
        ColumnV1(name="pad", kind="string", sql_type="char(60)", nullable=False)],
        primary_key=["id"], shape=shape)
    return TargetTable(schema="sb", name="sbtest1", meta=meta, key=("id",))


def test_mariadb_defaults_read_as_literals_or_expressions() -> None:
    assert parse_default(None, mariadb=True) == (None, False)
    assert parse_default("NULL", mariadb=True) == (None, False)  # DEFAULT NULL
    assert parse_default("'NULL'", mariadb=True) == ("NULL", False)  # the string 'NULL'
    assert parse_default("'it''s \\\\ here'", mariadb=True) == ("it's \\ here", False)
    assert parse_default("-1.5e3", mariadb=True) == ("-1.5e3", False)
    assert parse_default("b'101'", mariadb=True) == ("5", False)
    assert parse_default("current_timestamp()", mariadb=True) == ("current_timestamp()", True)
    assert parse_default("uuid()", mariadb=True) == ("uuid()", True)
    # MySQL 8 writes a literal bare and marks expressions in EXTRA.
    assert parse_default("abc", mariadb=False) == ("abc", False)
    assert parse_default("CURRENT_TIMESTAMP", mariadb=False, generated=True) == ("CURRENT_TIMESTAMP", True)


def test_indexes_gather_parts_in_order_and_leave_the_primary_key_out() -> None:
    shape = shape_from_rows([], [
        ("PRIMARY", 0, "id", None, "BTREE", "A", ""),
        ("ab", 1, "a", 8, "BTREE", "A", "by a and b"),
        ("ab", 1, "b", None, "BTREE", "D", "by a and b"),
        ("u", 0, "c", None, "BTREE", "A", ""),
        ("ft", 1, "t", None, "FULLTEXT", None, ""),
    ], None, mariadb=True)
    assert [i.name for i in shape.indexes] == ["ab", "u", "ft"]
    ab = shape.indexes[0]
    assert [(p.column, p.prefix, p.descending) for p in ab.parts] == [("a", 8, False), ("b", None, True)]
    assert ab.comment == "by a and b" and not ab.unique
    assert shape.indexes[1].unique and shape.indexes[2].kind == "fulltext"


def test_mysql_target_is_the_sysbench_table() -> None:
    create = MySQLSink("mysql://u@h/sb").create_statements(_sysbench())[1]
    assert "`id` int(11) NOT NULL AUTO_INCREMENT" in create
    assert "`k` int(11) NOT NULL DEFAULT 0" in create
    assert "`c` char(120) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL DEFAULT ''" in create
    assert "COMMENT 'pad''s comment'" in create
    assert "KEY `k_1` (`k`)" in create
    assert create.endswith("ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_general_ci")


def test_without_a_shape_targets_stay_as_they_were() -> None:
    meta = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                                ColumnV1(name="n", kind="string", sql_type="varchar(5)", nullable=False)],
                       primary_key=["id"], unique_keys=[["n"]])
    table = TargetTable(schema="d", name="t", meta=meta, key=("id",), unique_keys=(("n",),))
    create = MySQLSink("mysql://u@h/d").create_statements(table)[1]
    assert "`n` varchar(5) NULL" in create and "UNIQUE (`n`)" in create
    assert create.endswith("COLLATE=utf8mb4_bin")
    assert PostgresSink("postgresql://u@h/d").create_statements(table)[-1].startswith("CREATE TABLE")


def test_defaults_per_dialect() -> None:
    def col(kind: str, sql_type: str) -> ColumnV1:
        return ColumnV1(name="x", kind=kind, sql_type=sql_type)  # type: ignore[arg-type]

    def lit(value: str) -> ColumnShapeV1:
        return ColumnShapeV1(name="x", default=value)

    def expr(value: str) -> ColumnShapeV1:
        return ColumnShapeV1(name="x", default=value, default_expression=True)

    assert mysql_default(col("string", "text"), lit("a'b"), "text") == "('a''b')"  # MySQL 8: TEXT needs ()
    assert mysql_default(col("bit", "bit(3)"), lit("5"), "bit(3)") == "5"
    assert mysql_default(col("datetime", "datetime"), expr("current_timestamp()"), "datetime") == \
        "current_timestamp()"
    assert mysql_default(col("string", "char(36)"), expr("uuid()"), "char(36)") == "(uuid())"
    assert mysql_default(col("date", "date"), lit("0000-00-00"), "date") is None
    assert pg_default(col("string", "varchar(3)"), lit("a\\b")) == "'a\\b'"
    assert pg_default(col("timestamp", "timestamp"), expr("current_timestamp()")) == \
        "(CURRENT_TIMESTAMP AT TIME ZONE 'UTC')"
    assert pg_default(col("string", "char(36)"), expr("uuid()")) is None  # no same-meaning form
    assert pg_default(col("bytes", "binary(2)"), lit("ab")) == "'\\x6162'::bytea"
    assert pg_default(col("json", "json"), lit("{bad")) is None
    top = "18446744073709551615"
    assert sqlite_default(col("int", "bigint unsigned"), lit(top)) == f"'{top}'"
    assert sqlite_default(col("int", "int"), lit("7")) == "7"
    assert sqlite_default(col("datetime", "datetime"), expr("now()")) is None


def test_unique_indexes_are_unique_only_where_the_apply_path_knows_them() -> None:
    shape = TableShapeV1(indexes=[
        IndexV1(name="u_code", unique=True, parts=[IndexPartV1(column="code")]),
        IndexV1(name="u_prefix", unique=True, parts=[IndexPartV1(column="name", prefix=4)]),
        IndexV1(name="by_gone", parts=[IndexPartV1(column="gone")]),
        IndexV1(name="pk_again", unique=True, parts=[IndexPartV1(column="id")]),
    ])
    meta = TableMetaV2(columns=[ColumnV1(name=n, kind="string", sql_type="varchar(9)", nullable=n != "id")
                                for n in ("id", "code", "name")],
                       primary_key=["id"], unique_keys=[["code"]], shape=shape)
    table = TargetTable(schema="d", name="t", meta=meta, key=("id",), unique_keys=(("code",),))
    found = {i.name: i.unique for i in target_indexes(table)}
    # A prefix unique index would let parallel partitions meet duplicates the source never had;
    # an index over a column left out is not created; the key is the primary key already.
    assert found == {"u_code": True, "u_prefix": False}
    create = MySQLSink("mysql://u@h/d").create_statements(table)[1]
    assert "UNIQUE KEY `u_code` (`code`)" in create and "KEY `u_prefix` (`name`(4))" in create
    assert "UNIQUE (`code`)" not in create  # the named index is the unique key
    pg = PostgresSink("postgresql://u@h/d").create_statements(table)
    assert 'CREATE UNIQUE INDEX IF NOT EXISTS "t__u_code" ON "d"."t" ("code")' in pg
    assert 'CREATE INDEX IF NOT EXISTS "t__u_prefix" ON "d"."t" ((left("name", 4)))' in pg
    lite = SQLiteSink("sqlite:///x.db").create_statements(table)
    assert 'CREATE INDEX IF NOT EXISTS "t__u_prefix" ON "t" (substr("name", 1, 4))' in lite


def test_a_shard_merge_puts_the_origin_column_in_every_unique_index() -> None:
    shape = TableShapeV1(indexes=[IndexV1(name="u", unique=True, parts=[IndexPartV1(column="code")]),
                                  IndexV1(name="k", parts=[IndexPartV1(column="code")])])
    meta = TableMetaV2(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                                ColumnV1(name="code", kind="int", sql_type="int", nullable=False)],
                       primary_key=["id"], unique_keys=[["code"]], shape=shape)
    merged = rewrite_meta(meta, OriginColumn(name="src"))
    found = shape_of(merged)
    assert found is not None
    assert [[p.column for p in i.parts] for i in found.indexes] == [["src", "code"], ["code"]]
    table = TargetTable(schema="d", name="t", meta=merged, key=tuple(merged.primary_key),
                        unique_keys=tuple(tuple(k) for k in merged.unique_keys))
    create = MySQLSink("mysql://u@h/d").create_statements(table)[1]
    assert "UNIQUE KEY `u` (`src`, `code`)" in create and "KEY `k` (`code`)" in create


def test_auto_increment_only_on_a_column_that_leads_an_index() -> None:
    table = _sysbench()
    merged = rewrite_meta(table.meta, OriginColumn(name="src"))
    create = MySQLSink("mysql://u@h/sb").create_statements(
        TargetTable(schema="sb", name="sbtest1", meta=merged, key=("src", "id")))[1]
    # The merged key starts with the origin column: InnoDB would refuse AUTO_INCREMENT on id.
    assert "AUTO_INCREMENT" not in create and "`id` int(11) NOT NULL," in create


def test_case_insensitive_collations_fold_only_when_the_changefeed_asks() -> None:
    assert is_case_insensitive("utf8mb4_general_ci") and is_case_insensitive("utf8mb4_uca1400_ai_ci")
    assert not is_case_insensitive("utf8mb4_bin") and not is_case_insensitive(None)
    table = _sysbench()
    exact = PostgresSink("postgresql://u@h/d").create_statements(table)
    assert not any("COLLATE" in s for s in exact)
    folded = TargetTable(schema="sb", name="sbtest1", meta=table.meta, key=("id",), case_insensitive=True)
    pg = PostgresSink("postgresql://u@h/d").create_statements(folded)
    assert any(s.startswith('CREATE COLLATION IF NOT EXISTS "sb"."sluice_ci"')
               and "deterministic = false" in s for s in pg)
    assert '"c" varchar(120) COLLATE "sb"."sluice_ci" NOT NULL DEFAULT \'\'' in pg[-2] or \
        '"c" char(120) COLLATE "sb"."sluice_ci" NOT NULL DEFAULT \'\'' in pg[-2]
    lite = SQLiteSink("sqlite:///x.db").create_statements(folded)[0]
    assert '"c" TEXT NOT NULL DEFAULT \'\' COLLATE NOCASE' in lite
    assert '"k" INTEGER NOT NULL DEFAULT 0,' in lite


def test_index_changes_follow_renames_and_leave_other_indexes_alone() -> None:
    def idx(name: str, *cols: str, unique: bool = False) -> IndexV1:
        return IndexV1(name=name, unique=unique, parts=[IndexPartV1(column=c) for c in cols])

    wanted = [idx("by_k_new", "k"), idx("by_c", "c"), idx("by_ab", "a", "b")]
    existing = [idx("by_k", "k"), idx("by_ab", "a"), idx("operators_own", "z"), idx("name", "n", unique=True)]
    drop, create = index_changes(wanted, existing)
    assert drop == ["by_k", "by_ab"]
    assert [i.name for i in create] == ["by_k_new", "by_c", "by_ab"]
    assert index_changes(wanted, wanted) == ([], [])


def test_derived_index_names_are_per_table_and_fit_postgres() -> None:
    assert derived_index_name("t", "k_1") == "t__k_1"
    long = derived_index_name("t" * 40, "i" * 40)
    assert len(long.encode()) <= 63 and long != derived_index_name("t" * 40, "i" * 39 + "j")
    meta = TableMetaV2(columns=[ColumnV1(name="k", kind="int", sql_type="int", nullable=False)],
                       primary_key=["k"], shape=TableShapeV1(indexes=[]))
    table = TargetTable(schema=None, name="t", meta=meta, key=("k",))
    assert owned_index_drops(table, ["t__old", "t_pkey", "users_own"]) == ["t__old"]
