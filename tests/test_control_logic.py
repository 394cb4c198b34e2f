"""The control plane's service logic without processes: member liveness, the scheduler's and
the replication-manager's cores, the folds and their snapshots; and the sink-worker agent and
the stream follower against a real nats-server (no Spark)."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import zlib
from uuid import uuid4

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from contracts import REGISTRY
from contracts.events.leadership import LeaderElectedV1
from contracts.events.members import MemberDrainingV1, MemberJoinedV2, MemberLeftV1
from contracts.events.scheduling import (
    AddTableV1,
    CheckpointAdvancedV1,
    DispatchRequestV1,
    DispatchResponseV1,
    MemberHeartbeatV3,
    MemberReadyV1,
    MoveRequestedV1,
    MoveTableV1,
    RebuiltV1,
    RemoveTableV1,
    ReplicationAnnounceV1,
    RequestDoneV1,
    ScheduleRequestV1,
    SetChangedV1,
    SpansChangedV1,
    TaskResultV1,
)
from libs.control.convert import span_of, span_ref, status_ref
from libs.control.follow import DomainFollower
from libs.control.members import MembersState, MemberTracker, members_fold
from libs.control.replication_state import ReplicationState
from libs.control.schedule_state import ScheduleState
from libs.eventstore import DomainLog
from libs.scheduling import MoveTable, Span, TableState, TableStatus
from libs.streams import announce_subject, dispatch_subject, heartbeat_subject
from services.replication_manager.core import ReplicationCore
from services.scheduler.core import Pending, SchedulerCore
from services.sink_worker.agent import SinkAgent

EPOCH = 10
REPL = TableState.REPLICATING
SPANS = [Span("cf", "src", "db", f"t{i}") for i in range(4)]


def hb(member: str, incarnation: str = "i1", *, seq: int = 1, epoch: int = EPOCH, draining: bool = False,
       leaving: bool = False, tables: list[TableStatus] | None = None) -> MemberHeartbeatV3:
    return MemberHeartbeatV3(member_id=member, incarnation=incarnation, draining=draining, leaving=leaving,
                             epoch=epoch, seq=seq, tables=[status_ref(t) for t in tables or []])


# ---------------------------------------------------------------- member liveness


def _apply(state: MembersState, events: list) -> list[str]:  # type: ignore[type-arg]
    for e in events:
        state.apply(e)
    return [type(e).__name__ for e in events]


def test_member_tracker_join_drain_ttl_and_replacement() -> None:
    state = MembersState()
    t = MemberTracker(state, ttl_s=5.0, now=0.0)
    assert _apply(state, t.on_heartbeat(hb("w1"), 0.0)) == ["MemberJoinedV2"]
    assert _apply(state, t.on_heartbeat(hb("w1"), 1.0)) == []
    assert _apply(state, t.on_heartbeat(hb("w1", draining=True), 2.0)) == ["MemberDrainingV1"]
    assert state.members["w1"].draining
    assert _apply(state, t.expire(6.9)) == []
    # A restart under the same id: the old process left, the new one joined.
    assert _apply(state, t.on_heartbeat(hb("w1", "i2"), 3.0)) == ["MemberLeftV1", "MemberJoinedV2"]
    assert state.incarnation("w1") == "i2" and not state.members["w1"].draining
    # A late heartbeat of the previous process cannot bring it back.
    assert _apply(state, t.on_heartbeat(hb("w1", "i1"), 3.5)) == []
    assert t.ignored == 1
    assert _apply(state, t.expire(8.1)) == ["MemberLeftV1"]
    assert state.members == {}


def test_member_tracker_clean_leave_and_replayed_members_get_a_full_ttl() -> None:
    state = MembersState()
    state.apply(MemberJoinedV2(member_id="w1", incarnation="i1"))
    state.apply(MemberJoinedV2(member_id="w2", incarnation="i1"))
    t = MemberTracker(state, ttl_s=5.0, now=100.0)  # a new leader after a replay
    assert _apply(state, t.expire(104.0)) == []
    left = t.on_heartbeat(hb("w1", leaving=True), 104.5)
    assert isinstance(left[0], MemberLeftV1) and left[0].reason == "shutdown"
    _apply(state, left)
    expired = t.expire(105.5)
    assert [(e.member_id, e.reason) for e in expired] == [("w2", "ttl-expired")]  # type: ignore[attr-defined]


def test_members_state_snapshot_round_trip() -> None:
    state = MembersState()
    for e in (MemberJoinedV2(member_id="a", incarnation="1", address="h:1"),
              MemberJoinedV2(member_id="b", incarnation="2"),
              MemberDrainingV1(member_id="b", incarnation="2"),
              MemberLeftV1(member_id="a", incarnation="1", reason="ttl-expired"),
              LeaderElectedV1(service="member", candidate="m", epoch=3)):
        state.apply(e)
    again = MembersState.restore(state.dump())
    assert again == state


# ---------------------------------------------------------------- folds


def _set_changed(span: Span, state: str, primary: str | None, ckpt: int = 0, **kw: object) -> SetChangedV1:
    members = {primary: "primary"} if primary else {}
    return SetChangedV1(span=span_ref(span), state=state, primary=primary, members=members,  # type: ignore[arg-type]
                        checkpoint_ts=ckpt, resolved_ts=ckpt, **kw)  # type: ignore[arg-type]


def test_replication_state_folds_and_snapshots_compactly() -> None:
    state = ReplicationState()
    state.apply(LeaderElectedV1(service="replication-manager", candidate="r", epoch=7))
    assert not state.ready
    state.apply(_set_changed(SPANS[0], "replicating", "w1", 50))
    state.apply(_set_changed(SPANS[1], "replicating", "w2", 40))
    state.apply(SetChangedV1(span=span_ref(SPANS[1]), state="absent", removed=True))
    state.apply(CheckpointAdvancedV1(changefeed="cf", checkpoint_ts=30, resolved_ts=35))
    state.apply(CheckpointAdvancedV1(changefeed="cf", checkpoint_ts=20, resolved_ts=20))  # never lowers
    state.apply(RebuiltV1(members={"w1": "i"}, sets=1, waited_s=0.1))
    state.apply(MemberReadyV1(member_id="w2", incarnation="j"))
    assert list(state.sets) == [SPANS[0]] and state.index.load("w1") == 1
    assert state.checkpoints == {"cf": (30, 35)}
    assert state.ready and state.ready_members == {"w1": "i", "w2": "j"}
    assert state.known_spans() == {SPANS[0]: (50, 50)}
    again = ReplicationState.restore(state.dump())
    assert (again.sets, again.checkpoints, again.ready, again.ready_members, again.epoch) == (
        state.sets, state.checkpoints, state.ready, state.ready_members, state.epoch)
    # Large states are plain JSON (the event store compresses and chunks them); snapshots
    # written before that carry the compressed dump, and restore still reads them.
    big = ReplicationState()
    for i in range(20_000):
        span = Span(f"cf{i % 7}", "src", f"db{i % 50}", f"table_{i}")
        big.apply(_set_changed(span, "replicating", f"w{i % 9}", i))
    dumped = big.dump()
    assert len(dumped["sets"]) == 20_000
    old_style = {"zlib": base64.b64encode(zlib.compress(json.dumps(dumped).encode())).decode()}
    for restored in (ReplicationState.restore(dumped), ReplicationState.restore(old_style)):
        assert restored.sets == big.sets and restored.index.load("w3") == big.index.load("w3")


def test_schedule_state_keeps_wanted_spans_and_operator_requests() -> None:
    state = ScheduleState()
    state.apply(SpansChangedV1(changefeed="cf", spans=[span_ref(s) for s in SPANS]))
    state.apply(MoveRequestedV1(span=span_ref(SPANS[0]), dest="w2"))
    state.apply(MoveRequestedV1(span=span_ref(SPANS[1]), dest="w3"))
    state.apply(MoveTableV1(task_id="x", span=span_ref(SPANS[0]), dest="w2", reason="operator"))
    state.apply(RequestDoneV1(kind="move", span=span_ref(SPANS[1]), ok=False, reason="gone"))
    assert state.wanted == {"cf": SPANS} and state.moves == {}
    state.apply(SpansChangedV1(changefeed="cf", spans=[]))
    assert state.wanted == {}
    assert ScheduleState.restore(state.dump()) == state


# ---------------------------------------------------------------- scheduler core


def _ready_replication(members: dict[str, str]) -> ReplicationState:
    rep = ReplicationState()
    rep.apply(LeaderElectedV1(service="replication-manager", candidate="r", epoch=EPOCH))
    rep.apply(RebuiltV1(members=members, sets=0, waited_s=0))
    return rep


def _members(*names: str) -> MembersState:
    state = MembersState()
    for n in names:
        state.apply(MemberJoinedV2(member_id=n, incarnation=f"inc-{n}"))
    return state


def _scheduler() -> tuple[SchedulerCore, ScheduleState]:
    state = ScheduleState()
    core = SchedulerCore(state, balance_interval_s=0.0, rng=random.Random(1))
    for e in core.spans_changes({"cf": SPANS}):
        state.apply(e)
    return core, state


def test_scheduler_waits_for_a_ready_replication_manager_and_reported_members() -> None:
    core, _ = _scheduler()
    members = _members("w1", "w2")
    rep = ReplicationState()  # no rebuilt leader yet
    assert core.round(members, rep, 0.0) == []
    rep = _ready_replication({"w1": "inc-w1"})  # w2 has not reported to the manager
    tasks = core.round(members, rep, 1.0)
    assert [type(t) for t in tasks] == [AddTableV1] * 4
    assert {t.member_id for t in tasks} == {"w1"}  # type: ignore[attr-defined]
    # Recorded tasks are in flight: the next round plans nothing for those spans.
    assert core.round(members, rep, 2.0) == []


def test_the_scheduler_reuses_its_comparison_and_wanted_spans_until_something_changes() -> None:
    """Rounds run on every input: the scheduler compares the discovered spans with the recorded
    ones only when either list is new, keeps one ``WantedSpans`` while the recorded spans stay,
    and reads an add's floor from the sets as they are when the add is planned."""
    core, state = _scheduler()
    discovered = {"cf": list(reversed(SPANS))}
    assert core.spans_changes(discovered) == []  # the same spans, in another order
    assert core.spans_changes(discovered) == []
    assert core._same["cf"][0] is discovered["cf"]
    rep = _ready_replication({"w1": "inc-w1"})
    first = core.wanted(rep)
    assert core.wanted(rep) is first and set(first) == set(SPANS) and first[SPANS[0]] == 0
    rep.apply(_set_changed(SPANS[0], "absent", None, 77))
    assert first[SPANS[0]] == 77  # the set's checkpoint now, not when the mapping was built
    # A new discovery with a span more: one spans_changed, then a new WantedSpans once recorded.
    extra = Span("cf", "src", "db", "t_new")
    grown = {"cf": [*SPANS, extra]}
    changes = core.spans_changes(grown)
    assert len(changes) == 1 and isinstance(changes[0], SpansChangedV1)
    state.apply(changes[0])
    assert core.spans_changes(grown) == []
    assert core.wanted(rep) is not first and extra in core.wanted(rep)
    # The discovered list object kept, the recorded one replaced: compared again.
    state.apply(SpansChangedV1(changefeed="cf", spans=[span_ref(s) for s in SPANS]))
    assert [type(e) for e in core.spans_changes(grown)] == [SpansChangedV1]
    # A changefeed gone from both: nothing kept for it.
    state.apply(SpansChangedV1(changefeed="cf", spans=[]))
    assert core.spans_changes({}) == [] and core._same == {}


