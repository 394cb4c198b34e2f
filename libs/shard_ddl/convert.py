"""Lock events and messages (``libs.shard_ddl.lock`` dataclasses) to and from their contracts
(``contracts.events.shard_ddl``). Field names match one to one; only the value shapes differ:
``TableRef``/``Target`` travel as objects, tuples as lists, settled pairs as ``{span, position}``."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel

from contracts.events import shard_ddl as c
from libs.routing import TableRef, Target
from libs.shard_ddl.lock import (
    CaughtUp,
    Done,
    DoneReceived,
    ExecFailed,
    GroupChanged,
    Info,
    InfoQueued,
    InfoReceived,
    InfoRequest,
    LockCreated,
    LockEvent,
    LockRemoved,
    LockResolved,
    Operation,
    OperationIssued,
    ShardLeft,
    Unlocked,
)

__all__ = ["done_contract", "done_of", "from_contract", "ref_of", "shard_ref", "target_of", "target_ref",
           "to_contract"]

_PAIRS: list[tuple[type[Any], type[BaseModel]]] = [
    (GroupChanged, c.GroupChangedV1), (LockCreated, c.LockCreatedV1), (InfoReceived, c.InfoReceivedV1),
    (InfoQueued, c.InfoQueuedV1), (CaughtUp, c.CaughtUpV1), (OperationIssued, c.OperationIssuedV1),
    (DoneReceived, c.DoneReceivedV1), (ExecFailed, c.ExecFailedV1), (ShardLeft, c.ShardLeftV1),
    (Unlocked, c.UnlockedV1), (LockResolved, c.LockResolvedV1), (LockRemoved, c.LockRemovedV1),
    (Info, c.ShardInfoV1), (Operation, c.ShardOperationV1), (InfoRequest, c.ShardInfoRequestV1),
]
_TO = dict(_PAIRS)
_FROM = {model: cls for cls, model in _PAIRS}

_REF_FIELDS = {"span", "owner"}
_REF_LISTS = {"shards", "expected"}


def shard_ref(ref: TableRef) -> c.ShardRefV1:
    return c.ShardRefV1(source=ref.source, database=ref.schema, table=ref.table)


def ref_of(model: c.ShardRefV1) -> TableRef:
    return TableRef(model.source, model.database, model.table)


def target_ref(target: Target) -> c.TargetRefV1:
    return c.TargetRefV1(database=target.schema, table=target.table)


def target_of(model: c.TargetRefV1) -> Target:
    return Target(model.database, model.table)


def _out(name: str, value: Any) -> Any:
    if name == "target":
        return target_ref(value)
    if name in _REF_FIELDS:
        return None if value is None else shard_ref(value)
    if name in _REF_LISTS:
        return [shard_ref(r) for r in value]
    if name == "settled":
        return [c.SettledV1(span=shard_ref(r), position=p) for r, p in value]
    if isinstance(value, tuple):
        return list(value)
    return value


def _in(name: str, value: Any) -> Any:
    if name == "target":
        return target_of(value)
    if name in _REF_FIELDS:
        return None if value is None else ref_of(value)
    if name in _REF_LISTS:
        return tuple(ref_of(r) for r in value)
    if name == "settled":
        return tuple((ref_of(s.span), s.position) for s in value)
    if isinstance(value, list):
        return tuple(value)
    return value


def to_contract(item: LockEvent | Info | Operation | InfoRequest) -> BaseModel:
    model = _TO.get(type(item))
    if model is None:
        raise TypeError(f"no contract for {type(item).__name__}")
    fields = {f.name: _out(f.name, getattr(item, f.name)) for f in dataclasses.fields(item)}
    return model(**fields)


def from_contract(model: BaseModel) -> LockEvent | Info | Operation | InfoRequest:
    """The lock-side value of a contract (``shard_ddl.done`` and ``shard_dropped`` are handled by
    the service: they carry more than a ``Done``)."""
    cls = _FROM.get(type(model))
    if cls is None:
        raise TypeError(f"{type(model).__name__} is not a lock event or message")
    kwargs = {f.name: _in(f.name, getattr(model, f.name)) for f in dataclasses.fields(cls)}
    result: LockEvent | Info | Operation | InfoRequest = cls(**kwargs)
    return result


def done_of(model: c.ShardDoneV1) -> Done:
    return Done(model.changefeed, target_of(model.target), model.instance, ref_of(model.span), model.kind)


def done_contract(done: Done, error: str | None = None) -> c.ShardDoneV1:
    return c.ShardDoneV1(changefeed=done.changefeed, target=target_ref(done.target), instance=done.instance,
                         span=shard_ref(done.span), kind=done.kind, error=error)
