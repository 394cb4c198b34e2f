"""Shard routing: which downstream table each upstream table lands in, and the checks a
changefeed's routing must pass before it is accepted.

Plain logic, no I/O. The words:

- a *table* is ``TableRef(source, schema, table)``: one upstream table of one source;
- a *route rule* maps tables matched by its source/schema/table patterns to one target
  ``Target(schema, table)`` (``target_table=None`` keeps the upstream table name, DM's
  schema-level rule);
- the *table filter* decides which tables a changefeed replicates at all;
- a *shard group* is every table routed to one target: those tables are merged there, and a
  schema change must reach the target once for all of them (``libs.shard_ddl``).

Patterns, in rules and in the filter: a glob (``fnmatch`` syntax, case-sensitive like MySQL
names on Linux), or a regular expression when the text starts with ``~`` (DM's convention),
which must match the whole name. Rule patterns match one name part each, so a dot inside a
name is just a character; filter patterns match ``schema.table`` as a whole. ``TableFilter`` is
the one filter implementation: span discovery (``changefeeds.table_selected``) uses it too.

Choices written down:

- A selected table that no rule matches goes to the same schema/table downstream (identity
  route), which is what a changefeed without rules does today. Such a table still joins the
  shard group of a rule whose target has its name.
- One table matched by several rules with *different* targets is an error, at validation time
  (``overlapping_routes``) and again in ``route`` for a table that appears later: guessing
  which rule wins would silently merge a table into the wrong target. Several rules agreeing on
  the target are fine.
- Shards of one target must have the same primary-key columns (names compared like MySQL
  compares column names: case-insensitively) with the same kind and SQL type (integer display
  widths ignored). A looser rule (``int`` into ``bigint``) would be safe for some pairs, but
  the downstream table is created from one shard's metadata and the other shard's values
  must fit it, so anything not equal is refused with the two definitions in the message.
- The optional origin column (Debezium's ``__dbz__physicalTableIdentifier`` idea) holds
  ``source/schema/table`` of the row's upstream table. With it the target key becomes
  ``(origin, *shard key)``, and so does every unique key: otherwise a REPLACE-style upsert of
  one shard's row would delete another shard's row holding the same unique value.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from contracts.events.changefeeds import ChangefeedSpec, TableRuleV1, current_spec
from contracts.events.rows import ColumnV1, IndexPartV1, RowImageV2, TableMetaV1, meta_with, shape_of
from libs.table_filter import NamePattern, RoutingConfigError, TableFilter
from libs.table_rules import rule_problems, rules_for, table_problems

__all__ = [
    "AmbiguousRouteError",
    "NamePattern",
    "OriginColumn",
    "ProblemKind",
    "RouteRule",
    "Router",
    "RoutingConfigError",
    "RoutingProblem",
    "RoutingValidationError",
    "ShardGroup",
    "TableFilter",
    "TableRef",
    "Target",
    "primary_key_signature",
    "rewrite_meta",
    "rewrite_row",
    "router_for",
    "validate_spec",
    "with_origin",
]


class TableRef(NamedTuple):
    """One upstream table. A NamedTuple so it is a cheap, ordered dict key."""

    source: str
    schema: str
    table: str

    def __str__(self) -> str:
        return f"{self.source}:{self.schema}.{self.table}"


class Target(NamedTuple):
    """One downstream table (the sink decides what ``schema`` means, see ``TargetTable``)."""

    schema: str
    table: str

    def __str__(self) -> str:
        return f"{self.schema}.{self.table}"


class AmbiguousRouteError(ValueError):
    """A table matched by rules with different targets."""

    def __init__(self, ref: TableRef, rules: Sequence[RouteRule], targets: Sequence[Target]) -> None:
        listed = "; ".join(f"rule {r.label} -> {t}" for r, t in zip(rules, targets, strict=True))
        super().__init__(f"table {ref} is matched by routes with different targets: {listed}; "
                         "narrow the patterns so each table has one target")
        self.ref = ref
        self.rules = tuple(rules)
        self.targets = tuple(targets)


# -- rules ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RouteRule:
    """Tables matching ``source``/``schema``/``table`` go to ``target_schema``.``target_table``.

    ``target_table=None`` keeps each table's own name (a schema-level merge: ``shop_*.*`` into
    ``shop.*``). ``name`` labels the rule in messages; by default its patterns are shown.
    """

    schema: str
    table: str = "*"
    target_schema: str = ""
    target_table: str | None = None
    source: str = "*"
    name: str = ""
    _patterns: tuple[NamePattern, NamePattern, NamePattern] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.target_schema:
            raise RoutingConfigError(f"route {self.label}: target_schema must not be empty")
        if self.target_table is not None and not self.target_table:
            raise RoutingConfigError(f"route {self.label}: target_table must be a name or omitted")
        object.__setattr__(self, "_patterns",
                           (NamePattern(self.source), NamePattern(self.schema), NamePattern(self.table)))

    @property
    def label(self) -> str:
        return self.name or f"{self.source}:{self.schema}.{self.table}"

    def matches(self, ref: TableRef) -> bool:
        src, sch, tbl = self._patterns
        return src.matches(ref.source) and sch.matches(ref.schema) and tbl.matches(ref.table)

    def target_for(self, ref: TableRef) -> Target:
        return Target(self.target_schema, self.target_table if self.target_table is not None else ref.table)

    @property
    def fixed_target(self) -> bool:
        """Every matched table lands in one target (the rule *is* a merge)."""
        return self.target_table is not None


# -- origin column --------------------------------------------------------------------------------

def _escape_part(part: str) -> str:
    # '%' first, so the escape itself stays unambiguous; '/' is the separator.
    return part.replace("%", "%25").replace("/", "%2F")


@dataclass(frozen=True)
class OriginColumn:
    """The extra column that records each row's upstream table in the merged target.

    The value is ``source/schema/table`` with ``%`` and ``/`` percent-escaped in each part, so
    two different upstream tables can never share a value (which would bring the key
    collisions back) and ordinary names stay readable.
    """

    name: str = "_sluice_origin"
    width: int = 255

    def __post_init__(self) -> None:
        if not self.name:
            raise RoutingConfigError("origin column name must not be empty")
        if self.width < 1:
            raise RoutingConfigError("origin column width must be positive")

    def value(self, ref: TableRef) -> str:
        return "/".join(_escape_part(p) for p in ref)

    def column(self) -> ColumnV1:
        # NOT NULL: it is part of the target key.
        return ColumnV1(name=self.name, kind="string", sql_type=f"varchar({self.width})", nullable=False)


def rewrite_meta(meta: TableMetaV1, origin: OriginColumn) -> TableMetaV1:
    """The shard's metadata as the merged target sees it: origin column first, in every key.

    A table without a primary key keeps an empty one (the origin alone identifies nothing); its
    unique keys still gain the origin so the key policy can pick one of them.
    """
    if any(c.name.casefold() == origin.name.casefold() for c in meta.columns):
        raise RoutingConfigError(f"origin column {origin.name!r} collides with a column of the table")
    shape = shape_of(meta)
    if shape is not None:
        # Each unique index gains the origin too: shards may hold the same values there.
        shape = shape.model_copy(update={"indexes": [
            i.model_copy(update={"parts": [IndexPartV1(column=origin.name), *i.parts]}) if i.unique else i
            for i in shape.indexes]})
    return meta_with(
        shape,
        columns=[origin.column(), *meta.columns],
        primary_key=[origin.name, *meta.primary_key] if meta.primary_key else [],
        unique_keys=[[origin.name, *uk] for uk in meta.unique_keys],
    )


def with_origin(values: Mapping[str, object], origin: OriginColumn, ref: TableRef) -> dict[str, object]:
    return {origin.name: origin.value(ref), **values}


def rewrite_row(row: RowImageV2, origin: OriginColumn, ref: TableRef) -> RowImageV2:
    """The row image with the origin value in both images (before and after, when present), so
    a delete or key-changing update finds the right shard's row downstream."""
    return RowImageV2(
        op=row.op,
        before=with_origin(row.before, origin, ref) if row.before is not None else None,
        after=with_origin(row.after, origin, ref) if row.after is not None else None,
    )


