"""Event sourcing on JetStream: typed appends with fencing, replay, snapshots, dead letters."""

from libs.eventstore.deadletter import dead_letter, ensure_deadletter_stream
from libs.eventstore.domain_log import DomainLog, Fenced, LeaderLog, LeaseLost, LeaseView
from libs.eventstore.memory import MemoryDomainLog, MemoryStream
from libs.eventstore.snapshots import Loaded, Snapshot, Snapshots
from libs.eventstore.store import (
    AppendConflict,
    EventStore,
    StoredEvent,
    check_subject,
    consume,
    decode_message,
    filter_fields,
)

__all__ = [
    "AppendConflict",
    "DomainLog",
    "EventStore",
    "Fenced",
    "LeaderLog",
    "LeaseLost",
    "LeaseView",
    "Loaded",
    "MemoryDomainLog",
    "MemoryStream",
    "Snapshot",
    "Snapshots",
    "StoredEvent",
    "check_subject",
    "consume",
    "dead_letter",
    "decode_message",
    "ensure_deadletter_stream",
    "filter_fields",
]
