"""MySQL / MariaDB sink (pymysql).

Sessions are pinned to known settings rather than whatever the server defaults are:

- ``utf8mb4`` connection and tables (4-byte characters such as emoji), ``utf8mb4_bin`` table
  collation: a case- or accent-insensitive collation would make the unique-key conflict delete
  remove rows that the (binary) source considers different;
- ``sql_mode`` strict and without ``NO_BACKSLASH_ESCAPES`` / ``ANSI_QUOTES`` (pymysql's escaping
  and our backtick quoting assume them), so an over-long value fails instead of being truncated;
- ``time_zone = '+00:00'`` and ``READ COMMITTED``: partitions touch disjoint keys, so gap locks
  buy nothing and only add deadlocks;
- bytes are sent as ``_binary'...'`` so BLOB values are never checked as utf8mb4 text.

The initial load's bulk path (``load_rows``) is ``LOAD DATA LOCAL INFILE ... REPLACE``, its
data streamed from memory: pymysql only reads a named local file, so a connection of our own
answers the server's file request with the rows at hand, and never with a file from disk,
whatever name the server asks for. REPLACE removes every row that collides on the primary or
any unique key, which is the apply path's conflict delete plus upsert in one statement.
"""

from __future__ import annotations

import binascii
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar

import pymysql
import pymysql.connections
import pymysql.converters
from pymysql.constants import SERVER_STATUS

from contracts.events.rows import ColumnV1, IndexV1
from libs.codec.decode import (
    MYSQL_MAX_KEY_BYTES,
    SqlTypeError,
    format_time,
    fsp_of,
    is_text_like_mysql,
    mysql_key_bytes,
    mysql_key_type,
    parse_sql_type,
)
from libs.codec.table_shape import shape_from_rows
from libs.mysql_connection import MySQLConnection
from libs.target_definitions import mysql_definition_of
from libs.target_fit import TargetDefinition, column_problem
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.shape_ddl import (
    index_changes,
    mysql_column_clauses,
    mysql_index_clause,
    mysql_table_options,
    not_null,
    table_shape,
    target_indexes,
)
from services.sink_worker.sinks.sql_common import (
    _KEY_PREFIX,
    ByteEncoder,
    LiteralUpsert,
    SqlSink,
    source_text_files,
)
from services.sink_worker.sinks.write_fence import FENCE_TABLE

_SESSION_INIT = (
    "SET SESSION sql_mode = 'STRICT_TRANS_TABLES,ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION',"
    " time_zone = '+00:00'"
)

# ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT, "server has gone away", "lost connection",
# "can't connect", ER_SERVER_SHUTDOWN, ER_CONNECTION_KILLED (server restart mid-partition).
_RETRYABLE_CODES = frozenset({1213, 1205, 2006, 2013, 2003, 1053, 1927})

# ER_NOT_ALLOWED_COMMAND (MariaDB, MySQL 5.7), ER_CLIENT_LOCAL_FILES_DISABLED (MySQL 8):
# the server refuses LOAD DATA LOCAL; the bulk path falls back to the upsert.
_LOCAL_INFILE_REFUSED = frozenset({1148, 3948})

# Packets of the streamed file: well under any max_allowed_packet, few enough to not matter.
_LOAD_PACKET_BYTES = 64 * 1024


class _StreamedLoad(pymysql.connections.MySQLResult):
    """The result of a query that may answer with a LOCAL INFILE request: the request is served
    from ``data`` (None: refused, the server asked for a file nobody offered)."""

    def __init__(self, connection: Any, data: bytes | None) -> None:
        super().__init__(connection)
        self._data = data

    def _read_load_local_packet(self, first_packet: Any) -> None:
        conn = self.connection
        assert conn is not None
        try:
            if self._data is None:
                raise pymysql.err.OperationalError(
                    1148, "the server asked for a local file outside a bulk load: refused")
            view = memoryview(self._data)
            for start in range(0, len(view), _LOAD_PACKET_BYTES):
                conn.write_packet(view[start:start + _LOAD_PACKET_BYTES])
        finally:
            conn.write_packet(b"")  # end of the file, also after a refusal
            ok_packet = conn._read_packet()
        if not ok_packet.is_ok_packet():
            raise pymysql.err.OperationalError(2014, "Commands out of sync after LOAD DATA")
        self._read_ok_packet(ok_packet)  # type: ignore[attr-defined]


