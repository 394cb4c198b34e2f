"""Each leader service's handlers against the in-memory domain log (``MemoryDomainLog``): no
nats-server, no processes. The process tests (test_control_plane, test_ddl_lock_service,
test_shard_ddl_process, ...) cover the same services end to end."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from contracts import REGISTRY
from contracts.events import shard_ddl as c
from contracts.events.leadership import LeaderElectedV1
from contracts.events.members import MemberJoinedV2, MemberLeftV1
from contracts.events.scheduling import (
    AddTableV1,
    MemberHeartbeatV3,
    RebuiltV1,
    ScheduleRequestAnsweredV1,
    ScheduleRequestV1,
    SpansChangedV1,
    TaskResultV1,
)
from contracts.events.snapshots import SnapshotTakenV2
from libs.config import Settings
from libs.control.changefeeds_state import ChangefeedView
from libs.control.convert import span_ref, status_ref
from libs.control.ddl_state import DdlState, ddl_fold
from libs.control.members import MembersState, members_fold
from libs.control.replication_state import ReplicationState, replication_fold
from libs.control.schedule_state import ScheduleState, schedule_fold
from libs.eventstore import Fenced, LeaseLost, MemoryDomainLog, MemoryStream
from libs.leader_service import Entry, Inbox
from libs.routing import TableRef, Target
from libs.scheduling import ChangefeedId, Span, TableState, TableStatus
from libs.shard_ddl.lock import LockKeeper, LockKey
from services.ddl_lock.service import CommandError, DdlLockHandlers, decode_command
from services.member.service import MemberHandlers
from services.replication_manager.service import HeartbeatWaiting, ReplicationHandlers, ResendGate
from services.scheduler.service import SchedulerHandlers

EPOCH = 7
SPANS = [Span("cf", "src", "db", f"t{i}") for i in range(3)]


@dataclass
class Lease:
    epoch: int = EPOCH
    ok: bool = True

    def valid(self) -> bool:
        return self.ok


@dataclass
class Fixed:
    """A followed domain's state, fixed for the test."""

    state: Any


def _members(*names: str) -> MembersState:
    state = MembersState()
    for n in names:
        state.apply(MemberJoinedV2(member_id=n, incarnation=f"inc-{n}"))
    return state


def _ready_replication(members: dict[str, str]) -> ReplicationState:
    rep = ReplicationState()
    rep.apply(LeaderElectedV1(service="replication-manager", candidate="r", epoch=3))
    rep.apply(RebuiltV1(members=members, sets=0, waited_s=0))
    return rep


async def _opened(domain: str, fold: Any, initial: Any, lease: Lease | None = None,
                  stream: MemoryStream | None = None, **kw: Any) -> MemoryDomainLog[Any]:
    log: MemoryDomainLog[Any] = MemoryDomainLog(domain, producer=f"{domain}/test", stream=stream, fold=fold,
                                                initial=initial, **kw)
    await log.open(domain, "me", (lease or Lease()).epoch, lease or Lease())
    return log


# ---------------------------------------------------------------- the in-memory log itself


async def test_memory_log_fences_a_second_writer_and_replays_from_its_snapshot() -> None:
    stream = MemoryStream("CTL_MEMBERS")
    first = await _opened("members", members_fold, MembersState(), stream=stream,
                          restore=MembersState.restore, dump=MembersState.dump)
    await first.append(MemberJoinedV2(member_id="w1", incarnation="a"))
    await first.snapshot()
    await first.append(MemberJoinedV2(member_id="w2", incarnation="b"))
    second = await _opened("members", members_fold, MembersState(), Lease(epoch=EPOCH + 1), stream=stream,
                           restore=MembersState.restore, dump=MembersState.dump)
    assert second.loaded is not None and second.loaded.snapshot_seq == 3
    assert second.loaded.events_replayed == 1  # only what came after the snapshot
    assert sorted(second.state.members) == ["w1", "w2"]
    with pytest.raises(Fenced):  # the successor's LeaderElected moved the end of the log
        await first.append(MemberLeftV1(member_id="w1", incarnation="a", reason="test"))
    with pytest.raises(Fenced):  # a stale epoch may not open the log at all
        await _opened("members", members_fold, MembersState(), Lease(epoch=EPOCH), stream=stream,
                      restore=MembersState.restore)
    lease = Lease(epoch=EPOCH + 5)
    third = await _opened("members", members_fold, MembersState(), lease, stream=stream,
                          restore=MembersState.restore)
    lease.ok = False
    with pytest.raises(LeaseLost):
        await third.append(MemberLeftV1(member_id="w1", incarnation="a", reason="test"))
    kinds = [type(e).__name__ for e in second.events()]
    assert kinds == ["LeaderElectedV1", "MemberJoinedV2", "MemberJoinedV2", "LeaderElectedV1",
                     "LeaderElectedV1"]
    assert [type(s.event) for s in stream.read([second.snapshot_subject])] == [SnapshotTakenV2]


