"""Changefeed definitions: the changefeeds domain stream is their event log."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contracts.events.rows import SourcePositionV1
from contracts.registry import register, upcaster

KeyPolicy = Literal["primary", "unique", "all_columns"]
# How a changefeed starts on tables that already hold rows: copy them first and then stream
# from where the copy is consistent ("snapshot"), stream only ("binlog-only"), or copy only.
InitialLoad = Literal["snapshot", "binlog-only", "snapshot-only"]


class SourceRefV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    url: str = Field(min_length=1, description="mysql://user:pass@host:port/ of the source.")


class TableFilterV1(BaseModel):
    """Patterns over ``database.table`` (a glob, or a regular expression after ``~`` matching the
    whole name); a table is in when it matches an include and no exclude."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    include: list[str] = Field(default_factory=lambda: ["*.*"])
    exclude: list[str] = Field(default_factory=list)


class RouteRuleV1(BaseModel):
    """Upstream tables matching the three patterns land in ``target_schema.target_table``.

    Patterns are globs, or regular expressions when they start with ``~`` (whole-name match).
    ``target_schema`` is the downstream database (PostgreSQL: schema); ``target_table``
    omitted keeps each table's own name (a schema-level merge).
    """

    model_config = ConfigDict(extra="forbid", defer_build=True)
    source: str = Field("*", min_length=1)
    database: str = Field(min_length=1, description="Pattern over the upstream database (schema).")
    table: str = Field("*", min_length=1)
    target_schema: str = Field(min_length=1)
    target_table: str | None = Field(None, min_length=1)
    name: str = ""


class ChangefeedSpecV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    sources: list[SourceRefV1] = Field(min_length=1)
    filter: TableFilterV1 = Field(default_factory=TableFilterV1)
    sink_url: str = Field(min_length=1)
    key_policy: KeyPolicy = Field(
        "primary", description="Tables without a primary key are refused unless this says otherwise."
    )
    start: Literal["earliest", "latest"] = "earliest"
    start_position: dict[str, SourcePositionV1] = Field(default_factory=dict)


class ChangefeedSpecV2(BaseModel):
    """v2 adds shard routing (``routes``, ``origin_column``) and the initial load mode."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    sources: list[SourceRefV1] = Field(min_length=1)
    filter: TableFilterV1 = Field(default_factory=TableFilterV1)
    routes: list[RouteRuleV1] = Field(
        default_factory=list,
        description="Route rules; tables no rule matches keep their schema and table name.")
    origin_column: str | None = Field(
        None, min_length=1,
        description="When set, merged targets get this extra column holding source/schema/table "
                    "of each row's upstream table, and it joins every key.")
    sink_url: str = Field(min_length=1)
    key_policy: KeyPolicy = Field(
        "primary", description="Tables without a primary key are refused unless this says otherwise."
    )
    initial_load: InitialLoad = Field(
        "snapshot", description="snapshot: copy existing rows, then stream from the copy's "
                                "consistent point; binlog-only: stream from start/start_position/"
                                "start_time; snapshot-only: copy and stop.")
    start: Literal["earliest", "latest"] = "earliest"
    start_position: dict[str, SourcePositionV1] = Field(default_factory=dict)
    start_time: datetime | None = Field(
        None, description="binlog-only: skip transactions committed before this time.")


def _spec_v1_to_v2(spec: dict[str, Any]) -> dict[str, Any]:
    # v1 changefeeds streamed only: keep that meaning instead of the v2 default (snapshot).
    return {**spec, "routes": [], "origin_column": None, "initial_load": "binlog-only",
            "start_time": None}


@register("changefeed.created", 1)
class ChangefeedCreatedV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    spec: ChangefeedSpecV1
    requested_by: str = ""


@register("changefeed.updated", 1)
class ChangefeedUpdatedV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    spec: ChangefeedSpecV1
    requested_by: str = ""


@register("changefeed.created", 2)
class ChangefeedCreatedV2(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    spec: ChangefeedSpecV2
    requested_by: str = ""


@register("changefeed.updated", 2)
class ChangefeedUpdatedV2(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    spec: ChangefeedSpecV2
    requested_by: str = ""


@upcaster("changefeed.created", 1)
def _created_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v1_to_v2(data["spec"])}


@upcaster("changefeed.updated", 1)
def _updated_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v1_to_v2(data["spec"])}


@register("changefeed.state_changed", 1)
class ChangefeedStateChangedV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    id: str = Field(min_length=1)
    state: Literal["running", "paused", "deleted"]
    requested_by: str = ""
    reason: str = ""


# v3 of changefeed.created / changefeed.updated: secrets as references and creation checks
# (apisec), and the cross-shard unique-conflict policy (poison).

class ChangefeedCheckV1(BaseModel):
    """A creation check the api ran and that failed, accepted anyway with ``skip_checks``."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    check: str = Field(min_length=1, description="e.g. source_reachable, binlog_format, sink_writable")
    target: str = Field("", description="The source id, 'sink' or the route the check is about.")
    message: str = Field(min_length=1, description="What failed and the fix.")


