"""Table scheduling: heartbeats, dispatches, schedule tasks, replication sets and checkpoints.

Who writes what (TiCDC scheduler v3 over NATS):

- ``member.heartbeat`` (core NATS, ``heartbeat_subject(member)``): a sink-worker's table
  report, several times a second. The member service turns it into liveness events; the
  replication-manager reads it as the member's report (TiCDC HeartbeatResponse): complete about
  once a second, and in between only the spans whose status changed since the last complete one.
- ``replication.announce`` (core NATS, ``announce_subject("replication")``): the
  replication-manager leader's epoch, so members learn about a new leader and report to it
  (TiCDC Announce). Members reject dispatches of older epochs from then on.
- ``dispatch.requested`` / ``dispatch.answered`` (request/reply on ``dispatch_subject(member)``):
  one phase of two-phase scheduling for one span, and the member's verdict with the span's state.
- ``schedule.*`` (the schedule domain stream, written by the scheduler leader): the spans each
  changefeed wants, the tasks for the replication-manager, and the operator requests.
- ``replication.*`` (the replication domain stream, written by the replication-manager
  leader): task results, replication set changes, changefeed checkpoint advances, readiness.

Operator requests (move, rebalance, drain) reach the scheduler leader as ``schedule.request``
over request/reply on ``command_subject("schedule")``; the leader answers at once with
``schedule.request_answered`` (accepted or the reason it is not), and records accepted ones in
its stream so the next leader carries them on.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contracts.registry import register, upcaster

TableStateName = Literal["absent", "preparing", "prepared", "replicating", "stopping", "stopped"]
SetStateName = Literal["absent", "prepare", "commit", "replicating", "removing"]
RoleName = Literal["primary", "secondary", "undetermined"]
DispatchActionName = Literal["add-prepare", "add-commit", "remove"]
VerdictName = Literal["accepted", "duplicate", "busy", "stale-epoch", "wrong-member", "ignored"]


class SpanRefV1(BaseModel):
    """A span: one upstream table of one source in one changefeed. ``source``, ``database`` and
    ``table`` are ROWS-stream subject tokens (``libs.streams.token``), as spans are discovered."""

    model_config = ConfigDict(extra="forbid", defer_build=True, frozen=True)
    changefeed: str = Field(min_length=1)
    source: str = Field(min_length=1)
    database: str = Field(min_length=1)
    table: str = Field(min_length=1)


class TableStatusV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    span: SpanRefV1
    state: TableStateName
    checkpoint_ts: int = Field(0, ge=0, description="Everything of the span up to this ts is downstream.")
    resolved_ts: int = Field(0, ge=0)


# ---------------------------------------------------------------- member <-> control plane


@register("member.heartbeat", 1)
class MemberHeartbeatV1(BaseModel):
    """First version: every heartbeat was the member's complete report."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    member_id: str = Field(min_length=1)
    incarnation: str = Field(min_length=1, description="Fresh per process start.")
    address: str = Field("", description="Where the member serves health and metrics.")
    draining: bool = Field(False, description="The member is shutting down: move its spans away.")
    leaving: bool = Field(False, description="Last heartbeat of a clean exit: the member is gone now.")
    epoch: int = Field(0, ge=0, description="Newest replication-manager epoch the member has seen.")
    seq: int = Field(ge=0, description="Increases with every report of this member (heartbeats and "
                                       "dispatch answers), across restarts under the same id.")
    tables: list[TableStatusV1] = Field(default_factory=list,
                                        description="Every span the member holds.")


