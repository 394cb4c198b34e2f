"""The compiled row decoder against the binlog library on one real binlog: every column type of
the type matrix with its edge values (and zero dates, invalid ENUMs, empty SETs, NULLs, rows
events of many rows, every character set, ones Python has no codec for) read twice by capture's reader, once
through the library's per-column parse and once through the compiled decoder, must give the
same items, value for value and type for type."""

from __future__ import annotations

import pytest

from libs.localservers.mariadb import MariaDB
from services.capture.binlog_reader import Rows
from tests.helpers.rows_events import DB, assert_same_items, read_items, write

pytestmark = pytest.mark.integration


def test_the_compiled_decoder_gives_the_librarys_items(mariadb: MariaDB) -> None:
    start, end = write(mariadb)
    library, library_reader = read_items(mariadb, start, end, fast_rows=False)
    compiled, compiled_reader = read_items(mariadb, start, end, fast_rows=True)

    rows = [i for i in library if isinstance(i, Rows) and i.database == DB]
    tables = {i.table for i in rows}
    assert {"wide", "extra", "narrow", "spatial", "key_bit", "key_time", "charsets"} <= tables
    assert sum(len(i.images) for i in rows) > 300
    assert library_reader.decoded.compiled == 0

    assert_same_items(compiled, library)

    # Every rows event went through the compiled decoder, the spatial types' included.
    spatial = sum(1 for i in rows if i.table == "spatial")
    assert spatial > 0
    assert compiled_reader.decoded.library == 0
    assert compiled_reader.decoded.compiled == sum(1 for i in library if isinstance(i, Rows))