UniqueConflictPolicy = Literal["error", "overwrite"]


class ChangefeedSpecV3(ChangefeedSpecV2):
    """v3 adds what a merged target does when a shard's row takes a unique value another
    shard's row holds (only targets without an origin column can have such a conflict)."""

    on_unique_conflict: UniqueConflictPolicy = Field(
        "error", description="error: the target's spans stop with a conflict report; overwrite: the "
                             "other shard's row is removed, with an event per removed row. Setting "
                             "origin_column avoids the conflict altogether.")


def _spec_v2_to_v3(spec: dict[str, Any]) -> dict[str, Any]:
    # v2 changefeeds removed the other shard's row silently: keep that, now explicit.
    return {**spec, "on_unique_conflict": "overwrite"}


def spec_v3(spec: ChangefeedSpecV2) -> ChangefeedSpecV3:
    """A spec as v3: a v2 one built in code keeps v2's behaviour, as its upcast does."""
    if isinstance(spec, ChangefeedSpecV3):
        return spec
    return ChangefeedSpecV3.model_validate(_spec_v2_to_v3(spec.model_dump()))


_V3_DOC = ("v3: source and sink URLs hold no password; a password is a reference to a named "
           "secret, ``secret:NAME`` in the URL's password place, resolved by each service from "
           "its secrets directory or SLUICE_SECRET_<NAME>. ``failed_checks`` lists the creation "
           "checks that failed when the operator accepted the changefeed with skip_checks. "
           "The spec gains ``on_unique_conflict``.")


@register("changefeed.created", 3)
class ChangefeedCreatedV3(BaseModel):
    __doc__ = _V3_DOC
    model_config = ConfigDict(extra="forbid", defer_build=True)
    spec: ChangefeedSpecV3
    requested_by: str = ""
    failed_checks: list[ChangefeedCheckV1] = Field(default_factory=list)


@register("changefeed.updated", 3)
class ChangefeedUpdatedV3(BaseModel):
    __doc__ = _V3_DOC
    model_config = ConfigDict(extra="forbid", defer_build=True)
    spec: ChangefeedSpecV3
    requested_by: str = ""
    failed_checks: list[ChangefeedCheckV1] = Field(default_factory=list)


# v2 events may hold literal passwords in their URLs: they keep working (the resolver passes a
# literal through) and every api output redacts them; no check was recorded for them. They
# removed another shard's row silently on a unique conflict: the upcast keeps that, explicitly.
@upcaster("changefeed.created", 2)
def _created_v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v2_to_v3(data["spec"]), "failed_checks": []}


@upcaster("changefeed.updated", 2)
def _updated_v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v2_to_v3(data["spec"]), "failed_checks": []}


# v4 of changefeed.created / changefeed.updated: per-table event filters, column selection
# and computed columns (``table_rules``).