# -- key compatibility ----------------------------------------------------------------------------

_INT_WIDTH = re.compile(r"^(tinyint|smallint|mediumint|int|integer|bigint)\s*\(\s*\d+\s*\)")


def _normalise_sql_type(sql_type: str) -> str:
    t = " ".join(sql_type.lower().split())
    # int(11) and int are the same type; MySQL 8 stopped printing display widths.
    t = _INT_WIDTH.sub(lambda m: m.group(1), t)
    return "int" + t[len("integer"):] if t.startswith("integer") else t


def primary_key_signature(meta: TableMetaV1) -> tuple[tuple[str, str, str], ...]:
    """``(name casefolded, kind, normalised sql type)`` of each primary-key column, sorted by
    name: two shards merge safely when their signatures are equal."""
    cols = {c.name.casefold(): c for c in meta.columns}
    sig = []
    for name in meta.primary_key:
        col = cols.get(name.casefold())
        kind, sql = (col.kind, _normalise_sql_type(col.sql_type)) if col else ("?", "?")
        sig.append((name.casefold(), kind, sql))
    return tuple(sorted(sig))


def _describe_key(meta: TableMetaV1) -> str:
    if not meta.primary_key:
        return "no primary key"
    cols = {c.name.casefold(): c for c in meta.columns}
    parts = []
    for name in meta.primary_key:
        col = cols.get(name.casefold())
        parts.append(f"{name} {col.sql_type}" if col else f"{name} (missing column)")
    return "(" + ", ".join(parts) + ")"