async def test_memory_stream_follow_sees_later_appends() -> None:
    log = await _opened("members", members_fold, MembersState())
    seen: list[str] = []

    async def follow() -> None:
        async for stored in log.memory.follow([log.events_subject]):
            seen.append(type(stored.event).__name__)
            if len(seen) == 2:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0)  # let the follower reach the end of the log before the append
    await log.append(MemberJoinedV2(member_id="w1", incarnation="a"))
    await asyncio.wait_for(task, 5)
    assert seen == ["LeaderElectedV1", "MemberJoinedV2"]


async def test_inbox_batches_and_answers() -> None:
    inbox: Inbox[str, str] = Inbox()
    inbox.put("a")
    asked = asyncio.create_task(inbox.ask("b"))
    await asyncio.sleep(0)
    await inbox.wait(5)
    entries = inbox.take(None)
    assert [e.item for e in entries] == ["a", "b"]
    entries[1].reply("answer")
    assert await asked == "answer"
    inbox.wake()
    await asyncio.wait_for(inbox.wait(60), 5)  # a wake ends the wait without an input
    assert inbox.take(1) == []


# ---------------------------------------------------------------- scheduler


async def test_scheduler_handlers_answer_requests_and_record_tasks() -> None:
    log = await _opened("schedule", schedule_fold, ScheduleState(), restore=ScheduleState.restore,
                        dump=ScheduleState.dump)
    status: dict[str, Any] = {}

    async def discover(_view: ChangefeedView) -> dict[ChangefeedId, list[Span]] | None:
        return {"cf": SPANS}

    h = SchedulerHandlers(Lease(), log, Settings(scheduler_balance_interval_s=0.001), Fixed(_members("w1")),
                          Fixed(_ready_replication({"w1": "inc-w1"})), Fixed(ChangefeedView()),
                          discover=discover, wake=lambda: None, publish_status=status.update)
    answer: asyncio.Future[ScheduleRequestAnsweredV1] = asyncio.get_running_loop().create_future()
    await h.handle(Entry(ScheduleRequestV1(kind="drain", member_id="w9", requested_by="ops"), answer))
    assert not answer.result().accepted and "w9" in answer.result().reason
    await h.tick()
    events = log.events()
    assert isinstance(events[1], SpansChangedV1) and len(events[1].spans) == 3
    assert [type(e) for e in events[2:]] == [AddTableV1] * 3  # wanted spans first, then the tasks
    assert status["tasks_in_flight"] == 3 and status["wanted_spans"] == 3
    await h.tick()
    assert len(log.events()) == 5  # tasks in flight are not planned twice


