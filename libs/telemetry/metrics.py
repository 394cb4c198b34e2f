"""Prometheus metrics shared by every service; service-specific ones live beside the service."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, generate_latest

from libs.ts import lag_seconds

__all__ = ["lag_seconds", "render_latest"]

NATS_RECONNECTS = Counter("sluice_nats_reconnects", "NATS reconnections of this process.")
LEADER_EPOCH = Gauge("sluice_leader_epoch", "Epoch this process leads with; 0 when not leader.",
                     ["service"])
IS_LEADER = Gauge("sluice_is_leader", "1 while this process holds its service's lease.", ["service"])
LEADER_STEPDOWNS = Counter("sluice_leader_stepdowns", "Times this process lost leadership.",
                           ["service", "reason"])
DEAD_LETTERS = Counter("sluice_dead_letters", "Messages moved to a dead-letter subject.",
                       ["stream", "kind"])
EVENTS_APPENDED = Counter("sluice_events_appended", "Events appended to domain streams.", ["stream"])
APPEND_CONFLICTS = Counter("sluice_append_conflicts",
                           "Appends refused by the expected-sequence check.", ["stream"])
SNAPSHOTS_TOO_LARGE = Counter("sluice_snapshots_too_large",
                              "Domain snapshots not written: larger than the NATS server's max_payload.",
                              ["stream"])
SNAPSHOTS_UNUSABLE = Counter("sluice_snapshots_unusable",
                             "Chunked domain snapshots a reader did not trust (chunks missing or not "
                             "joining): it replayed the events instead.", ["stream"])


def render_latest() -> tuple[bytes, str]:
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