@register("member.heartbeat", 2)
class MemberHeartbeatV2(BaseModel):
    """A sink-worker's liveness and its table report: complete (every span it holds) or, between
    complete ones, partial (``HEARTBEAT_PARTIAL_HEADER``; ``libs.scheduling.report_delta``)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    member_id: str = Field(min_length=1)
    incarnation: str = Field(min_length=1, description="Fresh per process start.")
    address: str = Field("", description="Where the member serves health and metrics.")
    draining: bool = Field(False, description="The member is shutting down: move its spans away.")
    leaving: bool = Field(False, description="Last heartbeat of a clean exit: the member is gone now.")
    epoch: int = Field(0, ge=0, description="Newest replication-manager epoch the member has seen.")
    seq: int = Field(ge=0, description="Increases with every report of this member (heartbeats and "
                                       "dispatch answers), across restarts under the same id.")
    complete: bool = Field(True, description="True: ``tables`` is every span the member holds (one it "
                                             "leaves out is absent there). False: only the spans whose "
                                             "status changed since the member's last complete report; "
                                             "the others are as that report said.")
    tables: list[TableStatusV1] = Field(default_factory=list,
                                        description="The spans the report covers (see ``complete``).")


@upcaster("member.heartbeat", 1)
def _member_heartbeat_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "complete": True}  # every v1 heartbeat was a complete report


@register("member.heartbeat", 3)
class MemberHeartbeatV3(MemberHeartbeatV2):
    """v2 that may come in several messages: a report larger than the server's max_payload
    (a member with thousands of spans) is cut into ``parts`` messages of the same ``seq``, each
    with a slice of ``tables`` (``libs.control.heartbeat_parts``); ``complete`` then speaks of
    every part's tables together. A reader takes such a report only once every part of it
    arrived; the other fields are the same in each part. A report of one message is still
    written as v2, which older readers read. ``unchanged`` came with v3 too
    (``libs.scheduling.report_delta``)."""

    part: int = Field(0, ge=0, description="Which message of the report this is, from 0.")
    parts: int = Field(1, ge=1, description="How many messages the report was cut into.")
    unchanged: bool = Field(False, description="The member's last partial report again (nothing "
                                               "changed since): ``tables`` is empty and the "
                                               "heartbeat is liveness only, not a report.")

    @model_validator(mode="after")
    def _consistent(self) -> MemberHeartbeatV3:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} of a report of {self.parts} parts")
        if self.unchanged and (self.complete or self.tables or self.parts > 1):
            raise ValueError("an unchanged heartbeat is partial, in one message, without tables")
        return self


@upcaster("member.heartbeat", 2)
def _member_heartbeat_v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "part": 0, "parts": 1, "unchanged": False}  # every v2 heartbeat was one report


@register("replication.announce", 1)
class ReplicationAnnounceV1(BaseModel):
    """The replication-manager leader's epoch; members report to it and fence older ones."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    epoch: int = Field(ge=1)
    candidate: str = Field(min_length=1)


@register("dispatch.requested", 1)
class DispatchRequestV1(BaseModel):
    """One phase of two-phase scheduling for one span on one member."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    member_id: str = Field(min_length=1)
    incarnation: str = Field(description="The member process it is meant for; another one refuses it.")
    span: SpanRefV1
    action: DispatchActionName
    checkpoint_ts: int = Field(ge=0)
    epoch: int = Field(ge=1, description="The sender's epoch; below the member's newest: refused.")


@register("dispatch.answered", 1)
class DispatchResponseV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    member_id: str = Field(min_length=1)
    incarnation: str
    verdict: VerdictName
    epoch: int = Field(ge=0, description="Newest epoch the member has seen.")
    seq: int = Field(ge=0)
    status: TableStatusV1 = Field(description="The span's state after the dispatch.")


# ---------------------------------------------------------------- schedule domain


@register("schedule.spans_changed", 1)
class SpansChangedV1(BaseModel):
    """Every span ``changefeed`` wants now (empty: none, the changefeed is paused or deleted).

    The replication-manager holds a changefeed's checkpoint until every one of these spans
    has a replication set (No Lost Table)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    changefeed: str = Field(min_length=1)
    spans: list[SpanRefV1]


