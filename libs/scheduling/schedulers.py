"""Schedulers: decide what should run where, as schedule tasks for the replication manager.

Run in priority order by ``Coordinator`` (as TiCDC v3's scheduler manager does): basic (add
absent spans, remove unwanted ones), drain, operator moves, operator rebalance, automatic
balance. Each is a plain class reading a ``SchedulingView``; none of them changes a set.

Limits, and why:
- adds and removes come in batches of ``add_batch_size`` per round and are not counted against
  the move cap: they are how a changefeed starts or a dead member's spans come back, and
  holding them behind balancing moves would stall replication;
- a member gets at most ``max_adds_per_member`` adds in flight: a changefeed of thousands of
  tables would otherwise pile hundreds of prepares onto each worker in a few rounds, the slowest
  of them would pass the replication-manager's prepare timeout and be rolled back, and planned
  again, so the start took longer than adding them at the pace the worker prepares;
- moves (drain, operator, balance) are capped at ``max_task_concurrency`` in flight, since each
  one doubles the work on the span for a while;
- a span never gets a second task while one is running or its set is mid-transition.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Collection, Iterable, Iterator, KeysView, Mapping
from dataclasses import dataclass, field

from libs.scheduling.model import InvalidTaskError, MemberId, MemberInfo, Span
from libs.scheduling.replication_set import SetIndex, SetLike, SetState
from libs.scheduling.tasks import AddTable, MoveTable, RemoveTable, ScheduleTask

DEFAULT_ADD_BATCH_SIZE = 50
DEFAULT_MAX_ADDS_PER_MEMBER = 100
DEFAULT_MAX_TASK_CONCURRENCY = 10
DEFAULT_BALANCE_INTERVAL_S = 60.0
DEFAULT_OPERATOR_PIN_S = 600.0
"""How long the automatic balance leaves a span an operator moved where the operator put it."""


class WantedSpans(Mapping[Span, int]):
    """Every span that should run, with the checkpoint an add starts it from; never changed
    after construction.

    A view whose ``wanted`` is one of these lets the basic scheduler keep the spans it still has
    to add across rounds (while the view carries the same object) instead of comparing every
    wanted span with the sets each round, which made scheduling 100,000 spans quadratic. A
    caller whose wanted spans change builds a new one; a plain mapping is scanned every round.
    """

    __slots__ = ("_floor", "_floors")

    def __init__(self, floors: Mapping[Span, int] | Iterable[tuple[Span, int]] = (), *,
                 floor: Callable[[Span], int] | None = None) -> None:
        """``floor``: the checkpoint of a span is asked for when an add needs it (the sets'
        checkpoints move all the time; the spans do not), and ``floors`` gives only the spans."""
        self._floors: dict[Span, int] = dict(floors)
        self._floor = floor

    def __getitem__(self, span: Span) -> int:
        found = self._floors[span]
        return found if self._floor is None else self._floor(span)

    def __iter__(self) -> Iterator[Span]:
        return iter(self._floors)

    def __len__(self) -> int:
        return len(self._floors)

    def __contains__(self, span: object) -> bool:
        return span in self._floors

    def keys(self) -> KeysView[Span]:
        # The dict's own view: set algebra with it runs in C.
        return self._floors.keys()


class SchedulingView:
    """What the schedulers may look at.

    ``members``: live members that may receive work (the replication manager leaves out the
    ones that have not reported their tables yet). ``wanted``: every span that should run, with
    the checkpoint to start it from (a ``WantedSpans`` to schedule in time independent of the
    number of spans). ``sets``: the replication sets. ``running``: tasks in
    flight. ``index``: incremental indexes over ``sets`` (built by scanning if not given).
    """

    def __init__(
        self,
        members: Mapping[MemberId, MemberInfo],
        wanted: Mapping[Span, int],
        sets: Mapping[Span, SetLike],
        *,
        running: Mapping[Span, ScheduleTask] | None = None,
        index: SetIndex | None = None,
        ready: bool = True,
    ) -> None:
        self.members = members
        self.wanted = wanted
        self.sets = sets
        self.running: Mapping[Span, ScheduleTask] = running if running is not None else {}
        self.index = index if index is not None else SetIndex.build(sets.values())
        self.ready = ready

    def eligible(self) -> list[MemberId]:
        """Members that may take new spans, in a stable order."""
        return sorted(m for m, info in self.members.items() if not info.draining)

    def draining(self) -> list[MemberId]:
        return sorted(m for m, info in self.members.items() if info.draining)

    def load(self, member: MemberId) -> int:
        return self.index.load(member)

    def all_wanted_replicating(self) -> bool:
        if self.index.unstable or self.index.absent:
            return False
        sets = self.sets
        for span in self.wanted:
            rs = sets.get(span)
            if rs is None or rs.state is not SetState.REPLICATING or rs.error is not None:
                return False
        return True


@dataclass
class ScheduleContext:
    """Shared by the schedulers of one round."""

    taken: set[Span]
    """Spans that already have a task (running or produced this round)."""
    budget: int
    """Moves that may still start this round."""
    rng: random.Random
    now: float = 0.0
    rejected: list[tuple[ScheduleTask, str]] = field(default_factory=list)
    pinned: Collection[Span] = ()
    """Spans an operator moved lately: the automatic balance does not pick them."""


def _least_loaded(loads: Mapping[MemberId, int], rng: random.Random, capacity: int | None = None,
                  exclude: Collection[MemberId] = ()) -> MemberId | None:
    """Least loaded member under ``capacity``, ties at random; ``exclude``: members that still
    hold the span (a set may keep an undetermined member while it replicates elsewhere)."""
    candidates = {m: load for m, load in loads.items() if m not in exclude}
    if not candidates:
        return None
    low = min(candidates.values())
    if capacity is not None and low >= capacity:
        return None
    ties = [m for m, load in candidates.items() if load == low]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def _movable(view: SchedulingView, span: Span, member: MemberId, taken: Collection[Span]) -> bool:
    if span in taken:
        return False
    rs = view.sets.get(span)
    return (rs is not None and rs.error is None and rs.state is SetState.REPLICATING
            and rs.primary == member)


class _Unset:
    """For one ``WantedSpans`` and one set index: the wanted spans without a set (a heap,
    smallest first) and the sets of spans nobody wants, kept across rounds.

    Each round applies only the index's membership changes since the last (sets created or
    removed); a span that got a set stays in the heap until it comes up, and is dropped then.
    The spans handed out as candidates are lent: the next round puts back the ones still
    without a set (the add was not chosen or was rejected) rather than pushing every candidate
    back at once, since nearly all of them have a set by then.
    A new ``WantedSpans``, other sets, or a journal that no longer reaches back mean a rescan.
    """

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        self.wanted: WantedSpans | None = None
        self.sets: Mapping[Span, SetLike] = {}
        self.index: SetIndex | None = None
        self.mark = 0
        self.heap: list[Span] = []
        self.queued: set[Span] = set()
        """Spans in ``heap`` or ``lent``."""
        self.lent: list[Span] = []
        self.unwanted: dict[Span, None] = {}

    def sync(self, view: SchedulingView) -> bool:
        """Bring the spans up to date with ``view``; False when its wanted spans are a plain
        mapping (the caller scans them)."""
        wanted, sets, index = view.wanted, view.sets, view.index
        if not isinstance(wanted, WantedSpans):
            self.forget()  # let go of the last view's objects
            return False
        changed = (index.membership_since(self.mark)
                   if wanted is self.wanted and sets is self.sets and index is self.index else None)
        if changed is None:
            self.wanted, self.sets, self.index = wanted, sets, index
            self.heap = list(wanted.keys() - sets.keys())
            heapq.heapify(self.heap)
            self.queued = set(self.heap)
            self.lent = []
            self.unwanted = dict.fromkeys(sets.keys() - wanted.keys())
        else:
            self._return_lent()
            for span in changed:
                if span in sets:
                    if span not in wanted:
                        self.unwanted[span] = None
                    continue
                self.unwanted.pop(span, None)
                if span in wanted and span not in self.queued:
                    heapq.heappush(self.heap, span)
                    self.queued.add(span)
        self.mark = index.membership
        return True

    def _return_lent(self) -> None:
        for span in self.lent:
            if span in self.sets:
                self.queued.discard(span)  # back on the heap (sync) if its set goes
            else:
                heapq.heappush(self.heap, span)
        self.lent = []

    def smallest(self, n: int, taken: Collection[Span]) -> list[Span]:
        """The ``n`` smallest wanted spans without a set that are not taken (lent until the
        next ``sync``)."""
        self._return_lent()
        heap, sets = self.heap, self.sets
        out = self.lent
        skipped: list[Span] = []
        while heap and len(out) < n:
            span = heapq.heappop(heap)
            if span in sets:
                self.queued.discard(span)  # added since; back on the heap if its set goes
            elif span in taken:
                skipped.append(span)
            else:
                out.append(span)
        for span in skipped:
            heapq.heappush(heap, span)
        return list(out)


class BasicScheduler:
    """Add wanted spans that nobody replicates; remove spans that are no longer wanted."""

    def __init__(self, add_batch_size: int = DEFAULT_ADD_BATCH_SIZE,
                 max_adds_per_member: int = DEFAULT_MAX_ADDS_PER_MEMBER) -> None:
        if add_batch_size < 1:
            raise ValueError("add_batch_size must be at least 1")
        if max_adds_per_member < 1:
            raise ValueError("max_adds_per_member must be at least 1")
        self.add_batch_size = add_batch_size
        self.max_adds_per_member = max_adds_per_member
        self._unset = _Unset()

    def schedule(self, view: SchedulingView, ctx: ScheduleContext) -> list[ScheduleTask]:
        tasks: list[ScheduleTask] = []
        sets, wanted, taken = view.sets, view.wanted, ctx.taken
        incremental = self._unset.sync(view)
        # Key-view set algebra runs in C; a Python loop over 10,000 spans every round would not.
        unwanted: Collection[Span] = self._unset.unwanted if incremental else sets.keys() - wanted.keys()
        if unwanted:
            removable = (s for s in unwanted if s not in taken and sets[s].error is None)
            for span in heapq.nsmallest(self.add_batch_size, removable):
                tasks.append(RemoveTable(span))
                taken.add(span)
        eligible = view.eligible()
        adding: dict[MemberId, int] = {}
        for task in view.running.values():
            if isinstance(task, AddTable):
                adding[task.member] = adding.get(task.member, 0) + 1
        room = {m: self.max_adds_per_member - adding.get(m, 0) for m in eligible}
        if not any(r > 0 for r in room.values()):
            return tasks
        candidates: set[Span]
        if incremental:
            candidates = set(self._unset.smallest(self.add_batch_size, taken))
        else:
            # Steady state (every wanted span has a set) costs one difference, not two.
            with_sets = len(sets) - len(unwanted)
            candidates = wanted.keys() - sets.keys() if len(wanted) > with_sets else set()
            candidates.difference_update(taken)
        # Absent sets have a set, so they are never among the above: the index keeps them.
        candidates.update(s for s in view.index.absent if s in wanted and s not in taken)
        if not candidates:
            return tasks
        # Smallest spans first, so a round's picks do not depend on hash order.
        chosen = heapq.nsmallest(self.add_batch_size, candidates)
        # Least loaded first, ties at random: the random key is drawn once per member and
        # re-drawn after each assignment.
        heap = [(view.load(m), ctx.rng.random(), m) for m in eligible if room[m] > 0]
        heapq.heapify(heap)
        for span in chosen:
            rs = sets.get(span)
            # A member still holding the span (undetermined) cannot be its new secondary.
            holders = rs.members if rs is not None else {}
            skipped = []
            while heap and heap[0][2] in holders:
                skipped.append(heapq.heappop(heap))
            if heap:
                load, _, member = heapq.heappop(heap)
                tasks.append(AddTable(span, member, wanted[span]))
                taken.add(span)
                room[member] -= 1
                if room[member] > 0:
                    heapq.heappush(heap, (load + 1, ctx.rng.random(), member))
            for entry in skipped:
                heapq.heappush(heap, entry)
        return tasks


class DrainScheduler:
    """Move every span off draining members, to the least loaded members under capacity.

    Capacity is ceil(all assigned spans / members that stay), so the spans that leave a
    draining member spread out instead of piling onto one.
    """

    def schedule(self, view: SchedulingView, ctx: ScheduleContext) -> list[ScheduleTask]:
        draining = view.draining()
        if not draining or ctx.budget <= 0:
            return []
        eligible = view.eligible()
        if not eligible:
            return []
        total = sum(view.load(m) for m in view.members)
        capacity = math.ceil(total / len(eligible))
        loads = {m: view.load(m) for m in eligible}
        tasks: list[ScheduleTask] = []
        for member in draining:
            for span in view.index.assigned.get(member, {}):
                if ctx.budget <= 0:
                    return tasks
                if not _movable(view, span, member, ctx.taken):
                    continue
                dest = _least_loaded(loads, ctx.rng, capacity, view.sets[span].members)
                if dest is None:
                    continue
                tasks.append(MoveTable(span, dest, "drain"))
                ctx.taken.add(span)
                ctx.budget -= 1
                loads[dest] += 1
        return tasks


def validate_move(view: SchedulingView, span: Span, dest: MemberId) -> str | None:
    """Why an operator move cannot happen now, or None."""
    rs = view.sets.get(span)
    if rs is None:
        if span in view.wanted:
            return f"span {span.key} is not scheduled yet"
        return f"span {span.key} is unknown"
    if rs.error is not None:
        return f"span {span.key} is blocked by a conflict: {rs.error.detail}"
    if rs.state is not SetState.REPLICATING:
        return f"span {span.key} is {rs.state}; only a Replicating span can be moved"
    if span in view.running:
        return f"span {span.key} already has a task in flight"
    info = view.members.get(dest)
    if info is None:
        return f"member {dest} is not alive (or has not reported its tables yet)"
    if info.draining:
        return f"member {dest} is draining"
    if rs.primary == dest:
        return f"span {span.key} already replicates on {dest}"
    if dest in rs.members:
        return f"member {dest} still holds span {span.key} (undetermined)"
    return None


class OperatorMoveScheduler:
    """Operator-requested moves: validated when asked, re-validated when carried out."""

    def __init__(self, pin_s: float = DEFAULT_OPERATOR_PIN_S) -> None:
        self.pending: dict[Span, MoveTable] = {}
        self.failed: list[tuple[MoveTable, str]] = []
        self.pin_s = pin_s
        self.moved_at: dict[Span, float] = {}
        """When each span's operator move was handed out (``pinned``)."""

    def pinned(self, now: float) -> set[Span]:
        """Spans an operator moved less than ``pin_s`` ago: an operator who moves a table means
        it to stay, so the automatic balance evens the load with the other spans (it moved one
        straight back within a second in the control-plane test)."""
        for span in [s for s, at in self.moved_at.items() if now - at >= self.pin_s]:
            del self.moved_at[span]
        return set(self.moved_at)

    def request(self, view: SchedulingView, span: Span, dest: MemberId) -> MoveTable:
        reason = validate_move(view, span, dest)
        if reason is not None:
            raise InvalidTaskError(reason)
        task = MoveTable(span, dest, "operator")
        self.pending[span] = task
        return task

    def schedule(self, view: SchedulingView, ctx: ScheduleContext) -> list[ScheduleTask]:
        tasks: list[ScheduleTask] = []
        for span, task in list(self.pending.items()):
            if ctx.budget <= 0:
                break
            if span in ctx.taken:
                continue  # something else is happening to it; try next round
            reason = validate_move(view, span, task.dest)
            del self.pending[span]
            if reason is not None:
                self.failed.append((task, reason))
                ctx.rejected.append((task, reason))
                continue
            tasks.append(task)
            self.moved_at[span] = ctx.now
            ctx.taken.add(span)
            ctx.budget -= 1
        return tasks


