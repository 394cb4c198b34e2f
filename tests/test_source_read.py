"""The initial load's source read, the parts that need no server: mysqlclient's connect
arguments reach the server pymysql reaches with the same URL, parameters are bound as pymysql
binds them, and the typed read's converters are pymysql's. Reading real rows (every edge value,
batch bounds, key ranges) is in test_bulk_load."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pymysql.converters
from MySQLdb.constants import FIELD_TYPE

from services.sink_worker.snapshot import source_read


def test_localhost_is_tcp_as_in_pymysql_and_a_named_socket_is_used() -> None:
    tcp = source_read.connect_params("mysql://app:pw@localhost:3307/db", source_read.RAW)
    assert (tcp["host"], tcp["port"], tcp["user"], tcp["password"]) == ("127.0.0.1", 3307, "app", "pw")
    assert "unix_socket" not in tcp
    other = source_read.connect_params("mysql://db.example:3306", source_read.RAW)
    assert (other["host"], other["port"], other["user"]) == ("db.example", 3306, "root")
    assert other["password"] == ""
    sock = source_read.connect_params("mysql://root@localhost/?unix_socket=/run/m.sock", source_read.RAW)
    assert (sock["host"], sock["unix_socket"]) == ("localhost", "/run/m.sock")


def test_parameters_are_bound_as_pymysql_escapes_them() -> None:
    sql = source_read.bind("SELECT 1 WHERE a > %s AND b <= %s AND c = %s",
                           [5, "it's \\ here", dt.datetime(2026, 1, 2, 3, 4, 5, 6)])
    assert sql == ("SELECT 1 WHERE a > 5 AND b <= 'it\\'s \\\\ here'"
                   " AND c = '2026-01-02 03:04:05.000006'")
    assert source_read.bind("SELECT 100%", []) == "SELECT 100%"  # no parameters: left alone


def test_the_typed_read_converts_with_pymysqls_functions() -> None:
    conv = source_read._CONV[source_read.TYPED]
    assert conv[FIELD_TYPE.DATETIME] is pymysql.converters.convert_datetime
    assert conv[FIELD_TYPE.TIME] is pymysql.converters.convert_timedelta
    assert conv[FIELD_TYPE.DATE] is pymysql.converters.convert_date
    assert conv[FIELD_TYPE.NEWDECIMAL]("12.30") == Decimal("12.30")
    assert conv[FIELD_TYPE.LONGLONG] is int and conv[FIELD_TYPE.YEAR] is int
    assert conv[FIELD_TYPE.BIT] is bytes and conv[FIELD_TYPE.JSON] is str
    # A zero date stays the text pymysql leaves it (mysqlclient's own converter gives None).
    assert conv[FIELD_TYPE.DATETIME]("0000-00-00 00:00:00") == "0000-00-00 00:00:00"
    assert source_read._CONV[source_read.RAW] == {}