E = TypeVar("E")


_SEQUENCES = (tuple, list, set, frozenset)


class _Literals(dict[type, Callable[[Any], str]]):
    """Per Python type, how pymysql's ``Connection.escape`` spells a value of it (backslash
    escapes on, as the session's sql_mode pins): the common types directly, any other through
    the connection's own encoders, found once per type."""

    def __init__(self, conn: Any) -> None:
        super().__init__()
        self._conn = conn
        table = pymysql.converters._escape_table  # type: ignore[attr-defined]
        self[str] = lambda v: "'" + v.translate(table) + "'"
        self[int] = int.__repr__
        self[type(None)] = lambda v: "NULL"
        self[bytes] = self[bytearray] = lambda v: "X'" + v.hex() + "'"

    def __missing__(self, kind: type) -> Callable[[Any], str]:
        encoders = self._conn.encoders
        encoder = encoders.get(kind)
        if encoder is None or kind in _SEQUENCES or issubclass(kind, str | bytes | bytearray):
            found: Callable[[Any], str] = self._conn.escape
        else:
            def found(v: Any, encoder: Any = encoder) -> str:
                return str(encoder(v, encoders))
        self[kind] = found
        return found


def _row_literal(conn: Any) -> Callable[[Sequence[Any]], str]:
    """One row's values as pymysql would interpolate them: ``(v1,v2,...)``."""
    literals = _Literals(conn)

    def render(values: Sequence[Any]) -> str:
        return "(" + ",".join([literals[type(v)](v) for v in values]) + ")"

    return render

_ER_NET_PACKET_TOO_LARGE = 1153
# MySQL 5.7's default max_allowed_packet: a one-row statement below it is not measured.
_SMALLEST_PACKET_LIMIT = 4 * 1024 * 1024


class _LoadConnection(MySQLConnection):
    """A connection for ``LOAD DATA LOCAL``: ``load(sql, data)`` streams ``data`` as the file;
    any other file request of the server is refused (pymysql would open the named path)."""

    _load_data: bytes | None = None

    def load(self, sql: str, data: bytes) -> int:
        """Run ``sql`` (a LOAD DATA LOCAL) with ``data`` as the file; returns its warning count."""
        self._load_data = data
        try:
            with self.cursor() as cur:
                cur.execute(sql)
        finally:
            self._load_data = None
        return int(self._result.warning_count if self._result is not None else 0)

    def _read_query_result(self, unbuffered: bool = False) -> int:
        self._result = None
        result = _StreamedLoad(self, self._load_data)
        if unbuffered:
            result.init_unbuffered_query()
        else:
            result.read()
        self._result = result
        if result.server_status is not None:
            self.server_status = result.server_status
        return int(result.affected_rows or 0)


# LOAD DATA's default escapes (ESCAPED BY '\\'): a field never holds a raw separator.
_ESCAPES = {ord("\\"): "\\\\", ord("\t"): "\\t", ord("\n"): "\\n", ord("\r"): "\\r", 0: "\\0"}


def _text(value: Any) -> str:
    return str(value).translate(_ESCAPES)


def _load_files(rows: Iterable[Sequence[Any]], encoders: Sequence[Callable[[Any], str]],
                limit: int) -> Iterator[bytes]:
    """Rows as LOAD DATA's default text format (tab-separated fields, ``\\N`` for NULL), in
    files of about ``limit`` characters (a row is never split): a batch of wide rows is sent
    as several files, so the encoded copy in memory stays one file, not the batch."""
    lines: list[str] = []
    size = 0
    for row in rows:
        line = "\t".join(["\\N" if v is None else encode(v) for v, encode in zip(row, encoders, strict=True)])
        lines.append(line)
        size += len(line) + 1
        if size >= limit:
            lines.append("")
            yield "\n".join(lines).encode("utf-8")
            lines, size = [], 0
    if lines:
        lines.append("")
        yield "\n".join(lines).encode("utf-8")


