"""What a binlog Query event means for capture: a transaction boundary, a DDL on tables, a DML
written as a statement (which capture cannot replicate), or something to pass over.

Not a SQL parser: it recognises the statement forms that change a table's shape or content
and the table names they name, which is what the server writes to its binlog for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

StatementKind = Literal["begin", "commit", "ddl", "drop_database", "dml", "other"]

_IDENT = r"(?:`(?:[^`]|``)+`|[0-9A-Za-z_$\u0080-\uffff]+)"
_QUAL = rf"({_IDENT})(?:\s*\.\s*({_IDENT}))?"
_QUAL_NC = rf"{_IDENT}(?:\s*\.\s*{_IDENT})?"
_QUAL_RE = re.compile(_QUAL)


def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE | re.DOTALL)


_BEGIN = _rx(r"(BEGIN|START\s+TRANSACTION|XA\s+START|XA\s+BEGIN)\b")
_COMMIT = _rx(r"(COMMIT|ROLLBACK(?!\s+TO\b)|XA\s+COMMIT|XA\s+ROLLBACK)\b")
_ALTER = _rx(rf"ALTER\s+(?:ONLINE\s+)?(?:IGNORE\s+)?TABLE\s+(?:IF\s+EXISTS\s+)?{_QUAL}(.*)")
_ALTER_RENAME = _rx(rf"(?:^|,)\s*RENAME\s+(?:TO\s+|AS\s+)?(?!(?:COLUMN|INDEX|KEY)\b){_QUAL}")
_CREATE = _rx(rf"CREATE\s+(?:OR\s+REPLACE\s+)?(?:TEMPORARY\s+)?TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?{_QUAL}")
_DROP = _rx(rf"DROP\s+(?:TEMPORARY\s+)?TABLES?\s+(?:IF\s+EXISTS\s+)?"
            rf"({_QUAL_NC}(?:\s*,\s*{_QUAL_NC})*)")
_RENAME = _rx(rf"RENAME\s+TABLES?\s+(?:IF\s+EXISTS\s+)?"
              rf"({_QUAL_NC}\s+TO\s+{_QUAL_NC}(?:\s*,\s*{_QUAL_NC}\s+TO\s+{_QUAL_NC})*)")
_TRUNCATE = _rx(rf"TRUNCATE\s+(?:TABLE\s+)?{_QUAL}")
_CREATE_INDEX = _rx(rf"CREATE\s+(?:OR\s+REPLACE\s+)?(?:ONLINE\s+|OFFLINE\s+)?"
                    rf"(?:UNIQUE\s+|FULLTEXT\s+|SPATIAL\s+)?INDEX\s+(?:IF\s+NOT\s+EXISTS\s+)?"
                    rf"{_IDENT}\s+(?:USING\s+\w+\s+)?ON\s+{_QUAL}")
_DROP_INDEX = _rx(rf"DROP\s+INDEX\s+(?:IF\s+EXISTS\s+)?{_IDENT}\s+ON\s+{_QUAL}")
_DROP_DATABASE = _rx(rf"DROP\s+(?:DATABASE|SCHEMA)\s+(?:IF\s+EXISTS\s+)?({_IDENT})")
_DML = _rx(r"(INSERT|REPLACE|UPDATE|DELETE|LOAD\s+DATA|LOAD\s+XML)\b")
_DML_TABLE = [
    _rx(rf"(?:INSERT|REPLACE)\s+(?:(?:LOW_PRIORITY|DELAYED|HIGH_PRIORITY|IGNORE)\s+)*(?:INTO\s+)?{_QUAL}"),
    _rx(rf"UPDATE\s+(?:(?:LOW_PRIORITY|IGNORE)\s+)*{_QUAL}"),
    _rx(rf"DELETE\s+(?:(?:LOW_PRIORITY|QUICK|IGNORE)\s+)*FROM\s+{_QUAL}"),
    _rx(rf"LOAD\s+(?:DATA|XML)\b.*?\bINTO\s+TABLE\s+{_QUAL}"),
]

_COMMENT = re.compile(r"/\*(!\d*)?(.*?)\*/|--[ \t][^\n]*|#[^\n]*", re.DOTALL)


@dataclass(frozen=True)
class Statement:
    kind: StatementKind
    tables: tuple[tuple[str, str], ...] = ()  # (database, table), as named
    database: str = ""  # drop_database


def _unquote(ident: str) -> str:
    if ident.startswith("`") and ident.endswith("`"):
        return ident[1:-1].replace("``", "`")
    return ident


def _qualified(first: str, second: str | None, default_db: str) -> tuple[str, str]:
    if second is None:
        return default_db, _unquote(first)
    return _unquote(first), _unquote(second)


def _strip_comments(query: str) -> str:
    # Versioned comments (/*!50100 ... */) are executed by the server, so their text counts.
    return _COMMENT.sub(lambda m: (" " + m.group(2) + " ") if m.group(1) else " ", query).strip()


def _split_quals(text: str, default_db: str) -> list[tuple[str, str]]:
    return [_qualified(m.group(1), m.group(2), default_db) for m in _QUAL_RE.finditer(text)]


def classify(query: str, default_db: str) -> Statement:
    text = _strip_comments(query)
    if _BEGIN.match(text):
        return Statement("begin")
    if _COMMIT.match(text):
        return Statement("commit")
    m = _ALTER.match(text)
    if m:
        tables = [_qualified(m.group(1), m.group(2), default_db)]
        for r in _ALTER_RENAME.finditer(m.group(3)):
            tables.append(_qualified(r.group(1), r.group(2), default_db))
        return Statement("ddl", tuple(tables))
    for pattern in (_CREATE, _TRUNCATE, _CREATE_INDEX, _DROP_INDEX):
        m = pattern.match(text)
        if m:
            return Statement("ddl", (_qualified(m.group(1), m.group(2), default_db),))
    m = _DROP.match(text)
    if m:
        return Statement("ddl", tuple(_split_quals(m.group(1), default_db)))
    m = _RENAME.match(text)
    if m:
        names = [n for part in re.split(r"\s+TO\s+|\s*,\s*", m.group(1), flags=re.IGNORECASE)
                 for n in _split_quals(part, default_db)]
        return Statement("ddl", tuple(names))
    m = _DROP_DATABASE.match(text)
    if m:
        return Statement("drop_database", database=_unquote(m.group(1)))
    if _DML.match(text):
        for pattern in _DML_TABLE:
            m = pattern.match(text)
            if m:
                return Statement("dml", (_qualified(m.group(1), m.group(2), default_db),))
        return Statement("dml")
    return Statement("other")


# ---------------------------------------------------------------- for the sink's DDL plan

def strip_comments(query: str) -> str:
    """The statement as the server runs it: comments out, versioned comments' text kept."""
    return _strip_comments(query)


