"""Routing rules, table filter, shard groups, changefeed-creation validation and the origin column."""

from __future__ import annotations

import fnmatch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.events.changefeeds import TableFilterV1
from contracts.events.rows import ColumnV1, RowImageV2, TableMetaV1
from libs.routing import (
    AmbiguousRouteError,
    NamePattern,
    OriginColumn,
    Router,
    RouteRule,
    RoutingConfigError,
    RoutingValidationError,
    ShardGroup,
    TableFilter,
    TableRef,
    Target,
    primary_key_signature,
    rewrite_meta,
    rewrite_row,
    with_origin,
)

ORDERS = RouteRule("shop_*", "orders_*", "shop", "orders", name="orders")


def meta(*cols: tuple[str, str, str], pk: tuple[str, ...] = ("id",),
         uks: tuple[tuple[str, ...], ...] = ()) -> TableMetaV1:
    return TableMetaV1(columns=[ColumnV1(name=n, kind=k, sql_type=t) for n, k, t in cols],
                       primary_key=list(pk), unique_keys=[list(u) for u in uks])


ID_INT = meta(("id", "int", "int"), ("total", "decimal", "decimal(12,2)"))


# -- patterns and filter --------------------------------------------------------------------------

def test_glob_and_regex_patterns() -> None:
    assert NamePattern("shop_*").matches("shop_12")
    assert not NamePattern("shop_*").matches("SHOP_12")  # case-sensitive like MySQL on Linux
    assert NamePattern("shop_?").matches("shop_1") and not NamePattern("shop_?").matches("shop_12")
    assert NamePattern("shop_[12]").matches("shop_2")
    rx = NamePattern(r"~shop_\d+")
    assert rx.is_regex and rx.matches("shop_07") and not rx.matches("shop_07x")  # whole name only
    assert NamePattern("orders").is_literal and not NamePattern("o*").is_literal and not rx.is_literal


def test_a_bad_regex_is_a_config_error() -> None:
    with pytest.raises(RoutingConfigError, match="not a valid regular expression"):
        NamePattern("~shop_(")


def test_filter_include_exclude() -> None:
    f = TableFilter(("shop_*.*",), ("*.secret", r"~shop_9\..*"))
    assert f.selected("shop_1", "orders")
    assert not f.selected("shop_1", "secret")
    assert not f.selected("shop_9", "orders")
    assert not f.selected("crm", "orders")
    assert TableFilter().selected("any", "thing")


def test_filter_from_contract() -> None:
    f = TableFilter.from_contract(TableFilterV1(include=["shop.*"], exclude=["shop.secret"]))
    assert f.selected("shop", "a") and not f.selected("shop", "secret")


NAME = st.text(alphabet="ab._*?-", min_size=1, max_size=5)


def glob_selected(flt: TableFilterV1, database: str, table: str) -> bool:
    """The filter semantics the sink-worker and scheduler use today (``libs.changefeeds``)."""
    name = f"{database}.{table}"
    return (any(fnmatch.fnmatchcase(name, p) for p in flt.include)
            and not any(fnmatch.fnmatchcase(name, p) for p in flt.exclude))


@settings(max_examples=200, deadline=None)
@given(include=st.lists(NAME, min_size=1, max_size=3), exclude=st.lists(NAME, max_size=2), db=NAME,
       table=NAME)
def test_filter_agrees_with_todays_glob_filter(include: list[str], exclude: list[str], db: str,
                                                         table: str) -> None:
    flt = TableFilterV1(include=include, exclude=exclude)
    assert TableFilter.from_contract(flt).selected(db, table) == glob_selected(flt, db, table)


# -- rules and route() ----------------------------------------------------------------------------

def test_rule_validation_and_labels() -> None:
    with pytest.raises(RoutingConfigError, match="target_schema"):
        RouteRule("shop_*", target_schema="")
    with pytest.raises(RoutingConfigError, match="target_table"):
        RouteRule("shop_*", target_schema="shop", target_table="")
    assert RouteRule("a", "b", "x", source="s1").label == "s1:a.b"
    assert ORDERS.label == "orders"


def test_route_to_a_fixed_target_and_schema_level_rules() -> None:
    r = Router([ORDERS, RouteRule("crm_*", target_schema="crm")])
    assert r.route("s1", "shop_3", "orders_7") == Target("shop", "orders")
    assert r.route("s1", "crm_2", "contacts") == Target("crm", "contacts")  # table name kept
    assert r.route("s1", "misc", "t") == Target("misc", "t")  # no rule: identity