def _load_encoder(column: ColumnV1) -> tuple[Callable[[Any], str], str | None]:
    """How a value of ``column`` is spelled in the loaded file, and the SET expression that
    turns the file's field (``@v``) into the column value where the text alone would not:
    binary as hex (never checked as text), BIT and YEAR through a number (the string '0' would
    be YEAR 2000 and BIT its characters' bytes)."""
    kind = column.kind
    try:
        base = parse_sql_type(column.sql_type).base
    except SqlTypeError:
        base = ""
    if kind in ("bytes", "geometry"):  # a geometry: MariaDB's internal format, as stored
        return (lambda v: bytes(v).hex()), "UNHEX({})"
    if kind == "bit" or base == "year":
        return (lambda v: str(int(v))), "CAST({} AS UNSIGNED)"
    if kind == "int":
        return (lambda v: str(int(v))), None
    if kind == "float":
        return repr, None
    if kind == "decimal":
        return (lambda v: format(v, "f") if isinstance(v, Decimal) else _text(v)), None
    if kind == "date":
        return (lambda v: v.isoformat() if isinstance(v, date) else _text(v)), None
    if kind in ("datetime", "timestamp"):
        return (lambda v: v.isoformat(" ") if isinstance(v, datetime) else _text(v)), None
    if kind == "time":
        fsp = fsp_of(column)
        return (lambda v: format_time(v, fsp) if isinstance(v, timedelta) else _text(v)), None
    return _text, None


def _escape_bytes(value: bytes) -> bytes:
    # Byte-wise is safe in utf8mb4: no byte of a multi-byte character is an ASCII byte.
    return (value.replace(b"\\", b"\\\\").replace(b"\t", b"\\t").replace(b"\n", b"\\n")
            .replace(b"\r", b"\\r").replace(b"\0", b"\\0"))


def _bit_bytes(value: bytes) -> bytes:
    return str(int.from_bytes(value, "big")).encode()


def _source_bytes_encoder(column: ColumnV1) -> tuple[ByteEncoder, str | None]:
    """``_load_encoder`` for a value as the bytes a MySQL source's text protocol sent (in
    utf8mb4): numbers, dates and times are already spelled as the server reads them back
    (None: the bytes go as they are), only text needs escaping and binary its hex."""
    kind = column.kind
    try:
        base = parse_sql_type(column.sql_type).base
    except SqlTypeError:
        base = ""
    if kind in ("bytes", "geometry"):
        return binascii.hexlify, "UNHEX({})"
    if kind == "bit":
        return _bit_bytes, "CAST({} AS UNSIGNED)"
    if base == "year":
        return None, "CAST({} AS UNSIGNED)"
    if kind in ("int", "float", "decimal", "date", "datetime", "timestamp", "time"):
        return None, None
    return _escape_bytes, None