def plan_balance_moves(
    view: SchedulingView, ctx: ScheduleContext, reason: str,
) -> tuple[list[MoveTable], bool]:
    """Moves that bring every member to at most ceil(spans / members); and whether the
    members are already within that limit.

    Victims are random spans of overloaded members; each goes to the least loaded member, ties
    broken at random. Capped by ``ctx.budget``.
    """
    eligible = view.eligible()
    if len(eligible) < 2:
        return [], True
    loads = {m: view.load(m) for m in eligible}
    upper = math.ceil(sum(loads.values()) / len(eligible))
    balanced = all(load <= upper for load in loads.values())
    if balanced or ctx.budget <= 0:
        return [], balanced
    victims: list[tuple[MemberId, Span]] = []
    for member in eligible:
        excess = loads[member] - upper
        if excess <= 0:
            continue
        candidates = [s for s in view.index.assigned.get(member, {})
                      if s not in ctx.pinned and _movable(view, s, member, ctx.taken)]
        victims.extend((member, s) for s in ctx.rng.sample(candidates, min(excess, len(candidates))))
    ctx.rng.shuffle(victims)
    moves: list[MoveTable] = []
    for source, span in victims:
        if ctx.budget <= 0:
            break
        dest = _least_loaded(loads, ctx.rng, upper, view.sets[span].members)
        if dest is None or dest == source:
            continue
        moves.append(MoveTable(span, dest, reason))
        ctx.taken.add(span)
        ctx.budget -= 1
        loads[source] -= 1
        loads[dest] += 1
    return moves, False


