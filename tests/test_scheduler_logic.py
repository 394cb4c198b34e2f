"""Schedulers and the coordinator: basic add/remove, drain, operator move and rebalance,
automatic balance, concurrency caps, never two tasks per span; plus end-to-end runs with the
real ReplicationManager and instant member agents."""

from __future__ import annotations

import math
import random
from collections import Counter, deque

import pytest

from libs.scheduling import (
    AddTable,
    Coordinator,
    Dispatch,
    InvalidTaskError,
    MemberAgentState,
    MemberInfo,
    MoveTable,
    RemoveTable,
    ReplicationManager,
    ReplicationSet,
    ScheduleTask,
    SchedulingView,
    SetIndex,
    SetState,
    Span,
    TableState,
    TableStatus,
    WantedSpans,
    validate_move,
)

EPOCH = 2


def span(i: int, cf: str = "cf") -> Span:
    return Span(cf, "src", "db", f"t{i:04d}")


def replicating(s: Span, member: str, checkpoint: int = 100) -> ReplicationSet:
    reports = {member: TableStatus(s, TableState.REPLICATING, checkpoint, checkpoint)}
    return ReplicationSet.from_reports(s, reports, epoch=EPOCH)


def members(*names: str, draining: tuple[str, ...] = ()) -> dict[str, MemberInfo]:
    return {m: MemberInfo(m, draining=m in draining) for m in names}


def view_of(placement: dict[Span, str], member_names: tuple[str, ...] = ("a", "b", "c"), *,
            wanted: dict[Span, int] | None = None, draining: tuple[str, ...] = (),
            running: dict[Span, ScheduleTask] | None = None) -> SchedulingView:
    sets = {s: replicating(s, m) for s, m in placement.items()}
    return SchedulingView(members(*member_names, draining=draining),
                          wanted if wanted is not None else dict.fromkeys(placement, 100),
                          sets, running=running)


class Cluster:
    """Manager + coordinator + instant member agents: every dispatch is answered at once."""

    def __init__(self, names: list[str], spans: int, *, seed: int = 7, **coordinator: int) -> None:
        self.agents = {m: MemberAgentState(m, min_epoch=EPOCH) for m in names}
        self.infos = members(*names)
        self.manager = ReplicationManager(EPOCH, live_members=names,
                                          max_task_concurrency=coordinator.get("max_task_concurrency", 10))
        for agent in self.agents.values():
            self.manager.handle_report(agent.collect_report())
        self.wanted = {span(i): 100 for i in range(spans)}
        self.coordinator = Coordinator(rng=random.Random(seed), balance_interval_s=0, **coordinator)
        self.max_moves_in_flight = 0

    def join(self, member: str) -> None:
        self.agents[member] = MemberAgentState(member, min_epoch=EPOCH)
        self.infos[member] = MemberInfo(member)
        self.manager.handle_member_joined(member)
        self.manager.handle_report(self.agents[member].collect_report())

    def deliver(self, dispatches: list[Dispatch]) -> None:
        queue = deque(dispatches)
        while queue:
            d = queue.popleft()
            agent = self.agents[d.member]
            outcome = agent.handle_dispatch(d)
            if agent.state_of(d.span) is TableState.PREPARING:
                agent.prepared(d.span)
            elif agent.state_of(d.span) is TableState.STOPPING:
                agent.stopped(d.span)
            reply = type(outcome)(outcome.verdict, outcome.transitions, agent.status(d.span))
            queue.extend(self.manager.handle_report(agent.reply(reply)))

    def round(self, now: float = 0.0, *, settle: bool = True) -> list[ScheduleTask]:
        view = self.manager.view(self.infos, self.wanted)
        tasks = self.coordinator.schedule(view, now)
        outcome = self.manager.handle_tasks(tasks)
        assert not outcome.rejected, outcome.rejected
        moves = sum(isinstance(t, MoveTable) for t in self.manager.running.values())
        self.max_moves_in_flight = max(self.max_moves_in_flight, moves)
        if settle:
            self.deliver(outcome.dispatches)
        return tasks

    def run(self, rounds: int = 1000) -> None:
        for _ in range(rounds):
            if not self.round():
                return
        raise AssertionError("did not settle")

    def loads(self) -> dict[str, int]:
        counts = Counter(rs.primary for rs in self.manager.sets.values() if rs.state is SetState.REPLICATING)
        return {m: counts.get(m, 0) for m in self.infos}

    def replicating_on_agents(self) -> Counter[Span]:
        return Counter(s for a in self.agents.values() for s, t in a.tables.items()
                       if t.state is TableState.REPLICATING)


