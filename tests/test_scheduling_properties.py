"""Property tests: a simulated cluster under random interleavings.

The cluster is the real ReplicationManager + Coordinator + one MemberAgentState per member,
with messages on per-member channels (dispatches to a member, reports from it) delivered in
random order across members. Hypothesis draws the interleaving: deliveries, lost and duplicated
dispatches, lost reports and reports overtaking older ones, pipelines preparing, applying,
stopping (slowly) or failing on their own, heartbeats, scheduling rounds, resends, member deaths
(noticed later), restarts under the same id, joins, drains, operator moves and rebalances,
spans (un)wanted, leader changes whose deposed leader keeps dispatching for a while, members
whose prepares never finish (a destination that never gets ready) and time passing beyond the
manager's prepare deadline. Walks
start from a steady state (all wanted spans replicating) unless said otherwise. After every step:

- every set keeps its invariants (at most one primary, roles consistent) and no conflict arises;
- No Double Write: at most one live member per span is Replicating, or Stopping after having
  written, as the members themselves hold it;
- checkpoints never go backwards (per span and published per changefeed), and a published
  checkpoint never exceeds what is really applied downstream for every span (No Lost Table
  for progress).

After quiescence (deaths noticed, the deposed leader silent, every message delivered) every
wanted span replicates on exactly one live member, the one the manager names as primary, and
nothing unwanted runs anywhere.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.scheduling import (
    CheckpointTracker,
    Coordinator,
    Dispatch,
    InvalidTaskError,
    MemberAgentState,
    MemberInfo,
    MemberReport,
    ReplicationManager,
    ReplicationSet,
    SetState,
    Span,
    TableState,
    compute_checkpoint,
)

UNIVERSE = [Span(cf, "src", "db", f"t{i}") for cf in ("cf1", "cf2") for i in range(4)]
START_TS = 100
PREPARE_TIMEOUT_S = 10.0


@dataclass
class Heartbeat:
    epoch: int


@dataclass
class SimMember:
    agent: MemberAgentState
    inbox: deque[Dispatch | Heartbeat] = field(default_factory=deque)
    outbox: deque[MemberReport] = field(default_factory=deque)


class Sim:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.epoch = 1
        self.next_member = 0
        self.members: dict[str, SimMember] = {}
        self.infos: dict[str, MemberInfo] = {}
        self.unnoticed_deaths: list[str] = []
        # Members whose prepares never finish (Spark never warm, a pull that hangs).
        self.stuck: set[str] = set()
        self.clock = 0.0
        self.manager = ReplicationManager(self.epoch, max_task_concurrency=2,
                                          prepare_timeout_s=PREPARE_TIMEOUT_S)
        self.zombie: ReplicationManager | None = None
        self.zombie_coordinator: Coordinator | None = None
        self.coordinator = self._coordinator()
        self.wanted: dict[Span, int] = dict.fromkeys(UNIVERSE[:6], START_TS)
        self.applied: dict[Span, int] = dict.fromkeys(UNIVERSE, START_TS)
        self.tracker = CheckpointTracker()
        self.span_checkpoints: dict[Span, int] = {}
        self.sets_seen: dict[Span, ReplicationSet] = {}  # the set each span had at the last check
        self.new_leader = False
        self.published: dict[str, int] = {}
        self.ts = START_TS
        for _ in range(3):
            self.join()

    def _coordinator(self) -> Coordinator:
        return Coordinator(add_batch_size=3, max_task_concurrency=2, balance_interval_s=0,
                           rng=random.Random(self.rng.random()))

    # -- plumbing ------------------------------------------------------------------------------

    def send(self, dispatches: list[Dispatch]) -> None:
        for d in dispatches:
            member = self.members.get(d.member)
            if member is not None:  # a dead member's messages are lost
                member.inbox.append(d)

    def pick(self, i: int) -> str | None:
        names = sorted(self.members)
        return names[i % len(names)] if names else None

    # -- operations ----------------------------------------------------------------------------

    def join(self) -> None:
        name = f"m{self.next_member}"
        self.next_member += 1
        self.members[name] = SimMember(MemberAgentState(name, min_epoch=self.epoch))
        self.infos[name] = MemberInfo(name)
        self.manager.handle_member_joined(name)
        self.members[name].inbox.append(Heartbeat(self.epoch))

    def deliver_dispatch(self, i: int) -> None:
        busy = sorted(m for m, s in self.members.items() if s.inbox)
        if busy:
            self._deliver_to(busy[i % len(busy)])

    def _deliver_to(self, name: str) -> None:
        member = self.members[name]
        msg = member.inbox.popleft()
        agent = member.agent
        if isinstance(msg, Heartbeat):
            if agent.observe_epoch(msg.epoch):
                member.outbox.append(agent.collect_report())
            return
        outcome = agent.handle_dispatch(msg)
        member.outbox.append(agent.reply(outcome))

    def lose_dispatch(self, i: int) -> None:
        """Core-NATS request/reply: a dispatch can be lost."""
        busy = sorted(m for m, s in self.members.items() if s.inbox)
        if busy:
            inbox = self.members[busy[i % len(busy)]].inbox
            del inbox[i % len(inbox)]

    def duplicate_dispatch(self, i: int) -> None:
        busy = sorted(m for m, s in self.members.items() if s.inbox)
        if busy:
            inbox = self.members[busy[i % len(busy)]].inbox
            inbox.append(inbox[i % len(inbox)])

    def lose_report(self, i: int) -> None:
        busy = sorted(m for m, s in self.members.items() if s.outbox)
        if busy:
            outbox = self.members[busy[i % len(busy)]].outbox
            del outbox[i % len(outbox)]

    def overtake_report(self, i: int) -> None:
        """Heartbeat replies and dispatch replies travel apart: a newer one can arrive first."""
        busy = sorted(m for m, s in self.members.items() if len(s.outbox) > 1)
        if busy:
            outbox = self.members[busy[i % len(busy)]].outbox
            self.send(self.manager.handle_report(outbox.pop()))

    def deliver_report(self, i: int) -> None:
        busy = sorted(m for m, s in self.members.items() if s.outbox)
        if not busy:
            return
        report = self.members[busy[i % len(busy)]].outbox.popleft()
        self.send(self.manager.handle_report(report))

    def progress(self, i: int, j: int) -> None:
        name = self.pick(i)
        if name is None:
            return
        # Stopping is left to finish_stop: slow stops are where double writes would hide.
        tables = self.members[name].agent.tables
        spans = sorted(s for s, t in tables.items() if t.state is not TableState.STOPPING)
        if spans:
            self._progress(name, spans[j % len(spans)], 1 + j % 7)

    def finish_stop(self, i: int, j: int) -> None:
        name = self.pick(i)
        if name is None:
            return
        tables = self.members[name].agent.tables
        spans = sorted(s for s, t in tables.items() if t.state is TableState.STOPPING)
        if spans:
            self._progress(name, spans[j % len(spans)], 1)

    def _progress(self, name: str, span: Span, step: int) -> None:
        """The member's pipeline for ``span`` finishes its current step (or applies a batch)."""
        agent = self.members[name].agent
        table = agent.tables[span]
        if table.state is TableState.PREPARING:
            if name not in self.stuck:
                agent.prepared(span)
        elif table.state is TableState.STOPPING:
            agent.stopped(span)
        elif table.state is TableState.REPLICATING:
            self.ts += step
            agent.update_progress(span, self.ts, self.ts + 3)
            self.applied[span] = max(self.applied[span], self.ts)

    def pump(self, finish_stops: bool = False) -> None:
        """Deliver everything in flight once and let every pipeline finish preparing (and
        stopping, if asked)."""
        finishing = (TableState.PREPARING, TableState.STOPPING) if finish_stops else (TableState.PREPARING,)
        for name in sorted(self.members):
            member = self.members[name]
            while member.inbox:
                self._deliver_to(name)
            for span in sorted(member.agent.tables):
                if member.agent.tables[span].state in finishing:
                    self._progress(name, span, 1)
        while any(m.outbox for m in self.members.values()):
            self.deliver_report(0)

    def abandon(self, i: int, j: int) -> None:
        name = self.pick(i)
        if name is None:
            return
        spans = sorted(self.members[name].agent.tables)
        if spans:
            self.members[name].agent.abandon(spans[j % len(spans)])

    def advance_all(self, i: int) -> None:
        """Every replicating pipeline applies a batch."""
        for name in sorted(self.members):
            for span, table in sorted(self.members[name].agent.tables.items()):
                if table.state is TableState.REPLICATING:
                    self._progress(name, span, 1 + (i + len(span.table)) % 5)

    def heartbeat(self, i: int) -> None:
        name = self.pick(i)
        if name is not None:
            self.members[name].inbox.append(Heartbeat(self.manager.epoch))

    def schedule(self) -> None:
        view = self.manager.view(self.infos, self.wanted)
        outcome = self.manager.handle_tasks(self.coordinator.schedule(view, now=self.ts))
        assert not outcome.rejected or not self.manager.ready, outcome.rejected
        self.send(outcome.dispatches)

    def tick(self) -> None:
        self.send(self.manager.tick(self.clock))

    def time_passes(self, i: int) -> None:
        """Wall-clock time goes by: up to twice the prepare deadline."""
        self.clock += PREPARE_TIMEOUT_S * (i % 5) / 2

    def toggle_stuck(self, i: int) -> None:
        """The member's prepares stop finishing (or start again)."""
        name = self.pick(i)
        if name is not None:
            self.stuck ^= {name}

    def kill(self, i: int) -> None:
        if len(self.members) <= 1:
            return
        name = self.pick(i)
        assert name is not None
        del self.members[name]
        self.infos.pop(name, None)
        self.stuck.discard(name)
        self.unnoticed_deaths.append(name)

    def notice_death(self) -> None:
        if self.unnoticed_deaths:
            name = self.unnoticed_deaths.pop(0)
            self.send(self.manager.handle_member_shutdown(name))

    def restart(self, i: int) -> None:
        """Same member id, state cleared (seed 002's processor restart)."""
        name = self.pick(i)
        if name is None:
            return
        old = self.members[name].agent
        self.members[name] = SimMember(MemberAgentState(name, min_epoch=self.epoch, seq_start=old.seq + 1000))
        self.members[name].inbox.append(Heartbeat(self.epoch))

    def toggle_drain(self, i: int) -> None:
        name = self.pick(i)
        if name is not None:
            self.infos[name] = MemberInfo(name, draining=not self.infos[name].draining)

    def operator_move(self, i: int, j: int) -> None:
        name = self.pick(j)
        replicating = sorted(s for s, rs in self.manager.sets.items() if rs.state is SetState.REPLICATING)
        span = replicating[i % len(replicating)] if replicating and i % 4 else UNIVERSE[i % len(UNIVERSE)]
        if name is None:
            return
        view = self.manager.view(self.infos, self.wanted)
        try:
            self.coordinator.request_move(view, span, name)
        except InvalidTaskError:
            pass

    def rebalance(self) -> None:
        self.coordinator.request_rebalance()

    def toggle_wanted(self, i: int) -> None:
        span = UNIVERSE[i % len(UNIVERSE)]
        if span in self.wanted:
            del self.wanted[span]
        else:
            # A span joining a changefeed starts from the changefeed's published checkpoint.
            start = max(START_TS, self.published.get(span.changefeed, START_TS))
            self.wanted[span] = start
            self.applied[span] = max(self.applied[span], start)

    def leader_change(self) -> None:
        old = self.manager
        self.epoch += 1
        known = old.span_checkpoints()  # what the new leader replays from the domain log
        live = [*self.members, *self.unnoticed_deaths]  # the member service's view
        self.manager = ReplicationManager(self.epoch, live_members=live, known_spans=known,
                                          max_task_concurrency=2, prepare_timeout_s=PREPARE_TIMEOUT_S)
        self.new_leader = True  # its sets are new objects carrying the old leader's checkpoints
        self.send(self.manager.take_startup_dispatches())
        self.zombie, self.zombie_coordinator = old, self.coordinator
        self.coordinator = self._coordinator()
        for member in self.members.values():
            member.inbox.append(Heartbeat(self.epoch))

    def zombie_acts(self) -> None:
        """The deposed leader has not noticed yet and keeps dispatching with its old epoch."""
        if self.zombie is None or self.zombie_coordinator is None:
            return
        view = self.zombie.view(self.infos, self.wanted)
        self.send(self.zombie.handle_tasks(self.zombie_coordinator.schedule(view, now=self.ts)).dispatches)
        self.send(self.zombie.tick())

    def zombie_stops(self) -> None:
        self.zombie = self.zombie_coordinator = None

    # -- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        for rs in self.manager.sets.values():
            rs.check_invariants()
        assert self.manager.errors == [], self.manager.errors
        writers: Counter[Span] = Counter()
        replicating: Counter[Span] = Counter()
        for member in self.members.values():
            for span, table in member.agent.tables.items():
                writers[span] += table.may_write
                replicating[span] += table.state is TableState.REPLICATING
        assert max(replicating.values(), default=0) <= 1, f"two members Replicating: {replicating}"
        assert max(writers.values(), default=0) <= 1, f"double write: {writers}"
        for span, rs in self.manager.sets.items():
            if self.sets_seen.get(span, rs) is not rs and not self.new_leader:
                # Removed and added again: a new life that starts from the changefeed's
                # checkpoint (re-applying is idempotent), not from the removed span's.
                self.span_checkpoints.pop(span, None)
            self.sets_seen[span] = rs
        self.new_leader = False
        for span, rs in self.manager.sets.items():
            previous = self.span_checkpoints.get(span, 0)
            assert rs.checkpoint_ts >= previous, f"{span} checkpoint went back"
            self.span_checkpoints[span] = rs.checkpoint_ts
            assert rs.checkpoint_ts <= self.applied[span], f"{span} checkpoint beyond applied"
        if not self.manager.ready:
            return  # a new leader still rebuilding: its sets must resume from these
        for span in list(self.span_checkpoints):
            if span not in self.manager.sets:
                del self.span_checkpoints[span]  # removed: a later set starts afresh
        by_cf: dict[str, list[Span]] = {}
        for span in self.wanted:
            by_cf.setdefault(span.changefeed, []).append(span)
        for cf, update in self.tracker.advance(by_cf, self.manager.sets).items():
            assert update.checkpoint_ts >= self.published.get(cf, 0)
            self.published[cf] = update.checkpoint_ts
            if update.advanced:
                floor = min(self.applied[s] for s in by_cf[cf])
                assert update.checkpoint_ts <= floor, f"{cf}: published {update.checkpoint_ts} > {floor}"

    # -- quiescence ----------------------------------------------------------------------------

    def settle(self) -> None:
        self.stuck.clear()
        self.zombie_stops()
        while self.unnoticed_deaths:
            self.notice_death()
        if not any(not info.draining for info in self.infos.values()):
            self.join()
        for _ in range(300):
            self.pump(finish_stops=True)
            for member in self.members.values():
                member.inbox.append(Heartbeat(self.manager.epoch))
            self.pump(finish_stops=True)
            self.check()
            if self.quiet():
                return
            self.schedule()
            self.tick()
            self.check()
        raise AssertionError(f"no quiescence: {self.manager.sets}")

    def quiet(self) -> bool:
        m = self.manager
        if not m.ready or m.running or m.index.unstable or m.index.lingering or m.index.absent:
            return False
        if set(m.sets) != set(self.wanted):
            return False
        return all(not s.inbox and not s.outbox for s in self.members.values())

    def check_no_lost_table(self) -> None:
        holders: dict[Span, list[str]] = {}
        for name, member in self.members.items():
            for span, table in member.agent.tables.items():
                assert span in self.wanted, f"unwanted {span} still on {name} ({table.state})"
                holders.setdefault(span, []).append(f"{name}:{table.state}")
        for span in self.wanted:
            rs = self.manager.sets[span]
            assert rs.state is SetState.REPLICATING and rs.primary in self.members, rs
            assert holders.get(span) == [f"{rs.primary}:replicating"], (span, holders.get(span))
        by_cf: dict[str, list[Span]] = {}
        for span in self.wanted:
            by_cf.setdefault(span.changefeed, []).append(span)
        for spans in by_cf.values():
            assert compute_checkpoint(spans, self.manager.sets).checkpoint_ts is not None