def test_route_by_source() -> None:
    r = Router([RouteRule("db", "t", "merged", "t", source="~eu-.*"),
                RouteRule("db", "t", "us", "t", source="us-1")])
    assert r.route("eu-1", "db", "t") == Target("merged", "t")
    assert r.route("us-1", "db", "t") == Target("us", "t")
    assert r.route("ap-1", "db", "t") == Target("db", "t")


def test_filtered_out_tables_route_nowhere() -> None:
    r = Router([ORDERS], TableFilter(exclude=("shop_9.*",)))
    assert r.route("s1", "shop_9", "orders_1") is None


def test_rules_agreeing_on_the_target_are_fine_but_disagreeing_ones_are_refused() -> None:
    agree = Router([ORDERS, RouteRule("~shop_\\d", "orders_1", "shop", "orders")])
    assert agree.route("s", "shop_1", "orders_1") == Target("shop", "orders")
    clash = Router([ORDERS, RouteRule("shop_1", "orders_1", "other", "orders", name="special")])
    with pytest.raises(AmbiguousRouteError) as err:
        clash.route("s", "shop_1", "orders_1")
    msg = str(err.value)
    assert "s:shop_1.orders_1" in msg and "rule orders -> shop.orders" in msg
    assert "special -> other.orders" in msg


def test_shard_groups() -> None:
    r = Router([ORDERS], TableFilter(exclude=("*.tmp",)))
    tables = [TableRef("s2", "shop_1", "orders_1"), TableRef("s1", "shop_2", "orders_2"),
              TableRef("s1", "shop_1", "orders_1"), TableRef("s1", "shop", "orders"),
              TableRef("s1", "misc", "users"), TableRef("s1", "misc", "tmp")]
    groups = r.shard_groups(tables)
    merged = groups[Target("shop", "orders")]
    # the unrouted shop.orders lands on the target by its own name, so it is a shard too
    assert merged == ShardGroup(Target("shop", "orders"), tuple(sorted([tables[0], tables[1], tables[2],
                                                                         tables[3]])))
    assert merged.sharded
    assert not groups[Target("misc", "users")].sharded
    assert Target("misc", "tmp") not in groups


# -- validation -----------------------------------------------------------------------------------

def test_validation_without_tables_checks_what_the_rules_alone_prove() -> None:
    r = Router([ORDERS, RouteRule("shop_*", "orders_*", "shop", "orders_v2", name="v2"),
                RouteRule("shop_*", "orders_*", "shop", "orders", name="same")])
    problems = r.validate()
    assert [p.kind for p in problems] == ["overlapping_routes"]
    assert problems[0].rules == ("orders", "v2")


def test_overlapping_routes_on_known_tables() -> None:
    r = Router([ORDERS, RouteRule("~shop_[0-9]+", "orders_1", "x", "y", name="narrow")])
    problems = r.validate([TableRef("s1", "shop_1", "orders_1"), TableRef("s1", "shop_2", "orders_2")])
    assert [p.kind for p in problems] == ["overlapping_routes"]
    assert problems[0].tables == (TableRef("s1", "shop_1", "orders_1"),)
    assert "x.y" in problems[0].message and "shop.orders" in problems[0].message


def test_empty_routes() -> None:
    r = Router([ORDERS, RouteRule("crm", "*", "crm2", name="crm"),
                RouteRule("hidden", "*", "h", name="hidden")], TableFilter(exclude=("hidden.*",)))
    problems = r.validate([TableRef("s1", "shop_1", "orders_1"), TableRef("s1", "hidden", "t")])
    msgs = {p.rules[0]: p.message for p in problems if p.kind == "empty_route"}
    assert set(msgs) == {"crm", "hidden"}
    assert "matches none of the known tables" in msgs["crm"]
    assert "excluded by the table filter" in msgs["hidden"]


def test_incompatible_primary_keys() -> None:
    r = Router([ORDERS])
    a, b, c = (TableRef("s1", "shop_1", "orders_1"), TableRef("s1", "shop_2", "orders_2"),
               TableRef("s2", "shop_3", "orders_3"))
    problems = r.validate({a: ID_INT, b: meta(("id", "int", "bigint")), c: ID_INT})
    assert [p.kind for p in problems] == ["incompatible_keys"]
    msg = problems[0].message
    assert "target shop.orders" in msg and "(id int) on s1:shop_1.orders_1, s2:shop_3.orders_3" in msg
    assert "(id bigint) on s1:shop_2.orders_2" in msg


