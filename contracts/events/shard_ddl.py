"""Shard DDL coordination (the ``ddl`` control domain): the messages between sink-workers and the
ddl-lock leader, and the lock events the leader records in its domain stream.

Messages (core NATS, never stored): a worker stopped before a shard's DDL sends ``shard_ddl.info``;
the leader answers with ``shard_ddl.operation`` (exec or skip) and, when an Info seems lost,
``shard_ddl.info_request``; the worker reports ``shard_ddl.done`` (``error`` set: the exec failed)
and ``shard_ddl.shard_dropped`` when a shard's table is dropped upstream.

Events (the ``ddl`` domain stream): one per change of a lock (``libs.shard_ddl.lock``), with
wall-clock ``at`` seconds so a new leader's timers continue where the old one's stopped.
Operator decisions (``unlocked``, ``lock_removed`` with ``by``) carry who asked and why.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from contracts.registry import register

OpKindV1 = Literal["exec", "skip"]


class ShardRefV1(BaseModel):
    """One upstream table (a shard): source id, database (schema) and table."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    source: str = Field(min_length=1)
    database: str = Field(min_length=1)
    table: str = Field(min_length=1)


class TargetRefV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    database: str = Field(min_length=1)
    table: str = Field(min_length=1)


class SettledV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    span: ShardRefV1
    position: int = Field(ge=0)


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    changefeed: str = Field(min_length=1)
    target: TargetRefV1


# -- messages -------------------------------------------------------------------------------------

@register("shard_ddl.info", 1)
class ShardInfoV1(_Base):
    span: ShardRefV1
    ddls: list[str] = Field(min_length=1, description="The DDL statements, rewritten to the target.")
    position: int = Field(ge=0, description="ROWS-stream sequence of the DDL event in the span's stream.")


@register("shard_ddl.operation", 1)
class ShardOperationV1(_Base):
    instance: int = Field(ge=0)
    span: ShardRefV1
    kind: OpKindV1
    ddls: list[str]
    position: int = Field(ge=0)


@register("shard_ddl.done", 1)
class ShardDoneV1(_Base):
    instance: int = Field(ge=0)
    span: ShardRefV1
    kind: OpKindV1
    error: str | None = Field(None, description="Set when the exec failed (the worker keeps retrying).")


@register("shard_ddl.info_request", 1)
class ShardInfoRequestV1(_Base):
    span: ShardRefV1


@register("shard_ddl.shard_dropped", 1)
class ShardDroppedV1(_Base):
    """A shard's table was dropped upstream: it leaves its target's group (the merged target
    keeps the other shards' rows). Sent by the worker, recorded by the leader."""

    span: ShardRefV1
    position: int = Field(ge=0)
    reason: str = ""


@register("shard_ddl.command", 1)
class DdlCommandV1(BaseModel):
    """An operator command to the ddl-lock leader on ``command_subject("ddl")`` (request/reply,
    not stored). The answer is JSON: ``{"ok": true, "locks"|"lock": ...}``, or ``{"ok": false,
    "code", "error"}`` with 404 (no such lock), 409 (refused), 422 (invalid) or 503 (the leader
    stepped down)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    action: Literal["list", "show", "unlock", "force_remove"]
    changefeed: str | None = Field(None, description="Every action but list: the lock's changefeed.")
    target: str | None = Field(None, description="Every action but list: the downstream table, "
                                                 "``schema.table``.")
    mode: Literal["exec", "skip"] | None = Field(None, description="unlock: execute the DDL or skip it.")
    owner: str | None = Field(None, description="unlock with exec: the shard (span) that executes it.")
    requested_by: str | None = Field(None, description="unlock, force_remove: who asked.")
    reason: str | None = Field(None, description="unlock, force_remove: why.")


# -- lock events ----------------------------------------------------------------------------------

@register("shard_ddl.group_changed", 1)
class GroupChangedV1(_Base):
    shards: list[ShardRefV1]
    at: float


@register("shard_ddl.lock_created", 1)
class LockCreatedV1(_Base):
    instance: int = Field(ge=1)
    generation: int = Field(ge=0)
    owner: ShardRefV1
    ddls: list[str]
    expected: list[ShardRefV1]
    at: float


@register("shard_ddl.info_received", 1)
class InfoReceivedV1(_Base):
    instance: int = Field(ge=1)
    span: ShardRefV1
    ddls: list[str]
    position: int = Field(ge=0)
    at: float


@register("shard_ddl.info_queued", 1)
class InfoQueuedV1(_Base):
    span: ShardRefV1
    ddls: list[str]
    position: int = Field(ge=0)
    at: float


@register("shard_ddl.caught_up", 1)
class CaughtUpV1(_Base):
    span: ShardRefV1
    generation: int = Field(ge=0)
    ddls: list[str]
    position: int = Field(ge=0)
    at: float


@register("shard_ddl.operation_issued", 1)
class OperationIssuedV1(_Base):
    instance: int = Field(ge=1)
    span: ShardRefV1
    kind: OpKindV1
    ddls: list[str]
    position: int = Field(ge=0)
    at: float


@register("shard_ddl.done_received", 1)
class DoneReceivedV1(_Base):
    instance: int = Field(ge=1)
    span: ShardRefV1
    kind: OpKindV1
    at: float


@register("shard_ddl.exec_failed", 1)
class ExecFailedV1(_Base):
    instance: int = Field(ge=1)
    span: ShardRefV1
    error: str
    at: float


@register("shard_ddl.shard_left", 1)
class ShardLeftV1(_Base):
    instance: int = Field(ge=1)
    span: ShardRefV1
    reason: str
    at: float


@register("shard_ddl.unlocked", 1)
class UnlockedV1(_Base):
    instance: int = Field(ge=1)
    mode: OpKindV1
    owner: ShardRefV1 | None = None
    by: str = Field(min_length=1, description="Who asked.")
    reason: str = Field(min_length=1, description="Why.")
    at: float


@register("shard_ddl.lock_resolved", 1)
class LockResolvedV1(_Base):
    instance: int = Field(ge=1)
    settled: list[SettledV1]
    created_at: float
    at: float


@register("shard_ddl.lock_removed", 1)
class LockRemovedV1(_Base):
    instance: int = Field(ge=1)
    by: str = Field("", description="Who removed it; empty when the leader did.")
    reason: str
    settled: list[SettledV1]
    created_at: float
    at: float