async def test_a_slow_discovery_does_not_hold_the_scheduler_rounds() -> None:
    """Only the first discovery is waited for; later ones run beside the rounds (listing 10,000
    tables and their foreign keys took seconds), and their result counts once it is there."""
    log = await _opened("schedule", schedule_fold, ScheduleState(), restore=ScheduleState.restore,
                        dump=ScheduleState.dump)
    release = asyncio.Event()
    calls = 0
    woken: list[int] = []

    async def discover(_view: ChangefeedView) -> dict[ChangefeedId, list[Span]] | None:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"cf": SPANS[:2]}
        await release.wait()
        return {"cf": SPANS}

    settings = Settings(scheduler_balance_interval_s=0.001, scheduler_discovery_interval_s=3600)
    h = SchedulerHandlers(Lease(), log, settings, Fixed(_members("w1")),
                          Fixed(_ready_replication({"w1": "inc-w1"})), Fixed(ChangefeedView()),
                          discover=discover, wake=lambda: woken.append(1), publish_status=lambda _s: None)
    await h.tick()
    assert [len(e.spans) for e in log.events() if isinstance(e, SpansChangedV1)] == [2]
    adds = sum(isinstance(e, AddTableV1) for e in log.events())
    assert adds == 2
    h.changefeeds_changed = True  # a discovery is due now, whatever the clock says
    await asyncio.wait_for(h.tick(), 5)  # the second discovery waits on ``release``: the round does not
    assert calls == 2 and [len(e.spans) for e in log.events() if isinstance(e, SpansChangedV1)] == [2]
    release.set()
    assert h._discovery is not None
    await asyncio.wait_for(h._discovery, 5)
    assert woken
    await h.tick()
    assert [len(e.spans) for e in log.events() if isinstance(e, SpansChangedV1)] == [2, 3]
    assert sum(isinstance(e, AddTableV1) for e in log.events()) == 3


# ---------------------------------------------------------------- replication-manager


async def test_replication_handlers_rebuild_and_follow_members() -> None:
    log = await _opened("replication", replication_fold, ReplicationState(),
                        restore=ReplicationState.restore, dump=ReplicationState.dump)
    sent: list[Any] = []
    schedule = ScheduleState()
    h = ReplicationHandlers(Lease(), log, Settings(), _members("w1"), schedule, started=0.0,
                            send=sent.append, publish_status=lambda _s: None)
    await h.start()
    assert not h.core.ready and h.core.manager.awaiting == {"w1"}
    await h.handle(Entry(MemberHeartbeatV3(member_id="w1", incarnation="inc-w1", epoch=EPOCH, seq=1)))
    assert h.core.ready
    # A turn's inputs are recorded at its tick, in one burst.
    assert not any(isinstance(e, RebuiltV1) for e in log.events())
    await h.tick()
    assert any(isinstance(e, RebuiltV1) for e in log.events())
    await h.handle(Entry(MemberJoinedV2(member_id="w2", incarnation="inc-w2")))
    assert h.core.incarnations == {"w1": "inc-w1", "w2": "inc-w2"}
    await h.handle(Entry(SpansChangedV1(changefeed="cf", spans=[span_ref(s) for s in SPANS])))
    await h.handle(Entry(AddTableV1(span=span_ref(SPANS[0]), member_id="w1", task_id="t1", checkpoint_ts=1)))
    # Nothing goes out before what it follows from is in the log.
    assert sent == [] and not any(isinstance(e, TaskResultV1) for e in log.events())
    await h.tick()
    assert [(d.member, d.action.value) for d in sent] == [("w1", "add-prepare")]
    results = [e for e in log.events() if isinstance(e, TaskResultV1)]
    assert [r.accepted for r in results] == [True]


# ---------------------------------------------------------------- member


async def test_member_handlers_join_and_expire() -> None:
    log = await _opened("members", members_fold, MembersState(), restore=MembersState.restore,
                        dump=MembersState.dump)
    status: dict[str, Any] = {}
    probed: list[tuple[str, str]] = []
    h = MemberHandlers(Lease(), log, Settings(member_ttl_s=5.0), probe=lambda m, i: probed.append((m, i)),
                       reconnects=lambda: 0, publish_status=status.update)
    await h.handle(Entry(MemberHeartbeatV3(member_id="w1", incarnation="a", seq=1)))
    await h.tick()
    assert sorted(log.state.members) == ["w1"] and status["w1"]["incarnation"] == "a"
    h.tracker.last_seen["w1"] -= 60  # silent for longer than the TTL
    await h.tick()
    assert [type(e) for e in log.events()] == [LeaderElectedV1, MemberJoinedV2, MemberLeftV1]
    assert log.state.members == {}