def test_scheduler_counts_its_own_tasks_in_flight_when_balancing() -> None:
    core, _ = _scheduler()
    members = _members("w1", "w2")
    rep = _ready_replication({"w1": "inc-w1", "w2": "inc-w2"})
    for s in SPANS:  # everything runs on w1
        rep.apply(_set_changed(s, "replicating", "w1"))
    first = core.round(members, rep, 10.0)
    assert sorted(type(t).__name__ for t in first) == ["MoveTableV1", "MoveTableV1"]
    # The sets do not show the moves yet: without counting them, w1 would still look loaded
    # with 4 and the other 2 spans would be moved as well.
    assert core.round(members, rep, 11.0) == []
    for t in first:
        assert isinstance(t, MoveTableV1)
        core.on_task_result(TaskResultV1(task_id=t.task_id, span=t.span, accepted=True))
        ev = _set_changed(Span(*t.span.model_dump().values()), "replicating", t.dest)
        rep.apply(ev)
        core.on_set_changed(ev)
    assert core.pending == {}
    assert core.round(members, rep, 12.0) == []
    assert sorted(rep.index.load(m) for m in ("w1", "w2")) == [2, 2]


def test_a_new_scheduler_leader_keeps_the_pins_of_the_operator_moves_it_replayed() -> None:
    """The automatic balance leaves an operator's move where the operator put it for a while
    (``OperatorMoveScheduler.pinned``): a leader elected after the move knows it from the
    stream (a control-plane test's new leader moved the span straight back)."""
    moved_at = 1_000_000.0
    state = ScheduleState()
    for e in SchedulerCore(state).spans_changes({"cf": SPANS}):
        state.apply(e)
    state.apply(MoveTableV1(task_id="x", span=span_ref(SPANS[0]), dest="w1", reason="operator"),
                at=moved_at)
    assert ScheduleState.restore(state.dump()) == state
    members = _members("w1", "w2")
    rep = _ready_replication({"w1": "inc-w1", "w2": "inc-w2"})
    for s in SPANS[:3]:
        rep.apply(_set_changed(s, "replicating", "w1"))
    rep.apply(_set_changed(SPANS[3], "replicating", "w2"))

    def balance_moves(seed: int, wall: float) -> list[Span]:
        leader = SchedulerCore(state, balance_interval_s=0.0, rng=random.Random(seed))  # just elected
        return [span_of(t.span) for t in leader.round(members, rep, 5.0, wall=wall)
                if isinstance(t, MoveTableV1)]

    for seed in range(20):  # whichever victim the rng draws, never the pinned span
        moves = balance_moves(seed, moved_at + 60)
        assert len(moves) == 1 and moves[0] != SPANS[0], moves
    # Past the pin it is a span like any other again, and the state forgets the move (else it
    # kept every operator move ever made, in every snapshot).
    assert SPANS[0] in {s for seed in range(20) for s in balance_moves(seed, moved_at + 700)}
    assert state.operator_moved == {} and state.dump()["operator_moved"] == []