# Weighted: mostly message traffic, so the cluster gets somewhere between disruptions.
OP_WEIGHTS = {
    "deliver_dispatch": 8, "deliver_report": 8, "progress": 6, "heartbeat": 3, "schedule": 4,
    "tick": 2, "pump": 2, "kill": 1, "notice_death": 2, "restart": 1, "join": 1, "toggle_drain": 1,
    "operator_move": 4, "rebalance": 1, "toggle_wanted": 1, "leader_change": 1, "zombie_acts": 2,
    "zombie_stops": 1, "lose_dispatch": 1, "duplicate_dispatch": 1, "lose_report": 1,
    "overtake_report": 1, "abandon": 1, "advance_all": 2, "finish_stop": 2, "time_passes": 1,
    "toggle_stuck": 1,
}
OPS = [op for op, weight in OP_WEIGHTS.items() for _ in range(weight)]
INDEXED = {"deliver_dispatch", "deliver_report", "heartbeat", "kill", "restart", "toggle_drain",
           "toggle_wanted", "lose_dispatch", "duplicate_dispatch", "lose_report", "overtake_report",
           "advance_all", "time_passes", "toggle_stuck"}
DOUBLE_INDEXED = {"progress", "operator_move", "abandon", "finish_stop"}


def apply(sim: Sim, op: str, i: int, j: int) -> None:
    if op in INDEXED:
        getattr(sim, op)(i)
    elif op in DOUBLE_INDEXED:
        getattr(sim, op)(i, j)
    else:
        getattr(sim, op)()


