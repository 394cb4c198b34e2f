"""Fixes for values pymysqlreplication decodes wrongly, shared by the library's path
(``binlog_reader``) and the compiled row decoder (``rows_decode``), which must give the same
values as the library's path after these fixes."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any


def fix_negative_time2(value: Any) -> Any:
    """pymysqlreplication 1.0.x reads the fraction of a negative TIME(n>0) as a signed number
    without MySQL's "intpart + 1, frac - 1" step, so -12:34:56.78 comes out as -12:34:56.22.
    It returns -(I + f) with I = the next whole second up and f = -(true fraction); the true
    magnitude is I - 1 + |f| = 2I - 1 - |r|. A whole number of seconds is decoded correctly."""
    if not isinstance(value, dt.timedelta) or value >= dt.timedelta(0):
        return value
    magnitude = -value
    if magnitude.microseconds == 0:
        return value
    whole_up = dt.timedelta(days=magnitude.days, seconds=magnitude.seconds + 1)
    return -(2 * whole_up - dt.timedelta(seconds=1) - magnitude)


def fix_year(value: Any) -> Any:
    """pymysqlreplication decodes YEAR as ``byte + 1900``, but the stored byte 0 is YEAR 0000
    (valid years are 1901..2155 and 0000), which it turns into 1900: no target would take it
    back as 0000 (MariaDB refuses 1900, others keep a wrong year)."""
    return 0 if value == 1900 else value


def binary_padder(width: int) -> Callable[[Any], Any]:
    """BINARY(n) is fixed width, padded with 0x00; the binlog leaves the trailing zero bytes
    out (as it does a CHAR's trailing spaces) and the reader does not put them back, so a value
    ending in zero bytes would shrink on any target that keeps bytes as given."""
    def pad(value: Any) -> Any:
        if value == "":  # the reader's spelling of an empty binary string
            value = b""
        if isinstance(value, bytes | bytearray) and len(value) < width:
            return bytes(value).ljust(width, b"\0")
        return value
    return pad
