"""Quiet spans (``services.sink_worker.round.quiet``): when a span that found nothing to read
may follow its source's resolved ts without asking its consumer, and when it must be visited."""

from __future__ import annotations

import pytest

from services.sink_worker.round.pull import ResolvedMark
from services.sink_worker.round.quiet import QuietSpan, follow_quietly, quiet_after_visit
from services.sink_worker.span.checkpoints import Checkpoint

CP = Checkpoint(stream_seq=40, ts=1_000)
MARK = ResolvedMark(ts=1_000, stream_seq=50)


def _visit(**changes: object) -> QuietSpan | None:
    facts: dict[str, object] = {"replicating": True, "fresh": 0, "head": False, "reached": True,
                                "ghosts": 0, "mark": MARK, "checkpoint": CP, "now": 100.0}
    facts.update(changes)
    return quiet_after_visit(**facts)  # type: ignore[arg-type]


def test_a_visit_that_found_nothing_makes_the_span_quiet_at_its_mark() -> None:
    assert _visit() == QuietSpan(mark_seq=50, checkpoint=CP, visited_at=100.0)


@pytest.mark.parametrize("change", [
    {"replicating": False}, {"fresh": 3}, {"head": True}, {"reached": False}, {"ghosts": 1},
    {"mark": None}, {"checkpoint": None},
])
def test_anything_left_to_read_or_do_keeps_the_span_visited(change: dict[str, object]) -> None:
    assert _visit(**change) is None


def test_a_quiet_span_follows_a_mark_that_says_nothing_was_published_after_its_own() -> None:
    quiet = QuietSpan(mark_seq=50, checkpoint=CP, visited_at=100.0)
    for since in (50, 12):  # quiet since its mark, or since an earlier one
        later = ResolvedMark(ts=2_000, stream_seq=51, quiet_since=since)
        assert follow_quietly(quiet, CP, later, None, 101.0, 15.0) == Checkpoint(40, 2_000)


@pytest.mark.parametrize("mark, checkpoint, now, recheck_s", [
    (ResolvedMark(ts=2_000, stream_seq=60, quiet_since=55), CP, 101.0, 15.0),  # data after the span's mark
    (ResolvedMark(ts=2_000, stream_seq=60), CP, 101.0, 15.0),  # capture says nothing (a session's first)
    (None, CP, 101.0, 15.0),
    (ResolvedMark(ts=2_000, stream_seq=60, quiet_since=50), Checkpoint(30, 900), 101.0, 15.0),  # rewound
    (ResolvedMark(ts=2_000, stream_seq=60, quiet_since=50), CP, 115.0, 15.0),  # recheck due
    (ResolvedMark(ts=2_000, stream_seq=60, quiet_since=50), CP, 101.0, 0.0),  # shortcut off
])
def test_a_quiet_span_is_visited_when_the_shortcut_cannot_know(
        mark: ResolvedMark | None, checkpoint: Checkpoint, now: float, recheck_s: float) -> None:
    quiet = QuietSpan(mark_seq=50, checkpoint=CP, visited_at=100.0)
    assert follow_quietly(quiet, checkpoint, mark, None, now, recheck_s) is None
    assert follow_quietly(None, CP, mark, None, 101.0, 15.0) is None


def test_a_quiet_span_stops_at_its_changefeeds_syncpoint_cap_and_never_goes_back() -> None:
    quiet = QuietSpan(mark_seq=50, checkpoint=CP, visited_at=100.0)
    mark = ResolvedMark(ts=2_000, stream_seq=51, quiet_since=50)
    assert follow_quietly(quiet, CP, mark, 1_500, 101.0, 15.0) == Checkpoint(40, 1_500)
    assert follow_quietly(quiet, CP, mark, 500, 101.0, 15.0) == CP  # already past T: stays
    older = ResolvedMark(ts=900, stream_seq=51, quiet_since=50)
    assert follow_quietly(quiet, CP, older, None, 101.0, 15.0) == CP


def test_the_shortcut_is_off_unless_asked_for() -> None:
    # It trusts capture's word: a row another publisher put on the subject would be skipped.
    from libs.config import Settings
    from services.sink_worker.span.runtime import PipelineOptions

    assert Settings().sink_quiet_recheck_s == 0 and PipelineOptions().quiet_recheck_s == 0
    quiet = QuietSpan(mark_seq=50, checkpoint=CP, visited_at=100.0)
    mark = ResolvedMark(ts=2_000, stream_seq=51, quiet_since=50)
    assert follow_quietly(quiet, CP, mark, None, 100.5, PipelineOptions().quiet_recheck_s) is None