def run(seed: int, ops: list[tuple[str, int, int]], *, steady: bool = True) -> Sim:
    sim = Sim(seed)
    sim.check()
    if steady:
        # Most interesting interleavings need spans that already replicate: start from there.
        sim.settle()
        sim.advance_all(seed)
        sim.check()
    for op, i, j in ops:
        apply(sim, op, i, j)
        sim.check()
    sim.settle()
    sim.check_no_lost_table()
    return sim


op_strategy = st.tuples(st.sampled_from(OPS), st.integers(0, 63), st.integers(0, 63))
LEADER_OPS = ["leader_change", "leader_change", "zombie_acts", "zombie_acts", "zombie_stops",
              "deliver_dispatch", "deliver_dispatch", "deliver_report", "deliver_report", "heartbeat",
              "progress", "finish_stop", "schedule", "tick", "kill", "notice_death", "operator_move",
              "overtake_report", "lose_dispatch", "advance_all"]


# Walks are long on purpose: hypothesis favours short lists, and the interleavings that matter
# (a move mid-commit when the leader changes, a slow stop when a member dies) need room.
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), ops=st.lists(op_strategy, min_size=30, max_size=250))
def test_simulated_cluster_keeps_safety_and_converges(seed: int, ops: list[tuple[str, int, int]]) -> None:
    run(seed, ops)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16),
       ops=st.lists(st.tuples(st.sampled_from(LEADER_OPS), st.integers(0, 63), st.integers(0, 63)),
                    min_size=30, max_size=250))
