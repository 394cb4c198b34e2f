"""Downstream errors as transient (re-running the batch may succeed) or permanent (it cannot).

The classification is by the database's own code, per dialect, never by message text:

- MySQL / MariaDB: the server error number (``pymysql`` puts it in ``exc.args[0]``);
- PostgreSQL: the SQLSTATE, by class (``22`` data exception, ``23`` integrity constraint
  violation) or by exact code;
- SQLite: the primary result code (the low byte of the extended code).

Only errors about the *data of a row* are permanent: the value does not fit the column, a
constraint refuses it, a NOT NULL column gets a NULL. Retrying the same batch fails the same
way for ever, so the pipeline stops the table it belongs to instead (the poison path). Anything
else (deadlocks, lock timeouts, lost connections, a missing table that the next round creates
again, an error we do not know) stays transient: today's retry every round, which never loses
a row.
"""

from __future__ import annotations

from typing import Literal

ErrorClass = Literal["transient", "permanent"]

# MySQL / MariaDB server error numbers that no retry can fix: the row's values.
MYSQL_PERMANENT: frozenset[int] = frozenset({
    1048,  # ER_BAD_NULL_ERROR: column cannot be null
    1062,  # ER_DUP_ENTRY: a unique key the sink does not know (added downstream by hand)
    1136,  # ER_WRONG_VALUE_COUNT_ON_ROW
    1153,  # ER_NET_PACKET_TOO_LARGE: a row above the downstream's max_allowed_packet
    1216, 1217, 1451, 1452,  # foreign key constraint fails (child / parent)
    1264,  # ER_WARN_DATA_OUT_OF_RANGE
    1265,  # WARN_DATA_TRUNCATED
    1292,  # ER_TRUNCATED_WRONG_VALUE (bad date/time/number)
    1366,  # ER_TRUNCATED_WRONG_VALUE_FOR_FIELD (bad string for the column's charset)
    1367,  # ER_ILLEGAL_VALUE_FOR_TYPE
    1406,  # ER_DATA_TOO_LONG
    1416,  # ER_CANT_CREATE_GEOMETRY_OBJECT
    1690,  # ER_DATA_OUT_OF_RANGE (BIGINT value is out of range)
    3140,  # ER_INVALID_JSON_TEXT (MySQL)
    3819,  # ER_CHECK_CONSTRAINT_VIOLATED (MySQL 8)
    4025,  # ER_CONSTRAINT_FAILED (MariaDB CHECK)
    4078,  # ER_ILLEGAL_PARAMETER_DATA_TYPES2_FOR_OPERATION (MariaDB)
})

# PostgreSQL SQLSTATE classes and codes that no retry can fix.
POSTGRES_PERMANENT_CLASSES: tuple[str, ...] = ("22", "23")
POSTGRES_PERMANENT_CODES: frozenset[str] = frozenset({
    "42804",  # datatype_mismatch
    "54000",  # program_limit_exceeded (e.g. a row too big for an index)
})

# SQLite primary result codes that no retry can fix.
SQLITE_CONSTRAINT = 19
SQLITE_TOOBIG = 18
SQLITE_MISMATCH = 20
SQLITE_PERMANENT: frozenset[int] = frozenset({SQLITE_TOOBIG, SQLITE_CONSTRAINT, SQLITE_MISMATCH})


def classify_mysql(code: int | None) -> ErrorClass:
    return "permanent" if code in MYSQL_PERMANENT else "transient"


def classify_postgres(sqlstate: str | None) -> ErrorClass:
    if sqlstate is None:
        return "transient"  # no SQLSTATE: the client lost or could not open the connection
    if sqlstate.startswith(POSTGRES_PERMANENT_CLASSES) or sqlstate in POSTGRES_PERMANENT_CODES:
        return "permanent"
    return "transient"


def classify_sqlite(code: int | None) -> ErrorClass:
    if code is None:
        return "transient"
    return "permanent" if (code & 0xFF) in SQLITE_PERMANENT else "transient"


def error_code(exc: BaseException) -> int | str | None:
    """The database's own code of a driver exception (None for anything else)."""
    # pymysql first: its errors carry a SQLSTATE too (newer versions), but the error number is
    # what tells MySQL's errors apart.
    module = type(exc).__module__ or ""
    if module.startswith("pymysql") and exc.args and isinstance(exc.args[0], int):
        return exc.args[0]
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str):
        return sqlstate
    sqlite_code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(sqlite_code, int):
        return sqlite_code
    return None


def classify(dialect: str, exc: BaseException) -> ErrorClass:
    """Whether ``exc``, raised by the ``dialect`` driver while applying rows, is permanent."""
    if getattr(exc, "conflict", None) is not None:
        return "permanent"  # unique_guard.UniqueConflictError: a cross-shard conflict, refused
    code = error_code(exc)
    if dialect == "mysql":
        return classify_mysql(code if isinstance(code, int) else None)
    if dialect == "postgresql":
        return classify_postgres(code if isinstance(code, str) else None)
    if dialect == "sqlite":
        return classify_sqlite(code if isinstance(code, int) else None)
    return "transient"
