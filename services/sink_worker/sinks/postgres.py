"""PostgreSQL sink (psycopg 3).

Upserts are ``INSERT ... ON CONFLICT (key) DO UPDATE``; PostgreSQL has no REPLACE, so rows that
hold the same unique-key values under another key are deleted first (``SqlSink._apply``).
DDL is transactional here, so ``reconcile_schema`` changes the table all at once or not at all.

The initial load's bulk path (``load_rows``): ``COPY ... FROM STDIN`` straight into the target
while no copied row meets one already there (a unique violation proves it did not); otherwise
into a temporary staging table (dropped at commit), then the same two steps set-wise: delete
the rows holding a staged row's unique values under another key, and ``INSERT ... SELECT ...
ON CONFLICT DO UPDATE``.

Spatial columns: PostGIS ``geometry`` (subtype and declared SRID as typmod, a SPATIAL index as
GiST) when the target database has the ``postgis`` extension, else ``bytea``; the value is
EWKB either way (``libs.codec.geometry``), so the SRID of every value is kept. Values are bound
as bytea (PostGIS casts it); COPY spells them per the target column's actual type (hex EWKB
text for geometry, bytea's hex input otherwise).
"""

from __future__ import annotations

import binascii
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import psycopg
import psycopg.errors
from psycopg.types.string import TextLoader

from contracts.events.rows import ColumnV1
from libs.codec.decode import postgis_type_for
from libs.codec.geometry import internal_to_ewkb
from libs.target_definitions import postgres_definition_of
from libs.target_fit import TargetDefinition, column_problem
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.shape_ddl import (
    column_shapes,
    folds_case,
    missing_derived,
    not_null,
    owned_index_drops,
    pg_collation_ref,
    pg_collation_statement,
    pg_default,
    pg_index_statement,
    table_shape,
    target_indexes,
)
from services.sink_worker.sinks.sql_common import ByteEncoder, SqlSink, source_text_files

# Kinds whose values the source's text protocol spells as COPY's text format reads them:
# numbers, text, dates and times of day (a zero or invalid date fails the COPY, as its decoded
# value fails the upsert), and bytes and geometries through their encoders. BIT, SET, TIME (an
# interval here) and JSON take the decoded path.
_SOURCE_TEXT_KINDS = frozenset({"int", "float", "decimal", "string", "bytes", "date", "datetime",
                                "timestamp", "geometry"})


def _escape_text(value: bytes) -> bytes:
    # Byte-wise is safe in utf8mb4: no byte of a multi-byte character is an ASCII byte. A NUL
    # goes through and fails the COPY, as PostgreSQL text holds none.
    return value.replace(b"\\", b"\\\\").replace(b"\t", b"\\t").replace(b"\n", b"\\n").replace(b"\r", b"\\r")


def _bytea_text(value: bytes) -> bytes:
    return b"\\\\x" + binascii.hexlify(value)  # bytea's hex input, its backslash escaped for COPY


def _ewkb_bytea_text(value: bytes) -> bytes:
    return _bytea_text(internal_to_ewkb(value))


def _ewkb_hex_text(value: bytes) -> bytes:
    return binascii.hexlify(internal_to_ewkb(value))  # PostGIS's geometry input reads hex EWKB


def _source_bytes_encoder(column: ColumnV1, postgis: bool = False) -> ByteEncoder:
    if column.kind == "geometry":
        return _ewkb_hex_text if postgis else _ewkb_bytea_text
    if column.kind == "bytes":
        return _bytea_text
    if column.kind == "string":
        return _escape_text
    return None