IgnorableEvent = Literal["insert", "update", "delete", "truncate", "drop table"]
"""Row events, and the DDL kinds that can be left out without the target's shape going wrong:
a skipped TRUNCATE or DROP TABLE keeps the target's rows, and later rows still fit it."""

ComputedType = Literal["string", "int", "float"]


class ComputedColumnV1(BaseModel):
    """A column the target gains, computed from the row's new image by a Spark SQL expression."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    name: str = Field(min_length=1, max_length=64)
    expr: str = Field(min_length=1, description=(
        "Spark SQL over the row's columns, e.g. "
        "\"concat(left(email, 1), '***@', substring_index(email, '@', -1))\"."))
    type: ComputedType = Field("string", description="string: text; int: bigint; float: double.")


class TableRuleV1(BaseModel):
    """What a changefeed leaves out of, or adds to, the tables matching ``tables``.

    Every rule matching a table applies: ignored events add up, expressions are OR-ed, dropped
    columns add up. At most one matching rule may set ``keep_columns``."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    tables: list[str] = Field(min_length=1, description="Patterns over ``database.table``, as in the "
                                                        "table filter (a glob, or a regex after ``~``).")
    ignore_events: list[IgnorableEvent] = Field(
        default_factory=list, description="Event types never applied downstream: insert, update, "
                                          "delete, truncate, drop table.")
    ignore_insert_value_expr: str | None = Field(
        None, min_length=1, description="Spark SQL over the inserted row: true leaves the insert out.")
    ignore_update_old_value_expr: str | None = Field(
        None, min_length=1,
        description="Spark SQL over the row before an update: true leaves the update out.")
    ignore_update_new_value_expr: str | None = Field(
        None, min_length=1,
        description="Spark SQL over the row after an update: true leaves the update out.")
    ignore_delete_value_expr: str | None = Field(
        None, min_length=1, description="Spark SQL over the deleted row: true leaves the delete out "
                                        "(the row stays downstream).")
    keep_columns: list[str] | None = Field(
        None, description="Only these columns reach the downstream (the key columns must be among them).")
    drop_columns: list[str] = Field(
        default_factory=list,
        description="Columns that never leave the source (key columns cannot be dropped).")
    computed: list[ComputedColumnV1] = Field(default_factory=list)


class ChangefeedSpecV4(ChangefeedSpecV3):
    """v4 adds ``table_rules``: event filters, column selection and computed columns per table."""

    table_rules: list[TableRuleV1] = Field(
        default_factory=list, description="Per table pattern: events and rows left out, columns kept, "
                                          "dropped or computed (see TableRuleV1).")


def _spec_v3_to_v4(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "table_rules": []}


def spec_v4(spec: ChangefeedSpecV2) -> ChangefeedSpecV4:
    """A spec as v4 (older ones have no table rules; a v2 one built in code keeps v2's
    unique-conflict behaviour, as its upcast does)."""
    if isinstance(spec, ChangefeedSpecV4):
        return spec
    return ChangefeedSpecV4.model_validate(_spec_v3_to_v4(spec_v3(spec).model_dump()))


_V4_DOC = _V3_DOC + " v4: the spec gains ``table_rules`` (event filters, column selection, computed columns)."


@register("changefeed.created", 4)
class ChangefeedCreatedV4(BaseModel):
    __doc__ = _V4_DOC
    model_config = ConfigDict(extra="forbid", defer_build=True)
    spec: ChangefeedSpecV4
    requested_by: str = ""
    failed_checks: list[ChangefeedCheckV1] = Field(default_factory=list)


@register("changefeed.updated", 4)
class ChangefeedUpdatedV4(BaseModel):
    __doc__ = _V4_DOC
    model_config = ConfigDict(extra="forbid", defer_build=True)
    spec: ChangefeedSpecV4
    requested_by: str = ""
    failed_checks: list[ChangefeedCheckV1] = Field(default_factory=list)


# A v3 changefeed had no table rules: every event and column went downstream.
@upcaster("changefeed.created", 3)
def _created_v3_to_v4(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v3_to_v4(data["spec"])}


