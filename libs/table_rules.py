"""A changefeed's table rules (``TableRuleV1``): which events and rows of a table are left out,
which columns reach the downstream and which computed ones it gains.

Plain logic, no I/O and no Spark: the api checks a spec with it, the sink-worker compiles the
rules of each table with it and rewrites the target's metadata. The expressions themselves are
Spark SQL, evaluated by the apply job (``services.sink_worker.round.row_rules``); here they are only
checked to parse (``expression_problem``), so a typo is refused when the changefeed is created
rather than when its first row arrives. Whether an expression's columns exist is known only
with the table's metadata: the sink-worker asks Spark's analyser when it plans the table, and
stops the table with the analyser's message if not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from contracts.events.changefeeds import ComputedType, TableRuleV1
from contracts.events.rows import ColumnKind, ColumnV1, TableMetaV1, meta_with, shape_of
from libs.table_filter import RoutingConfigError, TableFilter

ROW_EVENTS = ("insert", "update", "delete")
EXPRESSION_FIELDS = ("ignore_insert_value_expr", "ignore_update_old_value_expr",
                     "ignore_update_new_value_expr", "ignore_delete_value_expr")

_COMPUTED_COLUMN: dict[ComputedType, tuple[ColumnKind, str]] = {
    "string": ("string", "text"),
    "int": ("int", "bigint"),
    "float": ("float", "double"),
}


class TableRulesError(ValueError):
    """A table's rules do not fit its metadata (a key column dropped, an unknown column)."""


@dataclass(frozen=True)
class ComputedColumn:
    name: str
    expr: str
    type: ComputedType

    def column(self) -> ColumnV1:
        kind, sql_type = _COMPUTED_COLUMN[self.type]
        return ColumnV1(name=self.name, kind=kind, sql_type=sql_type, nullable=True)


@dataclass(frozen=True)
class TableRules:
    """The rules matching one table, combined (see ``TableRuleV1``)."""

    ignore_events: frozenset[str] = frozenset()
    insert_expr: str | None = None
    update_old_expr: str | None = None
    update_new_expr: str | None = None
    delete_expr: str | None = None
    keep: tuple[str, ...] | None = None
    drop: frozenset[str] = frozenset()
    computed: tuple[ComputedColumn, ...] = field(default=())

    @property
    def expressions(self) -> dict[str, str]:
        """Each row event's expressions by role: ``insert``, ``update_old``, ``update_new``, ``delete``."""
        found = {"insert": self.insert_expr, "update_old": self.update_old_expr,
                 "update_new": self.update_new_expr, "delete": self.delete_expr}
        return {role: e for role, e in found.items() if e is not None}

    @property
    def needs_spark(self) -> bool:
        """Rows of the table must go through an expression (a filter or a computed column)."""
        return bool(self.expressions or self.computed)

    def ignores(self, event: str) -> bool:
        return event in self.ignore_events

    def kept(self, name: str) -> bool:
        """Whether the source column ``name`` reaches the downstream."""
        return name not in self.drop and (self.keep is None or name in self.keep)

    def rewrite_meta(self, meta: TableMetaV1, *, strict: bool = False) -> TableMetaV1:
        """The target's view of the table: columns left out, computed ones added. Raises
        ``TableRulesError`` when a key column would be left out, and with ``strict`` (the
        creation check) when a kept or dropped column is unknown: at run time a dropped column
        may have gone upstream since (ALTER TABLE ... DROP COLUMN), which is no reason to stop."""
        names = {c.name for c in meta.columns}
        unknown = sorted((set(self.keep or ()) | self.drop) - names)
        if unknown and strict:
            raise TableRulesError(f"table rules name columns the table does not have: {', '.join(unknown)}")
        keys = set(meta.primary_key)
        lost = sorted(k for k in keys if not self.kept(k))
        if lost:
            raise TableRulesError(f"key column(s) {', '.join(lost)} cannot be dropped: the downstream finds "
                                  "each row by its key")
        clash = sorted(c.name for c in self.computed if c.name in names and self.kept(c.name))
        if clash:
            raise TableRulesError(f"computed column(s) {', '.join(clash)} already exist in the table; "
                                  "choose another name or drop the source column")
        columns = [c for c in meta.columns if self.kept(c.name)]
        columns += [c.column() for c in self.computed]
        uniques = [uk for uk in meta.unique_keys if all(self.kept(c) for c in uk)]
        # The shape stays whole: an index over a column left out is not created downstream.
        return meta_with(shape_of(meta), columns=columns, primary_key=list(meta.primary_key),
                         unique_keys=uniques)


NO_RULES = TableRules()


def _either(a: str | None, b: str | None) -> str | None:
    if a is None or b is None:
        return a or b
    return f"({a}) OR ({b})"


