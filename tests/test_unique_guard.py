"""The rule that tells a lucy reorder from a cross-shard unique conflict, and its reports (pure)."""

from __future__ import annotations

from services.sink_worker.incidents.log import overwritten_event
from services.sink_worker.sinks.error_class import classify
from services.sink_worker.sinks.unique_guard import (
    DELETED,
    ORIGIN_ADVICE,
    ConflictGuard,
    UniqueConflict,
    UniqueConflictError,
)


def test_only_a_holder_rewritten_or_deleted_by_the_same_span_in_the_batch_may_be_removed() -> None:
    guard = ConflictGuard("error", {(1,): 0, (2,): 1, (3,): DELETED}, ["a", "b"], "merged.users")
    assert guard.removable(0, (1,))  # span a rewrites its own holder in this batch: lucy
    assert not guard.removable(0, (2,))  # span b's row: another shard
    assert guard.removable(0, (3,))  # deleted in this batch anyway
    assert not guard.removable(0, (9,))  # written before this batch: not this shard's (see module)
    assert guard.shard_name(1) == "b" and "before this batch" in guard.shard_name(None)


def test_a_conflict_report_names_everything_and_is_permanent() -> None:
    conflict = UniqueConflict("merged.users", ("name",), ("lucy",), "cf/s/shop_b.users", (2,),
                              "cf/s/shop_a.users", (1,), action="overwritten")
    text = conflict.describe()
    for part in ("merged.users", "(name)", "'lucy'", "shop_b.users key [2]", "shop_a.users key [1]",
                 ORIGIN_ADVICE):
        assert part in text, part
    assert classify("mysql", UniqueConflictError(conflict)) == "permanent"
    event = overwritten_event("cf", conflict.to_json())
    assert (event.target, event.unique_key, event.value) == ("merged.users", ["name"], ["lucy"])
    assert event.key == [2] and event.other_key == [1] and event.other_shard == "cf/s/shop_a.users"


def test_changefeed_v3_defaults_to_error_and_old_feeds_keep_overwriting() -> None:
    from contracts import REGISTRY
    from contracts.events.changefeeds import (
        ChangefeedCreatedV2,
        ChangefeedCreatedV5,
        ChangefeedSpecV2,
        ChangefeedSpecV3,
        SourceRefV1,
    )
    from libs.changefeeds import ChangefeedView

    sources = [SourceRefV1(id="s1", url="mysql://u@h/")]
    assert ChangefeedSpecV3(id="cf", sources=sources, sink_url="sqlite:///x").on_unique_conflict == "error"
    old = REGISTRY.decode(REGISTRY.encode(ChangefeedCreatedV2(spec=ChangefeedSpecV2(
        id="cf", sources=sources, sink_url="sqlite:///x")), producer="t")).event
    assert isinstance(old, ChangefeedCreatedV5) and old.spec.on_unique_conflict == "overwrite"
    view = ChangefeedView()
    view.apply(ChangefeedCreatedV2(spec=ChangefeedSpecV2(id="cf2", sources=sources, sink_url="sqlite:///x")))
    assert getattr(view.specs["cf2"], "on_unique_conflict", None) == "overwrite"


def test_creation_warns_about_merged_targets_whose_unique_keys_lack_an_origin_column() -> None:
    from contracts.events.changefeeds import ChangefeedSpecV3, RouteRuleV1, SourceRefV1
    from contracts.events.rows import ColumnV1, TableMetaV1
    from libs.routing import TableRef, unique_conflict_warnings

    merge = RouteRuleV1(database="shop_*", table="users", target_schema="merged", target_table="users")
    spec = ChangefeedSpecV3(id="cf", sources=[SourceRefV1(id="s1", url="mysql://u@h/")],
                            sink_url="sqlite:///x", routes=[merge])
    static = unique_conflict_warnings(spec)
    assert len(static) == 1 and "merged.users" in static[0] and "origin_column" in static[0]
    assert "on_unique_conflict=error" in static[0]
    assert unique_conflict_warnings(spec.model_copy(update={"origin_column": "_origin"})) == []
    rename = RouteRuleV1(database="shop", table="users", target_schema="x", target_table="people")
    assert unique_conflict_warnings(spec.model_copy(update={"routes": [rename]})) == []

    cols = [ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
            ColumnV1(name="email", kind="string", sql_type="varchar(64)")]
    with_unique = TableMetaV1(columns=cols, primary_key=["id"], unique_keys=[["email"]])
    without = TableMetaV1(columns=cols, primary_key=["id"])
    metas = {TableRef("s1", "shop_a", "users"): with_unique, TableRef("s1", "shop_b", "users"): with_unique}
    precise = unique_conflict_warnings(spec, metas)
    assert len(precise) == 1 and "unique key (email)" in precise[0] and "2 shards" in precise[0]
    plain = {ref: without for ref in metas}
    assert unique_conflict_warnings(spec, plain) == []
