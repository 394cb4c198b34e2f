"""DDL text for shard merging: rewrite table names to the target's, compare statements, and
recognise a re-run of a DDL that the target already has.

Everything works on tokens of the MySQL lexer (``libs.mysql_statements.tokenize``), never on
regexes over the raw text, so a table name only changes where the grammar puts a table name: a
column, string literal or comment that happens to spell the table name (or ``ADD``,
``TABLE``...) is left alone.

Lexer assumptions (MySQL/MariaDB defaults): ``"..."`` is a string, not an identifier (no
``ANSI_QUOTES``); backslash escapes in strings (no ``NO_BACKSLASH_ESCAPES``); ``-- `` needs
whitespace after the dashes; ``/*! ... */`` versioned comments are kept verbatim but not looked
into.

Re-run detection answers one question for the owner that meets an error (or restarts) while
executing a shard DDL: is this statement already in effect on the target? ``already_applied``
counts as done, ``not_applied`` means it is safe to execute, ``unknown`` means we cannot tell
and a human must look (never guessed). An ALTER with several clauses is atomic on MySQL, but a
sink may run it clause by clause (PostgreSQL), so it is ``already_applied`` only when every
clause is, ``not_applied`` only when no clause is, and ``unknown`` otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import NamedTuple

from contracts.events.rows import TableMetaV1
from libs.mysql_statements import Token, significant, tokenize
from libs.sql_ident import quote_ident

__all__ = [
    "ColumnDef",
    "DDLRewriteError",
    "RerunCheck",
    "RerunVerdict",
    "TableName",
    "TableShape",
    "Token",
    "canonical_ddl",
    "check_applied",
    "ddls_equal",
    "normalise_type",
    "rewrite_for_target",
    "rewrite_table_names",
    "tokenize",
]


_SIMPLE_IDENT = re.compile(r"[A-Za-z0-9_$]+")


def canonical_ddl(sql: str) -> str:
    """A form for comparing statements from different shards: comments dropped (not versioned
    ones), whitespace only where it separates two words, bare words upper-cased, simple
    backticked identifiers unquoted (column names are case-insensitive in MySQL), a trailing
    ``;`` dropped. String literals are kept exactly."""
    parts: list[str] = []
    prev_wordlike = False
    for tok in tokenize(sql):
        if tok.kind in ("ws", "comment") and not tok.text.startswith("/*!"):
            continue
        if tok.kind == "word":
            text = tok.text.upper()
        elif tok.kind == "qident" and tok.closed and _SIMPLE_IDENT.fullmatch(tok.value):
            text = tok.value.upper()
        else:
            text = tok.text
        wordlike = tok.kind in ("word", "qident", "string") or tok.text.startswith("/*!")
        if parts and wordlike and prev_wordlike:
            parts.append(" ")
        parts.append(text)
        prev_wordlike = wordlike
    while parts and parts[-1] in (";", " "):
        parts.pop()
    return "".join(parts)


def ddls_equal(a: Sequence[str], b: Sequence[str]) -> bool:
    """Two DDL lists mean the same: same length, statements equal in canonical form."""
    return len(a) == len(b) and all(canonical_ddl(x) == canonical_ddl(y) for x, y in zip(a, b, strict=True))


# -- table names ----------------------------------------------------------------------------------

class TableName(NamedTuple):
    schema: str | None
    table: str

    def __str__(self) -> str:
        return f"{self.schema}.{self.table}" if self.schema is not None else self.table


class DDLRewriteError(ValueError):
    """A statement whose table names we cannot find with certainty: executing it unchanged on
    the target could hit the wrong table, so it is refused instead."""


def _quote_name(name: TableName) -> str:
    if name.schema is None:
        return quote_ident("mysql", name.table)
    return f"{quote_ident('mysql', name.schema)}.{quote_ident('mysql', name.table)}"


class _Cursor:
    """Walks the significant tokens of a statement and records name replacements."""

    def __init__(self, sql: str) -> None:
        self.sql = sql
        self.tokens = tokenize(sql)
        bad = next((t for t in self.tokens if not t.closed), None)
        if bad is not None:
            raise DDLRewriteError(f"unterminated {bad.kind} in DDL: {sql!r}")
        self.sig = significant(self.tokens)
        self.pos = 0
        self.replacements: list[tuple[int, int, str]] = []  # token index range [a, b] -> text

    def peek(self, ahead: int = 0) -> Token | None:
        k = self.pos + ahead
        return self.tokens[self.sig[k]] if k < len(self.sig) else None

    def peek_kw(self, ahead: int = 0) -> str:
        tok = self.peek(ahead)
        return tok.upper if tok is not None else ""

    def accept(self, *words: str) -> bool:
        """Consume the keyword sequence ``words`` when it is next."""
        if all(self.peek_kw(k) == w for k, w in enumerate(words)):
            self.pos += len(words)
            return True
        return False

    def accept_any(self, *words: str) -> str:
        kw = self.peek_kw()
        if kw in words:
            self.pos += 1
            return kw
        return ""

    def expect_punct(self, ch: str) -> bool:
        tok = self.peek()
        if tok is not None and tok.kind == "punct" and tok.text == ch:
            self.pos += 1
            return True
        return False

    def name(self) -> tuple[TableName, int, int]:
        """A possibly schema-qualified name at the cursor: (name, first token, last token)."""
        first = self.peek()
        if first is None or not first.is_ident:
            raise DDLRewriteError(f"expected a table name at {self._where()} in DDL: {self.sql!r}")
        a = self.sig[self.pos]
        self.pos += 1
        dot, second = self.peek(), self.peek(1)
        if dot is not None and dot.kind == "punct" and dot.text == "." and second is not None \
                and second.is_ident:
            b = self.sig[self.pos + 1]
            self.pos += 2
            return TableName(first.value, second.value), a, b
        return TableName(None, first.value), a, a

    def _where(self) -> str:
        tok = self.peek()
        return f"{tok.text!r}" if tok is not None else "the end"

    def at_end(self) -> bool:
        return self.pos >= len(self.sig)

    def output(self) -> str:
        if not self.replacements:
            return self.sql
        out: list[str] = []
        i = 0
        for a, b, text in sorted(self.replacements):
            out.extend(t.text for t in self.tokens[i:a])
            out.append(text)
            i = b + 1
        out.extend(t.text for t in self.tokens[i:])
        return "".join(out)


Renamer = Callable[[TableName], TableName | None]


def rewrite_table_names(sql: str, rename: Renamer, *, default_schema: str | None = None) -> str:
    """``sql`` with every table name passed through ``rename`` (None keeps the name).

    ``rename`` sees the name with an unqualified schema filled from ``default_schema`` (the
    statement's default database, when known). Replaced names are always backticked; every other
    byte of the statement is kept. Handles ALTER TABLE (with REFERENCES, RENAME TO, EXCHANGE
    PARTITION ... WITH TABLE), CREATE TABLE (with LIKE and REFERENCES), DROP TABLE, CREATE/DROP
    INDEX ... ON, RENAME TABLE and TRUNCATE; any other statement raises ``DDLRewriteError``.
    """
    cur = _Cursor(sql)

    def at_name() -> None:
        name, a, b = cur.name()
        lookup = name if name.schema is not None or default_schema is None \
            else TableName(default_schema, name.table)
        new = rename(lookup)
        if new is not None and new != lookup:
            cur.replacements.append((a, b, _quote_name(new)))

    def scan_rest(*, create: bool) -> None:
        # Bare REFERENCES/RENAME/WITH/LIKE are reserved words in MySQL, so as bare words they
        # can only be keywords; names that spell them must be backticked and are not matched.
        depth = 0
        while not cur.at_end():
            tok = cur.peek()
            assert tok is not None
            if tok.kind == "punct" and tok.text in "()":
                depth += 1 if tok.text == "(" else -1
                cur.pos += 1
            elif tok.upper == "REFERENCES":
                cur.pos += 1
                at_name()
            elif not create and depth == 0 and tok.upper == "RENAME" \
                    and cur.peek_kw(1) not in ("COLUMN", "INDEX", "KEY"):
                cur.pos += 1
                cur.accept_any("TO", "AS")
                at_name()
            elif not create and cur.accept("WITH", "TABLE"):
                at_name()
            else:
                cur.pos += 1

    head = cur.accept_any("ALTER", "CREATE", "DROP", "RENAME", "TRUNCATE")
    if head == "ALTER":
        while cur.accept_any("ONLINE", "OFFLINE", "IGNORE"):
            pass
        if not cur.accept("TABLE"):
            raise DDLRewriteError(f"unsupported ALTER statement (only ALTER TABLE): {sql!r}")
        cur.accept("IF", "EXISTS")
        at_name()
        scan_rest(create=False)
    elif head == "CREATE":
        cur.accept("OR", "REPLACE")
        while cur.accept_any("ONLINE", "OFFLINE", "TEMPORARY"):
            pass
        if cur.accept("TABLE"):
            cur.accept("IF", "NOT", "EXISTS")
            at_name()
            if cur.accept("LIKE") or (cur.expect_punct("(") and cur.accept("LIKE")):
                at_name()
            scan_rest(create=True)
        else:
            cur.accept_any("UNIQUE", "FULLTEXT", "SPATIAL")
            if not cur.accept("INDEX"):
                raise DDLRewriteError(f"unsupported CREATE statement (only TABLE and INDEX): {sql!r}")
            cur.accept("IF", "NOT", "EXISTS")
            cur.name()  # the index name
            _skip_to_keyword(cur, "ON", sql)
            at_name()
    elif head == "DROP":
        cur.accept("TEMPORARY")
        if cur.accept("TABLE"):
            cur.accept("IF", "EXISTS")
            at_name()
            while cur.expect_punct(","):
                at_name()
        elif cur.accept("INDEX"):
            while cur.accept_any("ONLINE", "OFFLINE"):
                pass
            cur.accept("IF", "EXISTS")
            cur.name()
            if not cur.accept("ON"):
                raise DDLRewriteError(f"DROP INDEX without ON <table>: {sql!r}")
            at_name()
        else:
            raise DDLRewriteError(f"unsupported DROP statement (only TABLE and INDEX): {sql!r}")
    elif head == "RENAME":
        if not cur.accept("TABLE"):
            raise DDLRewriteError(f"unsupported RENAME statement (only RENAME TABLE): {sql!r}")
        while True:
            at_name()
            if not cur.accept("TO"):
                raise DDLRewriteError(f"RENAME TABLE without TO: {sql!r}")
            at_name()
            if not cur.expect_punct(","):
                break
    elif head == "TRUNCATE":
        cur.accept("TABLE")
        at_name()
    else:
        raise DDLRewriteError(f"not a table DDL statement this rewriter knows: {sql!r}")
    return cur.output()


def _skip_to_keyword(cur: _Cursor, word: str, sql: str) -> None:
    while not cur.at_end():
        if cur.accept(word):
            return
        cur.pos += 1
    raise DDLRewriteError(f"expected {word} in DDL: {sql!r}")


def rewrite_for_target(sql: str, *, schema: str, table: str, target_schema: str | None,
                       target_table: str) -> str:
    """Rewrite a shard's DDL so it names the target: every reference to the shard's table
    (``schema.table``, or ``table`` unqualified) becomes ``target_schema.target_table``
    (``target_table`` alone when ``target_schema`` is None, e.g. for SQLite). Other tables
    (a foreign key's parent, say) are kept; use ``rewrite_table_names`` to map them too."""
    target = TableName(target_schema, target_table)

    def rename(name: TableName) -> TableName | None:
        if name.table == table and name.schema in (None, schema):
            return target
        return None

    return rewrite_table_names(sql, rename)


# -- re-run detection -----------------------------------------------------------------------------

class RerunVerdict(StrEnum):
    ALREADY_APPLIED = "already_applied"
    NOT_APPLIED = "not_applied"
    UNKNOWN = "unknown"


class RerunCheck(NamedTuple):
    verdict: RerunVerdict
    reason: str


class ColumnDef(NamedTuple):
    name: str
    sql_type: str | None = None
    """As the target reports it (``int(11) unsigned``); None when not known."""
    nullable: bool | None = None
    """None when not known."""


_INT_TYPES = {"tinyint", "smallint", "mediumint", "int", "bigint"}
_TYPE_ALIASES = {"integer": "int", "bool": "tinyint", "boolean": "tinyint", "dec": "decimal",
                 "numeric": "decimal", "fixed": "decimal", "real": "double", "int1": "tinyint",
                 "int2": "smallint", "int3": "mediumint", "int4": "int", "int8": "bigint",
                 "middleint": "mediumint"}
_TYPE_SUFFIXES = {"UNSIGNED", "SIGNED", "ZEROFILL", "PRECISION", "VARYING"}


def _type_from_tokens(toks: Sequence[Token]) -> str:
    """The data type at the start of a column definition, normalised: lower case, integer
    display widths dropped, aliases resolved, ``decimal`` defaults spelled out; attributes
    after the type (NULL, DEFAULT, CHARACTER SET, COMMENT...) ignored."""
    return _parse_type(toks)[0]


def _parse_type(toks: Sequence[Token]) -> tuple[str, int]:
    """``_type_from_tokens`` plus the index of the first token after the type."""
    if not toks or toks[0].kind != "word":
        return "", 0
    base = toks[0].text.lower()
    base = _TYPE_ALIASES.get(base, base)
    i = 1
    args: list[str] = []
    if i < len(toks) and toks[i].kind == "punct" and toks[i].text == "(":
        depth, j = 0, i
        while j < len(toks):
            t = toks[j]
            if t.kind == "punct" and t.text == "(":
                depth += 1
            elif t.kind == "punct" and t.text == ")":
                depth -= 1
                if depth == 0:
                    break
            elif depth == 1 and not (t.kind == "punct" and t.text == ","):
                args.append(t.text.lower() if t.kind != "string" else t.text)
            j += 1
        i = j + 1
    suffixes = []
    while i < len(toks) and toks[i].upper in _TYPE_SUFFIXES:
        suffixes.append(toks[i].text.lower())
        i += 1
    if base == "double" and "precision" in suffixes:
        suffixes.remove("precision")
    if base == "char" and "varying" in suffixes:
        base = "varchar"
        suffixes.remove("varying")
    if "signed" in suffixes:
        suffixes.remove("signed")  # the default
    if "zerofill" in suffixes and "unsigned" not in suffixes:
        suffixes.append("unsigned")  # zerofill implies unsigned
    if base in _INT_TYPES:
        args = []
    elif base == "decimal":
        args = (args + ["10", "0"][len(args):]) if len(args) < 2 else args
    elif base in ("char", "binary") and not args:
        args = ["1"]
    text = base + (f"({','.join(args)})" if args else "")
    return " ".join([text, *sorted(set(suffixes))]), i


def normalise_type(sql_type: str) -> str:
    toks = [tokenize(sql_type)[i] for i in significant(tokenize(sql_type))]
    return _type_from_tokens(toks)


class TableShape:
    """What re-run detection needs to know about the target table: column names (with their
    types when known) and indexes (name -> columns). Names compare case-insensitively, as MySQL
    compares column and index names."""

    def __init__(self, columns: Iterable[ColumnDef | str], indexes: Mapping[str, Sequence[str]] | None = None,
                 primary_key: Sequence[str] = ()) -> None:
        cols: dict[str, str | None] = {}
        nullable: dict[str, bool | None] = {}
        for c in columns:
            col = ColumnDef(c) if isinstance(c, str) else c
            cols[col.name.casefold()] = normalise_type(col.sql_type) if col.sql_type else None
            nullable[col.name.casefold()] = col.nullable
        self.columns = cols
        self.nullable = nullable
        self.indexes = {k.casefold(): tuple(c.casefold() for c in v) for k, v in (indexes or {}).items()}
        self.primary_key = tuple(c.casefold() for c in primary_key)

    @classmethod
    def from_meta(cls, meta: TableMetaV1, indexes: Mapping[str, Sequence[str]] | None = None) -> TableShape:
        """From the metadata capture publishes; it has no index names, so pass them when known
        (``PRIMARY`` is added from the primary key)."""
        idx = dict(indexes or {})
        if meta.primary_key:
            idx.setdefault("PRIMARY", meta.primary_key)
        return cls([ColumnDef(c.name, c.sql_type, c.nullable) for c in meta.columns], idx, meta.primary_key)

    def __repr__(self) -> str:
        return (f"TableShape(columns={self.columns!r}, indexes={self.indexes!r}, "
                f"primary_key={self.primary_key!r})")


_A, _N, _U = RerunVerdict.ALREADY_APPLIED, RerunVerdict.NOT_APPLIED, RerunVerdict.UNKNOWN


def _split_top(toks: Sequence[Token], sep: str = ",") -> list[list[Token]]:
    parts: list[list[Token]] = [[]]
    depth = 0
    for t in toks:
        if t.kind == "punct" and t.text == "(":
            depth += 1
        elif t.kind == "punct" and t.text == ")":
            depth -= 1
        if depth == 0 and t.kind == "punct" and t.text == sep:
            parts.append([])
        else:
            parts[-1].append(t)
    return [p for p in parts if p]


def _paren_columns(toks: Sequence[Token]) -> tuple[str, ...] | None:
    """Columns of an index: ``(a, b(10), c DESC)`` -> ``(a, b, c)`` (casefolded)."""
    start = next((i for i, t in enumerate(toks) if t.kind == "punct" and t.text == "("), None)
    if start is None:
        return None
    depth, end = 0, None
    for j in range(start, len(toks)):
        t = toks[j]
        if t.kind == "punct" and t.text == "(":
            depth += 1
        elif t.kind == "punct" and t.text == ")":
            depth -= 1
            if depth == 0:
                end = j
                break
    if end is None:
        return None
    cols = []
    for part in _split_top(toks[start + 1:end]):
        if not part[0].is_ident:
            return None  # an expression index: we cannot compare it
        cols.append(part[0].value.casefold())
    return tuple(cols)


class _Spec:
    """One clause's tokens with a tiny cursor."""

    def __init__(self, toks: Sequence[Token]) -> None:
        self.toks = list(toks)
        self.i = 0

    def kw(self, ahead: int = 0) -> str:
        k = self.i + ahead
        return self.toks[k].upper if k < len(self.toks) else ""

    def accept(self, *words: str) -> bool:
        if all(self.kw(k) == w for k, w in enumerate(words)):
            self.i += len(words)
            return True
        return False

    def accept_any(self, *words: str) -> bool:
        if self.kw() in words:
            self.i += 1
            return True
        return False

    def ident(self) -> str | None:
        if self.i < len(self.toks) and self.toks[self.i].is_ident:
            self.i += 1
            return self.toks[self.i - 1].value
        return None

    def rest(self) -> list[Token]:
        return self.toks[self.i:]

    def next_is_paren(self) -> bool:
        return self.i < len(self.toks) and self.toks[self.i].kind == "punct" and self.toks[self.i].text == "("


def _column_added(shape: TableShape, col_def: Sequence[Token]) -> RerunCheck:
    if not col_def or not col_def[0].is_ident:
        return RerunCheck(_U, "cannot read the column definition")
    name = col_def[0].value
    have = shape.columns.get(name.casefold(), "absent")
    if have == "absent":
        return RerunCheck(_N, f"column {name} does not exist")
    want = _type_from_tokens(col_def[1:])
    if have is None or have == want:
        return RerunCheck(_A, f"column {name} exists")
    return RerunCheck(_U, f"column {name} exists as {have}, the DDL adds it as {want}")


def _column_modified(shape: TableShape, old: str, col_def: Sequence[Token]) -> RerunCheck:
    if not col_def or not col_def[0].is_ident:
        return RerunCheck(_U, "cannot read the column definition")
    new = col_def[0].value
    want = _type_from_tokens(col_def[1:])
    old_present = old.casefold() in shape.columns
    if old.casefold() != new.casefold():
        new_type = shape.columns.get(new.casefold(), "absent")
        if old_present and new_type == "absent":
            return RerunCheck(_N, f"column {old} is not yet renamed to {new}")
        if not old_present and new_type != "absent" and (new_type is None or new_type == want):
            return RerunCheck(_A, f"column {old} is already {new} {want}")
        return RerunCheck(_U, f"columns {old} and {new}: state does not match either side of the change")
    if not old_present:
        return RerunCheck(_U, f"column {old} does not exist")
    have = shape.columns[old.casefold()]
    # MODIFY and CHANGE of a column to its own name can always run again without harm, so
    # anything we cannot prove already in effect is "not applied" (run it), never "unknown".
    if have is None:
        return RerunCheck(_N, f"type of column {old} is not known; running the change again is harmless")
    if have != want:
        return RerunCheck(_N, f"column {old} is {have}, not {want}")
    untracked = _untracked_attributes(col_def, shape.nullable.get(old.casefold()))
    if untracked:
        return RerunCheck(_N, f"column {old} is already {want}, but {untracked} is not tracked; "
                              "running the change again is harmless")
    return RerunCheck(_A, f"column {old} is already {want}")


def _untracked_attributes(col_def: Sequence[Token], nullable: bool | None) -> str:
    """The first attribute of a column definition (after name and type) whose effect on the
    target we cannot see, or "" when there is none (NULL/NOT NULL matching ``nullable``)."""
    _, end = _parse_type(col_def[1:])
    rest = [t.upper or t.text for t in col_def[1 + end:]]
    if rest == ["NOT", "NULL"]:
        return "" if nullable is False else "NOT NULL"
    if rest in (["NULL"], []):  # no NULL clause means NULL: MODIFY resets it
        return "" if nullable is True else "NULL"
    return " ".join(rest)


def _index_added(shape: TableShape, name: str | None, rest: Sequence[Token]) -> RerunCheck:
    cols = _paren_columns(rest)
    if name is not None:
        have = shape.indexes.get(name.casefold())
        if have is None:
            return RerunCheck(_N, f"index {name} does not exist")
        if cols is None or have == cols:
            return RerunCheck(_A, f"index {name} exists")
        return RerunCheck(_U, f"index {name} exists on ({', '.join(have)}), "
                              f"the DDL wants ({', '.join(cols)})")
    if cols is None:
        return RerunCheck(_U, "cannot read the index columns")
    # An unnamed index is named by MySQL after its first column; look it up by its columns.
    if any(v == cols for v in shape.indexes.values()):
        return RerunCheck(_A, f"an index on ({', '.join(cols)}) exists")
    return RerunCheck(_N, f"no index on ({', '.join(cols)})")


def _primary_added(shape: TableShape, rest: Sequence[Token]) -> RerunCheck:
    cols = _paren_columns(rest)
    if cols is None:
        return RerunCheck(_U, "cannot read the primary-key columns")
    if shape.primary_key == cols:
        return RerunCheck(_A, "the primary key is already in place")
    if not shape.primary_key:
        return RerunCheck(_N, "the table has no primary key")
    return RerunCheck(_U, f"the table has another primary key ({', '.join(shape.primary_key)})")


def _alter_clause(shape: TableShape, toks: Sequence[Token]) -> RerunCheck:
    s = _Spec(toks)
    if s.accept("ADD"):
        if s.accept("COLUMN"):
            s.accept("IF", "NOT", "EXISTS")
            if s.next_is_paren():
                inner = s.rest()[1:-1]
                return _combine([_column_added(shape, d) for d in _split_top(inner)])
            return _column_added(shape, s.rest())
        if s.kw() in ("INDEX", "KEY", "UNIQUE", "FULLTEXT", "SPATIAL", "CONSTRAINT", "PRIMARY"):
            name = None
            if s.accept("CONSTRAINT"):
                if s.kw() not in ("PRIMARY", "UNIQUE", "FOREIGN", "CHECK"):
                    name = s.ident()
            if s.accept("PRIMARY", "KEY"):
                return _primary_added(shape, s.rest())
            if s.kw() in ("FOREIGN", "CHECK"):
                return RerunCheck(_U, "foreign keys and checks are not tracked")
            s.accept_any("UNIQUE", "FULLTEXT", "SPATIAL")
            s.accept_any("INDEX", "KEY")
            s.accept("IF", "NOT", "EXISTS")
            if not s.next_is_paren() and s.kw() != "USING":
                name = s.ident() or name
            return _index_added(shape, name, s.rest())
        if s.kw() in ("FOREIGN", "CHECK", "PARTITION", "PERIOD", "SYSTEM"):
            return RerunCheck(_U, f"ADD {s.kw()} is not tracked")
        s.accept("IF", "NOT", "EXISTS")
        if s.next_is_paren():
            return _combine([_column_added(shape, d) for d in _split_top(s.rest()[1:-1])])
        return _column_added(shape, s.rest())
    if s.accept("DROP"):
        if s.accept("PRIMARY", "KEY"):
            return RerunCheck(_N, "the primary key exists") if shape.primary_key \
                else RerunCheck(_A, "the table has no primary key")
        if s.accept("INDEX") or s.accept("KEY"):
            s.accept("IF", "EXISTS")
            name = s.ident()
            if name is None:
                return RerunCheck(_U, "cannot read the index name")
            return RerunCheck(_N, f"index {name} exists") if name.casefold() in shape.indexes \
                else RerunCheck(_A, f"index {name} is gone")
        if s.kw() in ("FOREIGN", "CONSTRAINT", "CHECK", "PARTITION", "PERIOD", "SYSTEM"):
            return RerunCheck(_U, f"DROP {s.kw()} is not tracked")
        s.accept("COLUMN")
        s.accept("IF", "EXISTS")
        name = s.ident()
        if name is None:
            return RerunCheck(_U, "cannot read the column name")
        return RerunCheck(_N, f"column {name} exists") if name.casefold() in shape.columns \
            else RerunCheck(_A, f"column {name} is gone")
    if s.accept("MODIFY"):
        s.accept("COLUMN")
        s.accept("IF", "EXISTS")
        rest = s.rest()
        if not rest or not rest[0].is_ident:
            return RerunCheck(_U, "cannot read the column definition")
        return _column_modified(shape, rest[0].value, rest)
    if s.accept("CHANGE"):
        s.accept("COLUMN")
        s.accept("IF", "EXISTS")
        old = s.ident()
        if old is None:
            return RerunCheck(_U, "cannot read the column name")
        return _column_modified(shape, old, s.rest())
    if s.accept("RENAME"):
        kind = "column" if s.accept("COLUMN") else "index" if (s.accept("INDEX") or s.accept("KEY")) else ""
        if not kind:
            return RerunCheck(_U, "renaming the table is not tracked")
        old = s.ident()
        if old is None or not s.accept("TO"):
            return RerunCheck(_U, f"cannot read the {kind} rename")
        new = s.ident()
        if new is None:
            return RerunCheck(_U, f"cannot read the {kind} rename")
        names = shape.columns if kind == "column" else shape.indexes
        old_in, new_in = old.casefold() in names, new.casefold() in names
        if not old_in and new_in:
            return RerunCheck(_A, f"{kind} {old} is already named {new}")
        if old_in and not new_in:
            return RerunCheck(_N, f"{kind} {old} is not yet renamed")
        return RerunCheck(_U, f"{kind}s {old} and {new}: state does not match either side of the rename")
    word = s.kw() or (s.toks[0].text if s.toks else "")
    return RerunCheck(_U, f"{word or 'this'} clause is not tracked")


def _combine(checks: Sequence[RerunCheck]) -> RerunCheck:
    if not checks:
        return RerunCheck(_U, "nothing to check")
    verdicts = {c.verdict for c in checks}
    reasons = "; ".join(c.reason for c in checks)
    if verdicts == {_A}:
        return RerunCheck(_A, reasons)
    if verdicts == {_N}:
        return RerunCheck(_N, reasons)
    return RerunCheck(_U, reasons)


def check_applied(sql: str, shape: TableShape | None) -> RerunCheck:
    """Is ``sql`` (already rewritten to the target) in effect on the target table described by
    ``shape`` (None: the table does not exist)? See the module doc for the meaning."""
    tokens = tokenize(sql)
    if any(not t.closed for t in tokens):
        return RerunCheck(_U, "unterminated quote or comment in the statement")
    sig = [tokens[i] for i in significant(tokens)]
    while sig and sig[-1].kind == "punct" and sig[-1].text == ";":
        sig.pop()
    cur = _Spec(sig)
    if cur.accept("ALTER"):
        while cur.kw() in ("ONLINE", "OFFLINE", "IGNORE"):
            cur.i += 1
        if not cur.accept("TABLE"):
            return RerunCheck(_U, "only ALTER TABLE is tracked")
        cur.accept("IF", "EXISTS")
        if cur.ident() is None:
            return RerunCheck(_U, "cannot read the table name")
        if cur.i < len(sig) and sig[cur.i].kind == "punct" and sig[cur.i].text == ".":
            cur.i += 1
            cur.ident()
        if shape is None:
            return RerunCheck(_U, "the target table does not exist")
        clauses = _split_top(cur.rest())
        if not clauses:
            return RerunCheck(_U, "ALTER TABLE without clauses")
        return _combine([_alter_clause(shape, c) for c in clauses])
    if cur.accept("CREATE"):
        cur.accept("OR", "REPLACE")
        if cur.kw() == "OR":
            return RerunCheck(_U, "cannot read the CREATE statement")
        while cur.kw() in ("ONLINE", "OFFLINE", "TEMPORARY"):
            cur.i += 1
        if cur.accept("TABLE"):
            return (RerunCheck(_A, "the table exists") if shape is not None
                    else RerunCheck(_N, "the table does not exist"))
        cur.accept_any("UNIQUE", "FULLTEXT", "SPATIAL")
        if cur.accept("INDEX"):
            cur.accept("IF", "NOT", "EXISTS")
            name = cur.ident()
            if shape is None:
                return RerunCheck(_U, "the target table does not exist")
            return _index_added(shape, name, cur.rest())
        return RerunCheck(_U, "only CREATE TABLE and CREATE INDEX are tracked")
    if cur.accept("DROP"):
        cur.accept("TEMPORARY")
        if cur.accept("TABLE"):
            return (RerunCheck(_A, "the table is gone") if shape is None
                    else RerunCheck(_N, "the table exists"))
        if cur.accept("INDEX"):
            while cur.kw() in ("ONLINE", "OFFLINE"):
                cur.i += 1
            cur.accept("IF", "EXISTS")
            name = cur.ident()
            if name is None or shape is None:
                return RerunCheck(_U, "cannot check the index")
            return (RerunCheck(_N, f"index {name} exists") if name.casefold() in shape.indexes
                    else RerunCheck(_A, f"index {name} is gone"))
    return RerunCheck(_U, "statement kind is not tracked")