def rules_for(rules: Sequence[TableRuleV1], database: str, table: str) -> TableRules:
    """The combined rules of every rule matching ``database.table`` (``NO_RULES`` when none)."""
    out = NO_RULES
    for rule in rules:
        if not _matches(rule, database, table):
            continue
        if rule.keep_columns is not None and out.keep is not None:
            raise TableRulesError(f"{database}.{table}: two table rules set keep_columns; only one may")
        out = TableRules(
            ignore_events=out.ignore_events | frozenset(rule.ignore_events),
            insert_expr=_either(out.insert_expr, rule.ignore_insert_value_expr),
            update_old_expr=_either(out.update_old_expr, rule.ignore_update_old_value_expr),
            update_new_expr=_either(out.update_new_expr, rule.ignore_update_new_value_expr),
            delete_expr=_either(out.delete_expr, rule.ignore_delete_value_expr),
            keep=tuple(rule.keep_columns) if rule.keep_columns is not None else out.keep,
            drop=out.drop | frozenset(rule.drop_columns),
            computed=out.computed + tuple(ComputedColumn(c.name, c.expr, c.type) for c in rule.computed))
    return out


def _matches(rule: TableRuleV1, database: str, table: str) -> bool:
    return TableFilter(tuple(rule.tables), ()).selected(database, table)


# -- checks without metadata (the api's, at create/update) ----------------------------------------

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*")
  | (?P<quoted>`(?:[^`]|``)+`)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[A-Za-z]{0,2})
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<open>[(\[])
  | (?P<close>[)\]])
  | (?P<comma>,)
  | (?P<dot>\.)
  | (?P<op><=>|->|==|!=|<>|<=|>=|\|\||[=<>+\-*/%&|^~!:])
""", re.VERBOSE)

# Words that join or modify operands (never an operand themselves).
_CONNECTIVES = frozenset("""and or not is in like ilike rlike regexp between case when then else end
as distinct div interval escape from for""".split())
# Words a string literal may follow: typed literals (DATE '2026-01-01').
_TYPED_LITERALS = frozenset({"date", "timestamp", "timestamp_ntz", "timestamp_ltz", "x"})
_UNITS = frozenset("""year years month months week weeks day days hour hours minute minutes second
seconds millisecond milliseconds microsecond microseconds""".split())
_FORBIDDEN = frozenset({"select", "insert", "update", "delete", "drop", "create", "alter", "union"})


def expression_problem(expr: str) -> str | None:
    """Why ``expr`` is not a Spark SQL expression (None: it parses as far as can be told without
    Spark). Deterministic and strict about structure: every string and quoted name closed,
    parentheses balanced, no statement, and operands and operators alternate."""
    pos, depth = 0, 0
    last_word = ""
    prev = "start"  # kind of the previous significant token: start, operand, operator, open, close, comma
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            bad = expr[pos]
            if bad in "'\"`":
                return f"unterminated {'string' if bad != '`' else 'quoted name'} at position {pos}"
            return f"unexpected character {bad!r} at position {pos}"
        pos = m.end()
        kind = m.lastgroup
        text = m.group()
        if kind == "space":
            continue
        if kind == "word":
            lower = text.lower()
            if lower in _FORBIDDEN:
                return f"{text!r} at position {m.start()}: an expression, not a statement, is expected"
            if lower in _CONNECTIVES:
                kind = "connective"
            elif lower in _UNITS and prev == "operand":
                continue  # INTERVAL 1 DAY
        if kind == "string" and prev == "operand" and last_word in _TYPED_LITERALS:
            last_word = ""
            continue
        last_word = text.lower() if kind == "word" else ""
        if kind in ("string", "quoted", "number", "word"):
            if prev == "close" and kind == "word" and text.lower() in _UNITS:
                continue
            if prev in ("operand", "close"):
                return f"{text!r} at position {m.start()} follows an operand without an operator"
            prev = "operand"
        elif kind == "open":
            depth += 1
            prev = "open"
        elif kind == "close":
            depth -= 1
            if depth < 0:
                return f"unbalanced {text!r} at position {m.start()}"
            if prev in ("operator", "comma"):
                return f"')' at position {m.start()} follows an operator"
            prev = "close"
        elif kind == "comma":
            if depth == 0:
                return f"',' at position {m.start()} outside a function call"
            if prev in ("operator", "comma", "open", "start"):
                return f"',' at position {m.start()} follows no operand"
            prev = "comma"
        elif kind == "dot":
            if prev != "operand":
                return f"'.' at position {m.start()} follows no name"
            prev = "operator"
        elif kind == "connective":
            prev = "operator" if m.group().lower() not in ("end",) else "close"
        else:  # op
            if text == "*" and prev == "open":
                prev = "operand"  # count(*)
                continue
            if text in ("-", "+", "~", "!") and prev in ("start", "operator", "open", "comma"):
                prev = "operator"  # unary
                continue
            if prev in ("start", "operator", "open", "comma"):
                return f"operator {text!r} at position {m.start()} has no left operand"
            prev = "operator"
    if depth > 0:
        return "unbalanced '(' or '[': a bracket is not closed"
    if prev == "start":
        return "the expression is empty"
    if prev in ("operator", "comma"):
        return "the expression ends with an operator"
    return None


