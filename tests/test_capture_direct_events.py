"""The hot binlog events read from the packets' bytes (``services/capture/direct_events.py``)
against the binlog library's events, on one real binlog: capture's reader reads it with and
without the direct path and must give the same items, value for value and type for type.

The binlog holds every column type of the type matrix with its edge values (``rows_events``),
and what the direct path must hand back to the library or read exactly as it does: XA
transactions (prepared, committed, rolled back), a non-transactional table's statements
(``BEGIN``/``COMMIT`` query events), a rotation to a new binlog file in the middle, updates
with ``binlog_row_image=MINIMAL`` (partial row images: the library's none sources), a row of
20 MiB (a rows event split over several protocol packets), and a table with a POINT column
(outside the compiled decoder)."""

from __future__ import annotations

import pytest

from libs.localservers.mariadb import MariaDB
from services.capture.binlog_reader import Begin, Commit, Query, Rows, XaPrepare
from tests.helpers.rows_events import DB, assert_same_items, read_items, write

pytestmark = pytest.mark.integration

BIG = 20 * 1024 * 1024


def _more_statements() -> list[str]:
    return [
        f"CREATE TABLE {DB}.plain (id INT PRIMARY KEY, v VARCHAR(20)) ENGINE=MyISAM",
        f"INSERT INTO {DB}.plain VALUES (1, 'a'), (2, 'b')",
        f"UPDATE {DB}.plain SET v = 'c' WHERE id = 1",
        f"DELETE FROM {DB}.plain WHERE id = 2",
        f"CREATE TABLE {DB}.xa (id INT PRIMARY KEY, v INT)",
        "XA START 'x1'", f"INSERT INTO {DB}.xa VALUES (1, 1), (2, 2)", "XA END 'x1'",
        "XA PREPARE 'x1'", "XA COMMIT 'x1'",
        "XA START 'x2'", f"UPDATE {DB}.xa SET v = v + 1", "XA END 'x2'", "XA PREPARE 'x2'",
        "XA ROLLBACK 'x2'",
        "XA START 'x3'", f"DELETE FROM {DB}.xa WHERE id = 2", "XA END 'x3'",
        "XA COMMIT 'x3' ONE PHASE",
        "FLUSH BINARY LOGS",
        f"CREATE TABLE {DB}.big (id INT PRIMARY KEY, b LONGBLOB, t LONGTEXT)",
        f"INSERT INTO {DB}.big VALUES (1, REPEAT(x'C3', {BIG}), REPEAT('ü', 10))",
        f"UPDATE {DB}.big SET t = 'x'",
        "SET SESSION binlog_row_image = 'MINIMAL'",
        f"UPDATE {DB}.narrow SET k = k + 1 WHERE id < 10",
        f"DELETE FROM {DB}.narrow WHERE id < 5",
        f"UPDATE {DB}.xa SET v = 9",
        "SET SESSION binlog_row_image = 'FULL'",
        "BEGIN",
        f"INSERT INTO {DB}.xa VALUES (10, 10)",
        f"INSERT INTO {DB}.narrow VALUES (1000, 1, 'c', 'p')",
        f"UPDATE {DB}.xa SET v = 11 WHERE id = 10",
        "COMMIT",
    ]


@pytest.mark.parametrize("fast_rows", [True, False], ids=["compiled-rows", "library-rows"])
def test_the_direct_path_gives_the_librarys_items(mariadb: MariaDB, fast_rows: bool) -> None:
    start, end = write(mariadb, _more_statements(), autocommit=True)
    library, library_reader = read_items(mariadb, start, end, fast_rows=fast_rows, direct=False)
    direct, direct_reader = read_items(mariadb, start, end, fast_rows=fast_rows, direct=True,
                                       server_id=4244)

    assert end.file != start.file  # the rotation is in the range read
    rows = [i for i in library if isinstance(i, Rows) and i.database == DB]
    assert {"wide", "extra", "narrow", "spatial", "charsets", "plain", "xa", "big"} <= {i.table for i in rows}
    assert any(isinstance(i, XaPrepare) for i in library)
    assert any(isinstance(i, Begin) and i.xa for i in library)
    assert any(isinstance(i, Query) and i.query == "COMMIT" for i in library)
    big = [i for i in rows if i.table == "big" and i.op == "insert"]
    assert big and big[0].images[0].after is not None
    assert len(big[0].images[0].after["b"]) == BIG
    assert library_reader.decoded.direct == 0

    assert_same_items(direct, library)

    # The direct path took the hot events: every GTID, XID and rows event of a known table.
    begins = sum(1 for i in library if isinstance(i, Begin))
    commits = sum(1 for i in library if isinstance(i, Commit))
    assert direct_reader.decoded.direct >= begins + commits + (len(rows) - direct_reader.decoded.library
                                                               if fast_rows else 0)
    assert direct_reader.decoded.compiled == library_reader.decoded.compiled
    assert direct_reader.decoded.library == library_reader.decoded.library
    if fast_rows:
        # Partial row images (MINIMAL) went back to the library (the POINT table's rows the
        # compiled decoder reads since spatial types replicate).
        assert direct_reader.decoded.library >= 3