class RebalanceScheduler:
    """Operator "rebalance now": balances, ignoring the interval, once every wanted span
    replicates and nobody drains; stays requested until the members are balanced."""

    def __init__(self) -> None:
        self.requested = False

    def request(self) -> None:
        self.requested = True

    def schedule(self, view: SchedulingView, ctx: ScheduleContext) -> list[ScheduleTask]:
        if not self.requested or view.draining() or not view.all_wanted_replicating():
            return []
        moves, balanced = plan_balance_moves(view, ctx, "rebalance")
        if balanced:
            self.requested = False
        return list(moves)


class BalanceScheduler:
    """Automatic balance every ``interval_s``; keeps going without waiting while the last round
    found work (TiCDC's forceBalance). Pauses while a member drains."""

    def __init__(self, interval_s: float = DEFAULT_BALANCE_INTERVAL_S, enabled: bool = True) -> None:
        self.interval_s = interval_s
        self.enabled = enabled
        self._last = -math.inf
        self._force = False

    def schedule(self, view: SchedulingView, ctx: ScheduleContext) -> list[ScheduleTask]:
        if not self.enabled:
            return []
        if not self._force and ctx.now - self._last < self.interval_s:
            return []
        self._last = ctx.now
        if view.draining():
            self._force = False
            return []
        moves, _ = plan_balance_moves(view, ctx, "balance")
        self._force = bool(moves)
        return list(moves)