# -- validation -----------------------------------------------------------------------------------

ProblemKind = Literal["overlapping_routes", "empty_route", "incompatible_keys", "origin_column_collision",
                      "origin_value_too_long", "invalid_rule", "invalid_table_rule"]


@dataclass(frozen=True)
class RoutingProblem:
    kind: ProblemKind
    message: str
    tables: tuple[TableRef, ...] = ()
    rules: tuple[str, ...] = ()


class RoutingValidationError(ValueError):
    """The routing of a changefeed is refused; ``problems`` lists every reason, not just the first."""

    def __init__(self, problems: Sequence[RoutingProblem]) -> None:
        lines = "\n".join(f"- {p.message}" for p in problems)
        super().__init__(f"routing refused ({len(problems)} problem(s)):\n{lines}")
        self.problems = tuple(problems)


@dataclass(frozen=True)
class ShardGroup:
    """Every table routed to one target, sorted. ``sharded`` when more than one: only then does a
    DDL need the shard lock."""

    target: Target
    shards: tuple[TableRef, ...]

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1


class Router:
    """The routing of one changefeed: filter, rules and the optional origin column."""

    def __init__(self, rules: Sequence[RouteRule] = (), table_filter: TableFilter | None = None,
                 origin: OriginColumn | None = None, table_rules: Sequence[TableRuleV1] = ()) -> None:
        self.rules = tuple(rules)
        self.filter = table_filter or TableFilter()
        self.origin = origin
        self.table_rules = tuple(table_rules)
        """The changefeed's table rules (``libs.table_rules``): events, rows and columns left out."""
        self._table_rules_key = tuple(r.model_dump_json() for r in self.table_rules)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Router):
            return NotImplemented
        return ((self.rules, self.filter, self.origin, self._table_rules_key)
                == (other.rules, other.filter, other.origin, other._table_rules_key))

    def __hash__(self) -> int:
        return hash((self.rules, self.filter, self.origin, self._table_rules_key))

    def origin_for(self, ref: TableRef) -> OriginColumn | None:
        """The origin column a table's rows carry downstream: only tables a route rule merges
        get it (a table routed to itself keeps its own shape)."""
        if self.origin is None or not self.matching_rules(ref):
            return None
        return self.origin

    def matching_rules(self, ref: TableRef) -> list[RouteRule]:
        return [r for r in self.rules if r.matches(ref)]

    def route(self, source: str, schema: str, table: str) -> Target | None:
        """The target of a table, or None when the filter leaves it out.

        Raises ``AmbiguousRouteError`` when rules disagree on the target (see module doc).
        """
        if not self.filter.selected(schema, table):
            return None
        ref = TableRef(source, schema, table)
        rules = self.matching_rules(ref)
        if not rules:
            return Target(schema, table)
        targets = [r.target_for(ref) for r in rules]
        if len(set(targets)) > 1:
            raise AmbiguousRouteError(ref, rules, targets)
        return targets[0]

    def shard_groups(self, tables: Iterable[TableRef]) -> dict[Target, ShardGroup]:
        """Tables grouped by target (filtered-out tables left out). Raises on ambiguous routes."""
        by_target: dict[Target, list[TableRef]] = {}
        for ref in tables:
            target = self.route(*ref)
            if target is not None:
                by_target.setdefault(target, []).append(ref)
        return {t: ShardGroup(t, tuple(sorted(set(refs)))) for t, refs in sorted(by_target.items())}

    def validate(self, tables: Mapping[TableRef, TableMetaV1 | None] | Iterable[TableRef] | None = None
                 ) -> list[RoutingProblem]:
        """Every problem of this routing, for the changefeed-creation check.

        Without tables only what the rules alone prove is checked (two rules with identical
        patterns and different targets). With tables (the known upstream tables of the
        changefeed's sources), also: tables matched by rules with different targets, rules that
        match no selected table, and, where metadata is given, incompatible primary keys and
        origin-column problems of each shard group.
        """
        problems: list[RoutingProblem] = []
        problems.extend(self._static_overlaps())
        if tables is None:
            return problems
        metas: dict[TableRef, TableMetaV1 | None]
        if isinstance(tables, Mapping):
            metas = {TableRef(*k): v for k, v in tables.items()}
        else:
            metas = dict.fromkeys((TableRef(*t) for t in tables), None)
        refs = sorted(metas)

        groups: dict[Target, list[TableRef]] = {}
        used: set[int] = set()
        matched_unselected: set[int] = set()
        for ref in refs:
            hits = [i for i, r in enumerate(self.rules) if r.matches(ref)]
            if not self.filter.selected(ref.schema, ref.table):
                matched_unselected.update(hits)
                continue
            used.update(hits)
            targets = {self.rules[i].target_for(ref) for i in hits}
            if len(targets) > 1:
                labels = tuple(self.rules[i].label for i in hits)
                shown = "; ".join(f"rule {self.rules[i].label} -> {self.rules[i].target_for(ref)}"
                                  for i in hits)
                problems.append(RoutingProblem(
                    "overlapping_routes",
                    f"table {ref} is matched by routes with different targets: {shown}",
                    (ref,), labels))
                continue
            target = targets.pop() if targets else Target(ref.schema, ref.table)
            groups.setdefault(target, []).append(ref)

        for i, rule in enumerate(self.rules):
            if i in used:
                continue
            why = ("every table it matches is excluded by the table filter" if i in matched_unselected
                   else "it matches none of the known tables")
            problems.append(RoutingProblem(
                "empty_route", f"route {rule.label} -> {rule.target_schema}."
                f"{rule.target_table or '<same table>'} is empty: {why}", (), (rule.label,)))

        for target, shards in groups.items():
            with_meta = [(ref, m) for ref in shards if (m := metas.get(ref)) is not None]
            problems.extend(self._key_problems(target, with_meta))
            if self.origin is not None:
                problems.extend(self._origin_problems(target, shards, with_meta))
        return problems

    def check(self, tables: Mapping[TableRef, TableMetaV1 | None] | Iterable[TableRef] | None = None
              ) -> None:
        """``validate`` that raises ``RoutingValidationError`` listing every problem."""
        problems = self.validate(tables)
        if problems:
            raise RoutingValidationError(problems)

    def rewrite_meta_for(self, meta: TableMetaV1, ref: TableRef) -> TableMetaV1:
        """``rewrite_meta`` for one table: its table rules' columns left out and computed ones
        added (``TableRulesError`` when they do not fit it); only rule-routed tables get the
        origin column."""
        if self.table_rules:

            meta = rules_for(self.table_rules, ref.schema, ref.table).rewrite_meta(meta)
        origin = self.origin_for(ref)
        return rewrite_meta(meta, origin) if origin is not None else meta

    def rewrite_meta(self, meta: TableMetaV1) -> TableMetaV1:
        """The target's view of a shard's metadata (unchanged without an origin column)."""
        return rewrite_meta(meta, self.origin) if self.origin is not None else meta

    def rewrite_row(self, row: RowImageV2, ref: TableRef) -> RowImageV2:
        return rewrite_row(row, self.origin, ref) if self.origin is not None else row

    # -- helpers ----------------------------------------------------------------------------------

    def _static_overlaps(self) -> list[RoutingProblem]:
        out = []
        seen: dict[tuple[str, str, str], RouteRule] = {}
        for rule in self.rules:
            key = (rule.source, rule.schema, rule.table)
            other = seen.get(key)
            if other is None:
                seen[key] = rule
            elif (other.target_schema, other.target_table) != (rule.target_schema, rule.target_table):
                out.append(RoutingProblem(
                    "overlapping_routes",
                    f"routes {other.label} and {rule.label} match the same tables but go to different "
                    f"targets ({other.target_schema}.{other.target_table or '<same table>'} and "
                    f"{rule.target_schema}.{rule.target_table or '<same table>'})",
                    (), (other.label, rule.label)))
        return out

    @staticmethod
    def _key_problems(target: Target, shards: Sequence[tuple[TableRef, TableMetaV1]]) -> list[RoutingProblem]:
        if len(shards) < 2:
            return []
        # Group by signature so the message names every distinct key once, with the shards
        # holding it, instead of one line per pair.
        by_sig: dict[tuple[tuple[str, str, str], ...], list[tuple[TableRef, TableMetaV1]]] = {}
        for ref, meta in shards:
            by_sig.setdefault(primary_key_signature(meta), []).append((ref, meta))
        if len(by_sig) == 1:
            return []
        variants = "; ".join(
            f"{_describe_key(members[0][1])} on {', '.join(str(r) for r, _ in members)}"
            for members in by_sig.values())
        return [RoutingProblem(
            "incompatible_keys",
            f"target {target}: its shards have incompatible primary keys: {variants}. Shards merged "
            "into one table need the same primary-key columns and types",
            tuple(ref for ref, _ in shards))]

    def _origin_problems(self, target: Target, shards: Sequence[TableRef],
                         with_meta: Sequence[tuple[TableRef, TableMetaV1]]) -> list[RoutingProblem]:
        assert self.origin is not None
        origin = self.origin
        out = []
        clashing = [ref for ref, meta in with_meta
                    if any(c.name.casefold() == origin.name.casefold() for c in meta.columns)]
        if clashing:
            out.append(RoutingProblem(
                "origin_column_collision",
                f"target {target}: origin column {origin.name!r} already exists in "
                f"{', '.join(str(r) for r in clashing)}; choose another name",
                tuple(clashing)))
        too_long = [ref for ref in shards if len(origin.value(ref)) > origin.width]
        if too_long:
            out.append(RoutingProblem(
                "origin_value_too_long",
                f"target {target}: the origin value of {', '.join(str(r) for r in too_long)} is longer "
                f"than the origin column's width {origin.width}; raise the width",
                tuple(too_long)))
        return out