def test_leader_changes_with_a_deposed_leader_acting(seed: int, ops: list[tuple[str, int, int]]) -> None:
    run(seed, ops)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), ops=st.lists(op_strategy, max_size=60))
def test_from_an_empty_cluster(seed: int, ops: list[tuple[str, int, int]]) -> None:
    """Disruptions while the first spans are still being added."""
    run(seed, ops, steady=False)


@pytest.mark.parametrize("walk", range(12))
def test_long_random_walks(walk: int) -> None:
    """Long deterministic walks, beyond what the shrinking examples reach."""
    rng = random.Random(2024 + walk)
    ops = [(rng.choice(OPS), rng.randrange(64), rng.randrange(64)) for _ in range(1500)]
    run(walk, ops)


def test_the_walks_reach_the_interesting_situations() -> None:
    """Guards the generator: if the walks stopped reaching these, the properties above would
    pass without testing much."""
    seen: Counter[str] = Counter()
    for walk in range(40):
        rng = random.Random(77 + walk)
        sim = Sim(walk)
        sim.settle()
        last_primary = {s: rs.primary for s, rs in sim.manager.sets.items()}
        for _ in range(400):
            op, i, j = rng.choice(OPS), rng.randrange(64), rng.randrange(64)
            before = {s: rs.state for s, rs in sim.manager.sets.items()}
            epoch = sim.manager.epoch
            apply(sim, op, i, j)
            sim.check()
            for span, state in before.items():
                rs = sim.manager.sets.get(span)
                if rs is None:
                    seen["span removed"] += 1
                elif op == "notice_death" and state in (SetState.PREPARE, SetState.COMMIT) \
                        and rs.state != state:
                    seen["death during a move"] += 1
            for span, rs in sim.manager.sets.items():
                if rs.state is SetState.REPLICATING:
                    if last_primary.get(span) not in (None, rs.primary):
                        seen["span moved"] += 1
                    last_primary[span] = rs.primary
            if sim.manager.epoch != epoch:
                seen["leader change"] += 1
            if any(m.agent.rejected_stale for m in sim.members.values()):
                seen["stale dispatch rejected"] += 1
            if sim.manager.ready and sim.manager.index.lingering:
                seen["undetermined member"] += 1
        sim.settle()
        sim.check_no_lost_table()
    for situation in ("span removed", "span moved", "death during a move", "leader change",
                      "stale dispatch rejected", "undetermined member"):
        assert seen[situation] > 0, (situation, seen)