def test_scheduler_does_not_count_a_span_where_it_only_prepares() -> None:
    """A move that timed out in the scheduler while its destination still prepares: the span
    runs on its old owner, so the loads must say so (issue: a fourth worker still warming
    Spark was counted as holding two spans, and nothing was balanced any more)."""
    core, _ = _scheduler()
    members = _members("w1", "w2")
    rep = _ready_replication({"w1": "inc-w1", "w2": "inc-w2"})
    for s in SPANS[1:]:
        rep.apply(_set_changed(s, "replicating", "w1"))
    stuck = SetChangedV1(span=span_ref(SPANS[0]), state="prepare", primary="w1", secondary="w2",
                         members={"w1": "primary", "w2": "secondary"})
    rep.apply(stuck)
    assert rep.index.load("w2") == 1  # the set alone would place it on w2
    view = core.view(members, rep)
    assert (view.load("w1"), view.load("w2")) == (4, 0)
    # With its task in flight the scheduler counts it where it is going, as before.
    core.pending[SPANS[0]] = Pending(MoveTable(SPANS[0], "w2"), "t", 0.0, accepted=True)
    view = core.view(members, rep)
    assert (view.load("w1"), view.load("w2")) == (3, 1)


def test_scheduler_replans_rejected_timed_out_and_orphaned_tasks() -> None:
    core, _ = _scheduler()
    members = _members("w1")
    rep = _ready_replication({"w1": "inc-w1"})
    tasks = core.round(members, rep, 0.0)
    assert len(tasks) == 4
    t0 = tasks[0]
    assert isinstance(t0, AddTableV1)
    core.on_task_result(TaskResultV1(task_id=t0.task_id, span=t0.span, accepted=False, reason="no"))
    assert [t.span for t in core.round(members, rep, 1.0)] == [t0.span]  # type: ignore[attr-defined]
    assert len(core.round(members, rep, 100.0)) == 4  # every task timed out
    assert core.tasks_timed_out == 4
    core.on_replication_epoch(EPOCH + 1)  # a new manager leader may never read them
    assert core.pending == {}


