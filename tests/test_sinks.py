"""Sinks against real MariaDB, PostgreSQL and SQLite: types, idempotence, unique keys, quoting,
schema reconciliation, concurrency and deadlock retries. No mocks.

Every sink under test is a pickled-and-unpickled copy (``target`` fixture), because that is how
the apply job ships sinks to Spark executors.
"""

from __future__ import annotations

import base64
import functools
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from contracts.events.rows import ColumnV1, TableMetaV1
from libs.checksum import compare_tables, table_checksum
from libs.codec.decode import (
    SqlTypeError,
    canonical_json,
    decode_row,
    decode_value,
    format_time,
    parse_sql_type,
    parse_time,
    sql_type_for,
)
from libs.sql_ident import IdentifierError, quote_ident
from services.sink_worker.sinks.base import Delete, PartitionResult, TargetTable, Upsert
from services.sink_worker.sinks.factory import open_sink
from tests.helpers.sinks import SINKS, Target, make_target

pytestmark = pytest.mark.integration


# --------------------------------------------------------------------------- helpers


@pytest.fixture(params=SINKS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    return make_target(request, request.param, tmp_path)


def col(name: str, kind: str, sql_type: str, nullable: bool = True) -> ColumnV1:
    return ColumnV1(name=name, kind=kind, sql_type=sql_type, nullable=nullable)


def upsert(meta: TableMetaV1, image: dict[str, Any]) -> Upsert:
    row = decode_row(meta, image)
    return Upsert(key=tuple(row[k] for k in meta.primary_key), row=row)


def expected(meta: TableMetaV1, images: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decoded rows as fetch_rows returns them (JSON canonicalised), sorted by key."""
    out = []
    for image in images:
        row = decode_row(meta, image)
        for c in meta.columns:
            if c.kind == "json" and row.get(c.name) is not None:
                row[c.name] = canonical_json(row[c.name])
        out.append(row)
    return sorted(out, key=lambda r: tuple(r[k] for k in meta.primary_key))


def by_key(rows: list[dict[str, Any]], key: tuple[str, ...]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: tuple(r[k] for k in key))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --------------------------------------------------------------------------- every kind

ALL_KINDS = TableMetaV1(
    columns=[
        col("id", "int", "bigint(20) unsigned", False),
        col("i", "int", "int(11)"),
        col("ti", "int", "tinyint(4)"),
        col("ui", "int", "int(10) unsigned"),
        col("yr", "int", "year(4)"),
        col("f", "float", "float"),
        col("d", "float", "double"),
        col("dec", "decimal", "decimal(30,10)"),
        col("s", "string", "varchar(64)"),
        col("ch", "string", "char(8)"),
        col("txt", "string", "text"),
        col("en", "string", "enum('a','b c','it''s')"),
        col("st", "set", "set('x','y','z')"),
        col("bin", "bytes", "varbinary(16)"),
        col("blb", "bytes", "blob"),
        col("dt", "datetime", "datetime(6)"),
        col("dt0", "datetime", "datetime"),
        col("ts", "timestamp", "timestamp(3)"),
        col("dte", "date", "date"),
        col("tm", "time", "time(6)"),
        col("js", "json", "json"),
        col("bt", "bit", "bit(8)"),
        col("bt64", "bit", "bit(64)"),
    ],
    primary_key=["id"],
)

U64 = 2**64 - 1
ALL_KINDS_ROWS: list[dict[str, Any]] = [
    {
        "id": U64, "i": -2147483648, "ti": -128, "ui": 4294967295, "yr": 2024, "f": 1.5,
        "d": 3.141592653589793, "dec": "-12345678901234567890.0123456789",
        "s": "héllo 😀 wörld 𝄞", "ch": "abc", "txt": "long " * 200 + "😀", "en": "it's", "st": "x,z",
        "bin": b64(b"\x00\xff\x10'\\"), "blb": b64(bytes(range(256))),
        "dt": "2024-02-29T23:59:59.123456", "dt0": "1999-12-31T00:00:00",
        "ts": "2038-01-19T03:14:08.123000", "dte": "1000-01-01", "tm": "-838:59:59.000000",
        "js": '{"b": [1, 2.5, "😀"], "a": null, "c": {"z": 1, "y": "q\\"uote"}}',
        "bt": 5, "bt64": U64,
    },
    {"id": 1, **{c.name: None for c in ALL_KINDS.columns if c.name != "id"}},
    {
        "id": 2, "i": 0, "ti": 127, "ui": 0, "yr": 1901, "f": -0.25, "d": -1e-300,
        "dec": "0.0000000001", "s": "", "ch": "", "txt": "", "en": "b c", "st": "",
        "bin": "", "blb": b64(b"\x00"), "dt": "1970-01-01T00:00:00.000001", "dt0": "2000-01-01T12:00:00",
        "ts": "1970-01-01T00:00:01.999000", "dte": "9999-12-31", "tm": "00:00:00.000001",
        "js": "[]", "bt": 0, "bt64": 0,
    },
    {
        "id": 3, "i": 2147483647, "ti": 0, "ui": 1, "yr": 2155, "f": 3.25, "d": 0.1,
        "dec": "99999999999999999999.9999999999", "s": "'; DROP TABLE x; --", "ch": "a\\b",
        "txt": "tab\tnewline\n", "en": "a", "st": "y", "bin": b64(b"%s%%"), "blb": b64(b"\\0"),
        "dt": "2024-01-01T00:00:00.000000", "dt0": "2024-01-01T00:00:00",
        "ts": "2024-01-01T00:00:00.000000", "dte": "2024-06-30", "tm": "838:59:59.999999",
        "js": '"just a string"', "bt": 255, "bt64": 2**63,
    },
]


def test_every_kind_round_trips(target: Target) -> None:
    table = target.table("all_kinds", ALL_KINDS)
    changes = [upsert(ALL_KINDS, r) for r in ALL_KINDS_ROWS]
    result = target.sink.apply_partition(table, changes)
    assert result.upserted == len(ALL_KINDS_ROWS)
    assert target.sink.fetch_rows(table) == expected(ALL_KINDS, ALL_KINDS_ROWS)

    # Delete by the widest key value, then write it again: key lookups match the stored form.
    target.sink.apply_partition(table, [Delete((U64,))])
    assert [r["id"] for r in target.sink.fetch_rows(table)] == [1, 2, 3]
    target.sink.apply_partition(table, changes[:1])
    assert target.sink.fetch_rows(table) == expected(ALL_KINDS, ALL_KINDS_ROWS)


def test_ensure_table_is_idempotent_and_truncate_drop(target: Target) -> None:
    table = target.table("t", ALL_KINDS)
    target.sink.ensure_table(table)  # again: no error
    target.sink.apply_partition(table, [upsert(ALL_KINDS, ALL_KINDS_ROWS[1])])
    target.sink.truncate_table(table)
    assert target.sink.fetch_rows(table) == []
    target.sink.drop_table(table)
    target.sink.drop_table(table)  # IF EXISTS
    assert target.sink.reconcile_schema(table)  # a missing table is created
    assert target.sink.fetch_rows(table) == []


# --------------------------------------------------------------------------- idempotence

SIMPLE = TableMetaV1(
    columns=[col("id", "int", "int(11)", False), col("name", "string", "varchar(32)"),
             col("age", "int", "int(11)")],
    primary_key=["id"],
    unique_keys=[["name"]],
)


def rows_of(pairs: list[tuple[int, str | None, int]]) -> list[dict[str, Any]]:
    return [{"id": i, "name": n, "age": a} for i, n, a in pairs]


def test_idempotent_reapply_and_older_batch(target: Target) -> None:
    table = target.table("people", SIMPLE)
    batch1 = [upsert(SIMPLE, r) for r in rows_of([(i, f"n{i}", i) for i in range(40)])]
    # The next consistent batch: updates, deletes, inserts, and a unique value moving key.
    batch2: list[Delete | Upsert] = [Delete((i,)) for i in range(0, 40, 3)]
    batch2 += [upsert(SIMPLE, r) for r in rows_of([(i, f"m{i}", i * 10) for i in range(1, 40, 3)])]
    batch2 += [upsert(SIMPLE, r) for r in rows_of([(100, "n2", 1), (101, None, 2), (102, None, 3)])]
    batch2 = [c for c in batch2 if not (isinstance(c, Upsert) and c.key == (2,))] + [Delete((2,))]

    target.sink.apply_partition(table, batch1)
    target.sink.apply_partition(table, batch2)
    final = target.sink.fetch_rows(table)
    assert {r["id"]: r["name"] for r in final}[100] == "n2"
    assert 2 not in {r["id"] for r in final}

    target.sink.apply_partition(table, batch2)  # the same batch again
    assert target.sink.fetch_rows(table) == final
    target.sink.apply_partition(table, batch1)  # replay from an older checkpoint ...
    target.sink.apply_partition(table, batch2)  # ... converges to the same state
    assert target.sink.fetch_rows(table) == final

    # Within one call, the last change per key wins.
    target.sink.apply_partition(table, [upsert(SIMPLE, rows_of([(500, "x", 1)])[0]), Delete((500,))])
    assert target.sink.fetch_rows(table) == final


# --------------------------------------------------------------------------- the TDSQL "lucy" case

LUCY = rows_of([(1, "lucy", 18)])[0]
LUCY2 = rows_of([(2, "lucy", 20)])[0]


def _lucy_partitions() -> tuple[list[Delete | Upsert], list[Delete | Upsert]]:
    # insert (1,lucy), delete (1,lucy), insert (2,lucy) in one batch: the final images are
    # "key 1 is gone" and "key 2 is (2,lucy,20)", hashed to different partitions.
    return [Delete((1,))], [upsert(SIMPLE, LUCY2)]


@pytest.mark.parametrize("seeded", [False, True], ids=["empty", "after-insert-batch"])
def test_unique_key_case_commutes(target: Target, seeded: bool) -> None:
    table = target.table("sync_table", SIMPLE)
    p1, p2 = _lucy_partitions()
    for first, second in ((p1, p2), (p2, p1)):
        target.sink.truncate_table(table)
        if seeded:  # insert (1,lucy) was in the previous batch, already applied
            target.sink.apply_partition(table, [upsert(SIMPLE, LUCY)])
        target.sink.apply_partition(table, first)
        target.sink.apply_partition(table, second)
        assert target.sink.fetch_rows(table) == [LUCY2]
    # Replaying the older batch and then this one converges too.
    target.sink.apply_partition(table, [upsert(SIMPLE, LUCY)])
    assert target.sink.fetch_rows(table) == [LUCY]
    target.sink.apply_partition(table, p2)
    target.sink.apply_partition(table, p1)
    assert target.sink.fetch_rows(table) == [LUCY2]


def test_unique_key_case_concurrent_partitions(target: Target) -> None:
    table = target.table("sync_table", SIMPLE)
    p1, p2 = _lucy_partitions()
    for round_ in range(4):
        target.sink.truncate_table(table)
        target.sink.apply_partition(table, [upsert(SIMPLE, LUCY)])
        parts = [p1, p2] if round_ % 2 else [p2, p1]
        run_concurrently([functools.partial(target.sink.apply_partition, table, p) for p in parts])
        assert target.sink.fetch_rows(table) == [LUCY2]


def test_unique_values_swap_between_keys(target: Target) -> None:
    table = target.table("swap", SIMPLE)
    before = rows_of([(1, "lucy", 1), (2, "bob", 2)])
    after = rows_of([(1, "bob", 1), (2, "lucy", 2)])
    for split in (True, False):
        for reverse in (False, True):
            target.sink.truncate_table(table)
            target.sink.apply_partition(table, [upsert(SIMPLE, r) for r in before])
            changes = [upsert(SIMPLE, r) for r in after]
            if reverse:
                changes.reverse()
            parts = [[c] for c in changes] if split else [changes]
            results = [target.sink.apply_partition(table, p) for p in parts]
            assert target.sink.fetch_rows(table) == after
            assert sum(r.conflicts_removed for r in results) >= 1


def test_null_unique_values_do_not_conflict(target: Target) -> None:
    table = target.table("nulls", SIMPLE)
    rows = rows_of([(1, None, 1), (2, None, 2), (3, "x", 3)])
    target.sink.apply_partition(table, [upsert(SIMPLE, r) for r in rows])
    target.sink.apply_partition(table, [upsert(SIMPLE, rows_of([(4, None, 4)])[0])])
    assert [r["id"] for r in target.sink.fetch_rows(table)] == [1, 2, 3, 4]


def run_concurrently(fns: list[Callable[[], Any]], timeout: float = 60) -> list[Any]:
    barrier = threading.Barrier(len(fns))
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            barrier.wait(timeout)
            results[i] = fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a partition did not finish"
    if errors:
        raise errors[0]
    return results


# --------------------------------------------------------------------------- quoting

WEIRD = TableMetaV1(
    columns=[col("order", "int", "int(11)", False), col('we"ird', "string", "varchar(40)"),
             col("back`tick", "string", "text"), col("sp ace %s", "int", "int(11)"),
             col("select", "string", "enum('x''); DROP TABLE canary; --','%s')")],
    primary_key=["order"],
    unique_keys=[['we"ird']],
)


def test_sql_words_and_quotes_in_names_are_just_names(target: Target, request: pytest.FixtureRequest,
                                                      tmp_path: Path) -> None:
    if target.schema:
        # The database / schema name is quoted the same way.
        target.schema = target.schema + ' "we`ird" sch'
    canary = target.table("canary", SIMPLE)
    target.sink.apply_partition(canary, [upsert(SIMPLE, LUCY)])
    table = target.table("select", WEIRD)
    hostile = "x'); DROP TABLE canary; --"
    rows = [
        {"order": 1, 'we"ird': hostile, "back`tick": "`; DROP TABLE `canary`", "sp ace %s": 1,
         "select": hostile},
        {"order": 2, 'we"ird': '" OR 1=1 --', "back`tick": None, "sp ace %s": None, "select": "%s"},
    ]
    target.sink.apply_partition(table, [upsert(WEIRD, r) for r in rows])
    # The unique key on the quoted column works: the value moves to key 3.
    moved = {"order": 3, 'we"ird': hostile, "back`tick": "b", "sp ace %s": 3, "select": "%s"}
    result = target.sink.apply_partition(table, [upsert(WEIRD, moved), Delete((2,))])
    assert result.conflicts_removed == 1 and result.deleted == 1
    assert target.sink.fetch_rows(table) == [moved]
    assert target.sink.fetch_rows(canary) == [LUCY]

    grown = WEIRD.model_copy(update={"columns": [*WEIRD.columns, col("new`\"col", "int", "int(11)")]})
    grown_table = target.table("select", grown, create=False)
    assert target.sink.reconcile_schema(grown_table)
    assert target.sink.reconcile_schema(grown_table) == []
    assert target.sink.fetch_rows(grown_table) == [{**moved, 'new`"col': None}]


def test_quote_ident() -> None:
    assert quote_ident("mysql", "back`tick") == "`back``tick`"
    assert quote_ident("postgresql", 'we"ird') == '"we""ird"'
    assert quote_ident("sqlite", "select") == '"select"'
    assert quote_ident("mysql", "50%", for_params=True) == "`50%%`"
    assert quote_ident("sqlite", "50%", for_params=True) == '"50%"'
    for bad in ("", "a\x00b", "x" * 64):
        with pytest.raises(IdentifierError):
            quote_ident("postgresql", bad)


# --------------------------------------------------------------------------- schema changes


def test_reconcile_schema_adds_and_drops_columns(target: Target) -> None:
    table = target.table("evolving", SIMPLE)
    target.sink.apply_partition(table, [upsert(SIMPLE, r) for r in rows_of([(1, "a", 10), (2, "b", 20)])])
    assert target.sink.reconcile_schema(table) == []  # nothing to do

    # Drop `name` (it carries the unique key) and add `email` + `score`.
    changed = TableMetaV1(
        columns=[col("id", "int", "int(11)", False), col("age", "int", "int(11)"),
                 col("email", "string", "varchar(255)"), col("score", "decimal", "decimal(8,2)")],
        primary_key=["id"],
    )
    new_table = TargetTable(schema=table.schema, name=table.name, meta=changed, key=("id",))
    # Only a column a DDL dropped goes: without it named, `name` is the target's own and stays.
    target.sink.reconcile_schema(new_table)
    assert "name" in (target.sink.target_columns(new_table) or [])
    statements = target.sink.reconcile_schema(new_table, ["NAME"])
    assert statements
    assert target.sink.reconcile_schema(new_table, ["name"]) == []  # re-runnable: already there
    assert target.sink.fetch_rows(new_table) == [
        {"id": 1, "age": 10, "email": None, "score": None},
        {"id": 2, "age": 20, "email": None, "score": None},
    ]
    third = {"id": 3, "age": 1, "email": "e", "score": "1.50"}
    target.sink.apply_partition(new_table, [upsert(changed, third)])
    assert target.sink.fetch_rows(new_table)[-1] == {**third, "score": Decimal("1.50")}

    # A metadata without the key column is refused, not applied as "drop the key".
    keyless = TableMetaV1(columns=[col("age", "int", "int(11)")], primary_key=[])
    with pytest.raises(ValueError, match="key"):
        target.sink.reconcile_schema(TargetTable(table.schema, table.name, keyless, key=("id",)))
    assert len(target.sink.fetch_rows(new_table)) == 3


def test_targets_met_for_the_first_time_are_checked_in_bulk_and_each_unsettled_one_reconciled(
        target: Target) -> None:
    from contracts.events.rows import IndexPartV1, IndexV1, TableMetaV2, TableShapeV1
    from services.sink_worker.ddl.target_schemas import TargetSchemas

    grown = TableMetaV1(columns=[*SIMPLE.columns, col("email", "string", "varchar(255)")],
                        primary_key=SIMPLE.primary_key, unique_keys=SIMPLE.unique_keys)
    indexed = TableMetaV2(columns=SIMPLE.columns, primary_key=SIMPLE.primary_key,
                          unique_keys=SIMPLE.unique_keys, shape=TableShapeV1(indexes=[
                              IndexV1(name="by_age", unique=False, parts=[IndexPartV1(column="age")])]))
    settled = [target.table(f"settled{n}", SIMPLE) for n in range(3)]
    behind = target.table("behind", SIMPLE)  # created with the old columns; the batch has more
    unindexed = target.table("unindexed", SIMPLE)
    missing = target.table("missing", SIMPLE, create=False)
    batch = [*settled, replace(behind, meta=grown), replace(unindexed, meta=indexed), missing]
    found = target.sink.settled_schemas(batch)
    if target.kind == "mariadb":
        assert found == {(t.schema, t.name) for t in settled}
    else:
        assert found == set()  # checked one by one, as before
    schemas = TargetSchemas()
    schemas.settle(target.sink, "url", batch)
    for table in batch:
        schemas.ensure(target.sink, "url", table, reconcile=True)
    assert "email" in (target.sink.target_columns(batch[3]) or [])
    assert target.sink.target_columns(missing) == ["id", "name", "age"]
    # Every one is now what reconcile_schema brings it to: nothing left to do on any.
    assert all(target.sink.reconcile_schema(t) == [] for t in batch)
    assert target.sink.settled_schemas(batch) == (
        {(t.schema, t.name) for t in batch} if target.kind == "mariadb" else set())


_USER_MADE = {
    "mariadb": "CREATE TABLE {t} (id BIGINT NOT NULL PRIMARY KEY, name VARCHAR(200) NOT NULL,"
               " age INT NOT NULL, note VARCHAR(20) NOT NULL DEFAULT 'n/a')"
               " PARTITION BY HASH (id) PARTITIONS 2",
    "postgres": "CREATE TABLE {t} (id bigint NOT NULL PRIMARY KEY, name varchar(200) NOT NULL,"
                " age integer NOT NULL, note varchar(20) NOT NULL DEFAULT 'n/a') PARTITION BY HASH (id)",
    "sqlite": "CREATE TABLE {t} (id INTEGER NOT NULL PRIMARY KEY, name TEXT NOT NULL, age INTEGER NOT NULL,"
              " note TEXT NOT NULL DEFAULT 'n/a')",
}


def test_a_user_made_target_is_kept_through_a_recopy(target: Target) -> None:
    """A target that was there before Sluice (partitioned, an extra column with a default,
    wider types) is used as it is: a DDL that re-copies the table keeps it, emptied, with its
    extra column's values put back; one Sluice made is dropped and made again."""
    from libs.scheduling.model import Span
    from services.sink_worker.sinks.sql_common import SqlSink
    from services.sink_worker.snapshot.initial_load import SnapshotRequest, empty_for_recopy

    sink = target.sink
    assert isinstance(sink, SqlSink)
    table = target.table("usermade", SIMPLE, create=False)
    ref = sink._table_ref(table)

    def run(*sql: str) -> None:
        sink._run(lambda cur: [cur.execute(s) for s in sql], "test DDL")

    if target.kind == "postgres":
        run(f'CREATE SCHEMA IF NOT EXISTS "{target.schema}"')
    if target.kind == "mariadb":
        run(f"CREATE DATABASE IF NOT EXISTS `{target.schema}`")
    run(_USER_MADE[target.kind].format(t=ref))
    if target.kind == "postgres":
        run(f'CREATE TABLE "{target.schema}".usermade_p0 PARTITION OF {ref}'
            " FOR VALUES WITH (MODULUS 1, REMAINDER 0)")
    sink.ensure_table(table)  # there already: used as it is
    assert not sink.made_by_sluice(table)
    sink.reconcile_schema(table)  # the first batch's: nothing of the target's own goes
    sink.apply_partition(table, [upsert(SIMPLE, r) for r in rows_of([(1, "a", 10), (2, "b", 20)])])
    run(f"UPDATE {ref} SET note = 'mine' WHERE id = 2")

    # ALTER TABLE t MODIFY age BIGINT, DROP COLUMN name: re-copies the table.
    after = TableMetaV1(columns=[col("id", "int", "int(11)", False), col("age", "int", "bigint(20)")],
                        primary_key=["id"])
    again = TargetTable(schema=table.schema, name=table.name, meta=after, key=("id",))
    span = Span.of("cf", "src", "db", "usermade")
    request = SnapshotRequest(span, "mysql://unused", sink.url, None, "snapshot", recopy_of=7,
                              recopy_drops=("name",))
    empty_for_recopy(request, sink, again)
    assert sink.fetch_rows(again) == []
    sink.load_rows(again, ["id", "age"], [(1, 11), (2, 21), (3, 31)])
    assert sink.restore_columns(again) >= 1  # MySQL counts the rows it changed
    assert sink.restore_columns(again) == 0  # idempotent: the side table is gone
    rows = sink._run(lambda cur: (cur.execute(f"SELECT id, age, note FROM {ref} ORDER BY id"),
                                  [tuple(r) for r in cur.fetchall()])[1], "read")
    assert rows == [(1, 11, "n/a"), (2, 21, "mine"), (3, 31, "n/a")]
    definition = sink.definition(again)
    assert definition is not None
    types = {c.name: c.sql_type.lower() for c in definition.columns}
    assert set(types) == {"id", "age", "note"}
    if target.kind != "sqlite":
        assert types["id"].startswith("bigint")  # wider than the source's int: kept
    partitioned = {
        "mariadb": "SELECT COUNT(*) FROM information_schema.PARTITIONS WHERE TABLE_NAME = 'usermade'"
                   f" AND TABLE_SCHEMA = '{target.schema}' AND PARTITION_NAME IS NOT NULL",
        "postgres": f"SELECT COUNT(*) FROM pg_inherits WHERE inhparent = to_regclass('{ref}')",
        "sqlite": "SELECT 1",
    }[target.kind]
    count = sink._run(lambda cur: (cur.execute(partitioned), cur.fetchone()[0])[1], "partitions")
    assert count >= 1

    # A target Sluice made is dropped and made again, exactly from the source's metadata.
    made = target.table("slmade", SIMPLE)
    assert sink.made_by_sluice(made)
    sink.reconcile_schema(made)
    remade = TargetTable(schema=made.schema, name=made.name, meta=after, key=("id",))
    empty_for_recopy(SnapshotRequest(span, "mysql://unused", sink.url, None, "snapshot", recopy_of=8,
                                     recopy_drops=("name",)), sink, remade)
    assert sink.target_columns(remade) is None
    sink.ensure_table(remade)
    assert sink.made_by_sluice(remade)


def test_a_target_that_exists_after_a_failed_create_is_still_sluices(target: Target) -> None:
    """The record that Sluice made a target is never behind the table: a CREATE whose
    transaction fails after the CREATE ran (MySQL has committed it by then, as when the worker
    is killed there) leaves either no table or one recorded as Sluice's, never an unrecorded
    table that a re-copy would keep as an operator's, with columns the source no longer has."""
    from services.sink_worker.sinks.sql_common import SqlSink

    sink = target.sink
    assert isinstance(sink, SqlSink)
    table = target.table("halfmade", SIMPLE, create=False)
    if target.kind == "postgres":
        sink._run(lambda cur: cur.execute(f'CREATE SCHEMA IF NOT EXISTS "{target.schema}"'), "schema")
    if target.kind == "mariadb":
        sink._run(lambda cur: cur.execute(f"CREATE DATABASE IF NOT EXISTS `{target.schema}`"), "database")
    statements = [*sink.create_statements(table), "SELECT no_such_column"]
    with pytest.raises(Exception, match="no_such"):
        sink._run(lambda cur: sink._create_marked(cur, table, statements), "create, then fail")
    columns = sink.target_columns(table)
    if target.kind == "mariadb":
        assert columns is not None  # the CREATE committed itself: the case that matters
    assert columns is None or sink.made_by_sluice(table)


def test_text_and_blob_key_columns(target: Target) -> None:
    # MySQL cannot index TEXT/BLOB whole: the MySQL sink maps them to VARCHAR/VARBINARY.
    meta = TableMetaV1(
        columns=[col("k", "string", "text", False), col("b", "bytes", "blob", False),
                 col("u", "string", "mediumtext"), col("v", "int", "int(11)")],
        primary_key=["k", "b"], unique_keys=[["u"]],
    )
    table = target.table("textkeys", meta)
    rows: list[dict[str, Any]] = [{"k": "😀" * 100, "b": b64(b"\x00\x01"), "u": "x" * 500, "v": 1},
            {"k": "a", "b": b64(b""), "u": None, "v": 2}]
    target.sink.apply_partition(table, [upsert(meta, r) for r in rows])
    target.sink.apply_partition(table, [Delete(("a", b""))])
    assert target.sink.fetch_rows(table) == expected(meta, rows[:1])


# --------------------------------------------------------------------------- deadlocks


@pytest.mark.parametrize("kind", ["mariadb", "postgres"])
def test_overlapping_partitions_in_opposite_order(kind: str, request: pytest.FixtureRequest,
                                                  tmp_path: Path) -> None:
    t = make_target(request, kind, tmp_path)
    table = t.table("overlap", SIMPLE)
    keys = list(range(60))

    def partition(tag: int, reverse: bool) -> list[Delete | Upsert]:
        rows = rows_of([(k, f"t{tag}-{k}", tag) for k in keys])
        changes: list[Delete | Upsert] = [upsert(SIMPLE, r) for r in rows]
        return list(reversed(changes)) if reverse else changes

    for _ in range(3):
        run_concurrently([lambda: t.sink.apply_partition(table, partition(1, False)),
                          lambda: t.sink.apply_partition(table, partition(2, True))])
        rows = t.sink.fetch_rows(table)
        assert len(rows) == len(keys)
        # Each partition is one transaction: the later one wins every row, never a mix.
        assert len({r["age"] for r in rows}) == 1, rows


@pytest.mark.parametrize("kind", ["mariadb", "postgres"])
def test_deadlock_victim_partition_is_retried(kind: str, request: pytest.FixtureRequest, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    t = make_target(request, kind, tmp_path)
    table = t.table("deadlock", SIMPLE)
    t.sink.apply_partition(table, [upsert(SIMPLE, r) for r in rows_of([(i, f"n{i}", 0) for i in range(50)])])
    server = t.server
    if kind == "mariadb":
        raw = server.connect(t.schema)
        raw.begin()
        ref, waiting_sql = "`deadlock`", ("SELECT COUNT(*) FROM information_schema.INNODB_TRX"
                                          " WHERE trx_state = 'LOCK WAIT'")
    else:
        raw = server.connect()
        raw.autocommit = False
        ref = f'"{t.schema}"."deadlock"'
        waiting_sql = "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    cur = raw.cursor()
    # The other transaction changes many rows first, so InnoDB picks the sink as the victim
    # (PostgreSQL: the sink's session has the shorter deadlock_timeout, so it checks first).
    cur.execute(f"UPDATE {ref} SET age = 7 WHERE id >= 10")
    cur.execute(f"UPDATE {ref} SET age = 7 WHERE id = 1")

    # Deletes run first, then upserts: the sink locks key 2, then waits for key 1.
    partition: list[Delete | Upsert] = [Delete((2,)), upsert(SIMPLE, rows_of([(1, "sink", 99)])[0])]
    result: list[PartitionResult] = []
    worker = threading.Thread(target=lambda: result.append(t.sink.apply_partition(table, partition)))
    with caplog.at_level(logging.WARNING, logger="sluice.sink"):
        worker.start()
        watcher = server.connect()
        deadline = time.monotonic() + 10
        while True:
            with watcher.cursor() as wc:
                wc.execute(waiting_sql)
                row = wc.fetchone()
            if row and row[0] >= 1:
                break
            if time.monotonic() > deadline:
                with watcher.cursor() as wc:
                    wc.execute("SHOW PROCESSLIST" if kind == "mariadb" else
                               "SELECT pid, state, wait_event_type, query FROM pg_stat_activity")
                    pytest.fail(f"the sink never waited for the lock: {wc.fetchall()}")
            # Not faster: MariaDB refreshes its INNODB_TRX cache only when 0.1 s passed since
            # the last read, so tighter polling would never see the wait.
            time.sleep(0.15)
        watcher.close()
        cur.execute(f"UPDATE {ref} SET age = 8 WHERE id = 2")  # closes the cycle
        raw.commit()
        raw.close()
        worker.join(30)
    assert result, "the partition failed instead of being retried"
    assert any("retrying" in r.getMessage() for r in caplog.records)
    rows = {r["id"]: r for r in t.sink.fetch_rows(table)}
    assert 2 not in rows and rows[1] == {"id": 1, "name": "sink", "age": 99}
    assert rows[10]["age"] == 7


def test_sqlite_parallel_partitions_serialise(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    t = make_target(request, "sqlite", tmp_path)
    table = t.table("par", SIMPLE)
    parts = [[upsert(SIMPLE, r) for r in rows_of([(p * 100 + i, f"p{p}-{i}", p) for i in range(50)])]
             for p in range(6)]
    run_concurrently([functools.partial(t.sink.apply_partition, table, p) for p in parts])
    assert len(t.sink.fetch_rows(table)) == 300


# --------------------------------------------------------------------------- checksums


@pytest.fixture
def three_targets(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[Target]]:
    yield [make_target(request, kind, tmp_path) for kind in SINKS]


def test_checksum_equal_across_databases(three_targets: list[Target]) -> None:
    sums = []
    fetched = []
    for t in three_targets:
        table = t.table("ck", ALL_KINDS)
        t.sink.apply_partition(table, [upsert(ALL_KINDS, r) for r in ALL_KINDS_ROWS])
        rows = t.sink.fetch_rows(table)
        fetched.append(rows)
        sums.append(table_checksum(rows, ALL_KINDS.columns, ["id"]))
    assert sums[0] == sums[1] == sums[2], sums
    assert sums[0][0] == len(ALL_KINDS_ROWS)

    # Raw driver rows (bytes for BIT, str for JSON, ...) checksum equal too when given the kinds.
    maria = three_targets[0]
    conn = maria.server.connect(maria.schema)
    with conn.cursor() as cur:
        cur.execute("SELECT " + ", ".join(quote_ident("mysql", c.name) for c in ALL_KINDS.columns)
                    + " FROM ck")
        raw_rows = list(cur.fetchall())
    conn.close()
    assert table_checksum(raw_rows, ALL_KINDS.columns, ["id"]) == sums[0]

    # A difference is found and reported.
    pg = three_targets[1]
    table = pg.table("ck", ALL_KINDS, create=False)
    changed = dict(ALL_KINDS_ROWS[2], s="changed")
    pg.sink.apply_partition(table, [upsert(ALL_KINDS, changed), Delete((1,))])
    down = pg.sink.fetch_rows(table)
    assert table_checksum(down, ALL_KINDS.columns, ["id"]) != sums[0]
    diff = compare_tables(fetched[2], down, ["id"], ALL_KINDS.columns)
    assert not diff.ok
    assert diff.missing == [(1,)] and diff.extra == []
    assert [k for k, _ in diff.different] == [(2,)]
    assert diff.different[0][1] == {"s": ("", "changed")}
    assert "1 missing" in str(diff) and "different at (2,)" in str(diff)
    assert compare_tables(fetched[0], fetched[2], ["id"], ALL_KINDS.columns).ok


# --------------------------------------------------------------------------- values (pure)


def test_decode_value_per_kind() -> None:
    assert decode_value("int", "bigint(20) unsigned", U64) == U64
    assert decode_value("decimal", "decimal(5,2)", "-1.50") == Decimal("-1.50")
    assert decode_value("bytes", "blob", b64(b"\x00\xff")) == b"\x00\xff"
    assert decode_value("time", "time", "-01:02:03.5") == -timedelta(hours=1, minutes=2, seconds=3.5)
    assert decode_value("time", "time", "838:59:59") == timedelta(hours=838, minutes=59, seconds=59)
    assert decode_value("timestamp", "timestamp", "2024-01-01T02:00:00+02:00").hour == 0
    assert decode_value("json", "json", '{"a":1}') == '{"a":1}'
    assert decode_value("set", "set('a','b')", "a,b") == "a,b"
    assert decode_value("string", "varchar(5)", None) is None
    with pytest.raises(ValueError):
        decode_row(SIMPLE, {"id": 1, "nope": 2})
    for text in ("-838:59:59.000000", "00:00:00.000001", "12:30:00"):
        assert format_time(parse_time(text), 6).lstrip("-").split(".")[0] == text.lstrip("-").split(".")[0]
    assert format_time(timedelta(seconds=-1), 0) == "-00:00:01"


def test_sql_type_parsing_rejects_injection() -> None:
    t = parse_sql_type("enum('a','it''s','back\\\\slash')")
    assert t.base == "enum" and t.args == ("a", "it's", "back\\slash")
    assert t.mysql() == "enum('a','it''s','back\\\\slash')"
    assert parse_sql_type("decimal(12, 2) unsigned zerofill").mysql() == "decimal(12,2) unsigned"
    assert parse_sql_type("double precision").base == "double precision"
    for bad in ("int); DROP TABLE x; --", "enum('a') , b int", "varchar(10) character set latin1"):
        with pytest.raises(SqlTypeError):
            parse_sql_type(bad)
    # An unparsable type falls back to a safe type for its kind instead of reaching the DDL.
    assert sql_type_for("mysql", col("x", "int", "int); DROP TABLE x; --")) == "bigint"


@pytest.mark.parametrize(("kind", "sql_type", "mysql", "pg", "sqlite"), [
    ("int", "bigint(20) unsigned", "bigint(20) unsigned", "numeric(20,0)", "TEXT"),
    ("int", "bigint(20)", "bigint(20)", "bigint", "INTEGER"),
    ("int", "int(10) unsigned", "int(10) unsigned", "bigint", "INTEGER"),
    ("int", "tinyint(1)", "tinyint(1)", "smallint", "INTEGER"),
    ("float", "float", "float", "real", "REAL"),
    ("float", "double", "double", "double precision", "REAL"),
    ("decimal", "decimal(30,10)", "decimal(30,10)", "numeric(30,10)", "TEXT"),
    ("decimal", "decimal", "decimal(65,30)", "numeric", "TEXT"),
    ("string", "char(3)", "char(3)", "varchar(3)", "TEXT"),
    ("string", "longtext", "longtext", "text", "TEXT"),
    ("string", "enum('a','b')", "enum('a','b')", "text", "TEXT"),
    ("set", "set('a','b')", "set('a','b')", "text", "TEXT"),
    ("bytes", "varbinary(3)", "varbinary(3)", "bytea", "BLOB"),
    ("datetime", "datetime(6)", "datetime(6)", "timestamp(6)", "TEXT"),
    ("timestamp", "timestamp(3)", "datetime(3)", "timestamp(3)", "TEXT"),
    ("timestamp", "timestamp", "datetime", "timestamp(0)", "TEXT"),
    ("time", "time(6)", "time(6)", "interval", "TEXT"),
    ("json", "json", "json", "jsonb", "TEXT"),
    ("bit", "bit(8)", "bit(8)", "bigint", "INTEGER"),
    ("bit", "bit(64)", "bit(64)", "numeric(20,0)", "TEXT"),
])
def test_type_mapping(kind: str, sql_type: str, mysql: str, pg: str, sqlite: str) -> None:
    c = col("c", kind, sql_type)
    assert (sql_type_for("mysql", c), sql_type_for("postgresql", c), sql_type_for("sqlite", c)) == (
        mysql, pg, sqlite)


def test_open_sink_by_dialect(tmp_path: Path) -> None:
    assert open_sink("mariadb://root@127.0.0.1:1/x").dialect == "mysql"
    assert open_sink("postgres://u@h/db").dialect == "postgresql"
    sink = open_sink(f"sqlite:///{tmp_path}/x.db")
    assert sink.dialect == "sqlite" and pickle.loads(pickle.dumps(sink)).dialect == "sqlite"
    with pytest.raises(ValueError):
        open_sink("oracle://x")
