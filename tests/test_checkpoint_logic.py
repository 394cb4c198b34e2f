"""Changefeed checkpoint: minimum over spans, never backwards, never with a span missing."""

from __future__ import annotations

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
