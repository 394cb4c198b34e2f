"""The worker's self-fence and the member leader's probe: pure logic, with the clock passed in.

The property that matters: a member is never declared left (so its spans never move) before
its own fence deadline has passed, whatever the order of heartbeats, confirmations, probes and
the leader's own reconnects."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.events.members import MemberJoinedV2
from libs.control.members import MembersState
from services.member.probe import DEFAULT_MARGIN_S, MemberProbes
from services.sink_worker.fence import Fenced, SelfFence

FENCE_S = 1.0
HB_S = 0.2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_fence_opens_only_after_a_confirmed_heartbeat_and_closes_after_the_bound() -> None:
    clock = Clock()
    fence = SelfFence(FENCE_S, clock)
    assert not fence.may_write() and fence.deadline is None
    with pytest.raises(Fenced):
        fence.check()
    fence.confirm(100.0)
    clock.now = 100.9
    assert fence.may_write() and fence.remaining_s() == pytest.approx(0.1)
    fence.confirm(99.5)  # an older confirmation arriving late never moves the deadline back
    assert fence.deadline == 101.0
    clock.now = 101.0
    assert not fence.may_write()
    with pytest.raises(Fenced, match=r"1\.0 s"):
        fence.check()
    # Latched: a heartbeat confirmed after the deadline does not open it again.
    fence.confirm(101.0)
    assert not fence.may_write() and fence.broken


def test_a_confirmation_after_a_gap_longer_than_the_bound_does_not_reopen() -> None:
    """A SIGSTOPped worker resumes and its next heartbeat is confirmed at once: too late."""
    clock = Clock()
    fence = SelfFence(FENCE_S, clock)
    fence.confirm(100.0)
    clock.now = 105.0
    fence.confirm(105.0)  # before anything looked at the clock
    assert fence.broken and not fence.may_write()


def test_after_a_lost_connection_no_confirmation_counts_until_a_new_incarnation() -> None:
    clock = Clock()
    fence = SelfFence(FENCE_S, clock)
    fence.confirm(100.0)
    fence.connection_lost()
    fence.confirm(100.5)
    assert fence.deadline is None and not fence.may_write() and fence.broken
    fence.reset()
    assert not fence.broken
    fence.confirm(100.6)
    assert fence.may_write() and fence.deadline == pytest.approx(101.6)


def _state(member: str = "w1", incarnation: str = "i1") -> MembersState:
    return MembersState().apply(MemberJoinedV2(member_id=member, incarnation=incarnation))


def test_a_killed_member_is_left_fence_plus_margin_after_its_last_heartbeat() -> None:
    probes = MemberProbes(HB_S, FENCE_S)
    state = _state()
    seen = {"w1": 10.0}
    assert probes.to_probe(state, seen, 10.3) == []  # one heartbeat missed is no silence yet
    assert probes.to_probe(state, seen, 10.41) == [("w1", "i1")]
    probes.no_responders("w1", "i1", 10.42)
    assert probes.to_probe(state, seen, 10.5) == []  # asked 0.2 s apart at most
    assert probes.to_probe(state, seen, 10.62) == [("w1", "i1")]
    probes.no_responders("w1", "i1", 10.63)
    assert probes.due(state, seen, 11.29) == []
    left = probes.due(state, seen, 10.0 + FENCE_S + DEFAULT_MARGIN_S)
    assert [(e.member_id, e.incarnation, e.reason) for e in left] == [("w1", "i1", "no-responders")]


def test_one_no_responders_an_answer_or_a_heartbeat_keeps_the_member() -> None:
    probes = MemberProbes(HB_S, FENCE_S)
    state = _state()
    seen = {"w1": 10.0}
    probes.no_responders("w1", "i1", 10.5)
    assert probes.due(state, seen, 20.0) == []  # a single one may race a subscribe
    probes.no_responders("w1", "i1", 10.7)
    probes.answered("w1", "i1")
    assert probes.due(state, seen, 20.0) == []
    probes.no_responders("w1", "i1", 10.5)
    probes.no_responders("w1", "i1", 10.7)
    probes.heard("w1")
    assert probes.due(state, seen, 20.0) == []
    # A probe of an incarnation that has since been replaced says nothing about the new one.
    probes.no_responders("w1", "i0", 10.5)
    probes.no_responders("w1", "i0", 10.7)
    assert probes.due(state, seen, 20.0) == []


@given(
    gaps=st.lists(st.floats(0.01, 0.9), min_size=1, max_size=20),
    delays=st.lists(st.floats(0.0, 0.5), min_size=20, max_size=20),
    lost=st.sets(st.integers(0, 19)),
    leader_reconnect=st.one_of(st.none(), st.floats(0.0, 60.0)),
    probe_lag=st.floats(0.0, 3.0),
)
def test_never_declared_left_before_the_fence_deadline(
    gaps: list[float], delays: list[float], lost: set[int], leader_reconnect: float | None,
    probe_lag: float,
) -> None:
    """Heartbeats sent ``gaps`` apart (all confirmed by the server), each reaching the leader after a
    delay, some lost on the way to the leader (only possible around the leader's own reconnect),
    then the worker dies; the leader's probes start ``probe_lag`` after its last heartbeat."""
    sent = [sum(gaps[:i + 1]) for i in range(len(gaps))]  # confirmed in time, one after another
    clock = Clock()
    fence = SelfFence(FENCE_S, clock)
    received: list[float] = []
    for i, s in enumerate(sent):
        fence.confirm(s)
        if i in lost and leader_reconnect is not None:
            continue  # lost by a leader that reconnected after it
        received.append(s + delays[i])
    if leader_reconnect is not None and leader_reconnect < max(received, default=0.0):
        leader_reconnect = None if not lost else max(received)  # losses happen before a reconnect
    death = sent[-1]  # the connection is gone from here on: every probe finds no responders
    last_seen = max(received) if received else death
    first_probe = max(death, last_seen) + probe_lag
    probes = MemberProbes(HB_S, FENCE_S)
    state = _state()
    probes.no_responders("w1", "i1", first_probe)
    probes.no_responders("w1", "i1", first_probe + 0.25)
    deadline = fence.deadline
    assert deadline is not None
    # Just before the fence deadline plus the margin it must still wait; some time later it acts.
    assert probes.due(state, {"w1": last_seen}, deadline + DEFAULT_MARGIN_S - 0.001, leader_reconnect) == []
    late = max(first_probe, last_seen) + 0.25 + FENCE_S + DEFAULT_MARGIN_S
    assert probes.due(state, {"w1": last_seen}, late, leader_reconnect), "never declared left"