class PostgresSink(SqlSink):
    dialect = "postgresql"
    placeholder = "%s"
    max_params = 60_000  # the protocol carries at most 65535 parameters per statement

    def _connect(self) -> Any:
        params: dict[str, Any] = {
            "host": self.db.host,
            "port": self.db.port,
            "user": self.db.user or None,
            "password": self.db.password or None,
            "dbname": self.db.database or "postgres",
            "autocommit": False,
            "connect_timeout": 10,
        }
        # Other URL options (sslmode, application_name, ...) are libpq connection parameters.
        params.update(dict(self.db.options))
        params = {k: v for k, v in params.items() if v is not None}
        # Statements differ per chunk size and table: server-side prepares would only pile up.
        conn = psycopg.connect(**params, prepare_threshold=None)
        # jsonb as its text: the default loader would turn the document '"x"' into the str 'x',
        # which is then indistinguishable from the text of a document.
        for name in ("json", "jsonb"):
            conn.adapters.register_loader(name, TextLoader)
        return conn

    def _begin(self, conn: Any) -> None:
        # psycopg opens a transaction at the first statement when autocommit is off.
        return None

    def _retryable(self, exc: BaseException) -> bool:
        if not isinstance(exc, psycopg.Error):
            return isinstance(exc, ConnectionError)
        state = exc.sqlstate
        if state is None:
            # No SQLSTATE: the client lost or could not open the connection.
            return isinstance(exc, psycopg.OperationalError)
        # 40xxx: serialization_failure, deadlock_detected, ...; 55P03: lock_not_available;
        # 57P01-03: the server is shutting down / restarting; 08xxx: connection failures.
        return state.startswith(("40", "08")) or state in ("55P03", "57P01", "57P02", "57P03")

    def _table_ref(self, table: TargetTable, *, for_params: bool = False) -> str:
        q = self.pident if for_params else self.ident
        return f"{q(table.schema)}.{q(table.name)}" if table.schema else q(table.name)

    fence_lock_clause = " FOR SHARE"

    # ------------------------------------------------------------------ DDL

    def _column_clauses(self, table: TargetTable, column: ColumnV1, sql_type: str) -> tuple[str, str]:
        before = f" COLLATE {pg_collation_ref(self.ident, table.schema)}" if folds_case(table, column) else ""
        shape = column_shapes(table).get(column.name)
        default = pg_default(column, shape) if shape is not None else None
        return before, f" DEFAULT {default}" if default is not None else ""

    def _collation_statements(self, table: TargetTable) -> list[str]:
        if any(folds_case(table, c) for c in table.meta.columns):
            return [pg_collation_statement(self.ident, table.schema)]
        return []

    _postgis: bool | None = None
    """Whether the target database has the postgis extension (asked once, when a geometry
    column first needs a type or a value)."""

    def has_postgis(self) -> bool:
        if self._postgis is None:
            # A connection of its own: this is asked from inside other statements' work.
            conn = self._connect()
            try:
                with conn.cursor() as cur:
                    cur.execute("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'postgis')")
                    row = cur.fetchone()
                self._postgis = bool(row and row[0])
            finally:
                conn.close()
        return self._postgis

    def column_type(self, table: TargetTable, column: ColumnV1) -> str:
        if column.kind == "geometry" and self.has_postgis():
            return postgis_type_for(column)
        return super().column_type(table, column)

    def _adapt(self, column: ColumnV1 | None, value: Any) -> Any:
        if value is None or column is None or column.kind != "geometry":
            return value
        # EWKB as bytea, whatever the column: a bytea column keeps it, a PostGIS geometry column
        # takes it through PostGIS's implicit bytea -> geometry cast.
        return internal_to_ewkb(value)

    def _adapter(self, column: ColumnV1) -> Callable[[Any], Any] | None:
        if column.kind != "geometry":
            return None
        return lambda value: self._adapt(column, value)

    def _postgis_columns(self, table: TargetTable, columns: Sequence[str]) -> frozenset[str]:
        """Which of ``columns`` are PostGIS geometry columns in the target as it is (a bytea
        target made before the extension came stays bytea): COPY's text input differs."""
        colmap = self._columns(table)
        if not any(colmap[c].kind == "geometry" for c in columns) or not self.has_postgis():
            return frozenset()

        def work(cur: Any) -> frozenset[str]:
            cur.execute("SELECT a.attname FROM pg_attribute a WHERE a.attrelid = to_regclass(%s)"
                        " AND a.attnum > 0 AND NOT a.attisdropped AND a.atttypid = 'geometry'::regtype",
                        (self._table_ref(table),))
            return frozenset(str(r[0]) for r in cur.fetchall())

        return self._run(work, f"geometry columns of {table.name!r}")

    def create_statements(self, table: TargetTable) -> list[str]:
        self._validate(table)
        body = ",\n  ".join([*self._column_defs(table), *self._constraints(table)])
        out = []
        if table.schema:
            out.append(f"CREATE SCHEMA IF NOT EXISTS {self.ident(table.schema)}")
        out += self._collation_statements(table)
        out.append(f"CREATE TABLE IF NOT EXISTS {self._table_ref(table)} (\n  {body}\n)")
        return out + self.index_statements(table)

    def _spatial_indexes(self, table: TargetTable) -> bool:
        return any(i.kind == "spatial" for i in target_indexes(table)) and self.has_postgis()

    def index_statements(self, table: TargetTable) -> list[str]:
        ref = self._table_ref(table)
        gist = self._spatial_indexes(table)
        found = (pg_index_statement(self.ident, ref, table, i, gist=gist) for i in target_indexes(table))
        return [sql for sql in found if sql is not None]

    def _create(self, cur: Any, table: TargetTable) -> list[str]:
        return self._create_marked(cur, table, self.create_statements(table))

    def _index_sync(self, cur: Any, table: TargetTable) -> list[str]:
        """Statements bringing the target's secondary indexes to the source's (when the
        metadata carries its shape): the ones Sluice made for indexes the source no longer has
        are dropped, missing ones created."""
        if table_shape(table) is None:
            return []
        cur.execute("SELECT indexrelid::regclass::text, c.relname FROM pg_index i"
                    " JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = to_regclass(%s)",
                    (self._table_ref(table),))
        found = {str(name): str(qualified) for qualified, name in cur.fetchall()}
        drops = [f"DROP INDEX IF EXISTS {found[n]}" for n in owned_index_drops(table, list(found))]
        ref = self._table_ref(table)
        gist = self._spatial_indexes(table)
        creates = (pg_index_statement(self.ident, ref, table, i, gist=gist)
                   for i in missing_derived(table, list(found)))
        return drops + [sql for sql in creates if sql is not None]

    def _retryable_ddl(self, exc: BaseException) -> bool:
        # Two callers creating the same table/schema at once: IF NOT EXISTS is not atomic in
        # PostgreSQL, the loser gets a unique violation on the catalog; the retry finds it.
        if isinstance(exc, psycopg.Error) and exc.sqlstate in ("23505", "42P07", "42P06", "42710"):
            return True  # unique_violation, duplicate_table/schema/object
        return self._retryable(exc)

    def ensure_table(self, table: TargetTable) -> None:
        self._run(lambda cur: self._create(cur, table), f"create {table.name!r}", self._retryable_ddl)

    def _current(self, cur: Any, table: TargetTable) -> list[str] | None:
        cur.execute(
            "SELECT c.attname FROM pg_attribute c"
            " WHERE c.attrelid = to_regclass(%s) AND c.attnum > 0 AND NOT c.attisdropped"
            " ORDER BY c.attnum",
            (self._table_ref(table),),
        )
        names = [str(r[0]) for r in cur.fetchall()]
        if names:
            return names
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", (self._table_ref(table),))
        row = cur.fetchone()
        return [] if row and row[0] else None

    def reconcile_schema(self, table: TargetTable, drop: Collection[str] = ()) -> list[str]:
        self._validate(table)
        # Named by a MySQL statement, whose column names are case-insensitive.
        named = {c.casefold() for c in drop}

        def work(cur: Any) -> list[str]:
            current = self._current(cur, table)
            if current is None:
                return self._create(cur, table)
            want = {c.name for c in table.meta.columns}
            keep = set(table.key)
            # DROP COLUMN also drops the unique constraints that use it, as the source did.
            gone = [c for c in current if c.casefold() in named and c not in want and c not in keep]
            # lenient keeps them, nullable (DROP NOT NULL on a nullable column is a no-op).
            actions = ([f"ALTER COLUMN {self.ident(c)} DROP NOT NULL" for c in gone] if table.keep_columns
                       else [f"DROP COLUMN {self.ident(c)}" for c in gone])
            have = set(current)
            added = [c for c in table.meta.columns if c.name not in have]
            for c in added:
                sql_type = self.column_type(table, c)
                clauses = "".join(self._column_clauses(table, c, sql_type))
                actions.append(f"ADD COLUMN {self.ident(c.name)} {sql_type}{clauses}")
            statements: list[str] = []
            if actions:
                sql = f"ALTER TABLE {self._table_ref(table)} " + ", ".join(actions)
                statements = [*self._collation_statements(table), sql] if added else [sql]
            statements += self._index_sync(cur, table)
            for statement in statements:
                cur.execute(statement)
            return statements

        return self._run(work, f"reconcile {table.name!r}", self._retryable_ddl)

    def _definition(self, cur: Any, table: TargetTable) -> TargetDefinition | None:
        return postgres_definition_of(cur, table.schema or "public", table.name)

    def widen_in_place(self, table: TargetTable, types: Mapping[str, str]) -> list[str]:
        self._validate(table)

        def work(cur: Any) -> list[str]:
            actions: list[str] = []
            for column in table.meta.columns:
                found = types.get(column.name)
                if found is None:
                    continue
                name = self.ident(column.name)
                if column_problem(column, found, self.dialect) is not None:
                    # The target is empty (a re-copy emptied it): no value needs converting.
                    sql_type = self.column_type(table, column)
                    actions += [f"ALTER COLUMN {name} DROP DEFAULT",
                                f"ALTER COLUMN {name} TYPE {sql_type} USING NULL::{sql_type}"]
                    _, after = self._column_clauses(table, column, sql_type)
                    if after:
                        actions.append(f"ALTER COLUMN {name} SET{after}")
                if not not_null(table, column):
                    actions.append(f"ALTER COLUMN {name} DROP NOT NULL")
            if not actions:
                return []
            sql = f"ALTER TABLE {self._table_ref(table)} " + ", ".join(actions)
            cur.execute(sql)
            return [sql]

        return self._run(work, f"widen {table.name!r}", self._retryable_ddl)

    # ------------------------------------------------------------------ DML

    _direct_conflicted = False
    """A direct COPY of this sink met a row already there (see ``_copy_in``)."""
    load_file_bytes = 8 * 1024 * 1024
    """Bytes of COPY text built at once from source bytes (``load_source_bytes``)."""

    def load_rows(self, table: TargetTable, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  *, keys_unique: bool = True) -> int:
        if not rows:
            return 0
        rows = self._last_per_key(table, columns, rows, keys_unique)
        colmap = self._columns(table)
        gis = self._postgis_columns(table, columns)
        adapters: list[Callable[[Any], Any] | None] = [
            (lambda v: internal_to_ewkb(v).hex()) if c in gis else self._adapter(colmap[c]) for c in columns]
        if any(adapters):
            rows = [tuple(v if adapt is None or v is None else adapt(v)
                          for v, adapt in zip(row, adapters, strict=True)) for row in rows]

        def feed(copy: Any) -> None:
            for row in rows:
                copy.write_row(row)

        self._copy_in(table, columns, feed, keys_unique=keys_unique)
        return len(rows)

    def takes_source_bytes(self, table: TargetTable, columns: Sequence[str]) -> bool:
        colmap = self._columns(table)
        return all(colmap[c].kind in _SOURCE_TEXT_KINDS for c in columns)

    def load_source_bytes(self, table: TargetTable, columns: Sequence[str],
                          rows: Sequence[Sequence[bytes | None]], *, keys_unique: bool = True) -> int:
        if not rows:
            return 0
        rows = self._last_per_key(table, columns, rows, keys_unique)
        colmap = self._columns(table)
        gis = self._postgis_columns(table, columns)
        encoders = [_source_bytes_encoder(colmap[c], c in gis) for c in columns]

        def feed(copy: Any) -> None:
            for data in source_text_files(rows, encoders, self.load_file_bytes):
                copy.write(data)

        self._copy_in(table, columns, feed, keys_unique=keys_unique)
        return len(rows)

    @staticmethod
    def _last_per_key(table: TargetTable, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                      keys_unique: bool) -> Sequence[Sequence[Any]]:
        if keys_unique:
            return rows
        # ON CONFLICT DO UPDATE refuses to touch a row twice: the last row of a key wins, as in
        # the apply path.
        index = [list(columns).index(k) for k in table.key]
        return list({tuple(r[i] for i in index): r for r in rows}.values())

    def _copy_in(self, table: TargetTable, columns: Sequence[str], feed: Callable[[Any], None], *,
                 keys_unique: bool) -> None:
        """``feed(copy)`` writes the rows into a ``COPY ... FROM STDIN`` of ``columns``; they
        end up inserted or updated by key, in one transaction (see the module doc)."""
        self._validate(table)
        ref = self._table_ref(table)
        stage = self.ident("sluice_bulk_stage")
        cols = ", ".join(self.ident(c) for c in columns)
        key = set(table.key)
        same_key = " AND ".join(f"t.{self.ident(k)} = s.{self.ident(k)}" for k in table.key)
        # Without parameters psycopg sends the text as it is: plain quoting, no doubled %.
        statements = [
            f"DELETE FROM {ref} t USING {stage} s WHERE "
            + " AND ".join(f"t.{self.ident(c)} = s.{self.ident(c)}" for c in unique)
            + f" AND NOT ({same_key})"
            for unique in table.unique_keys
            if unique and set(unique) != key and set(unique) <= set(columns)
        ]
        updates = [f"{self.ident(c)} = EXCLUDED.{self.ident(c)}" for c in columns if c not in key]
        action = f"DO UPDATE SET {', '.join(updates)}" if updates else "DO NOTHING"
        statements.append(f"INSERT INTO {ref} ({cols}) SELECT {cols} FROM {stage}"
                          f" ON CONFLICT ({', '.join(self.ident(k) for k in table.key)}) {action}")

        # Straight into the target first, when a unique violation is the only way the copy's
        # rows can differ from their upsert: no key repeats in the rows, no unique key besides
        # the primary one. A fresh copy then costs one COPY, as a plain bulk load does. A
        # violation (the chunk is copied again, or another shard holds the key) rolls back to
        # the savepoint and takes the staging path, and so does every later load of this sink.
        direct = keys_unique and not self._direct_conflicted and all(
            set(unique) == key for unique in table.unique_keys if unique)

        def work(cur: Any) -> None:
            if direct and not self._direct_conflicted:
                cur.execute("SAVEPOINT sluice_direct")
                try:
                    with cur.copy(f"COPY {ref} ({cols}) FROM STDIN") as copy:
                        feed(copy)
                    return
                except psycopg.errors.UniqueViolation:
                    cur.execute("ROLLBACK TO SAVEPOINT sluice_direct")
                    self._direct_conflicted = True
            cur.execute(f"CREATE TEMPORARY TABLE {stage} (LIKE {ref}) ON COMMIT DROP")
            with cur.copy(f"COPY {stage} ({cols}) FROM STDIN") as copy:
                feed(copy)
            for sql in statements:
                cur.execute(sql)

        self._run(work, f"load into {table.name!r}", keep=True, fence=table.fence)

    def _upsert_sql(self, table: TargetTable, columns: Sequence[str], nrows: int) -> str:
        cols = ", ".join(self.pident(c) for c in columns)
        row = "(" + ", ".join(["%s"] * len(columns)) + ")"
        values = ", ".join([row] * nrows)
        key = set(table.key)
        conflict = ", ".join(self.pident(k) for k in table.key)
        updates = [f"{self.pident(c)} = EXCLUDED.{self.pident(c)}" for c in columns if c not in key]
        action = f"DO UPDATE SET {', '.join(updates)}" if updates else "DO NOTHING"
        return (f"INSERT INTO {self._table_ref(table, for_params=True)} ({cols}) VALUES {values}"
                f" ON CONFLICT ({conflict}) {action}")