# -- basic ---------------------------------------------------------------------------------------

def test_basic_adds_in_batches_to_least_loaded_members() -> None:
    wanted = {span(i): 100 for i in range(120)}
    view = SchedulingView(members("a", "b", "c"), wanted, {})
    tasks = Coordinator(rng=random.Random(1)).schedule(view)
    assert len(tasks) == 50 and all(isinstance(t, AddTable) for t in tasks)
    assert [t.span for t in tasks] == sorted(wanted)[:50]
    per_member = Counter(t.member for t in tasks if isinstance(t, AddTable))
    assert sorted(per_member.values()) == [16, 17, 17]
    assert Coordinator(add_batch_size=7).schedule(view).__len__() == 7


def test_a_member_gets_no_more_adds_in_flight_than_its_cap() -> None:
    wanted = {span(i): 100 for i in range(400)}
    # "a" has 8 adds in flight already, "b" 3: with a cap of 10, a round gives "a" 2 and "b" 7.
    running: dict[Span, ScheduleTask] = {span(1000 + i): AddTable(span(1000 + i), "a", 0) for i in range(8)}
    running.update({span(2000 + i): AddTable(span(2000 + i), "b", 0) for i in range(3)})
    running[span(3000)] = MoveTable(span(3000), "b")  # a move is not an add: not counted
    view = SchedulingView(members("a", "b"), wanted, {}, running=running)
    tasks = Coordinator(rng=random.Random(3), max_adds_per_member=10).schedule(view)
    assert Counter(t.member for t in tasks if isinstance(t, AddTable)) == {"a": 2, "b": 7}
    assert [t.span for t in tasks] == sorted(wanted)[:9]  # smallest spans first, as always
    full = {**running, **{span(4000 + i): AddTable(span(4000 + i), "b", 0) for i in range(7)},
            **{span(5000 + i): AddTable(span(5000 + i), "a", 0) for i in range(2)}}
    assert Coordinator(max_adds_per_member=10).schedule(
        SchedulingView(members("a", "b"), wanted, {}, running=full)) == []


def test_adds_wait_for_room_while_members_prepare_and_every_span_replicates_in_the_end() -> None:
    cluster = Cluster(["a", "b", "c"], 500, max_adds_per_member=7)
    for _ in range(3):  # the members do not answer: their adds stay in flight
        cluster.round(settle=False)
        adding = Counter(t.member for t in cluster.manager.running.values() if isinstance(t, AddTable))
        assert max(adding.values()) <= 7
    assert adding == {"a": 7, "b": 7, "c": 7}
    cluster.deliver(cluster.manager.tick())  # resent and answered now
    cluster.run()
    assert all(cluster.manager.sets[s].state is SetState.REPLICATING for s in cluster.wanted)


def test_basic_prefers_members_with_fewer_spans() -> None:
    placement = {span(i): "a" for i in range(6)}
    wanted = {**dict.fromkeys(placement, 100), span(10): 100, span(11): 100, span(12): 100}
    coordinator = Coordinator(rng=random.Random(2), balance_enabled=False)
    tasks = coordinator.schedule(view_of(placement, wanted=wanted))
    chosen = Counter(t.member for t in tasks if isinstance(t, AddTable))
    assert "a" not in chosen and sorted(chosen.values()) == [1, 2]


def test_basic_readds_absent_sets_with_the_wanted_checkpoint() -> None:
    s = span(1)
    rs = replicating(s, "a", checkpoint=500)
    rs.handle_member_shutdown("a")
    view = SchedulingView(members("b"), {s: 100}, {s: rs})
    assert Coordinator().schedule(view) == [AddTable(s, "b", 100)]


def test_basic_removes_unwanted_spans_but_not_busy_or_conflicted_ones() -> None:
    placement = {span(i): "a" for i in range(4)}
    conflicted = ReplicationSet.from_reports(span(3), {
        m: TableStatus(span(3), TableState.REPLICATING) for m in ("a", "b")}, epoch=EPOCH)
    sets = {**{s: replicating(s, m) for s, m in placement.items()}, span(3): conflicted}
    view = SchedulingView(members("a", "b"), {span(0): 100}, sets,
                          running={span(1): MoveTable(span(1), "b")})
    tasks = Coordinator(balance_enabled=False).schedule(view)
    assert tasks == [RemoveTable(span(2))]


def test_no_adds_without_an_eligible_member() -> None:
    view = SchedulingView(members("a", draining=("a",)), {span(1): 1}, {})
    assert Coordinator().schedule(view) == []
    assert Coordinator().schedule(SchedulingView({}, {span(1): 1}, {})) == []


