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