class MySQLSink(SqlSink):
    dialect = "mysql"
    placeholder = "%s"
    max_params = 1_000_000  # pymysql interpolates client side: only statement bytes matter
    _packet_limit: int | None = None
    """The downstream's max_allowed_packet, read when a row first might not fit."""

    def _connect(self) -> Any:
        return MySQLConnection(**self._params())

    def _params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "host": self.db.host,
            "port": self.db.port,
            "user": self.db.user,
            "password": self.db.password,
            "charset": "utf8mb4",
            "autocommit": False,
            "binary_prefix": True,
            "connect_timeout": 10,
            "init_command": _SESSION_INIT,
        }
        socket = self.db.option("unix_socket")
        if socket:
            params["unix_socket"] = socket
        return params

    def _connect_load(self) -> Any:
        return _LoadConnection(**{**self._params(), "local_infile": True})

    def _begin(self, conn: Any) -> None:
        # Applies to the next transaction only; spelled this way for MySQL and MariaDB alike
        # (the session variable is tx_isolation on one, transaction_isolation on the other).
        with conn.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        conn.begin()

    def _retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, pymysql.err.InterfaceError):
            return True  # the socket is already closed
        if isinstance(exc, pymysql.err.MySQLError) and exc.args:
            return exc.args[0] in _RETRYABLE_CODES
        return isinstance(exc, ConnectionError)

    def _check_row_fits(self, cur: Any, estimate: int, sql: str, params: Sequence[Any] | None) -> None:
        # A statement above max_allowed_packet makes the server drop the connection, which the
        # client reports as 2006/2013, like a network failure, and retries forever. Said as
        # the server's own "packet too large" (1153, permanent), the table stops with an
        # incident naming the row instead. Checked exactly only for a row that might not fit.
        if estimate <= _SMALLEST_PACKET_LIMIT:
            return
        if self._packet_limit is None:
            cur.execute("SELECT @@max_allowed_packet")
            self._packet_limit = int(cur.fetchone()[0])
        if estimate <= self._packet_limit:
            return
        size = len(cur.mogrify(sql, params).encode("utf8", "surrogateescape")) + 1
        if size > self._packet_limit:
            raise pymysql.err.OperationalError(
                _ER_NET_PACKET_TOO_LARGE, f"the row's statement is {size} bytes, larger than the "
                f"downstream's max_allowed_packet ({self._packet_limit}); raise it on the server")

    def _database(self, table: TargetTable) -> str:
        name = table.schema or self.db.database
        if not name:
            raise ValueError(f"no database for table {table.name!r}: set TargetTable.schema or the URL path")
        return name

    def _table_ref(self, table: TargetTable, *, for_params: bool = False) -> str:
        q = self.pident if for_params else self.ident
        return f"{q(self._database(table))}.{q(table.name)}"

    fence_lock_clause = " LOCK IN SHARE MODE"  # MySQL 8 and MariaDB alike (FOR SHARE: MySQL only)
    # Span keys compare byte for byte (two tables differing in case are two spans).
    fence_text_type = "VARCHAR(700) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"

    def _fence_ref(self, schema: str | None, *, for_params: bool = False) -> str:
        q = self.pident if for_params else self.ident
        database = schema or self.db.database
        if not database:
            raise ValueError("no database for the write fence table: set the target schema or the URL path")
        return f"{q(database)}.{q(FENCE_TABLE)}"

    def _fence_bump_sql(self, ref: str) -> str:
        return (f"INSERT INTO {ref} (span, token, owner) VALUES (%s, 1, %s) "
                "ON DUPLICATE KEY UPDATE token = token + 1, owner = VALUES(owner)")

    def _adapt(self, column: ColumnV1 | None, value: Any) -> Any:
        # pymysql renders a negative timedelta wrongly (-00:00:01 as '-1:59:59').
        if isinstance(value, timedelta):
            return format_time(value, fsp_of(column) if column is not None else 6)
        return value

    def _adapter(self, column: ColumnV1) -> Callable[[Any], Any] | None:
        # Only TIME columns decode to timedelta; every other column binds as it is.
        if column.kind != "time":
            return None
        fsp = fsp_of(column)
        return lambda value: format_time(value, fsp) if isinstance(value, timedelta) else value

    # ------------------------------------------------------------------ DDL

    def column_type(self, table: TargetTable, column: ColumnV1) -> str:
        keys = [table.key, *table.unique_keys]
        if not is_text_like_mysql(column) or not any(column.name in k for k in keys):
            return super().column_type(table, column)
        colmap = self._columns(table)
        budget = MYSQL_MAX_KEY_BYTES
        for k in keys:
            if column.name not in k:
                continue
            members = [colmap[c] for c in k if c in colmap]
            fixed = sum(mysql_key_bytes(c) or 0 for c in members)
            flexible = sum(1 for c in members if mysql_key_bytes(c) is None)
            budget = min(budget, (MYSQL_MAX_KEY_BYTES - fixed) // max(flexible, 1) - 2)
        if budget <= 0:
            raise ValueError(f"key with column {column.name!r} of {table.name!r} is too wide for InnoDB")
        return mysql_key_type(column, budget)

    def _column_clauses(self, table: TargetTable, column: ColumnV1, sql_type: str) -> tuple[str, str]:
        return mysql_column_clauses(table, column, sql_type)

    def create_statements(self, table: TargetTable) -> list[str]:
        self._validate(table)
        indexes = [mysql_index_clause(self.ident, i) for i in target_indexes(table)]
        body = ",\n  ".join([*self._column_defs(table), *self._constraints(table), *indexes])
        return [
            f"CREATE DATABASE IF NOT EXISTS {self.ident(self._database(table))}"
            " CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
            f"CREATE TABLE IF NOT EXISTS {self._table_ref(table)} (\n  {body}\n)"
            + mysql_table_options(table),
        ]

    def ensure_table(self, table: TargetTable) -> None:
        statements = self.create_statements(table)
        self._run(lambda cur: self._create_marked(cur, table, statements), f"create {table.name!r}")

    def _current(self, cur: Any, table: TargetTable) -> list[str] | None:
        cur.execute(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS"
            " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
            (self._database(table), table.name),
        )
        names = [str(r[0]) for r in cur.fetchall()]
        if names:
            return names
        cur.execute(
            "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s",
            (self._database(table), table.name),
        )
        return [] if cur.fetchone() else None

    def _loosen(self, cur: Any, table: TargetTable, names: Sequence[str]) -> list[str]:
        """MODIFY clauses making the NOT NULL ones of ``names`` nullable, with their type,
        charset, collation, default and comment as the target has them."""
        cur.execute(
            "SELECT COLUMN_NAME, COLUMN_TYPE, CHARACTER_SET_NAME, COLLATION_NAME, COLUMN_DEFAULT,"
            " COLUMN_COMMENT FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s AND"
            " TABLE_NAME = %s AND IS_NULLABLE = 'NO' AND COLUMN_NAME IN ("
            + ", ".join(["%s"] * len(names)) + ")",
            (self._database(table), table.name, *names),
        )
        clauses = []
        for name, sql_type, charset, collation, default, comment in cur.fetchall():
            text = f"MODIFY COLUMN {self.ident(str(name))} {sql_type}"
            if charset and collation:
                text += f" CHARACTER SET {charset} COLLATE {collation}"
            text += " NULL"
            if default is not None and str(default).upper() != "NULL":
                text += f" DEFAULT {default}"  # MariaDB spells it as an SQL expression
            if comment:
                text += " COMMENT " + cur.connection.literal(str(comment))
            clauses.append(text)
        return clauses

    def reconcile_schema(self, table: TargetTable, drop: Collection[str] = ()) -> list[str]:
        self._validate(table)
        named = {c.casefold() for c in drop}

        def work(cur: Any) -> list[str]:
            current = self._current(cur, table)
            if current is None:
                return self._create_marked(cur, table, self.create_statements(table))
            # MySQL column names are case-insensitive: `Name` and `name` are one column.
            have = {c.casefold(): c for c in current}
            want = {c.name.casefold() for c in table.meta.columns}
            keep = {k.casefold() for k in table.key}
            actions: list[str] = []
            drop = [c for f, c in have.items() if f in named and f not in want and f not in keep]
            if drop and table.keep_columns:
                actions += self._loosen(cur, table, drop)  # lenient: kept, nullable
                drop = []
            if drop:
                # Unique indexes over a dropped column go first: MySQL would otherwise shrink
                # them to the remaining columns, which can make existing rows collide.
                cur.execute(
                    "SELECT DISTINCT INDEX_NAME FROM information_schema.STATISTICS"
                    " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s AND NON_UNIQUE = 0"
                    " AND INDEX_NAME <> 'PRIMARY' AND COLUMN_NAME IN ("
                    + ", ".join(["%s"] * len(drop)) + ")",
                    (self._database(table), table.name, *drop),
                )
                actions += [f"DROP INDEX {self.ident(str(r[0]))}" for r in cur.fetchall()]
                actions += [f"DROP COLUMN {self.ident(c)}" for c in drop]
            for column in table.meta.columns:
                if column.name.casefold() not in have:
                    sql_type = self.column_type(table, column)
                    # Added to a table that has rows: no AUTO_INCREMENT (it would need a key).
                    before, after = mysql_column_clauses(table, column, sql_type, added=True)
                    actions.append(f"ADD COLUMN {self.ident(column.name)} {sql_type}{before} NULL{after}")
            done: list[str] = []
            if actions:
                # One ALTER: one table rebuild, and MySQL applies it all or nothing.
                sql = f"ALTER TABLE {self._table_ref(table)} " + ", ".join(actions)
                cur.execute(sql)
                done.append(sql)
            return done + self._sync_indexes(cur, table)

        return self._run(work, f"reconcile {table.name!r}")

    def settled_schemas(self, tables: Sequence[TargetTable]) -> set[tuple[str | None, str]]:
        """Two reads of information_schema for every database of ``tables`` (its columns, and
        its indexes when a table's metadata carries its shape), then ``reconcile_schema``'s
        comparison for each table without a connection of its own."""
        if not tables:
            return set()
        for table in tables:
            self._validate(table)
        databases = sorted({self._database(t) for t in tables})
        marks = ", ".join(["%s"] * len(databases))
        shaped = any(table_shape(t) is not None for t in tables)

        Found = tuple[dict[tuple[str, str], list[str]], dict[tuple[str, str], list[tuple[Any, ...]]]]

        def read(cur: Any) -> Found:
            cur.execute("SELECT TABLE_SCHEMA, TABLE_NAME, COLUMN_NAME FROM information_schema.COLUMNS"
                        f" WHERE TABLE_SCHEMA IN ({marks})"
                        " ORDER BY TABLE_SCHEMA, TABLE_NAME, ORDINAL_POSITION", databases)
            columns: dict[tuple[str, str], list[str]] = {}
            for schema, name, column in cur.fetchall():
                columns.setdefault((str(schema), str(name)), []).append(str(column))
            indexes: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
            if shaped:
                cur.execute("SELECT TABLE_SCHEMA, TABLE_NAME, INDEX_NAME, NON_UNIQUE, COLUMN_NAME, SUB_PART,"
                            " INDEX_TYPE, COLLATION, INDEX_COMMENT FROM information_schema.STATISTICS"
                            f" WHERE TABLE_SCHEMA IN ({marks})"
                            " ORDER BY TABLE_SCHEMA, TABLE_NAME, INDEX_NAME, SEQ_IN_INDEX", databases)
                for row in cur.fetchall():
                    indexes.setdefault((str(row[0]), str(row[1])), []).append(tuple(row[2:]))
            return columns, indexes

        columns, indexes = self._run(read, "schema check")
        settled: set[tuple[str | None, str]] = set()
        for table in tables:
            key = (self._database(table), table.name)
            current = columns.get(key)
            if not current:
                continue  # missing (or named otherwise): reconciled on its own, which creates it
            # As reconcile_schema: MySQL column names are case-insensitive.
            have = {c.casefold() for c in current}
            if any(c.name.casefold() not in have for c in table.meta.columns):
                continue
            if table_shape(table) is not None:
                existing = shape_from_rows([], indexes.get(key, []), None, mariadb=True).indexes
                drop, create = index_changes(target_indexes(table), existing)
                if drop or create:
                    continue
            settled.add((table.schema, table.name))
        return settled

    def widen_in_place(self, table: TargetTable, types: Mapping[str, str]) -> list[str]:
        self._validate(table)

        def work(cur: Any) -> list[str]:
            have = {n.casefold(): (n, t) for n, t in types.items()}
            actions: list[str] = []
            loose: list[str] = []
            for column in table.meta.columns:
                found = have.get(column.name.casefold())
                if found is None:
                    continue
                if column_problem(column, found[1], self.dialect) is None:
                    if not not_null(table, column):
                        loose.append(found[0])
                    continue
                sql_type = self.column_type(table, column)
                null = " NOT NULL" if not_null(table, column) else " NULL"
                before, after = mysql_column_clauses(table, column, sql_type, added=True)
                actions.append(f"MODIFY COLUMN {self.ident(found[0])} {sql_type}{before}{null}{after}")
            actions += self._loosen(cur, table, loose) if loose else []
            if not actions:
                return []
            sql = f"ALTER TABLE {self._table_ref(table)} " + ", ".join(actions)
            cur.execute(sql)
            return [sql]

        return self._run(work, f"widen {table.name!r}")

    def _definition(self, cur: Any, table: TargetTable) -> TargetDefinition | None:
        return mysql_definition_of(cur, self._database(table), table.name)

    def _restore_sql(self, table: TargetTable, kept: TargetTable, key: Sequence[str],
                     cols: Sequence[str]) -> str:
        on = " AND ".join(f"d.{self.ident(k)} = s.{self.ident(_KEY_PREFIX + k)}" for k in key)
        sets = ", ".join(f"d.{self.ident(c)} = s.{self.ident(c)}" for c in cols)
        return f"UPDATE {self._table_ref(table)} AS d JOIN {self._table_ref(kept)} AS s ON {on} SET {sets}"

    def _existing_indexes(self, cur: Any, table: TargetTable) -> list[IndexV1]:
        cur.execute(
            "SELECT INDEX_NAME, NON_UNIQUE, COLUMN_NAME, SUB_PART, INDEX_TYPE, COLLATION, INDEX_COMMENT"
            " FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s"
            " ORDER BY INDEX_NAME, SEQ_IN_INDEX", (self._database(table), table.name))
        return shape_from_rows([], [tuple(r) for r in cur.fetchall()], None, mariadb=True).indexes

    def _sync_indexes(self, cur: Any, table: TargetTable) -> list[str]:
        """The source's secondary indexes on the target (CREATE INDEX, ADD/DROP/RENAME INDEX
        upstream), when the metadata carries its shape."""
        if table_shape(table) is None:
            return []
        drop, create = index_changes(target_indexes(table), self._existing_indexes(cur, table))
        actions = [f"DROP INDEX {self.ident(n)}" for n in drop]
        actions += [f"ADD {mysql_index_clause(self.ident, i)}" for i in create]
        if not actions:
            return []
        sql = f"ALTER TABLE {self._table_ref(table)} " + ", ".join(actions)
        cur.execute(sql)
        return [sql]

    def statement_target(self) -> MySQLSink:
        return self

    def execute_ddl(self, sql: str) -> None:
        """Run one DDL statement as written (a shard DDL already rewritten to this target)."""
        self._run(lambda cur: cur.execute(sql), "shard DDL")

    def table_shape(self, table: TargetTable) -> tuple[list[tuple[str, str, bool]], dict[str, list[str]]]:
        """The target as it is now: ``(name, column type, nullable)`` per column and the columns
        of every index by name, for re-run detection of a DDL."""

        def work(cur: Any) -> tuple[list[tuple[str, str, bool]], dict[str, list[str]]]:
            db = self._database(table)
            cur.execute("SELECT COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE FROM information_schema.COLUMNS"
                        " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
                        (db, table.name))
            columns = [(str(r[0]), str(r[1]), str(r[2]) == "YES") for r in cur.fetchall()]
            cur.execute("SELECT INDEX_NAME, COLUMN_NAME FROM information_schema.STATISTICS"
                        " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY INDEX_NAME, SEQ_IN_INDEX",
                        (db, table.name))
            indexes: dict[str, list[str]] = {}
            for name, column in cur.fetchall():
                indexes.setdefault(str(name), []).append(str(column))
            return columns, indexes

        return self._run(work, f"shape of {table.name!r}")

    # ------------------------------------------------------------------ DML

    _local_infile_refused = False
    # Characters per streamed LOAD DATA file: a batch of wide rows goes as several files in its
    # one transaction, so its encoded copy in memory is one file's, not the batch's.
    load_file_chars = 8 * 1024 * 1024

    def local_infile_on(self) -> bool:
        """Whether the server takes ``LOAD DATA LOCAL`` (asked once per sink instance)."""
        if not self._local_infile_refused:
            def work(cur: Any) -> bool:
                cur.execute("SELECT @@GLOBAL.local_infile")
                row = cur.fetchone()
                return bool(row and int(row[0]))

            self._local_infile_refused = not self._run(work, "local_infile")
        return not self._local_infile_refused

    def load_rows(self, table: TargetTable, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  *, keys_unique: bool = True) -> int:
        if not rows:
            return 0
        if self._local_infile_refused:
            return super().load_rows(table, columns, rows, keys_unique=keys_unique)
        try:
            return self._load(table, columns, rows)
        except pymysql.err.OperationalError as exc:
            if not exc.args or exc.args[0] not in _LOCAL_INFILE_REFUSED:
                raise
            self._local_infile_refused = True
            return super().load_rows(table, columns, rows, keys_unique=keys_unique)

    def takes_source_bytes(self, table: TargetTable, columns: Sequence[str]) -> bool:
        # There is no upsert to fall back to with undecoded values: LOAD DATA LOCAL or nothing.
        return self.local_infile_on()

    def load_source_bytes(self, table: TargetTable, columns: Sequence[str],
                          rows: Sequence[Sequence[bytes | None]], *, keys_unique: bool = True) -> int:
        if not rows:
            return 0
        sql, encoders = self._load_statement(table, columns, _source_bytes_encoder)
        # REPLACE: the last row of a key wins, whether or not keys repeat.
        self._send_load(table, sql, lambda: source_text_files(rows, encoders, self.load_file_chars))
        return len(rows)

    def _load(self, table: TargetTable, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> int:
        sql, encoders = self._load_statement(table, columns, _load_encoder)
        self._send_load(table, sql, lambda: _load_files(rows, encoders, self.load_file_chars))
        return len(rows)

    def _load_statement(self, table: TargetTable, columns: Sequence[str],
                        encoder_of: Callable[[ColumnV1], tuple[E, str | None]]) -> tuple[str, list[E]]:
        """The LOAD DATA statement for ``columns`` and each column's encoder."""
        self._validate(table)
        colmap = self._columns(table)
        encoders: list[E] = []
        fields: list[str] = []
        sets: list[str] = []
        for i, name in enumerate(columns):
            encode, expression = encoder_of(colmap[name])
            encoders.append(encode)
            if expression is None:
                fields.append(self.ident(name))
            else:
                fields.append(f"@v{i}")
                sets.append(f"{self.ident(name)} = {expression.format(f'@v{i}')}")
        # No parameters: pymysql leaves the text alone, so identifiers are quoted plainly.
        sql = (f"LOAD DATA LOCAL INFILE 'sluice-bulk' REPLACE INTO TABLE {self._table_ref(table)}"
               " CHARACTER SET utf8mb4 FIELDS TERMINATED BY '\\t' ENCLOSED BY '' ESCAPED BY '\\\\'"
               " LINES STARTING BY '' TERMINATED BY '\\n'"
               f" ({', '.join(fields)})" + (f" SET {', '.join(sets)}" if sets else ""))
        return sql, encoders

    def _send_load(self, table: TargetTable, sql: str, files: Callable[[], Iterable[bytes]]) -> None:
        """Run ``sql`` once per file of ``files()`` in one transaction (made again on a retry)."""

        def work(cur: Any) -> None:
            # LOCAL turns strict mode's errors into warnings (the server cannot stop the
            # upload): any warning fails the load, as the same value fails the upsert.
            for data in files():
                if cur.connection.load(sql, data):
                    cur.execute("SHOW WARNINGS LIMIT 3")
                    raise pymysql.err.DataError(1265, f"LOAD DATA into {table.name!r} warned: "
                                                      f"{[tuple(r) for r in cur.fetchall()]}")

        self._run(work, f"load into {table.name!r}", connect=self._connect_load, keep=True,
                  fence=table.fence)

    def _upsert_sql(self, table: TargetTable, columns: Sequence[str], nrows: int) -> str:
        row = "(" + ", ".join(["%s"] * len(columns)) + ")"
        prefix, suffix = self._upsert_parts(table, columns, self.pident, for_params=True)
        return prefix + ", ".join([row] * nrows) + suffix

    def _upsert_parts(self, table: TargetTable, columns: Sequence[str], quote: Callable[[str], str], *,
                      for_params: bool) -> tuple[str, str]:
        cols = ", ".join(quote(c) for c in columns)
        key = set(table.key)
        # VALUES(col) rather than the 8.0.19 row alias: MariaDB has no alias syntax.
        updates = [f"{quote(c)} = VALUES({quote(c)})" for c in columns if c not in key]
        if not updates:
            first = quote(table.key[0])
            updates = [f"{first} = {first}"]
        return (f"INSERT INTO {self._table_ref(table, for_params=for_params)} ({cols}) VALUES ",
                f" ON DUPLICATE KEY UPDATE {', '.join(updates)}")

    def _literal_upsert(self, cur: Any, table: TargetTable, columns: Sequence[str]) -> LiteralUpsert | None:
        conn = cur.connection
        if conn.server_status & SERVER_STATUS.SERVER_STATUS_NO_BACKSLASH_ESCAPES:
            return None  # pymysql then quotes differently: leave it to pymysql
        prefix, suffix = self._upsert_parts(table, columns, self.ident, for_params=False)
        return LiteralUpsert(prefix, suffix, _row_literal(conn))