def rule_problems(rules: Sequence[TableRuleV1], initial_load: str = "binlog-only") -> list[str]:
    """Every problem the rules show without any table's metadata."""
    out: list[str] = []
    for i, rule in enumerate(rules):
        label = f"table_rules[{i}] ({', '.join(rule.tables)})"
        if rule.computed and initial_load != "binlog-only":
            out.append(f"{label}: computed columns need initial_load binlog-only: a copy of the table "
                       "reads rows with SQL on the source and cannot compute them")
        try:
            TableFilter(tuple(rule.tables), ())
        except RoutingConfigError as exc:
            out.append(f"{label}: {exc}")
        for name in EXPRESSION_FIELDS:
            expr = getattr(rule, name)
            if expr is not None and (problem := expression_problem(expr)) is not None:
                out.append(f"{label}: {name} {expr!r} does not parse: {problem}")
        for computed in rule.computed:
            if (problem := expression_problem(computed.expr)) is not None:
                out.append(f"{label}: computed column {computed.name} {computed.expr!r} does not parse: "
                           f"{problem}")
        names = [c.name for c in rule.computed]
        if len(set(names)) != len(names):
            out.append(f"{label}: computed column names repeat")
        if rule.keep_columns is not None and set(rule.keep_columns) & set(rule.drop_columns):
            out.append(f"{label}: columns both kept and dropped: "
                       f"{', '.join(sorted(set(rule.keep_columns) & set(rule.drop_columns)))}")
    return out


def table_problems(rules: Sequence[TableRuleV1], database: str, table: str, meta: TableMetaV1) -> list[str]:
    """Problems of the rules with one table's metadata: key columns dropped, unknown columns in
    keep/drop. (Columns inside expressions: the sink-worker's Spark analysis.)"""
    try:
        rules_for(rules, database, table).rewrite_meta(meta, strict=True)
    except TableRulesError as exc:
        return [f"{database}.{table}: {exc}"]
    return []


# -- checks with a table's columns (the api's creation checks, against the source) ---------------

# Words of an expression that name no column: literals, niladic functions, type names after AS.
_NOT_COLUMNS = frozenset("""true false null current_date current_timestamp current_user current_timezone
current_catalog current_database current_schema localtimestamp user session_user""".split())


def expression_names(expr: str) -> set[str]:
    """The column names ``expr`` reads, as far as can be told without Spark: bare and backquoted
    names that are not a function being called, a keyword, a literal, a unit, a type after AS or
    a struct field after a dot. An expression with a lambda (``x -> ...``) reads names of its
    own: none are reported for it, rather than a false one."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr) if m.lastgroup != "space"]
    if any(kind == "op" and text == "->" for kind, text in tokens):
        return set()
    names: set[str] = set()
    for i, (kind, text) in enumerate(tokens):
        before = tokens[i - 1] if i else ("start", "")
        after = tokens[i + 1] if i + 1 < len(tokens) else ("end", "")
        if kind == "quoted":
            if before[0] != "dot":
                names.add(text[1:-1].replace("``", "`"))
            continue
        if kind != "word":
            continue
        lower = text.lower()
        if (after[0] == "open" or before[0] == "dot" or before[1].lower() == "as"
                or lower in _CONNECTIVES or lower in _UNITS or lower in _FORBIDDEN or lower in _NOT_COLUMNS
                or (lower in _TYPED_LITERALS and after[0] == "string")):
            continue
        names.add(text)
    return names


def rule_column_problems(rules: Sequence[TableRuleV1], where: str, database: str, table: str,
                         meta: TableMetaV1) -> list[str]:
    """Each rule matching ``database.table`` checked against the table's columns, naming the
    rule and the column: unknown columns in an expression, keep_columns or drop_columns, and
    key columns dropped. ``where`` names the table's source for the message."""
    columns = {c.name.lower() for c in meta.columns}
    keys = set(meta.primary_key)
    out: list[str] = []
    for i, rule in enumerate(rules):
        if not _matches(rule, database, table):
            continue
        label = f"table_rules[{i}] ({', '.join(rule.tables)})"
        computed = {c.name.lower() for c in rule.computed}
        for name in EXPRESSION_FIELDS:
            expr = getattr(rule, name)
            unknown = sorted(n for n in expression_names(expr or "") if n.lower() not in columns | computed)
            if unknown:
                out.append(f"{label}: {name} reads column(s) {', '.join(unknown)}, which {database}.{table} "
                           f"of {where} does not have")
        for c in rule.computed:
            unknown = sorted(n for n in expression_names(c.expr) if n.lower() not in columns)
            if unknown:
                out.append(f"{label}: computed column {c.name} reads column(s) {', '.join(unknown)}, which "
                           f"{database}.{table} of {where} does not have")
        for field_name, given in (("drop_columns", rule.drop_columns),
                                  ("keep_columns", rule.keep_columns or [])):
            unknown = sorted(n for n in given if n.lower() not in columns)
            if unknown:
                out.append(f"{label}: {field_name} names column(s) {', '.join(unknown)}, which "
                           f"{database}.{table} of {where} does not have")
        dropped = sorted(k for k in keys if k in rule.drop_columns
                         or (rule.keep_columns is not None and k not in rule.keep_columns))
        if dropped:
            out.append(f"{label}: leaves out key column(s) {', '.join(dropped)} of {database}.{table} "
                       f"({where}): the downstream finds each row by its key")
    return out