def test_scheduler_operator_requests() -> None:
    core, state = _scheduler()
    members = _members("w1", "w2")
    rep = _ready_replication({"w1": "inc-w1", "w2": "inc-w2"})
    for s in SPANS:
        rep.apply(_set_changed(s, "replicating", "w1" if s != SPANS[3] else "w2"))
    reason, event = core.request(ScheduleRequestV1(kind="move", span=span_ref(SPANS[0]), dest="w9",
                                                   requested_by="ops"), members, rep)
    assert event is None and reason is not None and "w9" in reason
    reason, event = core.request(ScheduleRequestV1(kind="move", span=span_ref(SPANS[0]), dest="w2",
                                                   requested_by="ops"), members, rep)
    assert reason is None and isinstance(event, MoveRequestedV1)
    state.apply(event)
    out = core.round(members, rep, 0.0)
    moves = [e for e in out if isinstance(e, MoveTableV1) and e.reason == "operator"]
    assert [m.span for m in moves] == [span_ref(SPANS[0])]
    state.apply(moves[0])
    assert state.moves == {}
    drain = ScheduleRequestV1(kind="drain", member_id="w1", requested_by="ops")
    reason, event = core.request(drain, members, rep)
    assert reason is None and event is not None
    state.apply(event)
    assert core.usable_members(members, rep, state)["w1"].draining