# ---------------------------------------------------------------- ddl-lock


async def _ddl() -> tuple[DdlLockHandlers, MemoryDomainLog[Any], list[tuple[str, bytes]]]:
    log = await _opened("ddl", ddl_fold, DdlState(LockKeeper(resend_after=30.0)))
    sent: list[tuple[str, bytes]] = []

    async def send(subject: str, body: bytes) -> None:
        sent.append((subject, body))

    async def discover(_specs: Any) -> Any:
        raise AssertionError("not expected in this test")

    h = DdlLockHandlers(log, Settings(), Fixed(ChangefeedView()), send=send, discover=discover,
                        publish_status=lambda _s: None, producer="ddl-lock/test")
    return h, log, sent


async def _ask(h: DdlLockHandlers, item: Any) -> bytes:
    answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    await h.handle(Entry(item, answer))
    return answer.result()


async def test_ddl_lock_handlers_commands() -> None:
    h, _log, _sent = await _ddl()
    assert json.loads(await _ask(h, c.DdlCommandV1(action="list"))) == {"ok": True, "locks": []}
    shown = json.loads(await _ask(h, c.DdlCommandV1(action="show", changefeed="cf", target="db.t")))
    assert shown["code"] == 404
    bare = json.loads(await _ask(h, c.DdlCommandV1(action="show", changefeed="cf")))
    assert bare["code"] == 422 and "target is required" in bare["error"]


@pytest.mark.parametrize(("raw", "why"), [
    (b"not json", "not JSON"),
    (b"[1]", "JSON object"),
    (b'{"action": "explode"}', "action"),
    (b'{"action": "list", "extra": 1}', "extra"),
    (REGISTRY.encode(LeaderElectedV1(service="x", candidate="y", epoch=1), producer="t"),
     "not a ddl-lock command"),
    (REGISTRY.encode(c.DdlCommandV1(action="list"), producer="t").replace(b'"version":1', b'"version":9'),
     "version"),
])
def test_ddl_commands_decode_only_the_registered_contract(raw: bytes, why: str) -> None:
    with pytest.raises(CommandError) as caught:
        decode_command(raw)
    assert caught.value.code == 422 and why in str(caught.value)


def test_ddl_commands_in_an_envelope_or_bare() -> None:
    cmd = c.DdlCommandV1(action="unlock", changefeed="cf", target="db.t", mode="skip", requested_by="ops",
                         reason="r")
    assert decode_command(REGISTRY.encode(cmd, producer="t")) == cmd
    assert decode_command(cmd.model_dump_json(exclude_none=True).encode()) == cmd


async def test_ddl_lock_handlers_lock_a_known_group_and_record_it() -> None:
    h, log, sent = await _ddl()
    key = LockKey("cf", Target("db", "t"))
    h.groups = {key: frozenset({TableRef("s1", "db", "t"), TableRef("s2", "db", "t")})}
    info = c.ShardInfoV1(changefeed="cf", target=c.TargetRefV1(database="db", table="t"),
                         span=c.ShardRefV1(source="s1", database="db", table="t"),
                         ddls=["ALTER TABLE t ADD c INT"], position=5)
    assert await _ask(h, info) == b"ok"
    assert key in h.keeper.locks
    recorded = [type(e).__name__ for e in log.events()]
    assert "LockCreatedV1" in recorded and "InfoReceivedV1" in recorded
    dropped = c.ShardDroppedV1(changefeed="cf", target=c.TargetRefV1(database="db", table="t"),
                               span=c.ShardRefV1(source="s2", database="db", table="t"), position=9,
                               reason="DROP TABLE")
    assert await _ask(h, dropped) == b"ok"
    assert ("cf", TableRef("s2", "db", "t")) in log.state.dropped
    # The only other shard left: the lock resolves and s1 is told to execute.
    assert any(b'"exec"' in body for _subject, body in sent)