def renames(query: str, default_db: str) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """The ``(old, new)`` table pairs a statement renames, in the order the server applies
    them: ``RENAME TABLE a TO b, c TO d`` or ``ALTER TABLE a ... RENAME TO b``; [] otherwise."""
    text = _strip_comments(query)
    m = _RENAME.match(text)
    if m:
        pairs = []
        for part in re.split(r"\s*,\s*(?=(?:[^`]|`[^`]*`)*$)", m.group(1)):
            names = [_qualified(q.group(1), q.group(2), default_db)
                     for q in _QUAL_RE.finditer(re.sub(r"\s+TO\s+", " ", part, flags=re.IGNORECASE))]
            if len(names) == 2:
                pairs.append((names[0], names[1]))
        return pairs
    m = _ALTER.match(text)
    if m:
        old = _qualified(m.group(1), m.group(2), default_db)
        pairs = []
        for r in _ALTER_RENAME.finditer(m.group(3)):
            new = _qualified(r.group(1), r.group(2), default_db)
            pairs.append((old, new))
            old = new
        return pairs
    return []


def alter_clauses(query: str) -> list[str] | None:
    """The comma-separated clauses of an ``ALTER TABLE`` (commas inside parentheses and quotes
    do not split), or None when the statement is not one."""
    m = _ALTER.match(_strip_comments(query))
    if m is None:
        return None
    body, depth, quote = m.group(3), 0, ""
    clauses: list[str] = []
    current: list[str] = []
    for ch in body:
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"`":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            clauses.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    clauses.append("".join(current).strip())
    return [c for c in clauses if c]