def test_scheduler_removes_spans_of_a_stopped_changefeed() -> None:
    core, state = _scheduler()
    members = _members("w1")
    rep = _ready_replication({"w1": "inc-w1"})
    for s in SPANS:
        rep.apply(_set_changed(s, "replicating", "w1"))
    changes = core.spans_changes({})  # the changefeed is not running any more
    assert changes == [SpansChangedV1(changefeed="cf", spans=[])]
    state.apply(changes[0])
    assert sorted(type(e).__name__ for e in core.round(members, rep, 0.0)) == ["RemoveTableV1"] * 4


# ---------------------------------------------------------------- replication-manager core


def _core(alive: dict[str, str], **kw: object) -> ReplicationCore:
    return ReplicationCore(EPOCH, alive=alive, wanted={"cf": SPANS[:2]}, **kw)  # type: ignore[arg-type]


def test_replication_core_waits_for_reports_of_its_epoch_from_the_right_process() -> None:
    core = _core({"w1": "i1", "w2": "i2"}, known_spans={SPANS[0]: (100, 100)})
    assert not core.start(0.0).events
    # An older epoch's report, and the report of another process under the same id, count for nothing.
    assert core.on_heartbeat(hb("w1", "i1", epoch=EPOCH - 1), 0.1).events == []
    assert core.on_heartbeat(hb("w2", "other"), 0.2).events == []
    assert core.ignored_reports == 1 and core.manager.stale_reports == 1
    out = core.on_heartbeat(hb("w1", "i1", tables=[TableStatus(SPANS[0], REPL, 120, 130)]), 0.3)
    assert out.events == [] and out.dispatches == []
    out = core.on_heartbeat(hb("w2", "i2"), 0.5)
    assert core.ready
    rebuilt = [e for e in out.events if isinstance(e, RebuiltV1)]
    assert rebuilt and rebuilt[0].members == {"w1": "i1", "w2": "i2"}
    changed = [e for e in out.events if isinstance(e, SetChangedV1)]
    assert [(e.span.table, e.state, e.primary, e.checkpoint_ts) for e in changed] == [
        ("t0", "replicating", "w1", 120)]


