"""Syncpoints without NATS: choosing T, deciding when every span reached it, the hold's expiry,
abandoning a T that cannot be reached, the fold a new leader rebuilds from, the workers' cap,
and the spec's checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from contracts.events.changefeeds import ChangefeedSpecV6, ChangefeedSpecV7, SourceRefV1, current_spec
from contracts.events.syncpoints import SyncpointEndedV1, SyncpointPlannedV1, SyncpointReachedV1
from libs.control.replication_state import ReplicationState
from libs.syncpoints import (
    LEAD_S,
    Abandon,
    ChangefeedSyncpoints,
    Idle,
    Plan,
    Reach,
    Release,
    SpanProgress,
    capped,
    choose_ts,
    decide,
    marks_passed,
    reach_timeout_s,
)
from libs.ts import LOGICAL_BITS

SEC = 1000 << LOGICAL_BITS
T0 = 1_795_000_000_000 << LOGICAL_BITS


def _at(*checkpoints: int | None, stopped: int | None = None) -> dict[str, SpanProgress]:
    return {f"s{i}": SpanProgress(cp, stopped=i == stopped) for i, cp in enumerate(checkpoints)}


def _planned(ts: int, at: float) -> ChangefeedSyncpoints:
    sp = ChangefeedSyncpoints()
    sp.apply(SyncpointPlannedV1(changefeed="cf", ts=ts, planned_at=at))
    return sp


def test_t_goes_past_the_newest_mark_and_every_checkpoint() -> None:
    assert choose_ts([T0, T0 + 5 * SEC], [T0]) == T0 + 5 * SEC + int(LEAD_S * 1000) * (1 << LOGICAL_BITS)
    # A span already past the marks' lead (a checkpoint never goes back): T is after it.
    assert choose_ts([T0], [T0 + 10 * SEC]) == T0 + 10 * SEC + 1


def test_first_syncpoint_is_planned_once_every_span_runs_and_every_source_has_a_mark() -> None:
    sp = ChangefeedSyncpoints()
    kw = {"interval_s": 10.0, "hold_s": 2.0, "now": 100.0}
    assert decide(sp, spans={}, marks={"src": T0}, **kw) == Idle("no spans")
    assert isinstance(decide(sp, spans=_at(T0, None), marks={"src": T0}, **kw), Idle)
    assert isinstance(decide(sp, spans=_at(T0, T0, stopped=1), marks={"src": T0}, **kw), Idle)
    assert isinstance(decide(sp, spans=_at(T0, T0), marks={"src": None}, **kw), Idle)
    step = decide(sp, spans=_at(T0 - SEC, T0), marks={"src": T0, "src2": T0 - 3 * SEC}, **kw)
    assert step == Plan(choose_ts([T0, T0 - 3 * SEC], [T0 - SEC, T0]))
    assert decide(sp, interval_s=None, hold_s=0.0, now=100.0, spans=_at(T0), marks={"src": T0}) == \
        Idle("syncpoints off")


def test_reached_only_when_every_span_is_exactly_at_t() -> None:
    t = T0 + 2 * SEC
    sp = _planned(t, 100.0)
    kw = {"interval_s": 10.0, "hold_s": 2.0, "now": 101.0, "marks": {"src": t}}
    assert isinstance(decide(sp, spans=_at(t, t - 1), **kw), Idle)
    assert isinstance(decide(sp, spans=_at(t, None), **kw), Idle)  # a span without a member
    assert decide(sp, spans=_at(t, t), **kw) == Reach(t)


def test_a_span_past_t_or_stopped_or_too_slow_abandons_t() -> None:
    t = T0 + 2 * SEC
    sp = _planned(t, 100.0)
    kw = {"interval_s": 10.0, "hold_s": 2.0, "marks": {"src": t}}
    step = decide(sp, spans=_at(t, t + 1), now=101.0, **kw)
    assert isinstance(step, Abandon) and "s1 passed" in step.reason
    step = decide(sp, spans=_at(t, t - 5, stopped=1), now=101.0, **kw)
    assert isinstance(step, Abandon) and "stopped by an incident" in step.reason
    late = 100.0 + reach_timeout_s(10.0) + 0.1
    step = decide(sp, spans=_at(t, t - 5), now=late, **kw)
    assert isinstance(step, Abandon) and "s1 behind" in step.reason
    step = decide(sp, interval_s=None, hold_s=0.0, now=101.0, spans=_at(t, t), marks={"src": t})
    assert step == Abandon(t, "syncpoints were turned off")


def test_hold_expires_then_the_next_one_waits_for_the_interval() -> None:
    t = T0 + 2 * SEC
    sp = _planned(t, 100.0)
    sp.apply(SyncpointReachedV1(changefeed="cf", ts=t, commit_time="2026-11-27T18:00:01+00:00",
                                hold_until=104.0))
    kw = {"interval_s": 10.0, "hold_s": 3.0, "spans": _at(t, t), "marks": {"src": t + 5 * SEC}}
    assert sp.cap == t
    assert isinstance(decide(sp, now=103.9, **kw), Idle)
    assert decide(sp, now=104.0, **kw) == Release(t)
    sp.apply(SyncpointEndedV1(changefeed="cf", ts=t, outcome="released", ended_at=104.0))
    assert sp.cap is None and sp.last is not None and sp.last.ts == t and sp.released == 1
    assert isinstance(decide(sp, now=109.9, **kw), Idle)  # interval counts from the last plan
    assert isinstance(decide(sp, now=110.0, **kw), Plan)


def test_a_hold_longer_than_its_interval_plans_the_next_one_after_the_release() -> None:
    t = T0 + 2 * SEC
    sp = _planned(t, 100.0)
    sp.apply(SyncpointEndedV1(changefeed="cf", ts=t, outcome="abandoned", reason="x", ended_at=130.0))
    assert sp.last is None and sp.abandoned == 1 and sp.last_abandoned == "x"
    kw = {"interval_s": 10.0, "hold_s": 3.0, "spans": _at(t, t), "marks": {"src": t}}
    assert isinstance(decide(sp, now=129.0, **kw), Idle)
    assert isinstance(decide(sp, now=130.0, **kw), Plan)


def test_events_of_another_t_change_nothing() -> None:
    t = T0 + 2 * SEC
    sp = _planned(t, 100.0)
    sp.apply(SyncpointReachedV1(changefeed="cf", ts=t + 1, commit_time="x", hold_until=1.0))
    sp.apply(SyncpointEndedV1(changefeed="cf", ts=t - 1, outcome="released", ended_at=1.0))
    assert sp.pending is not None and not sp.pending.reached and sp.cap == t


def test_marks_past_t_are_named() -> None:
    assert marks_passed(T0, {"a": T0, "b": None}) is None
    assert marks_passed(T0, {"a": T0, "b": T0 + 1}) == "b"


def test_the_cap_bounds_the_horizon_and_never_lowers_a_checkpoint() -> None:
    assert capped(T0 + 5, None, T0) == T0 + 5
    assert capped(T0 + 5, T0 + 9, T0) == T0 + 5
    assert capped(T0 + 9, T0 + 5, T0) == T0 + 5
    # Past T already (it could not know of T in time): it stays, the leader abandons T.
    assert capped(T0 + 9, T0 + 5, T0 + 7) == T0 + 7


def test_a_new_leader_rebuilds_the_pending_syncpoint_from_the_log_and_a_snapshot() -> None:
    t = T0 + 2 * SEC
    state = ReplicationState()
    state.apply(SyncpointPlannedV1(changefeed="cf", ts=t - SEC, planned_at=90.0))
    state.apply(SyncpointReachedV1(changefeed="cf", ts=t - SEC, commit_time="c1", hold_until=92.0))
    state.apply(SyncpointEndedV1(changefeed="cf", ts=t - SEC, outcome="released", ended_at=92.0))
    state.apply(SyncpointPlannedV1(changefeed="cf", ts=t, planned_at=100.0))
    state.apply(SyncpointReachedV1(changefeed="cf", ts=t, commit_time="c2", hold_until=103.0))
    restored = ReplicationState.restore(state.dump())
    for s in (state, restored):
        sp = s.syncpoints["cf"]
        assert sp.cap == t and sp.pending is not None and sp.pending.hold_until == 103.0
        assert sp.last is not None and (sp.last.ts, sp.last.commit_time) == (t - SEC, "c1")
        record = sp.record("cf")
        assert record.holding and record.cap_ts == t and record.last_ts == t - SEC


def _spec(**kw: object) -> ChangefeedSpecV7:
    return ChangefeedSpecV7(id="cf", sources=[SourceRefV1(id="s", url="mysql://u@h:3306/")],
                            sink_url="sqlite:///x.db", **kw)  # type: ignore[arg-type]


def test_spec_checks_the_interval_and_the_hold() -> None:
    assert _spec(syncpoint_interval=10, syncpoint_hold_s=2).syncpoint_hold_s == 2
    for bad in ({"syncpoint_interval": 0.5}, {"syncpoint_interval": 5, "syncpoint_hold_s": 5},
                {"syncpoint_hold_s": 1}, {"syncpoint_interval": 5, "syncpoint_hold_s": -1}):
        with pytest.raises(ValidationError):
            _spec(**bad)


def test_an_older_spec_has_no_syncpoints() -> None:
    old = ChangefeedSpecV6(id="cf", sources=[SourceRefV1(id="s", url="mysql://u@h:3306/")],
                           sink_url="sqlite:///x.db")
    spec = current_spec(old)
    assert isinstance(spec, ChangefeedSpecV7)
    assert spec.syncpoint_interval is None and spec.syncpoint_hold_s == 0.0