@pytest.mark.parametrize("other,compatible", [
    (meta(("id", "int", "int(11)")), True),            # display width is not a type difference
    (meta(("ID", "int", "INT")), True),                 # column names are case-insensitive
    (meta(("id", "int", "integer")), True),
    (meta(("id", "int", "int unsigned")), False),
    (meta(("id", "string", "varchar(20)")), False),
    (meta(("order_id", "int", "int"), pk=("order_id",)), False),
    (meta(("id", "int", "int"), ("x", "int", "int"), pk=("id", "x")), False),
    (meta(("id", "int", "int"), pk=()), False),
])
def test_key_compatibility_rules(other: TableMetaV1, compatible: bool) -> None:
    r = Router([ORDERS])
    problems = r.validate({TableRef("s", "shop_1", "orders_1"): meta(("id", "int", "int")),
                           TableRef("s", "shop_2", "orders_2"): other})
    assert (problems == []) == compatible


def test_composite_keys_compare_as_sets_of_columns() -> None:
    m1 = meta(("a", "int", "int"), ("b", "string", "varchar(8)"), pk=("a", "b"))
    m2 = meta(("b", "string", "varchar(8)"), ("a", "int", "int"), pk=("b", "a"))
    assert primary_key_signature(m1) == primary_key_signature(m2)


def test_shards_without_metadata_are_not_judged() -> None:
    r = Router([ORDERS])
    assert r.validate({TableRef("s", "shop_1", "orders_1"): ID_INT,
                       TableRef("s", "shop_2", "orders_2"): None}) == []


def test_check_raises_with_every_problem() -> None:
    r = Router([ORDERS, RouteRule("none", "*", "x", name="nothing")])
    tables = {TableRef("s", "shop_1", "orders_1"): ID_INT,
              TableRef("s", "shop_2", "orders_2"): meta(("id", "string", "varchar(9)"))}
    with pytest.raises(RoutingValidationError) as err:
        r.check(tables)
    assert {p.kind for p in err.value.problems} == {"empty_route", "incompatible_keys"}
    assert "2 problem(s)" in str(err.value)
    Router([ORDERS]).check([TableRef("s", "shop_1", "orders_1")])  # fine: no error


def test_origin_column_problems() -> None:
    r = Router([ORDERS], origin=OriginColumn("_origin", width=20))
    clash = meta(("id", "int", "int"), ("_ORIGIN", "string", "text"))
    problems = r.validate({TableRef("s", "shop_1", "orders_1"): ID_INT,
                           TableRef("s", "shop_2", "orders_2"): clash,
                           TableRef("long-source-name", "shop_3", "orders_3"): ID_INT})
    kinds = {p.kind: p for p in problems}
    assert set(kinds) == {"origin_column_collision", "origin_value_too_long"}
    assert kinds["origin_column_collision"].tables == (TableRef("s", "shop_2", "orders_2"),)
    assert kinds["origin_value_too_long"].tables == (TableRef("long-source-name", "shop_3", "orders_3"),)


# -- origin column --------------------------------------------------------------------------------

def test_origin_value_is_readable_and_escaped() -> None:
    o = OriginColumn()
    assert o.value(TableRef("s1", "shop_1", "orders_1")) == "s1/shop_1/orders_1"
    assert o.value(TableRef("s1", "a/b", "c%d")) == "s1/a%2Fb/c%25d"
    assert o.column() == ColumnV1(name="_sluice_origin", kind="string", sql_type="varchar(255)",
                                  nullable=False)
    with pytest.raises(RoutingConfigError):
        OriginColumn("")
    with pytest.raises(RoutingConfigError):
        OriginColumn("x", width=0)


PART = st.text(alphabet="a/%_.", max_size=4)


@settings(max_examples=300, deadline=None)
@given(a=st.tuples(PART, PART, PART), b=st.tuples(PART, PART, PART))
def test_origin_values_never_collide(a: tuple[str, str, str], b: tuple[str, str, str]) -> None:
    o = OriginColumn()
    if a != b:
        assert o.value(TableRef(*a)) != o.value(TableRef(*b))