def test_coordinator_waits_for_a_ready_manager() -> None:
    view = SchedulingView(members("a"), {span(1): 1}, {}, ready=False)
    assert Coordinator().schedule(view) == []


def test_never_two_tasks_for_one_span() -> None:
    placement = {span(i): "a" for i in range(12)}
    running: dict[Span, ScheduleTask] = {span(0): MoveTable(span(0), "b")}
    view = view_of(placement, ("a", "b"), draining=("a",), running=running)
    coordinator = Coordinator(rng=random.Random(3))
    coordinator.request_move(view_of(placement, ("a", "b")), span(1), "b")
    tasks = coordinator.schedule(view)
    spans = [t.span for t in tasks]
    assert len(spans) == len(set(spans)) and span(0) not in spans


# -- move validation -----------------------------------------------------------------------------

def test_move_validation_errors_are_clear() -> None:
    placement = {span(1): "a", span(2): "a"}
    sets = {s: replicating(s, m) for s, m in placement.items()}
    view = SchedulingView(members("a", "b", "c", draining=("c",)),
                          {**dict.fromkeys(placement, 1), span(3): 1}, sets,
                          running={span(2): RemoveTable(span(2))})
    assert validate_move(view, span(1), "b") is None
    assert validate_move(view, span(9), "b") == "span cf/src/db/t0009 is unknown"
    assert validate_move(view, span(3), "b") == "span cf/src/db/t0003 is not scheduled yet"
    assert validate_move(view, span(1), "zz") == "member zz is not alive (or has not reported its tables yet)"
    assert validate_move(view, span(1), "c") == "member c is draining"
    assert validate_move(view, span(1), "a") == "span cf/src/db/t0001 already replicates on a"
    assert validate_move(view, span(2), "b") == "span cf/src/db/t0002 already has a task in flight"
    sets[span(1)].handle_move_table("b")
    assert validate_move(view, span(1), "c") == \
        "span cf/src/db/t0001 is prepare; only a Replicating span can be moved"
    with pytest.raises(InvalidTaskError, match="member zz is not alive"):
        Coordinator().request_move(view_of(placement, ("a", "b")), span(2), "zz")


def test_operator_move_runs_next_round_or_fails_with_a_reason() -> None:
    placement = {span(1): "a", span(2): "a"}
    view = view_of(placement, ("a", "b"))
    coordinator = Coordinator(balance_enabled=False)
    coordinator.request_move(view, span(1), "b")
    coordinator.request_move(view, span(2), "b")
    later = view_of(placement, ("a", "b"), draining=("b",))
    assert coordinator.schedule(later) == []
    assert coordinator.operator.failed == [
        (MoveTable(span(1), "b", "operator"), "member b is draining"),
        (MoveTable(span(2), "b", "operator"), "member b is draining"),
    ]
    coordinator.request_move(view, span(1), "b")
    assert coordinator.schedule(view) == [MoveTable(span(1), "b", "operator")]
    assert coordinator.schedule(view) == []