class Coordinator:
    """Runs the schedulers in priority order for one round.

    Never two tasks for one span (running tasks and mid-transition sets count); moves capped at
    ``max_task_concurrency`` in flight. ``rng`` is injectable so tests are reproducible.
    """

    def __init__(
        self,
        *,
        add_batch_size: int = DEFAULT_ADD_BATCH_SIZE,
        max_task_concurrency: int = DEFAULT_MAX_TASK_CONCURRENCY,
        balance_interval_s: float = DEFAULT_BALANCE_INTERVAL_S,
        balance_enabled: bool = True,
        rng: random.Random | None = None,
        max_adds_per_member: int = DEFAULT_MAX_ADDS_PER_MEMBER,
        operator_pin_s: float = DEFAULT_OPERATOR_PIN_S,
    ) -> None:
        self.max_task_concurrency = max_task_concurrency
        self.rng = rng if rng is not None else random.Random()
        self.basic = BasicScheduler(add_batch_size, max_adds_per_member)
        self.drain = DrainScheduler()
        self.operator = OperatorMoveScheduler(operator_pin_s)
        self.rebalance = RebalanceScheduler()
        self.balance = BalanceScheduler(balance_interval_s, balance_enabled)
        self.last_rejected: list[tuple[ScheduleTask, str]] = []

    def request_move(self, view: SchedulingView, span: Span, dest: MemberId) -> MoveTable:
        """Queue an operator move; raises InvalidTaskError with the reason if it cannot be done."""
        return self.operator.request(view, span, dest)

    def request_rebalance(self) -> None:
        self.rebalance.request()

    def schedule(self, view: SchedulingView, now: float = 0.0) -> list[ScheduleTask]:
        if not view.ready:
            return []
        taken = set(view.running)
        taken.update(view.index.unstable)
        moving = sum(1 for task in view.running.values() if isinstance(task, MoveTable))
        ctx = ScheduleContext(taken, max(0, self.max_task_concurrency - moving), self.rng, now)
        tasks = self.basic.schedule(view, ctx)
        for scheduler in (self.drain, self.operator, self.rebalance, self.balance):
            if ctx.budget <= 0:
                break
            if scheduler is self.balance:
                ctx.pinned = self.operator.pinned(now)
            tasks.extend(scheduler.schedule(view, ctx))
        self.last_rejected = ctx.rejected
        return tasks