def test_rewrite_meta_puts_the_origin_into_every_key() -> None:
    m = meta(("id", "int", "int"), ("email", "string", "varchar(80)"), uks=(("email",),))
    out = rewrite_meta(m, OriginColumn())
    assert out.columns[0].name == "_sluice_origin" and [c.name for c in out.columns[1:]] == ["id", "email"]
    assert out.primary_key == ["_sluice_origin", "id"]
    assert out.unique_keys == [["_sluice_origin", "email"]]
    keyless = rewrite_meta(meta(("a", "int", "int"), pk=(), uks=(("a",),)), OriginColumn())
    assert keyless.primary_key == [] and keyless.unique_keys == [["_sluice_origin", "a"]]
    with pytest.raises(RoutingConfigError, match="collides"):
        rewrite_meta(meta(("id", "int", "int"), ("_Sluice_Origin", "int", "int")), OriginColumn())


def test_rewrite_row_tags_both_images() -> None:
    o = OriginColumn()
    ref = TableRef("s1", "shop_1", "orders_1")
    upd = rewrite_row(RowImageV2(op="update", before={"id": 1, "x": 1}, after={"id": 2, "x": 1}), o, ref)
    assert upd.op == "update"
    assert upd.before == {"_sluice_origin": "s1/shop_1/orders_1", "id": 1, "x": 1}
    assert upd.after == {"_sluice_origin": "s1/shop_1/orders_1", "id": 2, "x": 1}
    ins = rewrite_row(RowImageV2(op="insert", after={"id": 1}), o, ref)
    assert ins.before is None and ins.after is not None
    assert with_origin({"id": 1}, o, ref) == {"_sluice_origin": "s1/shop_1/orders_1", "id": 1}


def test_router_rewrites_only_with_an_origin_column() -> None:
    ref = TableRef("s1", "shop_1", "orders_1")
    row = RowImageV2(op="delete", before={"id": 1})
    plain = Router([ORDERS])
    assert plain.rewrite_meta(ID_INT) is ID_INT and plain.rewrite_row(row, ref) is row
    tagged = Router([ORDERS], origin=OriginColumn("src"))
    assert tagged.rewrite_meta(ID_INT).primary_key == ["src", "id"]
    assert tagged.rewrite_row(row, ref).before == {"src": "s1/shop_1/orders_1", "id": 1}


# -- properties -----------------------------------------------------------------------------------

SCHEMAS = ["shop_1", "shop_2", "crm", "x"]
TABLES = ["orders_1", "orders_2", "users", "t"]
PATTERNS = ["*", "shop_*", "orders_*", "~(shop|crm)_?\\d?", "crm", "users", "t", "~orders_[12]"]

rule_st = st.builds(RouteRule, schema=st.sampled_from(PATTERNS), table=st.sampled_from(PATTERNS),
                    target_schema=st.sampled_from(["m", "n"]),
                    target_table=st.sampled_from([None, "merged", "other"]),
                    source=st.sampled_from(["*", "s1", "~s[12]"]))
table_st = st.builds(TableRef, st.sampled_from(["s1", "s2", "s3"]), st.sampled_from(SCHEMAS),
                     st.sampled_from(TABLES))


@settings(max_examples=200, deadline=None)
@given(rules=st.lists(rule_st, max_size=4), tables=st.lists(table_st, max_size=10),
       exclude=st.lists(st.sampled_from(["crm.*", "*.t", "x.*"]), max_size=2))
def test_validation_agrees_with_route_and_groups_partition_the_selected_tables(
        rules: list[RouteRule], tables: list[TableRef], exclude: list[str]) -> None:
    r = Router(rules, TableFilter(exclude=tuple(exclude)))
    problems = r.validate(tables)
    overlapping = {t for p in problems if p.kind == "overlapping_routes" for t in p.tables}
    routed: dict[TableRef, Target] = {}
    for t in tables:
        if t in overlapping:
            with pytest.raises(AmbiguousRouteError):
                r.route(*t)
            continue
        target = r.route(*t)
        if target is not None:
            routed[t] = target
    if not overlapping:
        groups = r.shard_groups(tables)
        assert {s for g in groups.values() for s in g.shards} == set(routed)
        assert all(routed[s] == g.target for g in groups.values() for s in g.shards)
    used = {i for i, rule in enumerate(rules) for t in routed if rule.matches(t)}
    empty = [p for p in problems if p.kind == "empty_route"]
    assert len(empty) == sum(1 for i, _ in enumerate(rules) if i not in used
                             and not any(rules[i].matches(t) for t in overlapping))
