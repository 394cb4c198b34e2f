"""The ddl domain folded (``DdlState``): the shard DDL locks as the ``LockKeeper`` holds them,
and the shards reported dropped. The ddl-lock leader writes the domain; its log folds with
``ddl_fold`` on replay, then the leader applies lock events to the keeper itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.events import shard_ddl as c
from libs.eventstore import StoredEvent
from libs.routing import TableRef
from libs.shard_ddl.convert import from_contract, ref_of
from libs.shard_ddl.lock import LockKeeper

_LOCK_EVENT_MODELS = (c.GroupChangedV1, c.LockCreatedV1, c.InfoReceivedV1, c.InfoQueuedV1, c.CaughtUpV1,
                      c.OperationIssuedV1, c.DoneReceivedV1, c.ExecFailedV1, c.ShardLeftV1, c.UnlockedV1,
                      c.LockResolvedV1, c.LockRemovedV1)
_RETURNING = (c.InfoReceivedV1, c.InfoQueuedV1, c.CaughtUpV1)


@dataclass
class DdlState:
    """The folded ddl domain: the keeper and the shards reported dropped (left out of groups
    until they send an Info again, i.e. the table was created again)."""

    keeper: LockKeeper = field(default_factory=LockKeeper)
    dropped: dict[tuple[str, TableRef], int] = field(default_factory=dict)
    live: bool = False
    """Replay done: the leader applies lock events to the keeper itself (``handle_*``), so the
    log's fold must not apply them again."""

    def fold(self, stored: StoredEvent) -> DdlState:
        ev = stored.event
        if isinstance(ev, c.ShardDroppedV1):
            self.dropped[(ev.changefeed, ref_of(ev.span))] = ev.position
            return self
        if isinstance(ev, _RETURNING):
            self.dropped.pop((ev.changefeed, ref_of(ev.span)), None)
        if isinstance(ev, _LOCK_EVENT_MODELS) and not self.live:
            event = from_contract(ev)
            self.keeper.apply(event)  # type: ignore[arg-type]
        return self


def ddl_fold(state: DdlState, stored: StoredEvent) -> DdlState:
    return state.fold(stored)