@register("schedule.add_table", 1)
class AddTableV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    task_id: str = Field(min_length=1)
    span: SpanRefV1
    member_id: str = Field(min_length=1)
    checkpoint_ts: int = Field(ge=0)
    requested_by: str = ""


@register("schedule.move_table", 1)
class MoveTableV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    task_id: str = Field(min_length=1)
    span: SpanRefV1
    dest: str = Field(min_length=1)
    reason: str = Field("", description="balance, drain, rebalance or operator.")
    requested_by: str = ""


@register("schedule.remove_table", 1)
class RemoveTableV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    task_id: str = Field(min_length=1)
    span: SpanRefV1
    requested_by: str = ""


@register("schedule.request", 1)
class ScheduleRequestV1(BaseModel):
    """An operator command to the scheduler leader (request/reply, not stored as is)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    kind: Literal["move", "rebalance", "drain"]
    span: SpanRefV1 | None = Field(None, description="move: the span to move.")
    dest: str | None = Field(None, description="move: the member to move it to.")
    member_id: str | None = Field(None, description="drain: the member to empty.")
    requested_by: str = Field(min_length=1)


@register("schedule.request_answered", 1)
class ScheduleRequestAnsweredV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    accepted: bool
    reason: str = ""
    leader: str = Field("", description="Instance id of the scheduler leader that answered.")


@register("schedule.move_requested", 1)
class MoveRequestedV1(BaseModel):
    """An accepted operator move, kept until it is carried out or turns out impossible."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    span: SpanRefV1
    dest: str = Field(min_length=1)
    requested_by: str = ""


@register("schedule.rebalance_requested", 1)
class RebalanceRequestedV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    requested_by: str = ""


@register("schedule.drain_requested", 1)
class DrainRequestedV1(BaseModel):
    """An operator drain of one member process (its incarnation: a restarted one is not drained)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    member_id: str = Field(min_length=1)
    incarnation: str
    requested_by: str = ""


@register("schedule.request_done", 1)
class RequestDoneV1(BaseModel):
    """An operator move or rebalance ended: carried out (``ok``) or dropped with ``reason``."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    kind: Literal["move", "rebalance"]
    span: SpanRefV1 | None = None
    ok: bool
    reason: str = ""


# ---------------------------------------------------------------- replication domain


@register("replication.task_result", 1)
class TaskResultV1(BaseModel):
    """The replication-manager's answer to one schedule task."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    task_id: str = Field(min_length=1)
    span: SpanRefV1
    accepted: bool
    reason: str = ""


@register("replication.set_changed", 1)
class SetChangedV1(BaseModel):
    """A replication set's state, roles or conflict changed (not sent for progress alone)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    span: SpanRefV1
    state: SetStateName
    primary: str | None = None
    secondary: str | None = None
    members: dict[str, RoleName] = Field(default_factory=dict)
    error: str | None = Field(None, description="Several members may write the span: operator action.")
    error_members: list[str] = Field(default_factory=list)
    removed: bool = False
    checkpoint_ts: int = Field(0, ge=0)
    resolved_ts: int = Field(0, ge=0)


@register("replication.checkpoint_advanced", 1)
class CheckpointAdvancedV1(BaseModel):
    """A changefeed's checkpoint (min over all its spans) moved forward; never backwards."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    changefeed: str = Field(min_length=1)
    checkpoint_ts: int = Field(ge=0)
    resolved_ts: int = Field(ge=0)


@register("replication.rebuilt", 1)
class RebuiltV1(BaseModel):
    """A new leader has every live member's report and rebuilt its sets; it dispatches now."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    members: dict[str, str] = Field(description="member id -> incarnation that reported.")
    sets: int = Field(ge=0)
    waited_s: float = Field(ge=0, description="From winning the lease to the last report.")


@register("replication.member_ready", 1)
class MemberReadyV1(BaseModel):
    """A member that joined after the rebuild has reported its tables: it may get work."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    member_id: str = Field(min_length=1)
    incarnation: str
