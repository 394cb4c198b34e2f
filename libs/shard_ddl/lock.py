"""Pessimistic shard DDL locks (TiDB DM's ``pessimism`` package), as a fold over events.

One lock per ``(changefeed, target)`` at a time; a lock *instance* (numbered from 1 per key)
lives from the Info that creates it until it is resolved or removed. The flow, as in DM:

1. A sink-worker whose shard span meets a DDL stops the span just before it and sends an
   ``Info{changefeed, target, span, ddls, position}`` (``ddls`` already rewritten to the
   target's table name, ``position`` = where the DDL sits in the span's stream).
2. The first Info creates the lock; its span is the *owner*. The lock expects every shard of
   the target's current group that has not passed this DDL yet (see generations below). It is
   *synced* when every expected shard has sent an Info and all DDL lists are equal (compared
   in canonical form, ``rerun.canonical_ddl``).
3. Synced: ``Operation(exec)`` to the owner, which executes the DDL on the target (re-run
   detection turns "already applied" into success) and reports done.
4. Owner done: ``Operation(skip)`` to every other shard; each skips its DDL and reports done. A
   shard resumes right after carrying out its own operation: the owner after executing, the
   others after skipping, and a skip is only sent once the target has the change.
5. Every expected shard done: the lock is *resolved*; the next DDL of any shard may lock.

State machine of one instance (``Lock.phase``)::

    waiting ──synced──> executing ──owner done──> skipping ──all done──> resolved
       │  └─ different DDLs ─> conflict ─(unlock exec|skip)─> executing | skipping
       │                       executing ─(exec failed)─> exec_failed ─(unlock skip)─> skipping
       └─ every shard left / force-remove / owner left while executing ─> removed

Every change of state is an event (the dataclasses below); the ``handle_*`` methods compute the
events *and fold them into this keeper through ``apply``*, so a keeper rebuilt by folding the
event log is equal to the live one by construction. ``handle_*`` return ``Outcome(events,
operations)``: append the events to the ddl domain stream, then send the operations. When the
append fails the leader is deposed and drops this keeper, so applying first is safe.

What the worker side must do (the contract these rules rely on): stop the span before the
DDL and send its Info, again every few seconds while no operation came, and at once on an
``InfoRequest``; carry out an operation only while stopped exactly at ``Operation.position``
(exec: rewrite, execute, treat re-run detection's "already applied" as success; skip: skip),
then send ``Operation.done()``; answer an operation for a position it has passed with its done
again and nothing else; report an exec error with ``handle_exec_failed`` and keep retrying.

Decisions (where DM is silent or we differ):

- **Exec at most once per instance.** The owner gets exactly one exec operation per instance
  (re-sent with the same id after a lost message or a leader change; the worker deduplicates
  and re-run detection absorbs a crash between executing and reporting). If the owner leaves
  the group while its exec is unanswered, nobody knows whether the DDL ran: the instance is
  removed and a new instance is formed at once from the shards still waiting, so a new owner
  executes it (with re-run detection) under a new instance number.
- **Conflicts are derived, not latched**: a shard whose DDL list differs from the lock's is a
  conflict until an operator unlock accepts it or that shard leaves. While a lock is in
  conflict it issues no operation at all.
- **Operator unlock** records a decision for the instance: ``exec`` with a chosen owner (which
  must be waiting with its Info; its DDLs become the lock's) or ``skip`` (nothing executed;
  an exec already in flight still finishes first, a failed one is superseded by a skip to its
  owner). The shards waiting at that moment are *accepted*; shards that have not arrived yet
  stay expected and get the decided operation when they come, unless their DDLs differ from
  the lock's, which is a new conflict for the operator to see.
- **Force-remove** forgets the instance and sends nothing; shards still blocked re-send their
  Info after their timeout and a fresh instance forms. Shards already settled (told to skip
  after the exec) keep their watermark. Refused while an exec is in flight: its owner could
  still execute and pass the DDL after the lock is gone.
- **Group changes.** The lock's expected shards are the group when it was created, minus
  shards that left (table dropped, span removed, changefeed paused), plus any shard that sends
  an Info (it is blocked on us, so it must be answered). A shard that joins the group while a
  lock waits is *not* expected: a table created during the DDL rollout may never send it.
- **Replays.** Every resolution records, per shard whose DDL is settled, the DDL's position (a
  watermark). A shard that replays from an older checkpoint and sends an Info at or below its
  watermark is answered with a skip at once, without a lock: otherwise a replayed DDL would
  form a lock that waits for shards that passed it long ago.
- **Generations** (DM keeps this on the worker side, ShardingMeta's sequence and activeIdx).
  Each shard counts the target's DDLs it has settled; a lock is for one generation and expects
  the shards below it. A shard that is past the lock's generation (done in it already, or it
  settled that DDL in an earlier, force-removed instance) has its Info queued for the next lock
  instead of it looking like a conflict. A shard that is behind (the others settled its next
  DDL without it, which only operator actions can cause) and sends exactly the DDL they
  settled is told to skip it at once (``CaughtUp``). A shard new to the group starts at the
  group's generation: a table created now already has the target's schema.
- **Re-sends.** ``due_resends(now)`` lists what has been awaited longer than ``resend_after``:
  an ``InfoRequest`` for a shard whose Info never came (it may be lost; a shard that has not
  reached the DDL ignores it) and the operation again for a shard whose done never came. The
  "since" times come from events; the throttle of re-sends is soft state, not folded, so after
  a leader change everything overdue is due at once, which is what a new leader wants.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from libs.routing import TableRef, Target
from libs.shard_ddl.rerun import canonical_ddl

__all__ = [
    "Awaited",
    "CaughtUp",
    "Done",
    "DoneReceived",
    "ExecFailed",
    "GroupChanged",
    "Info",
    "InfoQueued",
    "InfoReceived",
    "InfoRequest",
    "IssuedOp",
    "KeeperSnapshot",
    "Lock",
    "LockActionError",
    "LockCreated",
    "LockEvent",
    "LockKeeper",
    "LockKey",
    "LockRemoved",
    "LockResolved",
    "OpKind",
    "Operation",
    "OperationIssued",
    "Outcome",
    "ShardInfo",
    "ShardLeft",
    "UnknownGroupError",
    "Unlocked",
    "Watermark",
]

OpKind = Literal["exec", "skip"]
UnlockMode = Literal["exec", "skip"]
Phase = Literal["waiting", "conflict", "executing", "exec_failed", "skipping"]


class LockKey(NamedTuple):
    changefeed: str
    target: Target

    def __str__(self) -> str:
        return f"{self.changefeed}/{self.target}"


# -- messages (worker <-> ddl-lock) ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Info:
    """A shard stopped just before a DDL and waits for an operation."""

    changefeed: str
    target: Target
    span: TableRef
    ddls: tuple[str, ...]
    position: int
    """Where the DDL sits in the span's stream (e.g. the ROWS-stream sequence of the DDL event):
    strictly increasing per span and the same when the span replays it."""

    def __post_init__(self) -> None:
        if not self.ddls:
            raise ValueError("an Info needs at least one DDL statement")
        if self.position < 0:
            raise ValueError("an Info's position must be >= 0")

    @property
    def key(self) -> LockKey:
        return LockKey(self.changefeed, self.target)


@dataclass(frozen=True, slots=True)
class Operation:
    """What one shard must do with its DDL. ``id`` is stable across re-sends, so a worker can
    tell a re-sent operation from a new one."""

    changefeed: str
    target: Target
    instance: int
    span: TableRef
    kind: OpKind
    ddls: tuple[str, ...]
    position: int
    """The position of the shard's DDL this operation is for: a worker applies it only while
    stopped exactly there (a late operation for a DDL it passed is answered with its done)."""

    @property
    def id(self) -> str:
        s = self.span
        return f"{self.changefeed}/{self.target}#{self.instance}/{self.kind}/{s.source}:{s.schema}.{s.table}"

    def done(self) -> Done:
        return Done(self.changefeed, self.target, self.instance, self.span, self.kind)


@dataclass(frozen=True, slots=True)
class Done:
    """A shard carried out its operation (the operation echoed back, as DM's ``done=true``)."""

    changefeed: str
    target: Target
    instance: int
    span: TableRef
    kind: OpKind


@dataclass(frozen=True, slots=True)
class InfoRequest:
    """Ask a shard to send its Info again (the first may be lost)."""

    changefeed: str
    target: Target
    span: TableRef


class Outcome(NamedTuple):
    events: list[LockEvent]
    operations: list[Operation]


class LockActionError(ValueError):
    """An operator action that does not apply to the lock as it is; nothing was changed."""


class UnknownGroupError(ValueError):
    """An Info for a target whose shard group the keeper was never told."""


# -- events ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class GroupChanged:
    changefeed: str
    target: Target
    shards: tuple[TableRef, ...]
    at: float


@dataclass(frozen=True, slots=True)
class LockCreated:
    changefeed: str
    target: Target
    instance: int
    generation: int
    owner: TableRef
    ddls: tuple[str, ...]
    expected: tuple[TableRef, ...]
    at: float


@dataclass(frozen=True, slots=True)
class InfoReceived:
    changefeed: str
    target: Target
    instance: int
    span: TableRef
    ddls: tuple[str, ...]
    position: int
    at: float


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """A shard behind the others sent a DDL they all settled already, with the same text: it
    is told to skip it at once (no lock) and its generation advances."""

    changefeed: str
    target: Target
    span: TableRef
    generation: int
    ddls: tuple[str, ...]
    position: int
    at: float

    def operation(self) -> Operation:
        return Operation(self.changefeed, self.target, 0, self.span, "skip", self.ddls, self.position)


@dataclass(frozen=True, slots=True)
class InfoQueued:
    """An Info for the next instance from a shard already done in the current one."""

    changefeed: str
    target: Target
    span: TableRef
    ddls: tuple[str, ...]
    position: int
    at: float


@dataclass(frozen=True, slots=True)
class OperationIssued:
    changefeed: str
    target: Target
    instance: int
    span: TableRef
    kind: OpKind
    ddls: tuple[str, ...]
    position: int
    at: float

    def operation(self) -> Operation:
        return Operation(self.changefeed, self.target, self.instance, self.span, self.kind, self.ddls,
                         self.position)


@dataclass(frozen=True, slots=True)
class DoneReceived:
    changefeed: str
    target: Target
    instance: int
    span: TableRef
    kind: OpKind
    at: float


@dataclass(frozen=True, slots=True)
class ExecFailed:
    changefeed: str
    target: Target
    instance: int
    span: TableRef
    error: str
    at: float


@dataclass(frozen=True, slots=True)
class ShardLeft:
    changefeed: str
    target: Target
    instance: int
    span: TableRef
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class Unlocked:
    """An operator's decision for a lock instance."""

    changefeed: str
    target: Target
    instance: int
    mode: UnlockMode
    owner: TableRef | None
    by: str
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class LockResolved:
    changefeed: str
    target: Target
    instance: int
    settled: tuple[tuple[TableRef, int], ...]
    """Each shard whose DDL is in effect on the target (or decided skipped), with its position."""
    created_at: float
    at: float


@dataclass(frozen=True, slots=True)
class LockRemoved:
    changefeed: str
    target: Target
    instance: int
    by: str
    """Who removed it; "" when the keeper did (every shard left, owner left while executing)."""
    reason: str
    settled: tuple[tuple[TableRef, int], ...]
    """As in ``LockResolved``: a force-removed lock may have settled some shards already (owner
    done, skips sent); their watermarks keep a re-sent Info from forming a lock that waits for
    shards that passed the DDL."""
    created_at: float
    at: float


@dataclass(frozen=True, slots=True)
class KeeperSnapshot:
    """The whole keeper state, so a replay starts from the newest snapshot (rollup)."""

    locks: tuple[Lock, ...]
    groups: tuple[tuple[LockKey, frozenset[TableRef]], ...]
    queued: tuple[tuple[LockKey, tuple[tuple[TableRef, ShardInfo], ...]], ...]
    watermarks: tuple[tuple[tuple[LockKey, TableRef], Watermark], ...]
    generations: tuple[tuple[tuple[LockKey, TableRef], int], ...]
    history: tuple[tuple[LockKey, tuple[tuple[int, tuple[str, ...]], ...]], ...]
    last_instance: tuple[tuple[LockKey, int], ...]
    at: float


LockEvent = (GroupChanged | LockCreated | InfoReceived | InfoQueued | CaughtUp | OperationIssued
             | DoneReceived | ExecFailed | ShardLeft | Unlocked | LockResolved | LockRemoved | KeeperSnapshot)


# -- state ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ShardInfo:
    ddls: tuple[str, ...]
    position: int
    at: float
    canon: tuple[str, ...]

    @classmethod
    def of(cls, ddls: tuple[str, ...], position: int, at: float) -> ShardInfo:
        return cls(ddls, position, at, tuple(canonical_ddl(d) for d in ddls))


@dataclass(frozen=True, slots=True)
class IssuedOp:
    kind: OpKind
    ddls: tuple[str, ...]
    position: int
    at: float


@dataclass(frozen=True, slots=True)
class Watermark:
    position: int
    instance: int
    target: Target


@dataclass(frozen=True, slots=True)
class Awaited:
    what: Literal["info", "done"]
    since: float


@dataclass
class Lock:
    """One lock instance. Mutated only by ``LockKeeper.apply``."""

    changefeed: str
    target: Target
    instance: int
    generation: int
    """Which DDL of the target's sequence this is (1 = the first since the group was known)."""
    owner: TableRef | None
    ddls: tuple[str, ...]
    canon: tuple[str, ...]
    created_at: float
    expected: set[TableRef] = field(default_factory=set)
    infos: dict[TableRef, ShardInfo] = field(default_factory=dict)
    """Shards waiting at their DDL, in arrival order (the order picks a new owner)."""
    ops: dict[TableRef, IssuedOp] = field(default_factory=dict)
    done: dict[TableRef, float] = field(default_factory=dict)
    exec_span: TableRef | None = None
    exec_error: str | None = None
    mode: Literal["auto", "exec", "skip"] = "auto"
    accepted: set[TableRef] = field(default_factory=set)
    left: dict[TableRef, str] = field(default_factory=dict)
    left_infos: dict[TableRef, ShardInfo] = field(default_factory=dict)
    unlocks: list[Unlocked] = field(default_factory=list)
    settled_before: tuple[str, ...] | None = None
    """The DDLs other shards already settled at this generation (an earlier instance that was
    force-removed after some shards passed it); None when there is none or an operator has
    decided since."""

    @property
    def key(self) -> LockKey:
        return LockKey(self.changefeed, self.target)

    @property
    def id(self) -> str:
        return f"{self.key}#{self.instance}"

    @property
    def conflict(self) -> dict[TableRef, tuple[str, ...]]:
        """Waiting shards whose DDLs differ from the lock's and no operator has accepted."""
        return {s: i.ddls for s, i in self.infos.items() if s not in self.accepted and i.canon != self.canon}

    @property
    def settled_conflict(self) -> bool:
        """The lock's DDLs differ from what other shards already settled at this generation."""
        return (self.settled_before is not None
                and tuple(canonical_ddl(d) for d in self.settled_before) != self.canon)

    @property
    def in_conflict(self) -> bool:
        return bool(self.conflict) or self.settled_conflict

    @property
    def synced(self) -> bool:
        return all(s in self.infos for s in self.expected) and not self.in_conflict

    @property
    def exec_completed(self) -> bool:
        """The exec operation was carried out (the target has the DDL)."""
        s = self.exec_span
        return s is not None and s in self.done and self.ops[s].kind == "exec"

    @property
    def phase(self) -> Phase:
        if self.in_conflict:
            return "conflict"
        s = self.exec_span
        if s is not None and s not in self.done and self.ops[s].kind == "exec":
            return "exec_failed" if self.exec_error is not None else "executing"
        return "skipping" if self.ops else "waiting"

    def awaited(self) -> dict[TableRef, Awaited]:
        """Expected shards the lock still waits for: their Info, or their done."""
        out: dict[TableRef, Awaited] = {}
        for s in sorted(self.expected):
            if s not in self.infos:
                out[s] = Awaited("info", self.created_at)
            elif s in self.ops and s not in self.done:
                out[s] = Awaited("done", self.ops[s].at)
        return out

    def blocked(self) -> list[TableRef]:
        """Shards stopped at their DDL (Info sent, no done yet)."""
        return [s for s in self.infos if s not in self.done]

    def operation(self, span: TableRef) -> Operation | None:
        op = self.ops.get(span)
        if op is None:
            return None
        return Operation(self.changefeed, self.target, self.instance, span, op.kind, op.ddls, op.position)

    def settled(self) -> tuple[tuple[TableRef, int], ...]:
        """Shards whose DDL needs nothing more (see ``LockResolved.settled``)."""
        out = []
        for span, info in [*self.infos.items(), *self.left_infos.items()]:
            op = self.ops.get(span)
            if (span in self.done or (op is not None and op.kind == "skip")
                    or (self.exec_completed and info.canon == self.canon)):
                out.append((span, info.position))
        return tuple(sorted(out))

    def next_operations(self) -> list[tuple[TableRef, OpKind]]:
        """Operations due now, by the rules in the module doc (none while in conflict)."""
        if self.in_conflict:
            return []
        out: list[tuple[TableRef, OpKind]] = []
        waiting = [s for s in self.infos if s not in self.ops]
        if self.mode == "skip":
            s = self.exec_span
            if s is not None and s not in self.done:
                # An exec in flight finishes first; a failed one is superseded by a skip.
                if self.exec_error is not None and self.ops[s].kind == "exec":
                    out.append((s, "skip"))
                return out
            return [(w, "skip") for w in waiting]
        if self.exec_span is None:
            ready = self.owner is not None and self.owner in self.infos
            if ready and (self.synced or self.mode == "exec"):
                assert self.owner is not None
                out.append((self.owner, "exec"))
            return out
        if self.exec_completed:
            out.extend((w, "skip") for w in waiting)
        return out


# -- the keeper -----------------------------------------------------------------------------------

class LockKeeper:
    """Every lock of the ddl-lock leader, plus what it needs to open the next ones."""

    def __init__(self, *, resend_after: float = 30.0) -> None:
        self.resend_after = resend_after
        self.locks: dict[LockKey, Lock] = {}
        self.groups: dict[LockKey, frozenset[TableRef]] = {}
        self.queued: dict[LockKey, dict[TableRef, ShardInfo]] = {}
        self.watermarks: dict[tuple[LockKey, TableRef], Watermark] = {}
        # How many of the target's DDLs each shard has settled, and the settled DDLs by
        # generation that some shard of the group may still be behind on.
        self.generations: dict[tuple[LockKey, TableRef], int] = {}
        self.history: dict[LockKey, dict[int, tuple[str, ...]]] = {}  # generation -> DDLs settled
        self.last_instance: dict[LockKey, int] = {}
        # Soft state, not folded (see module doc): when each awaited item was last re-sent.
        self._nudged: dict[tuple[LockKey, int, TableRef, str], float] = {}

    # -- fold -------------------------------------------------------------------------------------

    @classmethod
    def rebuild(cls, events: Iterable[LockEvent], *, resend_after: float = 30.0) -> LockKeeper:
        keeper = cls(resend_after=resend_after)
        for event in events:
            keeper.apply(event)
        return keeper

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LockKeeper):
            return NotImplemented
        return self._state() == other._state()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def _state(self) -> tuple[object, ...]:
        return (self.locks, self.groups, {k: v for k, v in self.queued.items() if v}, self.watermarks,
                self.generations, self.history, self.last_instance)

    def apply(self, event: LockEvent) -> None:
        """Fold one event. Pure state transition: no decisions, no clocks."""
        if isinstance(event, KeeperSnapshot):
            snap = copy.deepcopy(event)
            self.locks = {lk.key: lk for lk in snap.locks}
            self.groups = dict(snap.groups)
            self.queued = {k: dict(v) for k, v in snap.queued}
            self.watermarks = dict(snap.watermarks)
            self.generations = dict(snap.generations)
            self.history = {k: dict(v) for k, v in snap.history}
            self.last_instance = dict(snap.last_instance)
            return
        key = LockKey(event.changefeed, event.target)
        if isinstance(event, GroupChanged):
            # A shard new to the group starts where the group is: a table created now has the
            # target's current schema, so it is not behind on DDLs settled before it existed.
            old = self.groups.get(key, frozenset())
            default = max((self.generations[(key, s)] for s in old if (key, s) in self.generations),
                          default=0)
            for s in event.shards:
                self.generations.setdefault((key, s), default)
            self.groups[key] = frozenset(event.shards)
            return
        if isinstance(event, CaughtUp):
            gk = (key, event.span)
            self.generations[gk] = max(self.generations.get(gk, 0), event.generation)
            self._raise_watermark(gk, Watermark(event.position, 0, event.target))
            self._unqueue(key, event.span)
            return
        if isinstance(event, InfoQueued):
            self.queued.setdefault(key, {})[event.span] = ShardInfo.of(event.ddls, event.position, event.at)
            return
        if isinstance(event, LockCreated):
            self.locks[key] = Lock(event.changefeed, event.target, event.instance, event.generation,
                                   event.owner, event.ddls, tuple(canonical_ddl(d) for d in event.ddls),
                                   event.at, expected=set(event.expected),
                                   settled_before=self.history.get(key, {}).get(event.generation))
            self.last_instance[key] = event.instance
            return
        lock = self.locks[key]
        if lock.instance != event.instance:
            raise ValueError(f"event for {key}#{event.instance} but the lock is #{lock.instance}: {event}")
        if isinstance(event, InfoReceived):
            info = ShardInfo.of(event.ddls, event.position, event.at)
            lock.infos[event.span] = info
            lock.expected.add(event.span)
            lock.left.pop(event.span, None)
            lock.left_infos.pop(event.span, None)
            self._unqueue(key, event.span)
            if lock.owner is None:
                lock.owner, lock.ddls, lock.canon = event.span, info.ddls, info.canon
        elif isinstance(event, OperationIssued):
            lock.ops[event.span] = IssuedOp(event.kind, event.ddls, event.position, event.at)
            if event.kind == "exec":
                lock.exec_span = event.span
        elif isinstance(event, DoneReceived):
            lock.done[event.span] = event.at
            if event.span == lock.exec_span:
                lock.exec_error = None
        elif isinstance(event, ExecFailed):
            lock.exec_error = event.error
        elif isinstance(event, ShardLeft):
            lock.expected.discard(event.span)
            lock.left[event.span] = event.reason
            info_left = lock.infos.pop(event.span, None)
            if info_left is not None:
                lock.left_infos[event.span] = info_left
            self._unqueue(key, event.span)
            if lock.owner == event.span and lock.exec_span is None:
                # Nothing executed yet: the next waiting shard (by arrival) owns the lock.
                nxt = next(iter(lock.infos), None)
                lock.owner = nxt
                if nxt is not None:
                    lock.ddls, lock.canon = lock.infos[nxt].ddls, lock.infos[nxt].canon
        elif isinstance(event, Unlocked):
            lock.mode = event.mode
            lock.accepted |= set(lock.infos)
            lock.settled_before = None  # the operator has seen it and decided
            lock.unlocks.append(event)
            if event.mode == "exec" and event.owner is not None:
                lock.owner = event.owner
                lock.ddls, lock.canon = lock.infos[event.owner].ddls, lock.infos[event.owner].canon
        elif isinstance(event, LockResolved | LockRemoved):
            del self.locks[key]
            for span, position in event.settled:
                gk = (key, span)
                self._raise_watermark(gk, Watermark(position, event.instance, event.target))
                # One settled DDL is one generation, also for a shard that was behind and took
                # part (in conflict) in a lock of a later generation.
                self.generations[gk] = self._generation(key, span) + 1
            if event.settled:
                self.history.setdefault(key, {})[lock.generation] = lock.ddls
            # Nobody in the group can be behind on generations every member has settled.
            group = self.groups.get(key, frozenset())
            floor = min((self.generations.get((key, s), 0) for s in group), default=0)
            hist = {g: c for g, c in self.history.get(key, {}).items() if g > floor}
            if hist:
                self.history[key] = hist
            else:
                self.history.pop(key, None)
        else:  # pragma: no cover - the union is exhaustive
            raise TypeError(f"not a lock event: {event!r}")

    def _raise_watermark(self, gk: tuple[LockKey, TableRef], wm: Watermark) -> None:
        old = self.watermarks.get(gk)
        if old is None or wm.position >= old.position:
            self.watermarks[gk] = wm

    def _unqueue(self, key: LockKey, span: TableRef) -> None:
        q = self.queued.get(key)
        if q is not None:
            q.pop(span, None)
            if not q:
                del self.queued[key]

    def snapshot(self, now: float) -> KeeperSnapshot:
        snap = KeeperSnapshot(
            locks=tuple(self.locks.values()),
            groups=tuple(self.groups.items()),
            queued=tuple((k, tuple(v.items())) for k, v in self.queued.items()),
            watermarks=tuple(self.watermarks.items()),
            generations=tuple(self.generations.items()),
            history=tuple((k, tuple(v.items())) for k, v in self.history.items()),
            last_instance=tuple(self.last_instance.items()),
            at=now,
        )
        return copy.deepcopy(snap)

    # -- handlers ---------------------------------------------------------------------------------

    def _emit(self, out: list[LockEvent], *events: LockEvent) -> None:
        for e in events:
            self.apply(e)
            out.append(e)

    def handle_group(self, changefeed: str, target: Target, shards: Collection[TableRef], now: float,
                     reason: str = "left the shard group") -> Outcome:
        """The target's shard group is now ``shards``: shards gone from it leave the lock."""
        key = LockKey(changefeed, target)
        out: list[LockEvent] = []
        new = frozenset(shards)
        if self.groups.get(key) != new:
            self._emit(out, GroupChanged(changefeed, target, tuple(sorted(new)), now))
        lock = self.locks.get(key)
        if lock is not None:
            gone = sorted((lock.expected | set(self.queued.get(key, {}))) - new)
            for span in gone:
                self._emit(out, ShardLeft(changefeed, target, lock.instance, span, reason, now))
        return self._finish(key, now, out)

    def handle_shard_left(self, changefeed: str, target: Target, span: TableRef, reason: str,
                          now: float) -> Outcome:
        """One shard left for good (table dropped, span removed from the changefeed)."""
        group = self.groups.get(LockKey(changefeed, target))
        if group is None:
            return Outcome([], [])  # no group, hence no lock: nothing waits for this shard
        return self.handle_group(changefeed, target, group - {span}, now, reason)

    def handle_changefeed_stopped(self, changefeed: str, reason: str, now: float) -> Outcome:
        """Paused or deleted: every shard of every target of the changefeed leaves."""
        events: list[LockEvent] = []
        ops: list[Operation] = []
        keys = sorted({k for k in [*self.groups, *self.locks] if k.changefeed == changefeed})
        for key in keys:
            e, o = self.handle_group(changefeed, key.target, (), now, reason)
            events += e
            ops += o
        return Outcome(events, ops)

    def handle_info(self, info: Info, now: float, shards: Collection[TableRef] | None = None) -> Outcome:
        """A shard waits at a DDL. ``shards``: the target's current group, when the caller has it
        (required for the first Info of a target the keeper has no group for)."""
        key = info.key
        out: list[LockEvent] = []
        resend: list[Operation] = []
        if shards is not None:
            out += self.handle_group(info.changefeed, info.target, shards, now).events
        wm = self.watermarks.get((key, info.span))
        if wm is not None and info.position <= wm.position:
            # A replay of a DDL settled by an earlier lock: skip it, no lock needed.
            resend.append(Operation(info.changefeed, info.target, wm.instance, info.span, "skip", info.ddls,
                                    info.position))
            return Outcome(out, resend + self._operations(out))
        if key not in self.groups:
            raise UnknownGroupError(f"no shard group known for {key}: pass the target's shards with its "
                                    "first Info")
        lock = self.locks.get(key)
        existing = lock.infos.get(info.span) if lock is not None else None
        if lock is not None and existing is not None and info.position <= existing.position:
            if info.position == existing.position:
                # The same Info again: the shard still waits, so what we sent it may be lost.
                resend += self._answer_again(lock, info)
            # An older position than the one it waits at: not where its protocol says it is; the
            # lock keeps showing what it awaits from it.
        else:
            item = ShardInfo.of(info.ddls, info.position, now)
            verdict = self._classify(key, info.span, item.canon)
            if verdict == "create":
                self._emit(out, *self._create(key, info.span, item, now))
            elif verdict == "join":
                assert lock is not None
                self._emit(out, InfoReceived(info.changefeed, info.target, lock.instance, info.span,
                                             info.ddls, info.position, now))
                # A shard that left and came back may hold an operation it never answered, or
                # replay a DDL it already carried out.
                resend += self._answer_again(lock, info)
            elif verdict == "behind":
                self._emit(out, self._caught_up(key, info.span, item, now))
            elif info.span not in self.queued.get(key, {}):
                self._emit(out, InfoQueued(info.changefeed, info.target, info.span, info.ddls, info.position,
                                           now))
        outcome = self._finish(key, now, out)
        return Outcome(outcome.events, resend + outcome.operations)

    def _answer_again(self, lock: Lock, info: Info) -> list[Operation]:
        if info.span in lock.done:
            # It carried out its operation and then replayed the DDL (restart from an older
            # checkpoint): the target has the change either way, so skip.
            return [Operation(info.changefeed, info.target, lock.instance, info.span, "skip", info.ddls,
                              info.position)]
        op = lock.operation(info.span)
        return [op] if op is not None else []

    def _generation(self, key: LockKey, span: TableRef) -> int:
        g = self.generations.get((key, span))
        if g is not None:
            return g
        group = self.groups.get(key, frozenset())  # a stranger counts as a newcomer to the group
        return max((self.generations.get((key, s), 0) for s in group), default=0)

    def _classify(self, key: LockKey, span: TableRef, canon: tuple[str, ...]
                  ) -> Literal["create", "join", "behind", "queue"]:
        """Where an Info that is not a re-send belongs, by the shard's generation:

        - ``behind``: the group settled the shard's next generation without it, with this very
          DDL (after operator actions): skip it at once;
        - ``queue``: the shard is past the current lock's DDL (done in it, or settled it in an
          earlier instance): the Info waits for the next lock;
        - ``join`` the current lock, or ``create`` one.
        """
        g = self._generation(key, span)
        settled = self.history.get(key, {}).get(g + 1)
        if settled is not None and tuple(canonical_ddl(d) for d in settled) == canon:
            lock = self.locks.get(key)
            if lock is None or g + 1 < lock.generation:
                return "behind"
        lock = self.locks.get(key)
        if lock is None:
            return "create"
        if span in lock.infos or g >= lock.generation:
            return "queue"
        return "join"

    def _create(self, key: LockKey, owner: TableRef, item: ShardInfo, now: float) -> list[LockEvent]:
        cf, target = key
        instance = self.last_instance.get(key, 0) + 1
        generation = self._generation(key, owner) + 1
        group = self.groups.get(key, frozenset())
        # Shards already past this generation are not waited for (they queue their next DDL).
        expected = {s for s in group if self._generation(key, s) < generation} | {owner}
        return [LockCreated(cf, target, instance, generation, owner, item.ddls, tuple(sorted(expected)), now),
                InfoReceived(cf, target, instance, owner, item.ddls, item.position, item.at)]

    def _caught_up(self, key: LockKey, span: TableRef, item: ShardInfo, now: float) -> CaughtUp:
        return CaughtUp(key.changefeed, key.target, span, self._generation(key, span) + 1, item.ddls,
                        item.position, now)

    def handle_done(self, done: Done, now: float) -> Outcome:
        key = LockKey(done.changefeed, done.target)
        lock = self.locks.get(key)
        if lock is None or lock.instance != done.instance or done.span not in lock.expected:
            return Outcome([], [])  # stale: an earlier instance, or a shard no longer in the lock
        op = lock.ops.get(done.span)
        if op is None or op.kind != done.kind or done.span in lock.done:
            return Outcome([], [])  # not what we asked it, or a duplicate
        out: list[LockEvent] = []
        self._emit(out, DoneReceived(done.changefeed, done.target, done.instance, done.span, done.kind, now))
        return self._finish(key, now, out)

    def handle_exec_failed(self, done: Done, error: str, now: float) -> Outcome:
        """The owner could not execute (and re-run detection did not say "already applied").
        Recorded for the operator; the worker may keep retrying."""
        key = LockKey(done.changefeed, done.target)
        lock = self.locks.get(key)
        if (lock is None or lock.instance != done.instance or lock.exec_span != done.span
                or done.span in lock.done or lock.ops[done.span].kind != "exec" or lock.exec_error == error):
            return Outcome([], [])
        out: list[LockEvent] = []
        self._emit(out, ExecFailed(done.changefeed, done.target, done.instance, done.span, error, now))
        return self._finish(key, now, out)

    def unlock(self, changefeed: str, target: Target, mode: UnlockMode, *, by: str, reason: str, now: float,
               owner: TableRef | None = None) -> Outcome:
        """Operator: decide the lock (see module doc). Raises ``LockActionError`` when it does not
        apply; nothing is changed then."""
        lock = self._lock_for_action(changefeed, target, by, reason)
        if mode == "exec":
            if owner is None:
                raise LockActionError(f"lock {lock.id}: unlock with exec needs the owner that executes")
            # Only a shard stopped at the DDL with no operation yet can execute it: one that was
            # told to skip may already have passed it.
            free = [s for s in lock.infos if s not in lock.ops]
            if owner not in free:
                waiting = ", ".join(str(s) for s in free) or "none"
                raise LockActionError(f"lock {lock.id}: {owner} is not waiting at the DDL without an "
                                      f"operation, so it cannot execute it (candidates: {waiting})")
            if lock.exec_span is not None:
                raise LockActionError(f"lock {lock.id}: exec was already sent to {lock.exec_span}; "
                                      "unlock with skip, or force-remove to start over")
        elif mode == "skip":
            if owner is not None:
                raise LockActionError(f"lock {lock.id}: unlock with skip executes nothing; "
                                      "do not name an owner")
        else:
            raise LockActionError(f"unknown unlock mode {mode!r}: use 'exec' or 'skip'")
        out: list[LockEvent] = []
        self._emit(out, Unlocked(changefeed, target, lock.instance, mode, owner, by, reason, now))
        return self._finish(lock.key, now, out)

    def force_remove(self, changefeed: str, target: Target, *, by: str, reason: str, now: float) -> Outcome:
        """Operator: forget the lock instance; blocked shards re-send and a new instance forms."""
        lock = self._lock_for_action(changefeed, target, by, reason)
        if lock.exec_span is not None and lock.exec_span not in lock.done:
            # The owner may still execute it after the lock is gone and move past the DDL, and
            # the next instance would wait for it forever. Nothing needs this: a lost exec is
            # re-sent, an owner that leaves starts a new instance, a failed one is unlocked.
            raise LockActionError(
                f"lock {lock.id}: exec is in flight to {lock.exec_span}; wait for its done, or unlock "
                "with skip if it failed")
        out: list[LockEvent] = []
        self._emit(out, LockRemoved(changefeed, target, lock.instance, by, reason, lock.settled(),
                                    lock.created_at, now))
        return self._finish(lock.key, now, out)

    def _lock_for_action(self, changefeed: str, target: Target, by: str, reason: str) -> Lock:
        if not by.strip() or not reason.strip():
            raise LockActionError("an operator action needs who asks (by) and why (reason)")
        lock = self.locks.get(LockKey(changefeed, target))
        if lock is None:
            raise LockActionError(f"no shard DDL lock for {changefeed}/{target}")
        return lock

    # -- progress ---------------------------------------------------------------------------------

    def _finish(self, key: LockKey, now: float, out: list[LockEvent]) -> Outcome:
        """Take every step the rules allow after a change, and collect the operations."""
        while True:
            step = self._next_step(key, now)
            if not step:
                break
            self._emit(out, *step)
        return Outcome(out, self._operations(out))

    @staticmethod
    def _operations(events: list[LockEvent]) -> list[Operation]:
        return [e.operation() for e in events if isinstance(e, OperationIssued | CaughtUp)]

    def _next_step(self, key: LockKey, now: float) -> list[LockEvent]:
        lock = self.locks.get(key)
        cf, target = key
        # Queued Infos (next DDLs of shards that were ahead) go first, one per step, so each is
        # classified against the lock as the previous one left it.
        for span, item in list(self.queued.get(key, {}).items()):
            verdict = self._classify(key, span, item.canon)
            if verdict == "create":
                return self._create(key, span, item, now)
            if verdict == "behind":
                return [self._caught_up(key, span, item, now)]
            if verdict == "join":
                assert lock is not None
                return [InfoReceived(cf, target, lock.instance, span, item.ddls, item.position, item.at)]
        if lock is None:
            return []
        if lock.exec_span is not None and lock.exec_span not in lock.expected \
                and lock.exec_span not in lock.done:
            return self._reinstance(lock, now)
        if not lock.expected:
            settled = lock.settled()
            if settled:
                return [LockResolved(cf, target, lock.instance, settled, lock.created_at, now)]
            return [LockRemoved(cf, target, lock.instance, "", "every shard left the group before the DDL "
                                "was settled", (), lock.created_at, now)]
        if all(s in lock.done for s in lock.expected):
            return [LockResolved(cf, target, lock.instance, lock.settled(), lock.created_at, now)]
        # exec carries the lock's DDLs (what the target gets); a skip carries the shard's own, which
        # is what that shard is stopped at.
        return [OperationIssued(cf, target, lock.instance, span, kind,
                                lock.ddls if kind == "exec" else lock.infos[span].ddls,
                                lock.infos[span].position, now)
                for span, kind in lock.next_operations()]

    def _reinstance(self, lock: Lock, now: float) -> list[LockEvent]:
        cf, target = lock.key
        assert lock.exec_span is not None
        step: list[LockEvent] = [LockRemoved(
            cf, target, lock.instance, "",
            f"owner {lock.exec_span} left while executing; whether the DDL ran is unknown, so the shards "
            "still waiting form a new lock whose owner runs it again with re-run detection",
            lock.settled(), lock.created_at, now)]
        # (settled is empty in practice: no skip goes out before the exec's done.)
        settled = {s for s, _ in lock.settled()}
        waiting = {s: i for s, i in lock.infos.items() if s not in settled}
        if waiting:
            (first, info), *_ = waiting.items()
            instance = lock.instance + 1
            step.append(LockCreated(cf, target, instance, lock.generation, first, info.ddls,
                                    tuple(sorted(lock.expected - settled)), now))
            step += [InfoReceived(cf, target, instance, s, i.ddls, i.position, i.at)
                     for s, i in waiting.items()]
        return step

    # -- queries ----------------------------------------------------------------------------------

    def lock(self, changefeed: str, target: Target) -> Lock | None:
        return self.locks.get(LockKey(changefeed, target))

    def __iter__(self) -> Iterator[Lock]:
        return iter(self.locks.values())

    def pending_operations(self) -> list[Operation]:
        """Every issued operation without a done: what a new leader re-sends after its rebuild."""
        out = []
        for lock in self.locks.values():
            for span in lock.ops:
                op = lock.operation(span)
                if op is not None and span in lock.expected and span not in lock.done:
                    out.append(op)
        return out

    def due_resends(self, now: float) -> list[Operation | InfoRequest]:
        """What has been awaited for ``resend_after`` or longer since it was last asked for. The
        items returned count as re-sent now (soft state, see module doc)."""
        out: list[Operation | InfoRequest] = []
        for lock in self.locks.values():
            for span, aw in lock.awaited().items():
                if (aw.what == "done" and span == lock.exec_span and lock.exec_error is not None
                        and lock.ops[span].kind == "exec"):
                    continue  # the owner reported a failure: it has the operation
                nk = (lock.key, lock.instance, span, aw.what)
                last = max(aw.since, self._nudged.get(nk, aw.since))
                if now - last < self.resend_after:
                    continue
                self._nudged[nk] = now
                if aw.what == "info":
                    out.append(InfoRequest(lock.changefeed, lock.target, span))
                else:
                    op = lock.operation(span)
                    assert op is not None
                    out.append(op)
        return out

    def blocked_shards(self) -> int:
        """Shards stopped at a DDL across all locks (a metric)."""
        return sum(len(lock.blocked()) for lock in self.locks.values())