# -- changefeed specs -----------------------------------------------------------------------------

def router_for(spec: ChangefeedSpec) -> Router:
    """The routing of a changefeed spec. Raises ``RoutingConfigError`` for an unreadable rule."""
    rules = [RouteRule(schema=r.database, table=r.table, target_schema=r.target_schema,
                       target_table=r.target_table, source=r.source, name=r.name) for r in spec.routes]
    origin = OriginColumn(spec.origin_column) if spec.origin_column else None
    return Router(rules, TableFilter.from_contract(spec.filter), origin, current_spec(spec).table_rules)


def validate_spec(spec: ChangefeedSpec,
                  tables_meta: Mapping[TableRef, TableMetaV1 | None] | Iterable[TableRef] | None = None
                  ) -> list[RoutingProblem]:
    """Every routing problem of a changefeed spec, for the creation check (the api refuses the
    changefeed with these messages). ``tables_meta``: the upstream tables of its sources, with
    their metadata where known (see ``Router.validate``). Table rules (v4) are checked too:
    expressions must parse, and with metadata, dropped or kept columns must exist and spare
    the key (``libs.table_rules``)."""

    rules = current_spec(spec).table_rules
    problems = [RoutingProblem("invalid_table_rule", text)
                for text in rule_problems(rules, spec.initial_load)]
    if rules and isinstance(tables_meta, Mapping):
        for ref, meta in sorted(tables_meta.items()):
            ref = TableRef(*ref)
            if meta is not None and router_filter_selects(spec, ref):
                problems.extend(RoutingProblem("invalid_table_rule", text, (ref,))
                                for text in table_problems(rules, ref.schema, ref.table, meta))
    try:
        router = router_for(spec)
    except RoutingConfigError as exc:
        return [*problems, RoutingProblem("invalid_rule", str(exc))]
    return [*problems, *router.validate(tables_meta)]


