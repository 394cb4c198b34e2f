"""Talking to the source outside the binlog stream: connection, pre-flight checks, positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pymysql

from libs.dburl import DatabaseUrl, DatabaseUrlError, parse_database_url
from libs.mysql_connection import connect as mysql_connect
from services.capture.binlog_reader import Position

SourceProblem = Literal["binlog_not_row", "binlog_not_full_image"]


@dataclass(frozen=True)
class SourceOptions:
    """The source URL plus capture's options from its query string.

    ``?start=current|earliest`` where a source with nothing in the stream starts (default
    current: its binlog position when capture first runs); ``?heartbeat=1.0`` seconds between
    binlog heartbeats, which drive the idle resolved marks; ``?databases=a,b`` the only
    databases captured (the URL's path database alone when given; default all).
    """

    url: DatabaseUrl
    start: str = "current"
    heartbeat_s: float = 1.0
    databases: frozenset[str] | None = None

    @classmethod
    def parse(cls, raw: str) -> SourceOptions:
        url = parse_database_url(raw)
        if url.dialect != "mysql":
            raise DatabaseUrlError(f"capture reads MySQL/MariaDB sources, not {url.dialect}")
        start = (url.option("start", "current") or "current").lower()
        if start not in ("current", "earliest"):
            raise DatabaseUrlError(f"start must be 'current' or 'earliest', not {start!r}")
        try:
            heartbeat = float(url.option("heartbeat", "1.0") or "1.0")
        except ValueError as exc:
            raise DatabaseUrlError(f"heartbeat must be a number of seconds: {exc}") from None
        if not 0.05 <= heartbeat <= 60:
            raise DatabaseUrlError("heartbeat must be between 0.05 and 60 seconds")
        names = [d.strip() for d in (url.option("databases") or "").split(",") if d.strip()]
        if url.database:
            names.append(url.database)
        return cls(url, start, heartbeat, frozenset(names) or None)

    def connection_kwargs(self) -> dict[str, Any]:
        return {"host": self.url.host, "port": self.url.port, "user": self.url.user,
                "password": self.url.password}


def connect(options: SourceOptions) -> Any:
    """A control connection; UTC so TIMESTAMP values read here match the binlog's (UTC)."""
    return mysql_connect(**options.connection_kwargs(), charset="utf8mb4", autocommit=True,
                           connect_timeout=5, read_timeout=30, write_timeout=30,
                           init_command="SET time_zone = '+00:00'")


def check_source(conn: Any) -> list[tuple[SourceProblem, str]]:
    """Why this server's binlog cannot be captured, as (rejection kind, message); [] when fine."""
    problems: list[tuple[SourceProblem, str]] = []
    with conn.cursor() as cur:
        cur.execute("SELECT @@GLOBAL.log_bin, @@GLOBAL.binlog_format, @@GLOBAL.binlog_row_image")
        log_bin, fmt, image = cur.fetchone()
        try:
            cur.execute("SELECT @@GLOBAL.binlog_row_metadata")
            metadata = str(cur.fetchone()[0])
        except pymysql.err.MySQLError:
            metadata = "unsupported"
    if str(log_bin) not in ("1", "ON"):
        problems.append(("binlog_not_row", "binary logging is off (log_bin); start the server with "
                                           "--log-bin and --binlog-format=ROW"))
    elif str(fmt).upper() != "ROW":
        problems.append(("binlog_not_row", f"binlog_format is {fmt}, capture needs ROW "
                                           "(SET GLOBAL binlog_format=ROW and in the config file)"))
    if str(image).upper() != "FULL":
        problems.append(("binlog_not_full_image", f"binlog_row_image is {image}, capture needs FULL"))
    if metadata.upper() != "FULL":
        # Without it the binlog carries no column names, enum/set values or signedness, and a
        # row could only be decoded against information_schema, which may be ahead of it.
        problems.append(("binlog_not_full_image",
                         f"binlog_row_metadata is {metadata}, capture needs FULL "
                         "(MariaDB >= 10.5, MySQL >= 8.0.14)"))
    return problems


def current_position(conn: Any) -> Position:
    with conn.cursor() as cur:
        for statement in ("SHOW BINARY LOG STATUS", "SHOW MASTER STATUS"):
            try:
                cur.execute(statement)
            except pymysql.err.ProgrammingError:
                continue
            row = cur.fetchone()
            if row:
                return Position(str(row[0]), int(row[1]))
    raise RuntimeError("the source reports no binlog position: is log_bin on?")


def earliest_position(conn: Any) -> Position:
    with conn.cursor() as cur:
        cur.execute("SHOW BINARY LOGS")
        rows = cur.fetchall()
    if not rows:
        raise RuntimeError("the source has no binary logs")
    return Position(str(rows[0][0]), 4)


@dataclass(frozen=True)
class ServerGtids:
    """Who the server is and where its binlog's GTIDs stand (MariaDB; ``mariadb`` False: a MySQL
    server, whose GTIDs capture does not follow yet)."""

    server_id: str
    mariadb: bool
    binlog_pos: str = ""
    binlog_state: str = ""


def server_gtids(conn: Any) -> ServerGtids:
    with conn.cursor() as cur:
        cur.execute("SELECT @@GLOBAL.server_id, VERSION()")
        server_id, version = cur.fetchone()
        if "mariadb" not in str(version).lower():
            return ServerGtids(str(server_id), False)
        cur.execute("SELECT @@GLOBAL.gtid_binlog_pos, @@GLOBAL.gtid_binlog_state")
        pos, state = cur.fetchone()
    return ServerGtids(str(server_id), True, str(pos or ""), str(state or ""))


def gtid_at(conn: Any, position: Position) -> str | None:
    """The MariaDB GTID position at a binlog position of this server (``BINLOG_GTID_POS``: read
    from the binlog itself, so exact whenever it is asked); None when the server cannot say
    (the file is purged, or not a MariaDB server)."""
    with conn.cursor() as cur:
        try:
            cur.execute("SELECT BINLOG_GTID_POS(%s, %s)", (position.file, position.pos))
        except pymysql.err.MySQLError:
            return None
        row = cur.fetchone()
    return None if row is None or row[0] is None else str(row[0])
