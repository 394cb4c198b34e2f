"""Quiet spans (``services.sink_worker.round.quiet``): when a span that found nothing to read
may follow its source's resolved ts without asking its consumer, and when it must be visited."""

from __future__ import annotations

import pytest

from services.sink_worker.round.pull import ResolvedMark
from services.sink_worker.round.quiet import QuietSpan, follow_quietly, quiet_after_visit, recheck_quietly
from services.sink_worker.span.checkpoints import Checkpoint

CP = Checkpoint(stream_seq=40, ts=1_000)
MARK = ResolvedMark(ts=1_000, stream_seq=50)
QUIET = QuietSpan(mark_seq=50, checkpoint=CP, visited_at=100.0)
LATER = ResolvedMark(ts=2_000, stream_seq=60)


def _visit(**changes: object) -> QuietSpan | None:
    facts: dict[str, object] = {"replicating": True, "fresh": 0, "head": False, "reached": True,
                                "ghosts": 0, "mark": MARK, "checkpoint": CP, "now": 100.0}
    facts.update(changes)
    return quiet_after_visit(**facts)  # type: ignore[arg-type]


def test_a_visit_that_found_nothing_makes_the_span_quiet_at_its_mark() -> None:
    assert _visit() == QUIET


@pytest.mark.parametrize("change", [
    {"replicating": False}, {"fresh": 3}, {"head": True}, {"reached": False}, {"ghosts": 1},
    {"mark": None}, {"checkpoint": None},
])
def test_anything_left_to_read_or_do_keeps_the_span_visited(change: dict[str, object]) -> None:
    assert _visit(**change) is None


def test_a_quiet_span_follows_while_the_stream_holds_no_data_after_its_mark() -> None:
    for last_data in (50, 12, 0):  # the newest data message is at or before the span's mark, or none
        assert follow_quietly(QUIET, CP, LATER, last_data, None, 101.0, 15.0) == Checkpoint(40, 2_000)


@pytest.mark.parametrize("mark, last_data, checkpoint, now, recheck_s", [
    (LATER, 51, CP, 101.0, 15.0),  # a data message after the span's mark, whoever published it
    (LATER, None, CP, 101.0, 15.0),  # the stream could not be asked
    (None, 0, CP, 101.0, 15.0),
    (LATER, 50, Checkpoint(30, 900), 101.0, 15.0),  # rewound or reloaded
    (LATER, 50, CP, 115.0, 15.0),  # recheck due
    (LATER, 50, CP, 101.0, 0.0),  # shortcut off
])
def test_a_quiet_span_is_visited_when_the_shortcut_cannot_know(
        mark: ResolvedMark | None, last_data: int | None, checkpoint: Checkpoint, now: float,
        recheck_s: float) -> None:
    assert follow_quietly(QUIET, checkpoint, mark, last_data, None, now, recheck_s) is None
    assert follow_quietly(None, CP, mark, 0, None, 101.0, 15.0) is None


def test_a_quiet_span_stops_at_its_changefeeds_syncpoint_cap_and_never_goes_back() -> None:
    assert follow_quietly(QUIET, CP, LATER, 50, 1_500, 101.0, 15.0) == Checkpoint(40, 1_500)
    assert follow_quietly(QUIET, CP, LATER, 50, 500, 101.0, 15.0) == CP  # already past T: stays
    older = ResolvedMark(ts=900, stream_seq=61)
    assert follow_quietly(QUIET, CP, older, 50, None, 101.0, 15.0) == CP


def test_a_due_recheck_with_nothing_new_stores_the_followed_checkpoint_without_a_visit() -> None:
    # Due (15 s after the visit) and the stream holds nothing after the mark: follow and store.
    assert recheck_quietly(QUIET, CP, LATER, 50, None, 115.0, 15.0) == Checkpoint(40, 2_000)
    assert recheck_quietly(QUIET, CP, LATER, 50, 1_500, 115.0, 15.0) == Checkpoint(40, 1_500)
    # Exactly one of the two answers for a quiet span with nothing new: follow, or follow and store.
    for now in (100.0, 114.9, 115.0, 500.0):
        answers = [follow_quietly(QUIET, CP, LATER, 50, None, now, 15.0),
                   recheck_quietly(QUIET, CP, LATER, 50, None, now, 15.0)]
        assert sum(a is not None for a in answers) == 1, now


@pytest.mark.parametrize("mark, last_data, checkpoint, now, recheck_s", [
    (LATER, 51, CP, 115.0, 15.0),  # data after the span's mark: a full visit reads it
    (LATER, None, CP, 115.0, 15.0),  # the stream could not be asked
    (None, 0, CP, 115.0, 15.0),
    (LATER, 50, Checkpoint(30, 900), 115.0, 15.0),  # rewound or reloaded
    (LATER, 50, CP, 101.0, 15.0),  # not due: it only follows
    (LATER, 50, CP, 115.0, 0.0),  # shortcut off
])
def test_a_recheck_that_cannot_know_is_a_full_visit(
        mark: ResolvedMark | None, last_data: int | None, checkpoint: Checkpoint, now: float,
        recheck_s: float) -> None:
    assert recheck_quietly(QUIET, checkpoint, mark, last_data, None, now, recheck_s) is None
    assert recheck_quietly(None, CP, mark, 0, None, 115.0, 15.0) is None


def test_the_shortcut_is_on_by_default_with_a_recheck() -> None:
    from libs.config import Settings
    from services.sink_worker.span.runtime import PipelineOptions

    assert Settings().sink_quiet_recheck_s == PipelineOptions().quiet_recheck_s == 5.0
