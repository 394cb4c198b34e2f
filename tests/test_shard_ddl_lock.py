"""The pessimistic shard DDL lock keeper: scenarios, then a simulation under random interleavings.

Scenarios pin each rule of ``libs.shard_ddl.lock`` (its module doc is the spec). The property
test runs one keeper against simulated sink-workers over a lossy network, with shard leaves,
operator actions, exec failures, worker replays and leader rebuilds drawn by hypothesis, and
checks after every step:

- a lock instance issues at most one exec;
- no skip goes out before the exec's done in that instance (the superseding skip to an owner
  whose exec failed, and skips after an operator's skip decision, are the only other skips);
- no exec is issued while the lock is in conflict;
- a keeper rebuilt by folding the event log (also from a snapshot) equals the live one;
- after the network heals (and an operator settles conflicts and failed execs), every lock
  resolves and every remaining shard has passed all its DDLs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.routing import TableRef, Target
from libs.shard_ddl import (
    CaughtUp,
    Done,
    DoneReceived,
    ExecFailed,
    Info,
    InfoQueued,
    InfoRequest,
    KeeperSnapshot,
    Lock,
    LockActionError,
    LockCreated,
    LockEvent,
    LockKeeper,
    LockKey,
    LockRemoved,
    LockResolved,
    Operation,
    OperationIssued,
    Outcome,
    ShardLeft,
    UnknownGroupError,
    Unlocked,
)

CF = "cf"
T = Target("shop", "orders")
A = TableRef("s1", "shop_1", "orders_1")
B = TableRef("s1", "shop_2", "orders_2")
C = TableRef("s2", "shop_1", "orders_1")
GROUP = (A, B, C)
ADD = ("ALTER TABLE `shop`.`orders` ADD COLUMN c int",)
ADD_OTHER = ("ALTER TABLE `shop`.`orders` ADD COLUMN c bigint",)


class Harness:
    """A keeper plus the event log it produced (what the domain stream would hold)."""

    def __init__(self, resend_after: float = 10.0) -> None:
        self.keeper = LockKeeper(resend_after=resend_after)
        self.log: list[LockEvent] = []
        self.now = 0.0

    def _take(self, outcome: Outcome) -> list[Operation]:
        self.log.extend(outcome.events)
        return outcome.operations

    def info(self, span: TableRef, ddls: tuple[str, ...] = ADD, position: int = 10,
             shards: tuple[TableRef, ...] | None = GROUP) -> list[Operation]:
        self.now += 1
        return self._take(self.keeper.handle_info(Info(CF, T, span, ddls, position), self.now, shards))

    def done(self, op: Operation) -> list[Operation]:
        self.now += 1
        return self._take(self.keeper.handle_done(op.done(), self.now))

    def leave(self, span: TableRef, reason: str = "table dropped") -> list[Operation]:
        self.now += 1
        return self._take(self.keeper.handle_shard_left(CF, T, span, reason, self.now))

    def unlock(self, mode: str, owner: TableRef | None = None) -> list[Operation]:
        self.now += 1
        return self._take(self.keeper.unlock(CF, T, mode, by="alice", reason="checked",  # type: ignore[arg-type]
                                             now=self.now, owner=owner))

    def force_remove(self) -> list[Operation]:
        self.now += 1
        return self._take(self.keeper.force_remove(CF, T, by="alice", reason="stuck", now=self.now))

    @property
    def lock(self) -> Lock:
        lock = self.keeper.lock(CF, T)
        assert lock is not None, "no lock"
        return lock

    @property
    def no_lock(self) -> bool:
        return self.keeper.lock(CF, T) is None

    def rebuilt(self) -> LockKeeper:
        return LockKeeper.rebuild(self.log)


def kinds(ops: list[Operation]) -> list[tuple[TableRef, str]]:
    return [(op.span, op.kind) for op in ops]


# -- the main flow --------------------------------------------------------------------------------

def test_happy_path_exec_then_skips_then_resolved() -> None:
    h = Harness()
    assert h.info(A) == []
    lock = h.lock
    assert lock.owner == A and lock.instance == 1 and lock.phase == "waiting"
    assert lock.awaited().keys() == {B, C}
    assert h.info(B) == []
    ops = h.info(C)
    assert kinds(ops) == [(A, "exec")]
    assert ops[0].ddls == ADD and ops[0].position == 10
    assert h.lock.phase == "executing" and h.lock.synced
    assert kinds(h.done(ops[0])) == [(B, "skip"), (C, "skip")]
    assert h.lock.phase == "skipping"
    skips = [op for op in h.keeper.pending_operations() if op.kind == "skip"]
    assert h.done(skips[0]) == []
    assert not h.no_lock
    h.done(skips[1])
    assert h.no_lock
    resolved = [e for e in h.log if isinstance(e, LockResolved)]
    assert len(resolved) == 1 and dict(resolved[0].settled) == {A: 10, B: 10, C: 10}
    assert h.rebuilt() == h.keeper


def test_single_shard_group_executes_at_once() -> None:
    h = Harness()
    assert kinds(h.info(A, shards=(A,))) == [(A, "exec")]


def test_equal_ddls_compare_in_canonical_form() -> None:
    h = Harness()
    h.info(A, ("ALTER TABLE `shop`.`orders` ADD COLUMN c int;",))
    h.info(B, ("alter table `shop`.`orders`\n  add column `c` INT  /* from shard 2 */",))
    assert kinds(h.info(C)) == [(A, "exec")]


def test_unknown_group_is_refused() -> None:
    h = Harness()
    with pytest.raises(UnknownGroupError):
        h.info(A, shards=None)
    assert h.log == []


def test_a_shard_outside_the_known_group_is_added_when_it_sends_an_info() -> None:
    h = Harness()
    h.info(A, shards=(A, B))
    stranger = TableRef("s3", "shop_9", "orders_9")
    h.info(stranger, shards=None)
    assert stranger in h.lock.expected
    ops = h.info(B, shards=None)
    assert kinds(ops) == [(A, "exec")]
    assert {op.span for op in h.done(ops[0])} == {B, stranger}


# -- conflicts and the operator -------------------------------------------------------------------

def test_conflict_is_visible_and_executes_nothing() -> None:
    h = Harness()
    h.info(A)
    h.info(B, ADD_OTHER)
    assert h.info(C) == []
    lock = h.lock
    assert lock.phase == "conflict"
    assert lock.ddls == ADD and lock.conflict == {B: ADD_OTHER}
    assert not any(isinstance(e, OperationIssued) for e in h.log)


def test_unlock_skip_skips_everyone_and_resolves() -> None:
    h = Harness()
    h.info(A)
    h.info(B, ADD_OTHER)
    h.info(C)
    ops = h.unlock("skip")
    assert sorted(kinds(ops)) == sorted([(A, "skip"), (B, "skip"), (C, "skip")])
    unlocked = [e for e in h.log if isinstance(e, Unlocked)]
    assert unlocked[0].by == "alice" and unlocked[0].reason == "checked"
    for op in ops:
        h.done(op)
    assert h.no_lock
    assert not any(isinstance(e, OperationIssued) and e.kind == "exec" for e in h.log)


def test_unlock_exec_with_chosen_owner_runs_its_ddls() -> None:
    h = Harness()
    h.info(A)
    h.info(B, ADD_OTHER)
    ops = h.unlock("exec", owner=B)
    assert kinds(ops) == [(B, "exec")] and ops[0].ddls == ADD_OTHER
    assert h.lock.owner == B
    assert kinds(h.done(ops[0])) == [(A, "skip")]
    # C had not arrived at the unlock; it is still expected and gets its skip when it comes
    # with the DDL that was executed...
    assert kinds(h.info(C, ADD_OTHER)) == [(C, "skip")]


def test_a_late_shard_with_yet_another_ddl_is_a_new_conflict() -> None:
    h = Harness()
    h.info(A)
    h.info(B, ADD_OTHER)
    h.done(h.unlock("exec", owner=B)[0])
    assert h.info(C, ("ALTER TABLE `shop`.`orders` DROP COLUMN d",)) == []
    assert h.lock.phase == "conflict" and set(h.lock.conflict) == {C}


@pytest.mark.parametrize("action", ["no_by", "no_lock", "exec_no_owner", "exec_not_waiting",
                                    "exec_twice", "skip_with_owner", "bad_mode"])
def test_operator_actions_that_do_not_apply_change_nothing(action: str) -> None:
    h = Harness()
    if action != "no_lock":
        h.info(A)
        h.info(B, ADD_OTHER)
    before = list(h.log)
    k = h.keeper
    with pytest.raises(LockActionError) as err:
        if action == "no_by":
            k.unlock(CF, T, "skip", by=" ", reason="x", now=1)
        elif action == "no_lock":
            k.force_remove(CF, T, by="alice", reason="x", now=1)
        elif action == "exec_no_owner":
            k.unlock(CF, T, "exec", by="alice", reason="x", now=1)
        elif action == "exec_not_waiting":
            k.unlock(CF, T, "exec", by="alice", reason="x", now=1, owner=C)
        elif action == "exec_twice":
            h.unlock("exec", owner=A)
            before = list(h.log)
            k.unlock(CF, T, "exec", by="alice", reason="x", now=1, owner=B)
        elif action == "skip_with_owner":
            k.unlock(CF, T, "skip", by="alice", reason="x", now=1, owner=A)
        else:
            k.unlock(CF, T, "maybe", by="alice", reason="x", now=1)  # type: ignore[arg-type]
    assert str(err.value)
    assert h.log == before and h.rebuilt() == k


def test_force_remove_forgets_the_instance_and_a_new_one_forms() -> None:
    h = Harness()
    h.info(A)
    h.info(B, ADD_OTHER)
    assert h.force_remove() == []
    removed = next(e for e in h.log if isinstance(e, LockRemoved))
    assert removed.by == "alice" and removed.reason == "stuck" and removed.settled == ()
    assert h.no_lock
    h.info(B, ADD_OTHER)  # B re-sends after its timeout
    assert h.lock.instance == 2 and h.lock.owner == B


def test_force_remove_after_the_exec_keeps_settled_shards_settled() -> None:
    h = Harness()
    h.info(A)
    h.info(B)
    exec_op = h.info(C)[0]
    skips = h.done(exec_op)
    h.force_remove()
    # B and C were told to skip (the target has the change): when they re-send, they get the
    # skip again at once instead of forming a lock that would wait for A, which has moved on.
    for op in skips:
        again = h.info(op.span)
        assert kinds(again) == [(op.span, "skip")]
    assert h.no_lock


# -- shards leaving -------------------------------------------------------------------------------

def test_a_shard_leaving_lets_the_lock_sync() -> None:
    h = Harness()
    h.info(A)
    h.info(B)
    ops = h.leave(C)
    assert kinds(ops) == [(A, "exec")]
    left = [e for e in h.log if isinstance(e, ShardLeft)]
    assert left[0].span == C and left[0].reason == "table dropped"
    assert C in h.lock.left


def test_the_owner_leaving_before_exec_hands_the_lock_on() -> None:
    h = Harness()
    h.info(A)
    h.info(B, ADD_OTHER)
    h.leave(A)
    assert h.lock.owner == B and h.lock.ddls == ADD_OTHER and not h.lock.conflict
    assert kinds(h.info(C, ADD_OTHER)) == [(B, "exec")]


def test_the_owner_leaving_while_executing_starts_a_new_instance() -> None:
    h = Harness()
    h.info(A)
    h.info(B)
    exec_op = h.info(C)[0]
    ops = h.leave(A)
    assert kinds(ops) == [(B, "exec")]
    assert ops[0].instance == 2
    assert h.lock.instance == 2 and h.lock.expected == {B, C}
    removed = [e for e in h.log if isinstance(e, LockRemoved)]
    assert removed[0].by == "" and "left while executing" in removed[0].reason
    assert h.done(exec_op) == []  # the old owner's late done belongs to instance 1
    assert h.rebuilt() == h.keeper


def test_every_shard_leaving_removes_or_resolves() -> None:
    h = Harness()
    h.info(A)
    h.info(B)
    h.leave(A)
    h.leave(B)
    h.leave(C)
    assert h.no_lock
    assert next(e for e in h.log if isinstance(e, LockRemoved)).settled == ()


def test_changefeed_paused_after_the_exec_settles_the_waiting_shards() -> None:
    h = Harness()
    h.info(A)
    h.info(B)
    h.done(h.info(C)[0])
    h.now += 1
    outcome = h.keeper.handle_changefeed_stopped(CF, "changefeed paused", h.now)
    h.log.extend(outcome.events)
    assert h.no_lock
    resolved = next(e for e in h.log if isinstance(e, LockResolved))
    assert dict(resolved.settled) == {A: 10, B: 10, C: 10}
    # On resume every shard replays its DDL: it is skipped at once, no lock forms.
    assert kinds(h.info(B)) == [(B, "skip")]
    assert h.no_lock


# -- lost, duplicated and late messages -----------------------------------------------------------

def test_a_duplicate_info_re_sends_the_operation() -> None:
    h = Harness()
    h.info(A)
    h.info(B)
    exec_op = h.info(C)[0]
    n = len(h.log)
    assert h.info(A) == [exec_op]  # the owner never got it
    assert len(h.log) == n


def test_duplicate_and_stale_dones_are_ignored() -> None:
    h = Harness()
    h.info(A, shards=(A, B))
    exec_op = h.info(B, shards=None)[0]
    skip = h.done(exec_op)[0]
    n = len(h.log)
    assert h.done(exec_op) == [] and len(h.log) == n
    wrong_kind = Done(CF, T, 1, B, "exec")
    assert h.keeper.handle_done(wrong_kind, 99).events == []
    h.done(skip)
    assert h.keeper.handle_done(skip.done(), 100).events == []


def test_due_resends_ask_for_lost_infos_and_dones_and_are_throttled() -> None:
    h = Harness(resend_after=10)
    h.info(A)  # created at t=1
    assert h.keeper.due_resends(5) == []
    due = h.keeper.due_resends(11)
    assert due == [InfoRequest(CF, T, B), InfoRequest(CF, T, C)]
    assert h.keeper.due_resends(15) == []
    assert len(h.keeper.due_resends(21)) == 2
    h.now = 30
    h.info(B)
    exec_op = h.info(C)[0]  # issued at t=32
    assert h.keeper.due_resends(35) == []
    assert h.keeper.due_resends(42) == [exec_op]


def test_replay_of_a_resolved_ddl_is_skipped_without_a_lock() -> None:
    h = Harness()
    h.info(A, shards=(A, B))
    skip = h.done(h.info(B, shards=None)[0])[0]
    h.done(skip)
    assert h.no_lock
    n = len(h.log)
    ops = h.info(A, shards=None)  # A restarted from a checkpoint before its DDL
    assert kinds(ops) == [(A, "skip")] and ops[0].position == 10 and ops[0].instance == 1
    assert len(h.log) == n  # nothing recorded
    assert h.info(A, position=20, shards=None) == [] and h.lock.instance == 2  # its next DDL locks


def test_a_done_shard_replaying_its_ddl_gets_a_skip() -> None:
    h = Harness()
    h.info(A)
    h.info(B)
    exec_op = h.info(C)[0]
    h.done(exec_op)
    ops = h.info(A)  # the owner crashed after reporting done and replays the DDL
    assert kinds(ops) == [(A, "skip")]


def test_the_next_ddl_of_a_done_shard_is_queued_for_the_next_instance() -> None:
    h = Harness()
    h.info(A)
    h.info(B)
    skips = h.done(h.info(C)[0])
    second = ("ALTER TABLE `shop`.`orders` ADD COLUMN d int",)
    assert h.info(A, second, position=20) == []
    assert any(isinstance(e, InfoQueued) for e in h.log)
    assert h.lock.instance == 1 and h.lock.conflict == {}
    h.done(skips[0])
    h.done(skips[1])
    lock = h.lock
    assert lock.instance == 2 and lock.owner == A and lock.ddls == second
    assert lock.expected == {A, B, C} and set(lock.infos) == {A}
    assert h.rebuilt() == h.keeper


# -- generations: shards out of step after operator actions --------------------------------------

NEXT = ("ALTER TABLE `shop`.`orders` ADD COLUMN d int",)


def skew(h: Harness) -> None:
    """A and B settle ADD (operator skip, then force-remove) while C never reached it."""
    h.info(A)
    h.info(B)
    for op in h.unlock("skip"):
        h.done(op)
    h.force_remove()
    assert h.keeper.generations[(LockKey(CF, T), A)] == 1 and h.keeper.generations[(LockKey(CF, T), C)] == 0


def test_a_shard_behind_with_the_settled_ddl_catches_up_at_once() -> None:
    h = Harness()
    skew(h)
    n = len(h.log)
    ops = h.info(C)
    assert kinds(ops) == [(C, "skip")] and ops[0].position == 10
    assert h.no_lock and [type(e) for e in h.log[n:]] == [CaughtUp]
    assert h.keeper.generations[(LockKey(CF, T), C)] == 1
    assert kinds(h.info(C)) == [(C, "skip")]  # and a replay of it is skipped by its watermark
    assert h.rebuilt() == h.keeper


def test_a_shard_ahead_queues_instead_of_conflicting() -> None:
    h = Harness()
    skew(h)
    assert h.info(A, NEXT, position=20) == []  # generation 2 lock, expects everyone
    assert h.lock.generation == 2 and h.lock.expected == {A, B, C}
    assert kinds(h.info(C)) == [(C, "skip")]  # C is behind: catches up, no conflict
    h.info(B, NEXT, position=20)
    assert kinds(h.info(C, NEXT, position=20)) == [(A, "exec")]


def test_a_shard_behind_with_a_different_ddl_is_a_conflict_not_a_lone_exec() -> None:
    h = Harness()
    skew(h)
    assert h.info(C, ADD_OTHER) == []  # expected only C, but the others settled ADD here
    lock = h.lock
    assert lock.generation == 1 and lock.expected == {C}
    assert lock.phase == "conflict" and lock.settled_conflict and lock.settled_before == ADD
    assert kinds(h.unlock("skip")) == [(C, "skip")]


def test_a_shard_new_to_the_group_starts_at_the_groups_generation() -> None:
    h = Harness()
    h.info(A, shards=(A, B))
    for op in h.done(h.info(B, shards=(A, B))[0]):
        h.done(op)
    h.now += 1
    h.log += h.keeper.handle_group(CF, T, (A, B, C), h.now).events
    assert h.keeper.generations[(LockKey(CF, T), C)] == 1
    h.info(A, NEXT, position=20, shards=None)
    assert h.lock.expected == {A, B, C}


# -- exec failures --------------------------------------------------------------------------------

def test_exec_failure_is_visible_and_unlock_skip_supersedes_it() -> None:
    h = Harness(resend_after=10)
    h.info(A)
    h.info(B)
    exec_op = h.info(C)[0]
    h.now += 1
    h.log += h.keeper.handle_exec_failed(exec_op.done(), "Duplicate column name 'c'", h.now).events
    assert h.lock.phase == "exec_failed" and h.lock.exec_error == "Duplicate column name 'c'"
    assert [e for e in h.keeper.due_resends(1000) if isinstance(e, Operation)] == []
    ops = h.unlock("skip")
    assert kinds(ops) == [(A, "skip")]  # the others wait for the owner's done
    assert sorted(kinds(h.done(ops[0]))) == [(B, "skip"), (C, "skip")]
    assert any(isinstance(e, ExecFailed) for e in h.log)


def test_an_exec_that_succeeds_after_a_failure_clears_the_error() -> None:
    h = Harness()
    h.info(A, shards=(A, B))
    exec_op = h.info(B, shards=None)[0]
    h.log += h.keeper.handle_exec_failed(exec_op.done(), "lock wait timeout", 5).events
    assert kinds(h.done(exec_op)) == [(B, "skip")]
    assert h.lock.exec_error is None


# -- rebuild --------------------------------------------------------------------------------------

def test_rebuild_from_the_log_and_from_a_snapshot_equals_the_live_keeper() -> None:
    h = Harness()
    h.info(A)
    h.info(B, ADD_OTHER)
    h.unlock("skip")
    snap = h.keeper.snapshot(h.now)
    tail_start = len(h.log)
    for op in list(h.keeper.pending_operations()):
        h.done(op)
    h.info(C)
    assert h.rebuilt() == h.keeper
    from_snapshot = LockKeeper.rebuild([snap, *h.log[tail_start:]])
    assert from_snapshot == h.keeper
    # the snapshot is a copy: later changes to the live keeper do not leak into it
    assert isinstance(snap, KeeperSnapshot) and snap.locks[0].done == {}


def test_a_new_leader_re_sends_every_pending_operation() -> None:
    h = Harness()
    h.info(A)
    h.info(B)
    skips = h.done(h.info(C)[0])
    new = h.rebuilt()
    assert sorted(new.pending_operations(), key=lambda o: o.span) == sorted(skips, key=lambda o: o.span)


def test_metrics_helpers() -> None:
    h = Harness()
    h.info(A)
    h.info(B)
    assert h.keeper.blocked_shards() == 2
    assert [lk.id for lk in h.keeper] == ["cf/shop.orders#1"]
    created = next(e for e in h.log if isinstance(e, LockCreated))
    assert h.lock.created_at == created.at


# == the simulation ===============================================================================

T2 = Target("shop", "customers")
DDL_COUNT = 2


def ddl_text(k: int, variant: int) -> tuple[str, ...]:
    # Equal DDLs arrive in different spellings; variant 1 is a genuinely different DDL.
    if variant == 1:
        return (f"ALTER TABLE `shop`.`t` ADD COLUMN c{k} bigint",)
    spell = [f"ALTER TABLE `shop`.`t` ADD COLUMN c{k} int", f"alter table `shop`.`t`  add column `c{k}` INT;"]
    return (spell[k % 2],)


@dataclass
class SimShard:
    ref: TableRef
    target: Target
    variants: list[int]
    next_ddl: int = 0  # index of the DDL it reaches next (or is stopped at)
    stopped: bool = False
    gone: bool = False
    failed_ops: set[str] = field(default_factory=set)

    def position(self, k: int) -> int:
        return 10 * (k + 1)

    def info(self) -> Info:
        k = self.next_ddl
        return Info(CF, self.target, self.ref, ddl_text(k, self.variants[k]), self.position(k))


class Sim:
    def __init__(self, sizes: tuple[int, int], variants: list[int]) -> None:
        self.keeper = LockKeeper(resend_after=5)
        self.log: list[LockEvent] = []
        self.now = 0.0
        self.net: list[Info | Operation | Done] = []
        self.shards: list[SimShard] = []
        vi = iter(variants)
        for target, n in ((T, sizes[0]), (T2, sizes[1])):
            for i in range(n):
                ref = TableRef(f"s{i % 2}", f"db_{i}", target.table)
                self.shards.append(SimShard(ref, target, [next(vi, 0) for _ in range(DDL_COUNT)]))
        for target in (T, T2):
            self.take(self.keeper.handle_group(CF, target, self.group(target), self.now))

    def group(self, target: Target) -> list[TableRef]:
        return [s.ref for s in self.shards if s.target == target and not s.gone]

    def shard(self, ref: TableRef) -> SimShard:
        return next(s for s in self.shards if s.ref == ref)

    def take(self, outcome: Outcome) -> None:
        start = len(self.log)
        self.log.extend(outcome.events)
        self.check_new_events(start)
        self.net.extend(outcome.operations)

    # -- invariants over the log -------------------------------------------------------------------

    def check_new_events(self, start: int) -> None:
        checker = LockKeeper.rebuild(self.log[:start])
        for e in self.log[start:]:
            if isinstance(e, OperationIssued) and e.kind == "exec":
                lock = checker.locks[(e.changefeed, e.target)]  # type: ignore[index]
                assert not lock.in_conflict, f"exec issued while in conflict: {e}"
            checker.apply(e)
        check_log(self.log)

    # -- workers -----------------------------------------------------------------------------------

    def worker_gets(self, op: Operation) -> None:
        s = self.shard(op.span)
        if s.gone:
            return
        current = s.position(s.next_ddl) if s.next_ddl < DDL_COUNT else None
        if s.stopped and op.position == current:
            if op.kind == "exec" and op.id in s.failed_ops:
                return  # it keeps failing until an operator acts or a re-send finds it fixed
            s.stopped = False
            s.next_ddl += 1
            self.net.append(op.done())
        elif current is None or op.position < current or (op.position == current and not s.stopped):
            self.net.append(op.done())  # an operation for a DDL it passed: answer again

    def reach(self, s: SimShard) -> None:
        if not s.gone and not s.stopped and s.next_ddl < DDL_COUNT:
            s.stopped = True
            self.net.append(s.info())

    def deliver(self, msg: Info | Operation | Done) -> None:
        self.now += 1
        if isinstance(msg, Info):
            if not self.shard(msg.span).gone:
                self.take(self.keeper.handle_info(msg, self.now))
        elif isinstance(msg, Operation):
            self.worker_gets(msg)
        else:
            self.take(self.keeper.handle_done(msg, self.now))

    # -- actions -----------------------------------------------------------------------------------

    def step(self, action: str, a: int, b: int) -> None:
        live = [s for s in self.shards if not s.gone]
        if action == "reach" and live:
            self.reach(live[a % len(live)])
        elif action == "deliver" and self.net:
            self.deliver(self.net.pop(a % len(self.net)))
        elif action == "drop" and self.net:
            self.net.pop(a % len(self.net))
        elif action == "dup" and self.net:
            self.net.append(self.net[a % len(self.net)])
        elif action == "resend" and live:
            s = live[a % len(live)]
            if s.stopped:
                self.net.append(s.info())
        elif action == "tick":
            self.now += 1 + b % 10
            for item in self.keeper.due_resends(self.now):
                if isinstance(item, InfoRequest):
                    s = self.shard(item.span)
                    if s.stopped and not s.gone:
                        self.net.append(s.info())
                else:
                    self.net.append(item)
        elif action == "leave" and live:
            s = live[a % len(live)]
            s.gone = True
            self.now += 1
            self.take(self.keeper.handle_shard_left(CF, s.target, s.ref, "table dropped", self.now))
        elif action == "replay" and live:
            # The worker restarts from a checkpoint before the DDL it passed last.
            s = live[a % len(live)]
            if s.next_ddl > 0 and not s.stopped:
                s.next_ddl -= 1
                s.stopped = True
                self.net.append(s.info())
        elif action == "fail":
            ops = [m for m in self.net if isinstance(m, Operation) and m.kind == "exec"]
            if ops:
                op = ops[a % len(ops)]
                s = self.shard(op.span)
                if s.stopped and op.position == s.position(s.next_ddl) and not s.gone:
                    s.failed_ops.add(op.id)
                    self.now += 1
                    self.take(self.keeper.handle_exec_failed(op.done(), "boom", self.now))
        elif action == "fixed":
            for s in self.shards:
                s.failed_ops.clear()
        elif action in ("unlock_skip", "unlock_exec", "force_remove"):
            target = (T, T2)[b % 2]
            lock = self.keeper.lock(CF, target)
            self.now += 1
            try:
                if action == "unlock_skip":
                    self.take(self.keeper.unlock(CF, target, "skip", by="op", reason="test", now=self.now))
                elif action == "force_remove":
                    self.take(self.keeper.force_remove(CF, target, by="op", reason="test", now=self.now))
                else:
                    waiting = list(lock.infos) if lock is not None else []
                    owner = waiting[a % len(waiting)] if waiting else None
                    self.take(self.keeper.unlock(CF, target, "exec", by="op", reason="test", now=self.now,
                                                 owner=owner))
            except LockActionError:
                pass
        elif action == "rebuild":
            new = LockKeeper.rebuild(self.log, resend_after=self.keeper.resend_after)
            assert new == self.keeper
            self.keeper = new
            self.net.extend(new.pending_operations())
        elif action == "snapshot":
            snap = self.keeper.snapshot(self.now)
            assert LockKeeper.rebuild([snap]) == self.keeper

    # -- quiescence --------------------------------------------------------------------------------

    def settle(self) -> None:
        """Heal the network; an operator settles conflicts and failed execs; run to the end."""
        for _ in range(200):
            for s in self.shards:
                s.failed_ops.clear()
                self.reach(s)
            while self.net:
                self.deliver(self.net.pop(0))
            for lock in list(self.keeper):
                if lock.phase in ("conflict", "exec_failed"):
                    self.now += 1
                    self.take(self.keeper.unlock(CF, lock.target, "skip", by="op", reason="settle",
                                                 now=self.now))
            self.now += 10
            for s in self.shards:
                if s.stopped and not s.gone:
                    self.net.append(s.info())  # the worker's own re-send timer
            for item in self.keeper.due_resends(self.now):
                if isinstance(item, InfoRequest):
                    s = self.shard(item.span)
                    if s.stopped and not s.gone:
                        self.net.append(s.info())
                else:
                    self.net.append(item)
            if not self.net and not list(self.keeper) and all(
                    s.gone or (s.next_ddl == DDL_COUNT and not s.stopped) for s in self.shards):
                return
        stuck = {lk.id: (lk.phase, lk.awaited()) for lk in self.keeper}
        shards = [(s.ref, s.next_ddl, s.stopped, s.gone) for s in self.shards]
        raise AssertionError(f"did not settle: locks {stuck}, shards {shards}")


def check_log(log: list[LockEvent]) -> None:
    """Invariants over the whole event log (it spans leader rebuilds)."""
    execs: Counter[tuple[object, int]] = Counter()
    exec_span: dict[tuple[object, int], TableRef] = {}
    exec_done: set[tuple[object, int]] = set()
    failed: set[tuple[object, int]] = set()
    skip_decided: set[tuple[object, int]] = set()
    owner_skipped: set[tuple[object, int]] = set()
    for e in log:
        if isinstance(e, KeeperSnapshot) or not hasattr(e, "instance"):
            continue
        inst = ((e.changefeed, e.target), e.instance)
        if isinstance(e, OperationIssued) and e.kind == "exec":
            execs[inst] += 1
            assert execs[inst] == 1, f"second exec in {inst}: {e}"
            exec_span[inst] = e.span
        elif isinstance(e, DoneReceived) and e.kind == "exec":
            exec_done.add(inst)
        elif isinstance(e, DoneReceived) and e.span == exec_span.get(inst):
            owner_skipped.add(inst)  # the skip that superseded a failed exec
        elif isinstance(e, ExecFailed):
            failed.add(inst)
        elif isinstance(e, Unlocked) and e.mode == "skip":
            skip_decided.add(inst)
        elif isinstance(e, OperationIssued) and e.kind == "skip":
            if inst in exec_span:
                if e.span == exec_span[inst]:
                    assert inst in failed and inst in skip_decided, f"owner skipped without cause: {e}"
                else:
                    assert inst in exec_done or inst in owner_skipped, f"skip before the owner's done: {e}"
            else:
                assert inst in skip_decided, f"skip without exec nor operator decision: {e}"


ACTIONS = ["reach", "reach", "deliver", "deliver", "deliver", "deliver", "drop", "dup", "resend", "tick",
           "leave", "replay", "fail", "fixed", "unlock_skip", "unlock_exec", "force_remove", "rebuild",
           "snapshot"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.tuples(st.integers(2, 4), st.integers(1, 2)),
    variants=st.lists(st.sampled_from([0, 0, 0, 1]), max_size=12),
    steps=st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 50), st.integers(0, 50)), max_size=60),
)
def test_random_interleavings_keep_the_lock_safe_and_it_resolves(
        sizes: tuple[int, int], variants: list[int], steps: list[tuple[str, int, int]]) -> None:
    sim = Sim(sizes, variants)
    for action, a, b in steps:
        sim.step(action, a, b)
    assert LockKeeper.rebuild(sim.log) == sim.keeper
    sim.settle()
    assert LockKeeper.rebuild(sim.log) == sim.keeper
    check_log(sim.log)
