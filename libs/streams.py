"""Stream, subject and bucket names: the one place that spells them."""

from __future__ import annotations

import re

ROWS_STREAM = "SLUICE_ROWS"
DEADLETTER_STREAM = "SLUICE_DEADLETTER"
LEADER_BUCKET = "sluice-leaders"
CHECKPOINT_BUCKET = "sluice-checkpoints"
# Initial-load progress per span (key: the span's checkpoint key), so a snapshot resumes from its
# last finished chunk on any worker and the api can show it.
SNAPSHOT_BUCKET = "sluice-snapshots"
# What a span being prepared waits for on its worker (reading its start, Spark warming up, the
# commit), so the api can say why a span shows `prepare`. Entries expire: only the live ones matter.
PREPARE_BUCKET = "sluice-prepare"
# Continuous validation: each span's status (key: the span's checkpoint key), written by the
# worker that runs it; on-demand compare requests (key: ``<changefeed>.request``), written by the api.
VALIDATION_BUCKET = "sluice-validation"
# Why a source's capture cannot read it and since when (key: the source's token), written by that
# capture while its sessions fail and deleted when one reads; the api's source status shows it.
SOURCE_HEALTH_BUCKET = "sluice-source-health"
# Syncpoints (key: the changefeed's token): the ts its spans may not pass now and its last
# syncpoint, written by the replication-manager leader (libs/syncpoints.py).
SYNCPOINT_BUCKET = "sluice-syncpoints"

# One event-sourced stream per control domain; its leader is the only writer.
DOMAINS = ("members", "schedule", "replication", "ddl", "changefeeds")

_TOKEN = re.compile(r"[^A-Za-z0-9_\-]")


def token(value: str) -> str:
    """Make a value safe as one NATS subject token (no dots, spaces or wildcards)."""
    cleaned = _TOKEN.sub("_", value)
    if not cleaned:
        raise ValueError("empty subject token")
    return cleaned


def domain_stream(domain: str) -> str:
    return f"SLUICE_{domain.upper()}"


# Control domains live under sluice.ctl.* so a domain named like a data subject (ddl) can
# never overlap the ROWS stream's subjects.
def domain_events_subject(domain: str) -> str:
    return f"sluice.ctl.{domain}.events"


def table_incidents_subject(domain: str = "changefeeds") -> str:
    """Where sink-workers record a table's incidents (``table.stopped``, overwritten rows): beside
    the changefeeds events in their stream, but a subject of its own, so a worker may write
    incidents without being able to forge a changefeed event."""
    return f"sluice.ctl.{domain}.incidents"


# The event types an incidents subject carries; any other type there is dead-lettered.
TABLE_INCIDENT_TYPES = ("table.stopped", "table.unique_conflict_overwritten")


def domain_fold_subjects(domain: str) -> list[str]:
    """The subjects a domain's state is folded from, in stream order: its events, and for the
    changefeeds the table incidents too."""
    if domain == "changefeeds":
        return [domain_events_subject(domain), table_incidents_subject(domain)]
    return [domain_events_subject(domain)]


def event_types_on(subject: str) -> tuple[str, ...] | None:
    """The only event types ``subject`` may carry; None when it is not restricted."""
    if subject.startswith("sluice.ctl.") and subject.endswith(".incidents"):
        return TABLE_INCIDENT_TYPES
    return None


def domain_snapshot_subject(domain: str) -> str:
    return f"sluice.ctl.{domain}.snapshot"


def domain_subjects(domain: str) -> list[str]:
    return [f"sluice.ctl.{domain}.>"]


def rows_subject(source: str, schema: str, table: str) -> str:
    return f"sluice.rows.{token(source)}.{token(schema)}.{token(table)}"


def rejected_subject(source: str) -> str:
    """Capture's rejections for a source. Four tokens, so it never matches a table's subject
    (``sluice.rows.<source>.<schema>.<table>``) yet sits in the ROWS stream beside them."""
    return f"sluice.rows.{token(source)}.rejected"


def ddl_subject(source: str, schema: str, table: str) -> str:
    return f"sluice.ddl.{token(source)}.{token(schema)}.{token(table)}"


def resolved_subject(source: str) -> str:
    return f"sluice.resolved.{token(source)}"


def source_data_subjects(source: str) -> str:
    """Every data subject of a source in the ROWS stream (its tables' rows and DDL, its
    rejections), but not its resolved marks (``sluice.resolved.<source>`` has no token after the
    source). The stream's last message on it is the newest thing a sink may have to read for the
    source, whoever published it (``services.sink_worker.round.quiet``)."""
    return f"sluice.*.{token(source)}.>"


HEARTBEAT_PARTIAL_HEADER = "Sluice-Partial-Report"
"""Header of a heartbeat that is a partial report (``member.heartbeat`` v2 ``complete`` false),
so the replication-manager can tell which waiting heartbeat a new one supersedes without
decoding it (``LatestHeartbeats``)."""

HEARTBEAT_UNCHANGED_HEADER = "Sluice-Report-Unchanged"
"""Header of a heartbeat that is liveness only (``member.heartbeat`` v3 ``unchanged``): the
member's last partial report again, which the replication-manager does not handle again."""

HEARTBEAT_PART_HEADER = "Sluice-Report-Part"
"""Header of a heartbeat message that is one part of a report cut in several
(``member.heartbeat`` v3): ``<seq>/<part>/<parts>``, so the replication-manager collects a
report's parts without decoding them (``libs.control.heartbeat_parts``)."""


ROWS_SUBJECTS = ["sluice.rows.>", "sluice.ddl.>", "sluice.resolved.>"]


def deadletter_subject(origin_stream: str) -> str:
    return f"sluice.deadletter.{token(origin_stream)}"


DEADLETTER_SUBJECTS = ["sluice.deadletter.>"]


def heartbeat_subject(member_id: str) -> str:
    return f"sluice.hb.{token(member_id)}"


def dispatch_subject(member_id: str) -> str:
    return f"sluice.dispatch.{token(member_id)}"


# Every member's heartbeat, for the member service and the replication-manager.
HEARTBEAT_SUBJECTS = "sluice.hb.*"


def member_probe_subject(member_id: str, incarnation: str) -> str:
    """Core-NATS request/reply a member answers while its connection is up (the member leader
    probes a silent member: "no responders" means the connection is gone)."""
    return f"sluice.member.alive.{token(member_id)}.{token(incarnation)}"


def announce_subject(service: str) -> str:
    """Core-NATS broadcast of a leader's epoch (replication-manager -> members)."""
    return f"sluice.announce.{token(service)}"


def command_subject(domain: str) -> str:
    """Request/reply for operator commands to a domain's leader. Deliberately outside
    ``sluice.ctl.>``: a core publish matching a stream's subjects would be stored in it."""
    return f"sluice.cmd.{token(domain)}"


# Shard DDL coordination (core NATS): workers report Infos, dones and dropped shards to the
# ddl-lock leader on one subject; the leader broadcasts operations and Info requests per
# changefeed, and every worker keeps those for the spans it runs.
SHARD_DDL_REPORT_SUBJECT = "sluice.shardddl.report"


def shard_ddl_ops_subject(changefeed: str) -> str:
    return f"sluice.shardddl.ops.{token(changefeed)}"


SHARD_DDL_OPS_SUBJECTS = "sluice.shardddl.ops.*"
def leader_command_subject(service: str) -> str:
    """Request/reply to a service's current leader (``{"action": "resign"}``); only the leader
    listens, so "no responders" means the service has no leader right now."""
    return f"sluice.cmd.leader.{token(service)}"