def router_filter_selects(spec: ChangefeedSpec, ref: TableRef) -> bool:
    try:
        return TableFilter.from_contract(spec.filter).selected(ref.schema, ref.table)
    except RoutingConfigError:
        return False


# --- poison: cross-shard unique conflicts (a warning, not a refusal) -----------------------------

def _merging_patterns(rule: RouteRule, spec: ChangefeedSpec) -> tuple[NamePattern, ...]:
    """The patterns that can make a rule match several tables (its source pattern only when
    the changefeed has several sources)."""
    source, schema, table = rule._patterns
    return (source, schema, table) if len(spec.sources) > 1 else (schema, table)


def unique_conflict_warnings(spec: ChangefeedSpec,
                             tables_meta: Mapping[TableRef, TableMetaV1 | None] | None = None) -> list[str]:
    """Warnings for the changefeed-creation answer (api, CLI): merged targets whose unique keys
    would not include an origin column, so two shards holding one unique value conflict
    downstream (``on_unique_conflict`` decides what then happens). Without metadata every rule
    that may merge several tables is named; with it, every merged target with a unique key."""
    if spec.origin_column is not None:
        return []
    try:
        router = router_for(spec)
    except RoutingConfigError:
        return []  # refused by validate_spec anyway
    policy = current_spec(spec).on_unique_conflict
    outcome = ("the target's tables stop with a conflict report" if policy == "error"
               else "the other shard's row is removed (an event per row)")
    advice = f"on_unique_conflict={policy}: {outcome}; set origin_column to keep shards apart"
    if tables_meta is None:
        return [f"route {rule.label} merges tables into {rule.target_schema}.{rule.target_table} without an "
                "origin_column: a unique key there (other than the primary key) will not include one, so "
                f"two shards holding the same unique value conflict ({advice})"
                for rule in router.rules
                if rule.fixed_target and not all(p.is_literal for p in _merging_patterns(rule, spec))]
    out = []
    for target, group in router.shard_groups(TableRef(*ref) for ref in tables_meta).items():
        if not group.sharded:
            continue
        uniques = sorted({tuple(uk) for ref in group.shards if (meta := tables_meta.get(ref)) is not None
                          for uk in meta.unique_keys if set(uk) != set(meta.primary_key)})
        for unique in uniques:
            out.append(f"merged target {target} has unique key ({', '.join(unique)}) without an origin "
                       f"column across {len(group.shards)} shards: a value two shards hold conflicts "
                       f"({advice})")
    return out
