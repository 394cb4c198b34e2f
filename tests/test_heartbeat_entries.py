"""A sink-worker's heartbeat entries (``SinkAgent._status_refs``): each span's entry is what
``status_ref`` makes of its status, kept from one heartbeat to the next only while the status
is the same. Pure: the agent is not started."""

from __future__ import annotations

from typing import Any

from libs.control.convert import status_ref
from libs.scheduling import TableState, TableStatus
from libs.scheduling.model import Span
from services.sink_worker.agent import SinkAgent

A, B = Span("cf", "src", "db", "a"), Span("cf", "src", "db", "b")


def test_an_unchanged_span_keeps_its_entry_and_a_changed_one_gets_a_new_one() -> None:
    nc: Any = None  # never used: no heartbeat is sent
    agent = SinkAgent(nc, member_id="w1", address="", heartbeat_interval_s=1.0)
    first = agent._status_refs([TableStatus(A, TableState.REPLICATING, 10, 12),
                                TableStatus(B, TableState.PREPARING, 0, 0)])
    assert first == [status_ref(TableStatus(A, TableState.REPLICATING, 10, 12)),
                     status_ref(TableStatus(B, TableState.PREPARING, 0, 0))]
    second = agent._status_refs([TableStatus(A, TableState.REPLICATING, 10, 12),
                                 TableStatus(B, TableState.REPLICATING, 11, 12)])
    assert second[0] is first[0]  # the same status: the same entry
    assert second[1] == status_ref(TableStatus(B, TableState.REPLICATING, 11, 12))
    moved = agent._status_refs([TableStatus(A, TableState.REPLICATING, 13, 14)])
    assert moved == [status_ref(TableStatus(A, TableState.REPLICATING, 13, 14))]
    # A span that left and came back is built again, not taken from a stale entry.
    again = agent._status_refs([TableStatus(B, TableState.REPLICATING, 11, 12)])
    assert again == [status_ref(TableStatus(B, TableState.REPLICATING, 11, 12))]


def test_heartbeats_are_complete_about_once_a_second_and_else_carry_what_changed() -> None:
    from libs.scheduling import Dispatch, DispatchAction

    nc: Any = None
    agent = SinkAgent(nc, member_id="w1", address="", heartbeat_interval_s=0.2, heartbeat_complete_s=1.0)
    agent.state.observe_epoch(5)
    for span in (A, B):
        agent.state.handle_dispatch(Dispatch("w1", span, DispatchAction.ADD_PREPARE, 10, 5))
    first = agent.heartbeat(now=0.0)
    assert first.complete and {t.span.table for t in first.tables} == {"a", "b"}
    assert agent.table_counts == {"preparing": 2}
    quiet = agent.heartbeat(now=0.2)
    assert not quiet.complete and quiet.tables == [] and quiet.seq > first.seq
    agent.state.prepared(A)
    changed = agent.heartbeat(now=0.4)
    assert not changed.complete and [(t.span.table, t.state) for t in changed.tables] == [("a", "prepared")]
    assert agent.table_counts == {"prepared": 1, "preparing": 1}  # every span, not only the report's
    again = agent.heartbeat(now=1.0)
    assert again.complete and len(again.tables) == 2
    agent.draining = True
    assert agent.heartbeat(now=1.1).complete  # the control plane moves a draining member's spans