@upcaster("changefeed.updated", 3)
def _updated_v3_to_v4(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v3_to_v4(data["spec"])}


# v5 of changefeed.created / changefeed.updated: continuous validation (``validation``).

ValidationMode = Literal["off", "fast", "full"]


class ValidationSpecV1(BaseModel):
    """Continuous validation: the worker that runs a table compares the rows its batches changed
    with the source once they are applied, at a consistent point (see DESIGN.md)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    mode: ValidationMode = Field(
        "off", description="off; fast: a row exists downstream exactly when it exists upstream; "
                           "full: and every column the table rules send downstream is equal.")


class ChangefeedSpecV5(ChangefeedSpecV4):
    """v5 adds ``validation`` (continuous validation, off by default)."""

    validation: ValidationSpecV1 = Field(default_factory=ValidationSpecV1)


def _spec_v4_to_v5(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "validation": {"mode": "off"}}


def spec_v5(spec: ChangefeedSpecV2) -> ChangefeedSpecV5:
    """A spec as v5 (older ones do not validate)."""
    if isinstance(spec, ChangefeedSpecV5):
        return spec
    return ChangefeedSpecV5.model_validate(_spec_v4_to_v5(spec_v4(spec).model_dump()))


_V5_DOC = _V4_DOC + " v5: the spec gains ``validation`` (continuous validation, fast or full)."


@register("changefeed.created", 5)
class ChangefeedCreatedV5(BaseModel):
    __doc__ = _V5_DOC
    model_config = ConfigDict(extra="forbid", defer_build=True)
    spec: ChangefeedSpecV5
    requested_by: str = ""
    failed_checks: list[ChangefeedCheckV1] = Field(default_factory=list)


@register("changefeed.updated", 5)
class ChangefeedUpdatedV5(BaseModel):
    __doc__ = _V5_DOC
    model_config = ConfigDict(extra="forbid", defer_build=True)
    spec: ChangefeedSpecV5
    requested_by: str = ""
    failed_checks: list[ChangefeedCheckV1] = Field(default_factory=list)


# A v4 changefeed did not validate.
@upcaster("changefeed.created", 4)
def _created_v4_to_v5(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v4_to_v5(data["spec"])}


@upcaster("changefeed.updated", 4)
def _updated_v4_to_v5(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v4_to_v5(data["spec"])}


# v6 of changefeed.created / changefeed.updated: how PostgreSQL and SQLite targets compare
# text whose source collation is case-insensitive (``text_comparison``).

TextComparison = Literal["exact", "case_insensitive"]


class ChangefeedSpecV6(ChangefeedSpecV5):
    """v6 adds ``text_comparison`` (``exact`` by default, as before)."""

    text_comparison: TextComparison = Field(
        "exact", description="How PostgreSQL and SQLite targets compare text columns whose source "
                             "collation is case-insensitive (*_ci): exact (byte/code point order, "
                             "the default) or case_insensitive (PostgreSQL: a nondeterministic ICU "
                             "collation; SQLite: COLLATE NOCASE). MySQL/MariaDB targets always take "
                             "the source's own collation.")


def _spec_v5_to_v6(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "text_comparison": "exact"}


def spec_v6(spec: ChangefeedSpecV2) -> ChangefeedSpecV6:
    """A spec as v6 (older ones compare text exactly)."""
    if isinstance(spec, ChangefeedSpecV6):
        return spec
    return ChangefeedSpecV6.model_validate(_spec_v5_to_v6(spec_v5(spec).model_dump()))


_V6_DOC = _V5_DOC + " v6: the spec gains ``text_comparison`` (case-insensitive collations downstream)."


@register("changefeed.created", 6)
class ChangefeedCreatedV6(ChangefeedCreatedV5):
    __doc__ = _V6_DOC
    spec: ChangefeedSpecV6


@register("changefeed.updated", 6)
class ChangefeedUpdatedV6(ChangefeedUpdatedV5):
    __doc__ = _V6_DOC
    spec: ChangefeedSpecV6


# A v5 changefeed compared text exactly on every target.
@upcaster("changefeed.created", 5)
def _created_v5_to_v6(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v5_to_v6(data["spec"])}


@upcaster("changefeed.updated", 5)
def _updated_v5_to_v6(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v5_to_v6(data["spec"])}





# v7 of changefeed.created / changefeed.updated: consistent points across tables (syncpoints).

class ChangefeedSpecV7(ChangefeedSpecV6):
    """v7 adds syncpoints: ``syncpoint_interval`` (off when unset) and ``syncpoint_hold_s``."""

    syncpoint_interval: float | None = Field(
        None, ge=1.0, le=86400.0,
        description="Seconds between syncpoints; unset: none. At each one every span of the "
                    "changefeed stops at one upstream ts T, and once all have applied exactly up "
                    "to T a row (changefeed, T, commit time) is written to the downstream's "
                    "sluice_syncpoint table (SQL downstreams only).")
    syncpoint_hold_s: float = Field(
        0.0, ge=0.0, le=3600.0,
        description="Seconds the spans wait at T once its row is written, so a reader sees the "
                    "downstream as it was upstream at T; less than syncpoint_interval.")

    @model_validator(mode="after")
    def _hold_below_interval(self) -> ChangefeedSpecV7:
        if self.syncpoint_hold_s and self.syncpoint_interval is None:
            raise ValueError("syncpoint_hold_s needs syncpoint_interval")
        if self.syncpoint_interval is not None and self.syncpoint_hold_s >= self.syncpoint_interval:
            raise ValueError(f"syncpoint_hold_s ({self.syncpoint_hold_s:g}) must be less than "
                             f"syncpoint_interval ({self.syncpoint_interval:g}): the spans would "
                             "never move between two holds")
        return self


def _spec_v6_to_v7(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "syncpoint_interval": None, "syncpoint_hold_s": 0.0}


def spec_v7(spec: ChangefeedSpecV2) -> ChangefeedSpecV7:
    """A spec as v7 (older ones write no syncpoints)."""
    if isinstance(spec, ChangefeedSpecV7):
        return spec
    return ChangefeedSpecV7.model_validate(_spec_v6_to_v7(spec_v6(spec).model_dump()))


_V7_DOC = _V6_DOC + " v7: the spec gains ``syncpoint_interval`` and ``syncpoint_hold_s`` (syncpoints)."


@register("changefeed.created", 7)
class ChangefeedCreatedV7(ChangefeedCreatedV6):
    __doc__ = _V7_DOC
    spec: ChangefeedSpecV7


@register("changefeed.updated", 7)
class ChangefeedUpdatedV7(ChangefeedUpdatedV6):
    __doc__ = _V7_DOC
    spec: ChangefeedSpecV7


# A v6 changefeed wrote no syncpoints.
@upcaster("changefeed.created", 6)
def _created_v6_to_v7(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v6_to_v7(data["spec"])}


@upcaster("changefeed.updated", 6)
def _updated_v6_to_v7(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v6_to_v7(data["spec"])}


# v8 of changefeed.created / changefeed.updated: what a schema change upstream does downstream
# (``schema_change_policy``, as Flink CDC's ``schema.change.behavior``).

SchemaChangePolicy = Literal["evolve", "lenient", "ignore", "stop"]


class ChangefeedSpecV8(ChangefeedSpecV7):
    """v8 adds ``schema_change_policy`` (``evolve`` by default, as before)."""

    schema_change_policy: SchemaChangePolicy = Field(
        "evolve", description="What a DDL upstream does downstream. evolve (the default): the "
                              "target follows the source; lenient: nothing is removed downstream "
                              "(a dropped column stays, nullable; a renamed column keeps the old "
                              "one beside the new; TRUNCATE and DROP TABLE are not applied); "
                              "ignore: no DDL reaches the target, rows are written with the "
                              "columns the target has; stop: a DDL stops its table with an "
                              "incident until an operator resumes it (then it is applied as "
                              "under evolve). See DESIGN.md, \"Schema-change policies\".")


def _spec_v7_to_v8(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "schema_change_policy": "evolve"}


def spec_v8(spec: ChangefeedSpecV2) -> ChangefeedSpecV8:
    """A spec as v8 (older ones evolve their targets)."""
    if isinstance(spec, ChangefeedSpecV8):
        return spec
    return ChangefeedSpecV8.model_validate(_spec_v7_to_v8(spec_v7(spec).model_dump()))


_V8_DOC = _V7_DOC + " v8: the spec gains ``schema_change_policy`` (evolve, lenient, ignore, stop)."


@register("changefeed.created", 8)
class ChangefeedCreatedV8(ChangefeedCreatedV7):
    __doc__ = _V8_DOC
    spec: ChangefeedSpecV8


@register("changefeed.updated", 8)
class ChangefeedUpdatedV8(ChangefeedUpdatedV7):
    __doc__ = _V8_DOC
    spec: ChangefeedSpecV8


# A v7 changefeed applied every DDL downstream.
@upcaster("changefeed.created", 7)
def _created_v7_to_v8(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v7_to_v8(data["spec"])}


@upcaster("changefeed.updated", 7)
def _updated_v7_to_v8(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v7_to_v8(data["spec"])}


# v9 of changefeed.created / changefeed.updated: how a large transaction is committed downstream
# (as TiCDC's ``transaction-atomicity``, but by size: an operator bounds lock time, not tables).


class ChangefeedSpecV9(ChangefeedSpecV8):
    """v9 adds ``large_txn_split_rows`` (unset by default: every transaction is atomic, as before)."""

    large_txn_split_rows: int | None = Field(
        None, ge=1000, le=100_000_000,
        description="Unset (the default): every source transaction is ONE downstream transaction, "
                    "however large (streamed in bounded memory). N: a transaction larger than its "
                    "span's round is committed every N row changes instead, bounding the "
                    "downstream's lock time and undo; a reader may then see part of it (never a "
                    "later transaction before it ends), and a failure mid-way leaves the committed "
                    "part until the retry applies it all again (SQL downstreams).")


def _spec_v8_to_v9(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "large_txn_split_rows": None}


def spec_v9(spec: ChangefeedSpecV2) -> ChangefeedSpecV9:
    """A spec as v9 (older ones apply every transaction whole)."""
    if isinstance(spec, ChangefeedSpecV9):
        return spec
    return ChangefeedSpecV9.model_validate(_spec_v8_to_v9(spec_v8(spec).model_dump()))


_V9_DOC = _V8_DOC + " v9: the spec gains ``large_txn_split_rows`` (large transactions committed in parts)."


@register("changefeed.created", 9)
class ChangefeedCreatedV9(ChangefeedCreatedV8):
    __doc__ = _V9_DOC
    spec: ChangefeedSpecV9


@register("changefeed.updated", 9)
class ChangefeedUpdatedV9(ChangefeedUpdatedV8):
    __doc__ = _V9_DOC
    spec: ChangefeedSpecV9


# A v8 changefeed applied every transaction as one downstream transaction.
@upcaster("changefeed.created", 8)
def _created_v8_to_v9(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v8_to_v9(data["spec"])}


@upcaster("changefeed.updated", 8)
def _updated_v8_to_v9(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "spec": _spec_v8_to_v9(data["spec"])}


ChangefeedSpec = ChangefeedSpecV9
"""The current spec, the one type every reader of a changefeed holds: events are upcast when
they are read (the upcasters above), and ``current_spec`` upcasts a spec built in code from an
older version the same way, so no reader asks whether a field exists."""
ChangefeedCreated = ChangefeedCreatedV9
"""The version of ``changefeed.created`` written now (``libs.changefeeds``)."""
ChangefeedUpdated = ChangefeedUpdatedV9


def current_spec(spec: ChangefeedSpecV2) -> ChangefeedSpec:
    """``spec`` as the current version (itself when it is one)."""
    return spec_v9(spec)
