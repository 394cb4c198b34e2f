"""Changefeed checkpoint: minimum over the covered spans, never backwards, never with a span
missing; a span stopped by an incident is not covered, and a resumed one holds the checkpoint
until it has caught up."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from libs.scheduling import (
    ChangefeedCheckpoint,
    CheckpointTracker,
    ReplicationSet,
    Span,
    TableState,
    TableStatus,
    compute_checkpoint,
    spans_by_changefeed,
)

T = TableState


def span(i: int, cf: str = "cf") -> Span:
    return Span(cf, "src", "db", f"t{i}")


def replicating(s: Span, checkpoint: int, resolved: int | None = None) -> ReplicationSet:
    status = TableStatus(s, T.REPLICATING, checkpoint, checkpoint if resolved is None else resolved)
    return ReplicationSet.from_reports(s, {"a": status}, epoch=1)


def test_checkpoint_and_resolved_are_the_minimum_over_spans() -> None:
    sets = {span(1): replicating(span(1), 100, 150), span(2): replicating(span(2), 120, 130)}
    cp = ChangefeedCheckpoint("cf", 50)
    update = cp.advance(sets, sets)
    assert (update.checkpoint_ts, update.resolved_ts, update.advanced) == (100, 130, True)
    assert (cp.checkpoint_ts, cp.resolved_ts) == (100, 130)


def test_a_lower_computed_value_leaves_the_published_one() -> None:
    sets = {span(1): replicating(span(1), 100, 150)}
    cp = ChangefeedCheckpoint("cf")
    cp.advance(sets, sets)
    # A new span starting from an older checkpoint pulls the minimum down; nothing regresses.
    sets[span(2)] = replicating(span(2), 40, 45)
    update = cp.advance(sets, sets)
    assert (update.checkpoint_ts, update.resolved_ts, update.advanced) == (100, 150, False)
    sets[span(2)].handle_member_status("a", T.REPLICATING, 200, 210)
    assert (cp.advance(sets, sets).checkpoint_ts, cp.resolved_ts) == (100, 150)
    sets[span(1)].handle_member_status("a", T.REPLICATING, 180, 190)
    assert (cp.advance(sets, sets).checkpoint_ts, cp.resolved_ts) == (180, 190)


def test_no_advance_while_a_span_has_no_set() -> None:
    sets = {span(1): replicating(span(1), 100)}
    cp = ChangefeedCheckpoint("cf", 10)
    update = cp.advance([span(1), span(2)], sets)
    assert (update.checkpoint_ts, update.advanced, update.blocked_by) == (10, False, span(2))
    assert update.reason == "span has no replication set"


def test_no_advance_while_a_span_is_absent_with_no_primary() -> None:
    sets = {span(1): replicating(span(1), 100), span(2): replicating(span(2), 100)}
    cp = ChangefeedCheckpoint("cf", 10)
    cp.advance(sets, sets)
    sets[span(1)].handle_member_status("a", T.REPLICATING, 200)
    sets[span(2)].handle_member_shutdown("a")  # its primary died
    update = cp.advance(sets, sets)
    assert (update.checkpoint_ts, update.advanced, update.blocked_by) == (100, False, span(2))
    assert update.reason == "span is absent: no member replicates it"
    sets[span(2)].handle_add_table("b", 100)  # being re-added from its checkpoint counts again
    assert cp.advance(sets, sets).checkpoint_ts == 100


def test_no_advance_while_a_span_is_in_conflict_or_without_spans() -> None:
    s = span(1)
    conflict = ReplicationSet.from_reports(s, {m: TableStatus(s, T.REPLICATING, 500, 500) for m in "ab"},
                                           epoch=1)
    update = ChangefeedCheckpoint("cf", 10).advance([s], {s: conflict})
    assert not update.advanced and update.reason is not None and "conflict" in update.reason
    assert compute_checkpoint([], {}).reason == "changefeed has no spans"


def test_moving_span_keeps_counting_with_its_last_checkpoint() -> None:
    s = span(1)
    rs = replicating(s, 100)
    rs.handle_move_table("b")
    rs.handle_member_status("b", T.PREPARED, 5, 5)  # a secondary's own checkpoint is ignored
    assert compute_checkpoint([s], {s: rs}).checkpoint_ts == 100


def test_tracker_keeps_changefeeds_apart() -> None:
    sets = {span(1, "x"): replicating(span(1, "x"), 100), span(2, "y"): replicating(span(2, "y"), 7)}
    tracker = CheckpointTracker()
    tracker.get("y", checkpoint_ts=20)
    updates = tracker.advance(spans_by_changefeed(sets), sets)
    assert {cf: u.checkpoint_ts for cf, u in updates.items()} == {"x": 100, "y": 20}
    assert tracker.changefeeds["y"].resolved_ts == 20


# -- tables stopped by an incident ---------------------------------------------------------------

def test_a_stopped_span_does_not_hold_the_checkpoint_and_rejoins_once_caught_up() -> None:
    spans = [span(1), span(2)]
    sets = {s: replicating(s, 100) for s in spans}
    cp = ChangefeedCheckpoint("cf")
    assert cp.advance(spans, sets).checkpoint_ts == 100
    # t2 stops at 100 (no key): t1 goes on, and so does the checkpoint, over t1 alone.
    stopped = {tuple(span(2))}
    sets[span(1)].handle_member_status("a", T.REPLICATING, 300, 300)
    update = cp.advance(spans, sets, stopped)
    assert (update.checkpoint_ts, update.resolved_ts, update.advanced) == (300, 300, True)
    # Resumed: t2 is at 100, behind the published 300. Nothing goes backwards, and the checkpoint
    # waits for t2 (t1 at 400 does not move it) until t2 passes it.
    sets[span(1)].handle_member_status("a", T.REPLICATING, 400, 400)
    assert cp.advance(spans, sets).checkpoint_ts == 300
    sets[span(2)].handle_member_status("a", T.REPLICATING, 250, 250)
    assert cp.advance(spans, sets).checkpoint_ts == 300
    sets[span(2)].handle_member_status("a", T.REPLICATING, 350, 350)
    assert cp.advance(spans, sets).checkpoint_ts == 350


def test_every_span_stopped_holds_the_checkpoint_with_that_reason() -> None:
    sets = {span(1): replicating(span(1), 100)}
    update = ChangefeedCheckpoint("cf", 50).advance(sets, sets, {tuple(span(1))})
    assert (update.checkpoint_ts, update.advanced) == (50, False)
    assert update.reason == "every table of the changefeed is stopped by an incident"


# A step: ("report", span, how far it moves), ("stop", span, _) or ("resume", span, _).
steps = st.lists(st.tuples(st.sampled_from(["report", "report", "report", "stop", "resume"]),
                           st.integers(0, 3), st.integers(0, 50)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(steps=steps)
def test_the_checkpoint_covers_exactly_the_spans_not_stopped(steps: list[tuple[str, int, int]]) -> None:
    """Whatever spans stop, report and resume: the published checkpoint never goes backwards;
    when it moves, every span not stopped is at least there (the promise); it is exactly the
    higher of what it was and the minimum over the spans not stopped (stopped spans never hold
    it, a resumed span behind it holds it until it catches up)."""
    spans = [span(i) for i in range(4)]
    sets = {s: replicating(s, 10) for s in spans}
    own = dict.fromkeys(spans, 10)
    stopped: set[tuple[str, str, str, str]] = set()
    cp = ChangefeedCheckpoint("cf")
    published = cp.advance(spans, sets).checkpoint_ts
    for kind, i, delta in steps:
        s = spans[i]
        if kind == "stop":
            stopped.add(tuple(s))
        elif kind == "resume":
            stopped.discard(tuple(s))
        elif tuple(s) not in stopped:  # a stopped span runs no round: its checkpoint stays
            own[s] += delta
            sets[s].handle_member_status("a", T.REPLICATING, own[s], own[s])
        update = cp.advance(spans, sets, stopped)
        covered = [own[x] for x in spans if tuple(x) not in stopped]
        assert update.checkpoint_ts >= published
        if update.advanced:
            assert all(c >= update.checkpoint_ts for c in covered)
        assert update.checkpoint_ts == (max(published, min(covered)) if covered else published)
        published = update.checkpoint_ts