# ---------------------------------------------------------------- dispatch resends


def test_resend_gate_holds_back_a_dispatch_its_member_accepted_and_only_that() -> None:
    gate = ResendGate(resend_s=10.0)
    prepare, commit = ("w1", "inc1", "span", "add-prepare"), ("w1", "inc1", "span", "add-commit")
    assert gate.take(prepare, 0.0)
    assert not gate.take(prepare, 0.5)  # on its way
    gate.done(prepare, 1.0, "accepted")
    for t in (2.0, 4.0, 10.9):  # the ticks while the member prepares: nothing sent again
        assert not gate.take(prepare, t)
    assert gate.take(commit, 3.0)  # the next step is another dispatch: it goes at once
    assert gate.take(prepare, 11.0)  # after resend_s it goes again, in case it was lost
    gate.done(prepare, 11.5, "duplicate")
    assert not gate.take(prepare, 12.0)
    # A restarted member (another incarnation) gets the step at once.
    assert gate.take(("w1", "inc2", "span", "add-prepare"), 12.0)


@pytest.mark.parametrize("verdict", [None, "busy", "stale-epoch", "wrong-member", "ignored"])
def test_resend_gate_resends_at_the_next_tick_what_was_not_accepted(verdict: str | None) -> None:
    gate = ResendGate(resend_s=10.0)
    key = ("w1", "inc1", "span", "add-prepare")
    assert gate.take(key, 0.0)
    gate.done(key, 0.0, "accepted")
    assert gate.take(key, 10.0)
    gate.done(key, 10.5, verdict)  # no answer (timeout) or a refusal: the accept is forgotten
    assert gate.take(key, 12.0)


def test_resend_gate_forgets_old_accepts() -> None:
    gate = ResendGate(resend_s=1.0)
    for i in range(3000):
        key = ("w", "i", i, "add-prepare")
        assert gate.take(key, float(i))
        gate.done(key, float(i), "accepted")
    assert len(gate) <= 1100


def test_resend_gate_sends_a_step_again_at_once_after_another_step_of_the_span_was_accepted() -> None:
    # A span moved away from w1 and back (prepare, commit, remove, then prepare again) within
    # resend_s: the second prepare is a new step, not a repeat of the first.
    gate = ResendGate(resend_s=10.0)
    step = ("w1", "inc1", "span")
    for action, t in (("add-prepare", 0.0), ("add-commit", 0.1), ("remove", 0.2)):
        assert gate.take((*step, action), t)
        gate.done((*step, action), t, "accepted")
    assert not gate.take((*step, "remove"), 1.0)  # the remove itself is still held back
    assert gate.take((*step, "add-prepare"), 1.7)  # it waited until 10.0 before
    gate.done((*step, "add-prepare"), 1.8, "accepted")
    assert not gate.take((*step, "add-prepare"), 2.0)
    assert gate.take((*step, "remove"), 2.1)  # the remove after that prepare is new too
    # Another span's accepts are its own.
    assert gate.take(("w1", "inc1", "other", "add-prepare"), 2.2)


def test_resend_gate_cleans_up_in_amortised_constant_time_when_every_accept_is_fresh() -> None:
    # A changefeed's start: 20,000 dispatches accepted within resend_s, none of them old.
    gate = ResendGate(resend_s=600.0)
    for i in range(20_000):
        key = ("w", "i", i, "add-prepare")
        assert gate.take(key, i / 1000)
        gate.done(key, i / 1000, "accepted")
    assert len(gate) == 20_000
    assert gate.cleanups <= 6  # the map doubled between two; it was ~19,000 clean-ups before


# ---------------------------------------------------------------- heartbeat backlog


