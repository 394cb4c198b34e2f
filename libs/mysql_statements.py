"""The one recogniser of MySQL/MariaDB statements: what a statement is and which tables it names.

- ``classify``: what a binlog Query event means for capture: a transaction boundary, a DDL on
  tables, a DML written as a statement (which capture cannot replicate), or something to pass
  over, with the tables it names.
- ``ddl_form``, ``renames``, ``alter_clauses``, ``strip_comments``: a DDL's form, the renames it
  carries out and an ALTER's clauses, for the sink's single-shard DDL plan
  (``services.sink_worker.ddl.plan``).
- ``tokenize``: the tokens of a statement, for shard DDL's name rewriting and re-run checks
  (``libs.shard_ddl.rerun``), which must touch a table name only where the grammar puts one.

Not a SQL parser: it recognises the statement forms that change a table's shape or content and
the table names they name, which is what the server writes to its binlog for them. Lexer
assumptions (MySQL/MariaDB defaults): ``"..."`` is a string, not an identifier (no
``ANSI_QUOTES``); backslash escapes in strings; ``-- `` needs whitespace after the dashes;
``/*! ... */`` versioned comments are executed by the server, so their text counts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

StatementKind = Literal["begin", "commit", "ddl", "drop_database", "dml", "other"]

# An unquoted identifier: [0-9A-Za-z_$] and U+0080..U+FFFF, spelt as what it is not: a class with
# the range \u0080-\uffff costs re's compiler ~3 ms a pattern (it maps every code point), and the
# module's patterns were most of a service's start (0.2-0.3 s in every process that imports it).
_IDENT = r"(?:`(?:[^`]|``)+`|[^\x00-#%-/:-@\[-^`{-\x7f\U00010000-\U0010ffff]+)"
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


# -- a DDL's form ---------------------------------------------------------------------------------

DdlForm = Literal["drop_table", "truncate", "create_or_replace_table", "create_table", "create_index",
                  "create_unique_index", "drop_index", "alter_table"]

_FORM_DROP = _rx(r"DROP\s+(TEMPORARY\s+)?TABLES?\b")
_FORM_TRUNCATE = _rx(r"TRUNCATE\b")
_FORM_CREATE_OR_REPLACE = _rx(r"CREATE\s+OR\s+REPLACE\s+(TEMPORARY\s+)?TABLE\b")
_FORM_CREATE_TABLE = _rx(r"CREATE\s+(TEMPORARY\s+)?TABLE\b")
_FORM_CREATE_INDEX = _rx(r"CREATE\s+(OR\s+REPLACE\s+)?(ONLINE\s+|OFFLINE\s+)?"
                         r"(?P<kind>UNIQUE\s+|FULLTEXT\s+|SPATIAL\s+)?INDEX\b")
_FORM_DROP_INDEX = _rx(r"DROP\s+INDEX\b")
_FORM_ALTER = _rx(r"ALTER\s+(ONLINE\s+)?(IGNORE\s+)?TABLE\b")


def ddl_form(statement: str) -> DdlForm | None:
    """The form of a DDL statement (comments already stripped: ``strip_comments``), or None."""
    if _FORM_DROP.match(statement):
        return "drop_table"
    if _FORM_TRUNCATE.match(statement):
        return "truncate"
    if _FORM_CREATE_OR_REPLACE.match(statement):
        return "create_or_replace_table"
    index = _FORM_CREATE_INDEX.match(statement)
    if index is not None:
        return "create_unique_index" if (index.group("kind") or "").strip().upper() == "UNIQUE" \
            else "create_index"
    if _FORM_DROP_INDEX.match(statement):
        return "drop_index"
    if _FORM_CREATE_TABLE.match(statement):
        return "create_table"
    if _FORM_ALTER.match(statement):
        return "alter_table"
    return None


def unquote(ident: str) -> str:
    """An identifier's name: backticks removed and doubled backticks undone."""
    return _unquote(ident)


IDENT = _IDENT
"""A regex for one identifier, bare or backticked."""


# -- lexer ----------------------------------------------------------------------------------------

class Token(NamedTuple):
    kind: str
    """``ws``, ``comment``, ``word`` (bare identifier, keyword or number), ``qident``
    (backticked identifier), ``string``, ``punct``."""
    text: str
    """Exactly as in the statement (a token list joins back to the statement)."""
    closed: bool = True
    """False for a quote or comment that runs to the end of the statement unterminated."""

    @property
    def upper(self) -> str:
        return self.text.upper() if self.kind == "word" else ""

    @property
    def is_ident(self) -> bool:
        return self.kind in ("word", "qident")

    @property
    def value(self) -> str:
        """The identifier's name: backticks removed and doubled backticks undone."""
        if self.kind == "qident":
            body = self.text[1:-1] if self.closed else self.text[1:]
            return body.replace("``", "`")
        return self.text


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_$" or ord(ch) > 127


def tokenize(sql: str) -> list[Token]:
    """Split a statement into tokens; never fails (unterminated quotes run to the end)."""
    out: list[Token] = []
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch.isspace():
            j = i + 1
            while j < n and sql[j].isspace():
                j += 1
            out.append(Token("ws", sql[i:j]))
        elif ch == "#" or (sql.startswith("--", i) and (i + 2 == n or sql[i + 2].isspace())):
            j = sql.find("\n", i)
            j = n if j < 0 else j
            out.append(Token("comment", sql[i:j]))
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            if j < 0:
                out.append(Token("comment", sql[i:], closed=False))
                j = n
            else:
                j += 2
                out.append(Token("comment", sql[i:j]))
        elif ch == "`":
            j = i + 1
            while True:
                k = sql.find("`", j)
                if k < 0:
                    out.append(Token("qident", sql[i:], closed=False))
                    j = n
                    break
                if k + 1 < n and sql[k + 1] == "`":  # doubled backtick inside the name
                    j = k + 2
                    continue
                j = k + 1
                out.append(Token("qident", sql[i:j]))
                break
        elif ch in "'\"":
            j = i + 1
            closed = False
            while j < n:
                c = sql[j]
                if c == "\\":
                    j += 2
                    continue
                if c == ch:
                    if j + 1 < n and sql[j + 1] == ch:  # doubled quote
                        j += 2
                        continue
                    j += 1
                    closed = True
                    break
                j += 1
            j = min(j, n)
            out.append(Token("string", sql[i:j], closed=closed))
        elif _is_word_char(ch):
            j = i + 1
            while j < n and _is_word_char(sql[j]):
                j += 1
            out.append(Token("word", sql[i:j]))
        else:
            j = i + 1
            out.append(Token("punct", ch))
        i = j
    return out


def significant(tokens: Sequence[Token]) -> list[int]:
    return [i for i, t in enumerate(tokens) if t.kind not in ("ws", "comment")
            or (t.kind == "comment" and t.text.startswith("/*!"))]
