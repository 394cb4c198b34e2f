"""The source table's definition beyond its columns' kinds (``TableShapeV1``), from
information_schema: column defaults, charsets, collations, comments and AUTO_INCREMENT; the
secondary and unique indexes; the table's charset, collation and comment.

``load_table_shape`` does the reading; the functions it uses to spell a default or gather an
index are pure (``parse_default``, ``shape_from_rows``). The shape is read with the rest of
``load_table_info`` and travels under the same rule (capture keeps it only where that read
holds at the row's position).

Defaults: MariaDB (10.2.7+) quotes a literal in ``COLUMN_DEFAULT`` (``'abc'``), spells
``DEFAULT NULL`` as the text ``NULL`` and an expression as its SQL (``current_timestamp()``);
MySQL 8 writes a literal's bare text and marks expressions with ``DEFAULT_GENERATED`` in
``EXTRA``. Both come out as ``(value, is_expression)``: a literal's value unquoted (a BIT
literal ``b'101'`` as its integer), an expression's SQL as written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from contracts.events.rows import ColumnShapeV1, IndexPartV1, IndexV1, TableShapeV1

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_BITS = re.compile(r"b'([01]*)'", re.IGNORECASE)
_INDEX_KINDS = {"BTREE": "btree", "HASH": "hash", "FULLTEXT": "fulltext", "SPATIAL": "spatial"}


def parse_default(raw: str | None, *, mariadb: bool, generated: bool = False) -> tuple[str | None, bool]:
    """``(value, is_expression)`` of an information_schema ``COLUMN_DEFAULT``; ``(None, False)``
    for no default or DEFAULT NULL."""
    if raw is None:
        return None, False
    text = str(raw)
    bits = _BITS.fullmatch(text)
    if bits:
        return str(int(bits.group(1) or "0", 2)), False
    if not mariadb:
        return (text, True) if generated else (text, False)
    if text == "NULL":
        return None, False
    if len(text) >= 2 and text[0] == "'" and text[-1] == "'":
        return _unquote(text[1:-1]), False
    if _NUMBER.fullmatch(text):
        return text, False
    return text, True


def _unquote(body: str) -> str:
    # MariaDB writes the literal as its SQL: quotes doubled, backslash escapes for the rest.
    out: list[str] = []
    i = 0
    escapes = {"0": "\0", "n": "\n", "r": "\r", "t": "\t", "Z": "\x1a", "b": "\b"}
    while i < len(body):
        ch = body[i]
        if ch == "'" and body[i + 1: i + 2] == "'":
            out.append("'")
            i += 2
        elif ch == "\\" and i + 1 < len(body):
            out.append(escapes.get(body[i + 1], body[i + 1]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def shape_from_rows(columns: Iterable[Sequence[Any]], indexes: Iterable[Sequence[Any]],
                    table: Sequence[Any] | None, *, mariadb: bool) -> TableShapeV1:
    """The shape from information_schema rows.

    ``columns``: ``(COLUMN_NAME, COLUMN_DEFAULT, CHARACTER_SET_NAME, COLLATION_NAME,
    COLUMN_COMMENT, EXTRA)`` in column order; ``indexes``: ``(INDEX_NAME, NON_UNIQUE,
    COLUMN_NAME, SUB_PART, INDEX_TYPE, COLLATION, INDEX_COMMENT)`` ordered by index and
    ``SEQ_IN_INDEX``; ``table``: ``(TABLE_COLLATION, TABLE_COMMENT, CHARACTER_SET_NAME)``.
    """
    shaped = []
    for name, default, charset, collation, comment, extra in columns:
        flags = str(extra or "").lower()
        value, expression = parse_default(default, mariadb=mariadb, generated="default_generated" in flags)
        shaped.append(ColumnShapeV1(
            name=str(name), default=value, default_expression=expression,
            charset=str(charset) if charset else None, collation=str(collation) if collation else None,
            comment=str(comment or ""), auto_increment="auto_increment" in flags))
    gathered: dict[str, IndexV1] = {}
    for index_name, non_unique, column, sub_part, index_type, order, comment in indexes:
        name = str(index_name)
        if name == "PRIMARY" or column is None:
            continue  # the primary key is the metadata's; a functional key part has no column
        kind = _INDEX_KINDS.get(str(index_type or "BTREE").upper(), "btree")
        # A SPATIAL index shows its key length (MariaDB: 32) as SUB_PART; it takes no prefix.
        prefix = int(sub_part) if sub_part is not None and kind != "spatial" else None
        part = IndexPartV1(column=str(column), prefix=prefix, descending=str(order or "A").upper() == "D")
        found = gathered.get(name)
        if found is None:
            gathered[name] = IndexV1(name=name, unique=not int(non_unique), kind=kind,
                                     parts=[part], comment=str(comment or ""))
        else:
            found.parts.append(part)
    collation, comment, charset = (table or (None, "", None))[:3]
    return TableShapeV1(columns=shaped, indexes=list(gathered.values()),
                        charset=str(charset) if charset else None,
                        collation=str(collation) if collation else None, comment=str(comment or ""))


def is_mariadb(conn: Any) -> bool:
    info = conn.get_server_info() if hasattr(conn, "get_server_info") else ""
    return "mariadb" in str(info).lower()


def load_table_shape(cur: Any, database: str, table: str, *, mariadb: bool) -> TableShapeV1:
    """The table's shape as information_schema shows it now (``cur``: a pymysql cursor)."""
    cur.execute(
        "SELECT COLUMN_NAME, COLUMN_DEFAULT, CHARACTER_SET_NAME, COLLATION_NAME, COLUMN_COMMENT, EXTRA"
        " FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s"
        " ORDER BY ORDINAL_POSITION", (database, table))
    columns = [tuple(r) for r in cur.fetchall()]
    cur.execute(
        "SELECT INDEX_NAME, NON_UNIQUE, COLUMN_NAME, SUB_PART, INDEX_TYPE, COLLATION, INDEX_COMMENT"
        " FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s"
        " ORDER BY INDEX_NAME, SEQ_IN_INDEX", (database, table))
    indexes = [tuple(r) for r in cur.fetchall()]
    cur.execute(
        "SELECT t.TABLE_COLLATION, t.TABLE_COMMENT, c.CHARACTER_SET_NAME FROM information_schema.TABLES t"
        " LEFT JOIN information_schema.COLLATIONS c ON c.COLLATION_NAME = t.TABLE_COLLATION"
        " WHERE t.TABLE_SCHEMA = %s AND t.TABLE_NAME = %s", (database, table))
    row = cur.fetchone()
    return shape_from_rows(columns, indexes, tuple(row) if row else None, mariadb=mariadb)
