"""A table stopped by its downstream, and an operator's decision on it (changefeeds domain).

A sink-worker records ``table.stopped`` when the downstream refuses one of a table's changes
for a reason no retry can fix (a value out of range or too long, a constraint): the table stops
there, the others go on. The operator answers with ``table.action_requested`` naming that
incident: ``skip`` the refused change (it goes to the dead letters) and go on, ``retry``, or
``resume`` after fixing the downstream. Both live in the changefeeds log, so they survive
restarts and span moves, and the api's event feed shows them.

``table.stopped`` v2 adds the kind ``unreplicable``: the table cannot be replicated as the
changefeed says (no usable key under its key policy, table rules that do not fit its columns,
a DDL that leaves it without a key); no statement or row is involved. The operator fixes the
cause and resumes the incident. A stopped table of either kind is left out of its changefeed's
checkpoint until it is resumed and catches up (DESIGN.md, "Tables stopped by an incident").
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contracts.registry import register, upcaster

TableAction = Literal["skip", "retry", "resume"]


class TableRefV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    changefeed: str = Field(min_length=1)
    source: str = Field(min_length=1, description="Source id token of the span.")
    database: str = Field(min_length=1)
    table: str = Field(min_length=1)


@register("table.stopped", 1)
class TableStoppedV1(BaseModel):
    """The downstream refused a change of this table for good; the table waits for an operator."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    table: TableRefV1
    incident: str = Field(min_length=1, description="Id an operator's action names.")
    target: str = Field(min_length=1, description="Downstream schema.table.")
    kind: Literal["refused"] = "refused"
    statement: Literal["upsert", "delete", "batch"] = Field(
        description="What the sink ran; batch: no single row reproduces the refusal.")
    key: str | None = Field(None, description="The refused row's key, as the contract's JSON values.")
    key_columns: list[str] = Field(default_factory=list)
    error: str = Field(description="The downstream's error.")
    code: int | str | None = Field(None, description="Its error number, SQLSTATE or result code.")
    upto_ts: int = Field(ge=0, description="End of the refused batch: a skip covers the key up to it.")
    worker: str = Field("", description="The member that ran the table.")


TableStopKind = Literal["refused", "unreplicable"]


@register("table.stopped", 2)
class TableStoppedV2(BaseModel):
    """A table stopped until an operator acts: its downstream refused a change for good
    (``refused``, as v1), or it cannot be replicated as the changefeed says (``unreplicable``:
    ``error`` is the reason, no statement, no key)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    table: TableRefV1
    incident: str = Field(min_length=1, description="Id an operator's action names.")
    target: str = Field("", description="Downstream schema.table (empty when the table has none).")
    kind: TableStopKind = "refused"
    statement: Literal["upsert", "delete", "batch"] | None = Field(
        None, description="What the sink ran (refused only); batch: no single row reproduces the refusal.")
    key: str | None = Field(None, description="The refused row's key, as the contract's JSON values.")
    key_columns: list[str] = Field(default_factory=list)
    error: str = Field(description="The downstream's error, or why the table cannot be replicated.")
    code: int | str | None = Field(None, description="Its error number, SQLSTATE or result code.")
    upto_ts: int = Field(ge=0, description="End of the refused batch: a skip covers the key up to it "
                                           "(unreplicable: the ts the table stopped at).")
    worker: str = Field("", description="The member that ran the table.")


# Every v1 body is a v2 body of kind "refused".
@upcaster("table.stopped", 1)
def _table_stopped_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return dict(data)


@register("table.action_requested", 1)
class TableActionRequestedV1(BaseModel):
    """An operator's decision on a stopped table's incident."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    table: TableRefV1
    incident: str = Field(min_length=1)
    action: TableAction
    requested_by: str = ""


@register("table.unique_conflict_overwritten", 1)
class UniqueConflictOverwrittenV1(BaseModel):
    """``on_unique_conflict = overwrite``: a merged target's row of another shard was removed
    because this shard's row took its unique value (one event per removed row)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    changefeed: str = Field(min_length=1)
    target: str = Field(min_length=1, description="Downstream schema.table.")
    unique_key: list[str]
    value: list[Any] = Field(description="The unique key's value, as the downstream returned it.")
    shard: str = Field(description="The span whose row took the value.")
    key: list[Any]
    other_shard: str = Field(description="The span whose row was removed, when the batch tells.")
    other_key: list[Any]