def test_the_automatic_balance_leaves_an_operators_move_where_it_is_for_a_while() -> None:
    # Four members with two spans each; an operator moves span 0 from a to b, so b holds three.
    placement = {span(i): "abcd"[i // 2] for i in range(8)}
    coordinator = Coordinator(rng=random.Random(1), balance_interval_s=1.0, operator_pin_s=100.0)
    coordinator.request_move(view_of(placement, ("a", "b", "c", "d")), span(0), "b")
    assert coordinator.schedule(view_of(placement, ("a", "b", "c", "d")), now=0.0) == [
        MoveTable(span(0), "b", "operator")]
    moved = {**placement, span(0): "b"}
    for seed in range(20):  # whichever victims the rng draws, never the pinned span
        coordinator.rng = random.Random(seed)
        coordinator.balance._last = -math.inf
        tasks = coordinator.schedule(view_of(moved, ("a", "b", "c", "d")), now=50.0)
        assert [(t.dest, t.reason) for t in tasks if isinstance(t, MoveTable)] == [("a", "balance")]
        assert all(t.span in (span(2), span(3)) for t in tasks)
    # Past the pin it is a span like any other again.
    drawn = set()
    for seed in range(20):
        coordinator.rng = random.Random(seed)
        coordinator.balance._last = -math.inf
        drawn.update(t.span for t in coordinator.schedule(view_of(moved, ("a", "b", "c", "d")), now=150.0))
    assert span(0) in drawn


# -- balance, rebalance, caps ---------------------------------------------------------------------

def test_balance_moves_random_victims_to_least_loaded_within_the_cap() -> None:
    placement = {span(i): "a" for i in range(30)}
    view = view_of(placement, ("a", "b", "c"))
    tasks = Coordinator(rng=random.Random(4)).schedule(view)
    assert len(tasks) == 10 and all(isinstance(t, MoveTable) and t.reason == "balance" for t in tasks)
    dests = Counter(t.dest for t in tasks if isinstance(t, MoveTable))
    assert sorted(dests.values()) == [5, 5]
    running = {t.span: t for t in tasks[:4]}
    assert len(Coordinator(rng=random.Random(4)).schedule(view_of(placement, running=running))) == 6


def test_balance_is_reproducible_with_a_seed() -> None:
    placement = {span(i): "a" for i in range(30)}
    first = Coordinator(rng=random.Random(5)).schedule(view_of(placement))
    second = Coordinator(rng=random.Random(5)).schedule(view_of(placement))
    other = Coordinator(rng=random.Random(6)).schedule(view_of(placement))
    assert first == second and first != other


def test_balance_respects_its_interval_and_pauses_during_drain() -> None:
    placement = {span(i): "a" for i in range(30)}
    coordinator = Coordinator(rng=random.Random(1), balance_interval_s=60)
    assert coordinator.schedule(view_of(placement), now=0)
    balanced = {span(i): "abc"[i % 3] for i in range(30)}
    assert coordinator.schedule(view_of(balanced), now=1) == []  # found nothing: force off
    assert coordinator.schedule(view_of(placement), now=30) == []  # within the interval
    assert coordinator.schedule(view_of(placement), now=61)
    drain = Coordinator(rng=random.Random(1))
    moves = drain.schedule(view_of(placement, ("a", "b", "c", "d"), draining=("d",)))
    assert moves == []  # d holds nothing to drain, and balance waits for the drain to end


def test_operator_rebalance_waits_for_all_replicating_and_stops_when_balanced() -> None:
    placement = {span(i): "a" for i in range(9)}
    coordinator = Coordinator(rng=random.Random(1), balance_enabled=False)
    assert coordinator.schedule(view_of(placement)) == []
    coordinator.request_rebalance()
    not_ready = view_of(placement, wanted={**dict.fromkeys(placement, 1), span(99): 1})
    assert [type(t) for t in coordinator.schedule(not_ready)] == [AddTable]
    tasks = coordinator.schedule(view_of(placement))
    assert len(tasks) == 6 and all(isinstance(t, MoveTable) and t.reason == "rebalance" for t in tasks)
    assert coordinator.rebalance.requested
    assert coordinator.schedule(view_of({span(i): "abc"[i % 3] for i in range(9)})) == []
    assert not coordinator.rebalance.requested


def test_balance_evenly_across_members_end_to_end() -> None:
    cluster = Cluster(["a", "b", "c"], 100)
    cluster.run()
    assert sorted(cluster.loads().values()) == [33, 33, 34]
    assert set(cluster.replicating_on_agents().values()) == {1}
    assert len(cluster.replicating_on_agents()) == 100


def test_fourth_member_rebalances_toward_ceil_n_over_m() -> None:
    cluster = Cluster(["a", "b", "c"], 100)
    cluster.run()
    cluster.join("d")
    cluster.run()
    loads = cluster.loads()
    assert max(loads.values()) <= math.ceil(100 / 4) and loads["d"] >= 100 - 3 * 25
    assert sum(loads.values()) == 100
    assert cluster.max_moves_in_flight <= 10
    assert set(cluster.replicating_on_agents().values()) == {1}


def test_drain_empties_the_member_within_capacity_and_the_cap() -> None:
    cluster = Cluster(["a", "b", "c", "d"], 80, max_task_concurrency=3)
    cluster.run()
    cluster.infos["a"] = MemberInfo("a", draining=True)
    tasks = cluster.round(settle=False)
    assert len(tasks) == 3 and all(isinstance(t, MoveTable) and t.reason == "drain" for t in tasks)
    cluster.deliver([])  # nothing delivered yet: the moves stay in flight
    assert cluster.round(settle=False) == []  # cap reached
    for rs in list(cluster.manager.sets.values()):
        cluster.deliver(rs.tick())
    cluster.run()
    loads = cluster.loads()
    assert loads["a"] == 0 and max(loads.values()) <= math.ceil(80 / 3)
    assert cluster.max_moves_in_flight <= 3
    assert all(t.state is TableState.STOPPED for t in cluster.agents["a"].tables.values())
    cluster.agents["a"].collect_report()  # Stopped is reported once, then forgotten
    assert not cluster.agents["a"].tables


def test_dead_member_spans_come_back_elsewhere() -> None:
    cluster = Cluster(["a", "b", "c"], 30)
    cluster.run()
    del cluster.agents["b"], cluster.infos["b"]
    cluster.manager.handle_member_shutdown("b")
    assert len(cluster.manager.index.absent) == 10
    cluster.run()
    assert sorted(cluster.loads().values()) == [15, 15]


# -- WantedSpans: the spans still to add kept across rounds -------------------------------------


def _twin_rounds(plain: Cluster, kept: Cluster, rounds: int = 1000) -> int:
    """Run both clusters round by round; every round must plan exactly the same tasks."""
    for n in range(rounds):
        a, b = plain.round(), kept.round()
        assert a == b, f"round {n}: {a} != {b}"
        if not a:
            return n
    raise AssertionError("did not settle")


def test_wanted_spans_schedule_exactly_like_a_plain_mapping_through_changes() -> None:
    plain = Cluster(["a", "b", "c"], 300, seed=11, add_batch_size=7)
    kept = Cluster(["a", "b", "c"], 300, seed=11, add_batch_size=7)
    kept.wanted = WantedSpans(kept.wanted)  # type: ignore[assignment]
    assert _twin_rounds(plain, kept) > 300 // 7
    # The wanted spans change: some go (removed), new ones come (added).
    changed = {s: 100 for s in list(plain.wanted)[50:]} | {span(1000 + i): 100 for i in range(30)}
    plain.wanted, kept.wanted = dict(changed), WantedSpans(changed)  # type: ignore[assignment]
    _twin_rounds(plain, kept)
    # A member dies: its spans are Absent, then added elsewhere.
    for cluster in (plain, kept):
        del cluster.infos["c"], cluster.agents["c"]
        cluster.deliver(cluster.manager.handle_member_shutdown("c"))
    _twin_rounds(plain, kept)
    for cluster in (plain, kept):
        assert cluster.manager.index.replicating == len(changed) == len(cluster.manager.sets)
    assert {s: rs.primary for s, rs in plain.manager.sets.items()} == \
        {s: rs.primary for s, rs in kept.manager.sets.items()}


def test_wanted_spans_without_a_set_come_back_until_they_have_one() -> None:
    wanted = WantedSpans({span(i): 100 for i in range(5)})
    sets: dict[Span, ReplicationSet] = {}
    index = SetIndex()
    coordinator = Coordinator(add_batch_size=2, rng=random.Random(1), balance_enabled=False)

    def added() -> list[Span]:
        view = SchedulingView(members("a"), wanted, sets, index=index)
        return [t.span for t in coordinator.schedule(view)]

    assert added() == [span(0), span(1)]
    # Rejected (no set appeared): offered again, still smallest first.
    assert added() == [span(0), span(1)]
    for s in (span(0), span(1)):
        sets[s] = replicating(s, "a")
        index.update(sets[s])
    assert added() == [span(2), span(3)]
    for s in (span(2), span(3)):
        sets[s] = replicating(s, "a")
        index.update(sets[s])
    # A set that goes while its span is still wanted: the span is to add again.
    del sets[span(0)]
    index.discard(span(0))
    assert added() == [span(0), span(4)]
    # A span with a task in flight is skipped, not lost.
    view = SchedulingView(members("a"), wanted, sets, index=index,
                          running={span(0): AddTable(span(0), "a", 100)})
    assert [t.span for t in coordinator.schedule(view)] == [span(4)]
    assert added() == [span(0), span(4)]
    # A set nobody wants is removed.
    stray = span(99)
    sets[stray] = replicating(stray, "a")
    index.update(sets[stray])
    assert RemoveTable(stray) in coordinator.schedule(SchedulingView(members("a"), wanted, sets, index=index))


def test_set_index_membership_journal() -> None:
    index = SetIndex()
    mark = index.membership
    rs = replicating(span(1), "a")
    index.update(rs)
    index.update(rs)  # no change of membership
    index.discard(span(2))  # never in the index
    assert index.membership_since(mark) == [span(1)]
    index.discard(span(1))
    assert index.membership_since(mark) == [span(1), span(1)]
    assert index.membership_since(index.membership) == []
    for i in range(SetIndex.JOURNAL + 1):
        index.update(replicating(span(i), "a"))
    assert index.membership_since(mark) is None  # too far behind: the reader rescans
    assert len(index.membership_since(index.membership - SetIndex.JOURNAL) or []) == SetIndex.JOURNAL
