"""The initial load's source read: one chunk's rows streamed from MySQL/MariaDB through
mysqlclient's C layer (libmariadb).

Why not pymysql, which the rest of the source side uses: the profile of a copy put a third of
its time in pymysql parsing result packets in Python. Here libmariadb reads the rows
(``mysql_use_result``: unbuffered, one row at a time off the socket, so memory holds the rows
fetched and no more) and ``fetch_row(maxrows=n)`` turns many rows into tuples in one C call,
with the GIL released while it waits on the network, so the copy's writer thread works
meanwhile.

Two ways to read values:

- ``RAW``: every value as the bytes the server sent (text protocol), NULL as None. A MySQL/
  MariaDB downstream loads these as they are (``MySQLSink.load_source_bytes``): numbers, dates
  and times are spelled alike on both sides, so nothing is decoded or encoded again.
- ``TYPED``: the Python values pymysql would have made of the same fields, by the same
  functions (``pymysql.converters``) or C equivalents (int, float, str, bytes), so a value read
  here equals one read through pymysql: zero dates stay strings, TIME is a timedelta, BIT, geometry and
  binary strings stay bytes, text in a ``_bin`` collation is str. mysqlclient's own
  converters differ (zero dates become None, TIME past 24 h is refused), which would change
  data; they are not used.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from decimal import Decimal
from typing import Any, Literal

import pymysql.converters
from MySQLdb import _mysql
from MySQLdb.constants import FIELD_TYPE, FLAG

from libs.dburl import parse_database_url

Mode = Literal["raw", "typed"]
RAW: Mode = "raw"
TYPED: Mode = "typed"

# A string field: str, or bytes when its character set is binary (mysqlclient's C layer reads
# the field's charsetnr for this pair; pymysql makes the same choice).
_TEXT_OR_BYTES = ((FLAG.BINARY, bytes), (None, str))
_TEXT_TYPES = (FIELD_TYPE.STRING, FIELD_TYPE.VAR_STRING, FIELD_TYPE.VARCHAR, FIELD_TYPE.TINY_BLOB,
               FIELD_TYPE.MEDIUM_BLOB, FIELD_TYPE.LONG_BLOB, FIELD_TYPE.BLOB)
_ALL_TYPES = [v for k, v in vars(FIELD_TYPE).items() if k.isupper() and isinstance(v, int)]


def _decimal(text: str) -> Decimal:
    return Decimal(text)


def _typed_conv() -> dict[int, Any]:
    # Field types pymysql has no decoder for arrive there as ASCII text: str here too.
    conv: dict[int, Any] = {t: str for t in _ALL_TYPES}
    conv.update({t: _TEXT_OR_BYTES for t in _TEXT_TYPES})
    conv[FIELD_TYPE.BIT] = bytes
    conv[FIELD_TYPE.GEOMETRY] = bytes  # MariaDB's internal format (SRID + WKB), as pymysql gives it
    conv[FIELD_TYPE.JSON] = str
    for t in (FIELD_TYPE.TINY, FIELD_TYPE.SHORT, FIELD_TYPE.LONG, FIELD_TYPE.LONGLONG, FIELD_TYPE.INT24,
              FIELD_TYPE.YEAR):
        conv[t] = int  # parsed in C
    # float() takes the field's bytes; Decimal and the date/time converters get str (the C
    # layer passes str to the converters of these field types).
    conv[FIELD_TYPE.FLOAT] = conv[FIELD_TYPE.DOUBLE] = float
    conv[FIELD_TYPE.DECIMAL] = conv[FIELD_TYPE.NEWDECIMAL] = _decimal
    conv[FIELD_TYPE.DATETIME] = conv[FIELD_TYPE.TIMESTAMP] = pymysql.converters.convert_datetime
    conv[FIELD_TYPE.DATE] = pymysql.converters.convert_date
    conv[FIELD_TYPE.TIME] = pymysql.converters.convert_timedelta
    return conv


_CONV: dict[Mode, dict[int, Any]] = {RAW: {}, TYPED: _typed_conv()}



def connect_params(url: str, mode: Mode) -> dict[str, Any]:
    """mysqlclient's connect arguments for a source URL, reaching the server pymysql reaches
    with the same URL: libmariadb takes the host ``localhost`` for its default unix socket,
    pymysql for TCP to 127.0.0.1, so ``localhost`` goes as 127.0.0.1 unless the URL names a
    socket (which libmariadb uses only with the host ``localhost``)."""
    db = parse_database_url(url)
    params: dict[str, Any] = {"user": db.user or "root", "password": db.password or "",
                              "connect_timeout": 10, "conv": _CONV[mode]}
    socket = db.option("unix_socket")
    if socket:
        params["host"], params["unix_socket"] = "localhost", socket
    else:
        params["host"] = "127.0.0.1" if db.host in ("", "localhost") else db.host
        params["port"] = db.port or 3306
    return params


# libmariadb errors that mean "this server does not do TLS" (CR_SSL_CONNECTION_ERROR and the
# server-side "SSL not supported"): the connection is then made again without it.
_NO_TLS_ERRORS = (2026, 2061)


def _open(params: dict[str, Any]) -> Any:
    """Connect with TLS whenever the server offers it, as pymysql does for the rest of the source
    side: the copy's rows must not cross the network in clear text where they need not.

    ``ssl_mode="REQUIRED"`` is what makes libmariadb (Debian 12's 3.3) negotiate TLS at all;
    that build still goes on without TLS when the server has none, and a build that enforces
    it fails with a TLS error, after which the connection is made again without it. The server
    certificate is not verified, the same "preferred" TLS pymysql gives without options.
    """
    try:
        return _mysql.connect(**params, ssl_mode="REQUIRED")
    except _mysql.OperationalError as exc:
        if not exc.args or exc.args[0] not in _NO_TLS_ERRORS:
            raise
    return _mysql.connect(**params)


def connect(url: str, mode: Mode) -> Any:
    """A source connection in UTC (TIMESTAMP values then match the binlog's), utf8mb4, with TLS
    when the server offers it."""
    conn = _open(connect_params(url, mode))
    try:
        conn.set_character_set("utf8mb4")
        conn.query("SET time_zone = '+00:00'")
        conn.autocommit(True)
    except BaseException:
        conn.close()
        raise
    return conn


def bind(sql: str, params: Sequence[Any]) -> str:
    """``sql`` with its ``%s`` parameters as literals, escaped as pymysql escapes them."""
    if not params:
        return sql
    return sql % tuple(pymysql.converters.escape_item(p, "utf8mb4") for p in params)


def stream_batches(url: str, sql: str, params: Sequence[Any], *, mode: Mode, batch_rows: int,
                   batch_bytes: int, sized: Sequence[int]) -> Iterator[list[tuple[Any, ...]]]:
    """The rows of one query in batches of ``batch_rows`` rows or about ``batch_bytes`` bytes,
    whichever comes first (a larger row alone). ``sized``: the positions of the columns whose
    values may be large (strings, binary, JSON); the others count 8 bytes each.

    Rows come off the socket as they are fetched (unbuffered), so memory holds one batch being
    filled plus what the caller keeps. The block asked of the C layer starts at one row and
    adapts to the row size seen so far, so it holds little more than the byte bound."""
    conn = connect(url, mode)
    try:
        conn.query(bind(sql, params))
        result = conn.use_result()
        fixed = 8 * (result.num_fields() - len(sized))
        step = 1
        batch: list[tuple[Any, ...]] = []
        size = 0
        while rows := result.fetch_row(maxrows=step, how=0):
            got = fixed * len(rows) + sum(len(v) for i in sized for r in rows if (v := r[i]) is not None)
            batch.extend(rows)
            size += got
            if len(batch) >= batch_rows or size >= batch_bytes:
                yield batch
                batch, size = [], 0
            # The next block: what the bounds leave room for at the size of the rows so far, at
            # most twice the last one, so rows growing larger overshoot the byte bound little.
            per_row = max(1, got // len(rows))
            step = max(1, min(batch_rows - len(batch), (batch_bytes - size) // per_row, 2 * len(rows)))
        if batch:
            yield batch
    finally:
        conn.close()