def _stuck_destination_run(seed: int, ops: list[tuple[str, int, int]]) -> Sim:
    """A member joins whose prepares never finish; the cluster keeps running around it."""
    sim = Sim(seed)
    sim.wanted = dict.fromkeys(UNIVERSE, START_TS)  # 8 spans on 3 members: 2 to move to a 4th
    sim.settle()
    sim.advance_all(seed)
    sim.join()
    stuck = max(sim.members)
    sim.stuck.add(stuck)
    sim.coordinator.request_rebalance()  # the new, empty member is the destination of moves
    for op, i, j in ops:
        if op == "toggle_stuck" or (op in ("kill", "restart") and sim.pick(i) == stuck):
            continue  # it stays stuck (and alive) for the whole walk
        apply(sim, op, i, j)
        sim.check()
    # Liveness with the stuck member still there: rounds with time passing. Every prepare on
    # it is given up within its deadline and its span keeps (or gets back) a live writer.
    sim.zombie_stops()
    while sim.unnoticed_deaths:
        sim.notice_death()
    sim.infos[stuck] = MemberInfo(stuck)  # a walk may have set it draining
    for i, span in enumerate(UNIVERSE):
        if span not in sim.wanted:
            sim.toggle_wanted(i)  # every span wanted again: enough load for the stuck member
    sim.coordinator.request_rebalance()
    timeouts = sim.manager.prepare_timeouts
    chosen = False
    for _ in range(40):
        sim.time_passes(1)
        before = sim.manager.prepare_timeouts
        sim.tick()
        timeouts += sim.manager.prepare_timeouts - before
        sim.check()
        sim.pump(finish_stops=True)
        for member in sim.members.values():
            member.inbox.append(Heartbeat(sim.manager.epoch))
        sim.pump(finish_stops=True)
        sim.schedule()
        sim.check()
        chosen = chosen or any(rs.secondary == stuck for rs in sim.manager.sets.values())
        for span, (holder, left) in sim.manager.prepare_deadlines(sim.clock).items():
            assert left >= 0, f"{span} preparing on {holder} past its deadline ({left} s)"
    m = sim.manager
    assert timeouts > 0 or not chosen, "the stuck member's prepares never expired"
    sim.tick()  # no time passes: it only starts the deadlines of the adds of the last round
    deadlines = m.prepare_deadlines(sim.clock)
    for span in sim.wanted:
        rs = m.sets[span]
        if rs.primary is None:
            # Only an add onto the stuck member, inside its deadline (a dead member's span
            # re-added there); never a span left without a set or half-moved.
            assert rs.state is SetState.PREPARE and rs.secondary == stuck and span in deadlines, rs
            continue
        assert rs.primary != stuck and rs.state in (SetState.REPLICATING, SetState.PREPARE), rs
        table = sim.members[rs.primary].agent.tables[span]
        assert table.state is TableState.REPLICATING, (span, rs.primary, table.state)
    # Once it gets ready, everything converges as usual (with the member taking its share).
    sim.settle()
    sim.check_no_lost_table()
    return sim


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), ops=st.lists(op_strategy, max_size=80))
def test_a_destination_that_never_finishes_prepare(seed: int, ops: list[tuple[str, int, int]]) -> None:
    """Moves and adds onto a member whose prepare never finishes are rolled back within the
    prepare deadline; the spans keep replicating on their old owners (never left half-moved)
    and nothing is lost once the member gets ready."""
    _stuck_destination_run(seed, ops)


def test_a_destination_that_never_finishes_prepare_is_given_up() -> None:
    """The plain case: the fourth member takes moves, never prepares, and they are rolled back."""
    sim = _stuck_destination_run(7, [])
    assert sim.manager.prepare_timeouts > 0
