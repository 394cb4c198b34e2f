"""Which heartbeat a member sends (``libs.scheduling.report_delta``): complete about once an
interval and whenever a partial one could not say what changed, else only what changed since
the last complete one. Pure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from libs.scheduling import TableState, TableStatus
from libs.scheduling.model import Span
from libs.scheduling.report_delta import ReportDelta

A, B, C = (Span("cf", "src", "db", t) for t in "abc")


def _r(span: Span, ts: int, state: TableState = TableState.REPLICATING) -> TableStatus:
    return TableStatus(span, state, ts, ts)


def test_complete_first_then_only_what_changed_since_the_last_complete_one() -> None:
    delta = ReportDelta(complete_every_s=1.0)
    assert delta.cut([_r(A, 1), _r(B, 1)], epoch=3, now=0.0) == (True, [_r(A, 1), _r(B, 1)])
    assert delta.cut([_r(A, 1), _r(B, 1)], epoch=3, now=0.2) == (False, None)  # nothing new: liveness only
    assert delta.cut([_r(A, 2), _r(B, 1)], epoch=3, now=0.4) == (False, [_r(A, 2)])
    assert delta.cut([_r(A, 2), _r(B, 1)], epoch=3, now=0.5) == (False, None)  # the same again
    # Cumulative: A changed since the complete one even though not since the last partial one.
    assert delta.cut([_r(A, 2), _r(B, 5), _r(C, 0, TableState.PREPARING)], epoch=3, now=0.6) == (
        False, [_r(A, 2), _r(B, 5), _r(C, 0, TableState.PREPARING)])
    assert delta.cut([_r(A, 2), _r(B, 5), _r(C, 0, TableState.PREPARING)], epoch=3, now=1.0)[0]  # interval


def test_a_new_epoch_a_span_gone_or_a_forced_one_is_complete_at_once() -> None:
    delta = ReportDelta(complete_every_s=10.0)
    delta.cut([_r(A, 1), _r(B, 1)], epoch=3, now=0.0)
    assert delta.cut([_r(A, 1), _r(B, 1)], epoch=4, now=0.1) == (True, [_r(A, 1), _r(B, 1)])
    assert delta.cut([_r(A, 1)], epoch=4, now=0.2) == (True, [_r(A, 1)])  # B stopped and was forgotten
    assert delta.cut([_r(A, 1)], epoch=4, now=0.3, force=True) == (True, [_r(A, 1)])
    assert delta.cut([_r(A, 1)], epoch=4, now=0.4) == (False, None)
    assert ReportDelta(complete_every_s=0).cut([_r(A, 1)], epoch=4, now=0.0)[0]
    off = ReportDelta(complete_every_s=0)
    off.cut([_r(A, 1)], epoch=4, now=0.0)
    assert off.cut([_r(A, 1)], epoch=4, now=0.0)[0]  # 0: every heartbeat complete


def test_a_quiet_spans_progress_waits_for_the_next_complete_report() -> None:
    delta = ReportDelta(complete_every_s=1.0)
    delta.cut([_r(A, 1), _r(B, 1)], epoch=3, now=0.0)
    # B only followed its source's resolved ts; A applied something.
    assert delta.cut([_r(A, 2), _r(B, 2)], epoch=3, now=0.2, quiet={B}) == (False, [_r(A, 2)])
    assert delta.cut([_r(A, 2), _r(B, 3)], epoch=3, now=0.4, quiet={B}) == (False, None)
    # A change of state goes out at once, quiet or not, and from then on with its progress.
    stopping = _r(B, 3, TableState.STOPPING)
    assert delta.cut([_r(A, 2), stopping], epoch=3, now=0.5, quiet={B}) == (False, [_r(A, 2), stopping])
    # The complete report carries every span's progress.
    assert delta.cut([_r(A, 2), _r(B, 4)], epoch=3, now=1.0, quiet={B}) == (True, [_r(A, 2), _r(B, 4)])
    assert delta.cut([_r(A, 2), _r(B, 5)], epoch=3, now=1.2, quiet={B}) == (False, None)
    assert delta.cut([_r(A, 2), _r(B, 5)], epoch=3, now=1.3) == (False, [_r(B, 5)])  # not quiet now


_STATES = st.sampled_from([TableState.PREPARING, TableState.REPLICATING, TableState.STOPPING])


@given(st.lists(st.tuples(st.floats(0, 0.5), st.dictionaries(st.sampled_from([A, B, C]),
                                                            st.tuples(_STATES, st.integers(0, 3)),
                                                            max_size=3)), max_size=30))
def test_the_last_complete_report_with_the_partial_ones_after_it_is_what_the_member_holds(
        steps: list[tuple[float, dict[Span, tuple[TableState, int]]]]) -> None:
    # What the replication-manager reads back from the newest complete report and the newest
    # partial one after it equals every span's status now, whatever changed in between, and
    # whichever older partial ones it also handled (or missed) on the way.
    delta = ReportDelta(complete_every_s=1.0)
    now = 0.0
    base: dict[Span, TableStatus] = {}
    every: dict[Span, TableStatus] = {}
    last_partial: dict[Span, TableStatus] = {}
    for gap, held in steps:
        now += gap
        tables = [TableStatus(s, state, ts, ts) for s, (state, ts) in sorted(held.items())]
        complete, sent = delta.cut(tables, epoch=1, now=now)
        if sent is None:  # liveness only: the replication-manager keeps what it handled last
            assert not complete
        elif complete:
            base = every = {t.span: t for t in sent}
            last_partial = {}
        else:
            last_partial = {t.span: t for t in sent}
            every = {**every, **last_partial}
        newest = {**base, **last_partial}
        want = {t.span: t for t in tables}
        assert newest == want  # only the newest partial one handled
        assert every == want  # every partial one handled, in order