def test_replication_core_tasks_dispatches_and_checkpoints() -> None:
    core = _core({"w1": "i1"}, checkpoints={"cf": (50, 50)})
    core.on_heartbeat(hb("w1", "i1"), 0.0)
    assert core.checkpoint_events() == []  # no span of the changefeed has a set
    out = core.on_task(AddTableV1(task_id="a", span=span_ref(SPANS[0]), member_id="w1", checkpoint_ts=0), 0.1)
    assert isinstance(out.events[0], TaskResultV1) and out.events[0].accepted
    assert [(d.member, d.action.value) for d in out.dispatches] == [("w1", "add-prepare")]
    bad = core.on_task(RemoveTableV1(task_id="b", span=span_ref(SPANS[3])), 0.2)
    assert isinstance(bad.events[0], TaskResultV1) and not bad.events[0].accepted
    answer = DispatchResponseV1(member_id="w1", incarnation="i1", verdict="accepted", epoch=EPOCH, seq=5,
                                status=status_ref(TableStatus(SPANS[0], TableState.PREPARED, 0, 0)))
    out = core.on_answer(answer, 0.3)
    assert [(d.action.value) for d in out.dispatches] == ["add-commit"]
    answer = answer.model_copy(update={"seq": 6, "status": status_ref(TableStatus(SPANS[0], REPL, 70, 80))})
    out = core.on_answer(answer, 0.4)
    changed = [(e.state, e.primary) for e in out.events if isinstance(e, SetChangedV1)]
    assert changed == [("replicating", "w1")]
    # t1 is wanted but has no set: the checkpoint holds (No Lost Table).
    assert core.checkpoint_events() == []
    core.on_task(AddTableV1(task_id="c", span=span_ref(SPANS[1]), member_id="w1", checkpoint_ts=0), 0.5)
    core.on_heartbeat(hb("w1", "i1", seq=9, tables=[TableStatus(SPANS[0], REPL, 90, 95),
                                                    TableStatus(SPANS[1], REPL, 40, 45)]), 0.6)
    assert core.checkpoint_events() == []  # min is 40 < the published 50: never backwards
    core.on_heartbeat(hb("w1", "i1", seq=10, tables=[TableStatus(SPANS[0], REPL, 90, 95),
                                                     TableStatus(SPANS[1], REPL, 60, 65)]), 0.7)
    assert core.checkpoint_events() == [
        CheckpointAdvancedV1(changefeed="cf", checkpoint_ts=60, resolved_ts=65)]


def test_replication_core_leaves_tables_stopped_by_an_incident_out_of_the_checkpoint() -> None:
    stopped: set[tuple[str, str, str, str]] = {tuple(SPANS[1])}  # as the changefeeds log folds it
    core = _core({"w1": "i1"}, checkpoints={"cf": (50, 50)}, stopped=lambda: stopped)
    core.on_heartbeat(hb("w1", "i1", tables=[TableStatus(SPANS[0], REPL, 90, 95),
                                             TableStatus(SPANS[1], REPL, 40, 45)]), 0.0)
    assert core.checkpoint_events() == [CheckpointAdvancedV1(changefeed="cf", checkpoint_ts=90,
                                                             resolved_ts=95)]
    assert core.blocked() == {}
    stopped.add(tuple(SPANS[0]))
    assert core.checkpoint_events() == []
    assert core.blocked() == {"cf": "every table of the changefeed is stopped by an incident"}
    stopped.clear()  # both resumed: t1 at 40 holds the published 90 until it passes it
    core.on_heartbeat(hb("w1", "i1", seq=2, tables=[TableStatus(SPANS[0], REPL, 120, 125),
                                                    TableStatus(SPANS[1], REPL, 80, 85)]), 0.1)
    assert core.checkpoint_events() == []
    core.on_heartbeat(hb("w1", "i1", seq=3, tables=[TableStatus(SPANS[0], REPL, 120, 125),
                                                    TableStatus(SPANS[1], REPL, 100, 110)]), 0.2)
    assert core.checkpoint_events() == [CheckpointAdvancedV1(changefeed="cf", checkpoint_ts=100,
                                                             resolved_ts=110)]


def test_replication_core_member_left_and_joined_again() -> None:
    core = _core({"w1": "i1"})
    core.on_heartbeat(hb("w1", "i1", tables=[TableStatus(SPANS[0], TableState.REPLICATING, 10, 10)]), 0.0)
    assert core.ready
    out = core.on_member_left("w1", "i1", 1.0)
    assert [(e.state, e.primary) for e in out.events if isinstance(e, SetChangedV1)] == [("absent", None)]
    core.on_member_joined("w1", "i2", 2.0)
    out = core.on_heartbeat(hb("w1", "i2", seq=2), 2.1)
    assert [e for e in out.events if isinstance(e, MemberReadyV1)] == [MemberReadyV1(member_id="w1",
                                                                                      incarnation="i2")]