async def test_only_the_newest_waiting_heartbeat_of_a_member_is_handled() -> None:
    log = await _opened("replication", replication_fold, ReplicationState(),
                        restore=ReplicationState.restore, dump=ReplicationState.dump)
    h = ReplicationHandlers(Lease(), log, Settings(), _members("w1", "w2"), ScheduleState(), started=0.0,
                            send=lambda _d: None, publish_status=lambda _s: None)
    await h.start()
    queued: list[HeartbeatWaiting] = []

    def arrive(member: str, seq: int) -> None:
        raw = REGISTRY.encode(MemberHeartbeatV3(member_id=member, incarnation=f"inc-{member}", epoch=EPOCH,
                                                seq=seq), producer=f"sink-worker/{member}")
        if h.heartbeats.offer(f"sluice.hb.{member}", raw):
            queued.append(HeartbeatWaiting(f"sluice.hb.{member}"))

    for seq in (1, 2, 3):
        arrive("w1", seq)
    arrive("w2", 1)
    assert [q.subject for q in queued] == ["sluice.hb.w1", "sluice.hb.w2"] and len(h.heartbeats) == 2
    await h.handle(Entry(queued[0]))
    assert h.core.manager.awaiting == {"w2"}
    assert h.core.manager._last_seq["w1"] == 3  # the newest report, the older ones never decoded
    await h.handle(Entry(queued[1]))
    assert h.core.ready and len(h.heartbeats) == 0
    arrive("w1", 4)  # after its turn a member's next heartbeat queues a turn again
    assert len(queued) == 3
    h.heartbeats.offer("sluice.hb.w9", b"garbage")
    await h.handle(Entry(HeartbeatWaiting("sluice.hb.w9")))  # ignored here (the member service dead-letters)


async def test_a_partial_heartbeat_never_replaces_a_waiting_complete_one_nor_ends_a_rebuild() -> None:
    log = await _opened("replication", replication_fold, ReplicationState(),
                        restore=ReplicationState.restore, dump=ReplicationState.dump)
    h = ReplicationHandlers(Lease(), log, Settings(), _members("w1"), ScheduleState(), started=0.0,
                            send=lambda _d: None, publish_status=lambda _s: None)
    await h.start()
    subject = "sluice.hb.w1"

    def raw(seq: int, complete: bool, *spans: Span) -> bytes:
        tables = [status_ref(TableStatus(s, TableState.REPLICATING, 100 + seq, 100 + seq)) for s in spans]
        return REGISTRY.encode(MemberHeartbeatV3(member_id="w1", incarnation="inc-w1", epoch=EPOCH, seq=seq,
                                                 complete=complete, tables=tables), producer="sink-worker/w1")

    # Only partial reports: the new leader keeps waiting for the member's complete one.
    assert h.heartbeats.offer(subject, raw(1, False, SPANS[0]), partial=True)
    await h.handle(Entry(HeartbeatWaiting(subject)))
    assert not h.core.ready and h.core.manager.awaiting == {"w1"}
    # A complete report, then partial ones while it waits: the complete one is handled first,
    # then the newest partial one (cumulative since the complete one); the older partial is gone.
    assert h.heartbeats.offer(subject, raw(2, True, SPANS[0], SPANS[1]))
    assert not h.heartbeats.offer(subject, raw(3, False, SPANS[1]), partial=True)
    assert not h.heartbeats.offer(subject, raw(4, False, SPANS[0], SPANS[1]), partial=True)
    await h.handle(Entry(HeartbeatWaiting(subject)))
    assert h.core.ready and len(h.heartbeats) == 0
    assert h.core.manager._last_seq["w1"] == 4
    assert {s: rs.checkpoint_ts for s, rs in h.core.manager.sets.items()} == {SPANS[0]: 104, SPANS[1]: 104}
    # A partial report leaves the spans it does not name as they were; a complete one that
    # leaves a span out says the member no longer holds it.
    assert h.heartbeats.offer(subject, raw(5, False, SPANS[1]), partial=True)
    await h.handle(Entry(HeartbeatWaiting(subject)))
    assert set(h.core.manager.index.holders["w1"]) == {SPANS[0], SPANS[1]}
    assert h.heartbeats.offer(subject, raw(6, True, SPANS[1]))
    await h.handle(Entry(HeartbeatWaiting(subject)))
    assert set(h.core.manager.index.holders.get("w1", ())) == {SPANS[1]}