# ---------------------------------------------------------------- against a real nats-server


async def test_domain_follower_replays_snapshot_then_follows(js: JetStreamContext) -> None:
    domain = f"members{uuid4().hex[:6]}"
    writer: DomainLog[MembersState] = DomainLog(js, domain, producer="test", fold=members_fold,
                                                initial=MembersState(), restore=MembersState.restore,
                                                dump=MembersState.dump)
    await writer.open("member", "a", 1)
    await writer.append(MemberJoinedV2(member_id="w1", incarnation="i"))
    await writer.snapshot()
    await writer.append(MemberJoinedV2(member_id="w2", incarnation="i"))
    seen: list[str] = []
    follower = DomainFollower(js, domain, members_fold, MembersState, restore=MembersState.restore,
                              on_event=lambda e: seen.append(e.type))
    await follower.load()
    assert sorted(follower.state.members) == ["w1", "w2"] and follower.events_folded == 1
    stop = asyncio.Event()
    task = asyncio.create_task(follower.run(stop))
    await writer.append(MemberLeftV1(member_id="w1", incarnation="i", reason="ttl-expired"))
    for _ in range(50):
        if "w1" not in follower.state.members:
            break
        await asyncio.sleep(0.1)  # polling the follower against a deadline
    stop.set()
    await task
    assert sorted(follower.state.members) == ["w2"] and seen == ["member.left"]


async def test_agent_answers_dispatches_fences_old_epochs_and_heartbeats(nc: Client) -> None:
    member = f"agent-{uuid4().hex[:6]}"
    beats: list[MemberHeartbeatV3] = []

    async def on_beat(msg: Msg) -> None:
        event = REGISTRY.decode(msg.data).event
        assert isinstance(event, MemberHeartbeatV3)
        beats.append(event)

    await nc.subscribe(heartbeat_subject(member), cb=on_beat)
    agent = SinkAgent(nc, member_id=member, address="http://x", heartbeat_interval_s=30.0)
    await agent.start()
    try:
        async def dispatch(epoch: int, action: str, incarnation: str | None = None) -> DispatchResponseV1:
            req = DispatchRequestV1(member_id=member, incarnation=incarnation or agent.incarnation,
                                    span=span_ref(SPANS[0]), action=action, checkpoint_ts=5,  # type: ignore[arg-type]
                                    epoch=epoch)
            msg = await nc.request(dispatch_subject(member), REGISTRY.encode(req, producer="t"), timeout=5)
            answer = REGISTRY.decode(msg.data).event
            assert isinstance(answer, DispatchResponseV1)
            return answer

        first = await dispatch(EPOCH, "add-prepare")
        assert (first.verdict, first.status.state, first.epoch) == ("accepted", "preparing", EPOCH)
        assert (await dispatch(EPOCH, "add-prepare")).verdict == "duplicate"
        wrong = await dispatch(EPOCH, "remove", incarnation="previous-life")
        assert wrong.verdict == "wrong-member" and agent.state.state_of(SPANS[0]) is TableState.PREPARING
        # A new leader announces itself; the old one's dispatches are refused from then on.
        await nc.publish(announce_subject("replication"), REGISTRY.encode(
            ReplicationAnnounceV1(epoch=EPOCH + 5, candidate="new"), producer="t"))
        for _ in range(50):
            if beats and beats[-1].epoch == EPOCH + 5:
                break
            await asyncio.sleep(0.1)  # polling for the heartbeat the announce triggers
        assert beats[-1].epoch == EPOCH + 5
        stale = await dispatch(EPOCH, "remove")
        assert stale.verdict == "stale-epoch" and agent.state.rejected_stale == 1
        assert agent.state.state_of(SPANS[0]) is TableState.PREPARING
        last = beats[-1]
        assert last.incarnation == agent.incarnation and not last.draining
        assert [t.state for t in last.tables] == ["preparing"]
        seqs = [b.seq for b in beats] + [first.seq]
        assert len(set(seqs)) == len(seqs)
    finally:
        agent.leaving = True
        await agent.close()
    await asyncio.sleep(0)  # let the last heartbeat's callback run
    for _ in range(50):
        if beats[-1].leaving:
            break
        await asyncio.sleep(0.1)
    assert beats[-1].leaving
