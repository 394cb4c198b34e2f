"""Every subject a service uses is one its NATS role may use (static; no server).

``USES`` lists, per role, what its service publishes, subscribes and reads, spelled with the
libs.streams names its code spells them with. One test checks each of them against
``role_permissions`` (the concrete subjects nats-server would check, JetStream API calls
included); another reads the service packages' imports of libs.streams, so a service that starts
using a subject builder not listed here fails until the builder is listed (and permitted).
The process tests check the same from the other side: no service connection is refused anything
while they run (``NatsServer.service_violations``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from contracts import ContractError
from libs.eventstore import check_subject
from libs.nats_auth import (
    API,
    DDL_LOCK,
    MEMBER,
    REPLICATION_MANAGER,
    SCHEDULER,
    SINK_WORKER,
    Permissions,
    capture_role,
    role_permissions,
)
from libs.streams import (
    CHECKPOINT_BUCKET,
    DEADLETTER_STREAM,
    DOMAINS,
    HEARTBEAT_SUBJECTS,
    LEADER_BUCKET,
    PREPARE_BUCKET,
    ROWS_STREAM,
    SHARD_DDL_OPS_SUBJECTS,
    SHARD_DDL_REPORT_SUBJECT,
    SNAPSHOT_BUCKET,
    SOURCE_HEALTH_BUCKET,
    SYNCPOINT_BUCKET,
    VALIDATION_BUCKET,
    announce_subject,
    command_subject,
    ddl_subject,
    deadletter_subject,
    dispatch_subject,
    domain_events_subject,
    domain_fold_subjects,
    domain_snapshot_subject,
    domain_stream,
    heartbeat_subject,
    leader_command_subject,
    member_probe_subject,
    rejected_subject,
    resolved_subject,
    rows_subject,
    shard_ddl_ops_subject,
    source_data_subjects,
    table_incidents_subject,
)

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "src1"
CAPTURE = capture_role(SOURCE)


@dataclass(frozen=True)
class Use:
    """What a service does with one libs.streams ``name``."""

    name: str
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    reads: tuple[tuple[str, str], ...] = ()
    """(stream, filter subject) read through a consumer of its own or a message get."""
    owns: tuple[str, ...] = ()
    """Streams it creates and appends to."""


_BUCKETS = {LEADER_BUCKET: "LEADER_BUCKET", CHECKPOINT_BUCKET: "CHECKPOINT_BUCKET",
            SNAPSHOT_BUCKET: "SNAPSHOT_BUCKET", PREPARE_BUCKET: "PREPARE_BUCKET",
            VALIDATION_BUCKET: "VALIDATION_BUCKET", SOURCE_HEALTH_BUCKET: "SOURCE_HEALTH_BUCKET",
            SYNCPOINT_BUCKET: "SYNCPOINT_BUCKET"}


def _kv_write(bucket: str, key: str) -> Use:
    return Use(_BUCKETS[bucket], publish=(f"$KV.{bucket}.{key}",), owns=(f"KV_{bucket}",))


def _kv_read(bucket: str) -> Use:
    return Use(_BUCKETS[bucket], reads=((f"KV_{bucket}", f"$KV.{bucket}.>"),))


def _folds(*domains: str) -> list[Use]:
    """Following domains (DomainFollower, the worker's own follower, the api's event feed)."""
    return [Use("domain_fold_subjects",
                reads=tuple((domain_stream(d), s) for d in domains for s in domain_fold_subjects(d)))]


def _writes_domain(domain: str) -> list[Use]:
    """A domain's one writer: its events and snapshots, on a stream it creates."""
    return [Use("domain_events_subject", owns=(domain_stream(domain),),
                publish=(domain_events_subject(domain), domain_snapshot_subject(domain)))]


def _dead_letters(*streams: str) -> Use:
    return Use("deadletter_subject", publish=tuple(deadletter_subject(s) for s in streams),
               owns=(DEADLETTER_STREAM,))


def _leader(role: str, domain: str, *follows: str) -> list[Use]:
    return [_kv_write(LEADER_BUCKET, role),
            Use("leader_command_subject", subscribe=(leader_command_subject(role),)),
            *_writes_domain(domain), *_folds(*follows), _dead_letters(*(domain_stream(d) for d in follows))]


ROWS_READ = Use("ROWS_STREAM", reads=((ROWS_STREAM, rows_subject(SOURCE, "db", "t")),
                                      (ROWS_STREAM, ddl_subject(SOURCE, "db", "t")),
                                      (ROWS_STREAM, resolved_subject(SOURCE))))

USES: dict[str, list[Use]] = {
    CAPTURE: [
        Use("ROWS_STREAM", owns=(ROWS_STREAM,)),
        Use("rows_subject", publish=(rows_subject(SOURCE, "db", "t"),)),
        Use("ddl_subject", publish=(ddl_subject(SOURCE, "db", "t"),)),
        Use("rejected_subject", publish=(rejected_subject(SOURCE),)),
        Use("resolved_subject", publish=(resolved_subject(SOURCE),)),
        _kv_write(LEADER_BUCKET, CAPTURE),
        # Why it cannot read its source (libs.source_health), under its own source's key.
        _kv_write(SOURCE_HEALTH_BUCKET, SOURCE),
        # The sources registry (libs.sources.registered_url) when started without a source URL.
        *_folds("changefeeds"), _dead_letters(domain_stream("changefeeds")),
    ],
    SINK_WORKER: [
        ROWS_READ,
        Use("rows_subject", reads=ROWS_READ.reads[:1]),
        Use("ddl_subject", reads=ROWS_READ.reads[1:2]),
        Use("resolved_subject", reads=ROWS_READ.reads[2:]),
        # The last message of a source's data subjects (round.quiet): a get by a wildcard subject.
        Use("source_data_subjects", reads=((ROWS_STREAM, source_data_subjects(SOURCE)),)),
        Use("domain_stream"), *_folds("changefeeds"),
        Use("table_incidents_subject", publish=(table_incidents_subject(),)),
        _kv_write(CHECKPOINT_BUCKET, "cf.src1.db.t"), _kv_write(SNAPSHOT_BUCKET, "cf.src1.db.t"),
        _kv_write(PREPARE_BUCKET, "cf.src1.db.t"), _kv_read(LEADER_BUCKET),
        _kv_write(VALIDATION_BUCKET, "cf.src1.db.t"), _kv_read(VALIDATION_BUCKET),
        _kv_read(SYNCPOINT_BUCKET),  # each changefeed's cap (libs.syncpoints.SyncpointCaps)
        Use("heartbeat_subject", publish=(heartbeat_subject("w1"),)),
        Use("dispatch_subject", subscribe=(dispatch_subject("w1"),)),
        Use("announce_subject", subscribe=(announce_subject(REPLICATION_MANAGER),)),
        Use("member_probe_subject", subscribe=(member_probe_subject("w1", "i1"),)),
        Use("SHARD_DDL_OPS_SUBJECTS", subscribe=(SHARD_DDL_OPS_SUBJECTS,)),
        Use("SHARD_DDL_REPORT_SUBJECT", publish=(SHARD_DDL_REPORT_SUBJECT,)),
        _dead_letters(ROWS_STREAM, domain_stream("changefeeds")),
    ],
    API: [
        Use("command_subject", publish=(command_subject("schedule"), command_subject("ddl"))),
        Use("leader_command_subject", publish=tuple(leader_command_subject(s) for s in
                                                    (MEMBER, SCHEDULER, REPLICATION_MANAGER, DDL_LOCK))),
        _kv_read(LEADER_BUCKET), _kv_read(CHECKPOINT_BUCKET), _kv_read(SNAPSHOT_BUCKET),
        _kv_read(PREPARE_BUCKET), _kv_read(SOURCE_HEALTH_BUCKET),
        _kv_read(VALIDATION_BUCKET), _kv_write(VALIDATION_BUCKET, "cf.request"),
        _kv_read(SYNCPOINT_BUCKET),
        Use("ROWS_STREAM", reads=((ROWS_STREAM, resolved_subject(SOURCE)),)),
        Use("resolved_subject", reads=((ROWS_STREAM, resolved_subject(SOURCE)),)),
        # A source's problem: capture's newest rejection of it (routes/cluster.py).
        Use("rejected_subject", reads=((ROWS_STREAM, rejected_subject(SOURCE)),)),
        Use("DEADLETTER_STREAM", reads=((DEADLETTER_STREAM, deadletter_subject(ROWS_STREAM)),),
            owns=(DEADLETTER_STREAM,)),
        Use("DOMAINS"), Use("domain_stream"), *_folds(*DOMAINS),
        # The changefeeds log it records (libs.changefeeds) and the dead letters it parks.
        *_writes_domain("changefeeds"), _dead_letters(*(domain_stream(d) for d in DOMAINS)),
    ],
    MEMBER: [*_leader(MEMBER, "members"),
             Use("HEARTBEAT_SUBJECTS", subscribe=(HEARTBEAT_SUBJECTS,)),
             Use("member_probe_subject", publish=(member_probe_subject("w1", "i1"),))],
    SCHEDULER: [*_leader(SCHEDULER, "schedule", "members", "replication", "changefeeds"),
                Use("command_subject", subscribe=(command_subject("schedule"),)), ROWS_READ],
    REPLICATION_MANAGER: [*_leader(REPLICATION_MANAGER, "replication", "members", "schedule", "changefeeds"),
                          Use("HEARTBEAT_SUBJECTS", subscribe=(HEARTBEAT_SUBJECTS,)),
                          Use("announce_subject", publish=(announce_subject(REPLICATION_MANAGER),)),
                          Use("dispatch_subject", publish=(dispatch_subject("w1"),)),
                          # Syncpoints: the sources' newest marks, each changefeed's cap.
                          Use("ROWS_STREAM", reads=((ROWS_STREAM, resolved_subject(SOURCE)),)),
                          Use("resolved_subject", reads=((ROWS_STREAM, resolved_subject(SOURCE)),)),
                          _kv_write(SYNCPOINT_BUCKET, "cf")],
    DDL_LOCK: [*_leader(DDL_LOCK, "ddl", "changefeeds"),
               Use("command_subject", subscribe=(command_subject("ddl"),)),
               Use("SHARD_DDL_REPORT_SUBJECT", subscribe=(SHARD_DDL_REPORT_SUBJECT,)),
               Use("shard_ddl_ops_subject", publish=(shard_ddl_ops_subject("cf"),)), ROWS_READ],
}

PACKAGES = {CAPTURE: "capture", SINK_WORKER: "sink_worker", API: "api", MEMBER: "member",
            SCHEDULER: "scheduler", REPLICATION_MANAGER: "replication_manager", DDL_LOCK: "ddl_lock"}

# Names that spell no subject of the Sluice NATS (a token of one; a header of heartbeats).
NOT_SUBJECTS = {"token", "HEARTBEAT_PARTIAL_HEADER", "HEARTBEAT_PART_HEADER", "HEARTBEAT_UNCHANGED_HEADER"}


def _refused(perms: Permissions, use: Use) -> list[str]:
    refused = [f"publish {s}" for s in use.publish if not perms.may_publish(s)]
    refused += [f"subscribe {s}" for s in use.subscribe if not perms.may_subscribe(s)]
    for stream, subject in use.reads:
        # What reading takes: stream info, a message get (by subject too), an own consumer
        # filtered on the subject (one or several filters) and its next messages.
        calls = [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
                 f"$JS.API.DIRECT.GET.{stream}.{subject}", f"$JS.API.CONSUMER.CREATE.{stream}.c.{subject}",
                 f"$JS.API.CONSUMER.CREATE.{stream}.c", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.c",
                 f"$JS.API.CONSUMER.DELETE.{stream}.c"]
        refused += [f"read {stream} {subject}: {c}" for c in calls if not perms.may_publish(c)]
    for stream in use.owns:
        calls = [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}",
                 f"$JS.API.STREAM.INFO.{stream}"]
        refused += [f"own {stream}: {c}" for c in calls if not perms.may_publish(c)]
    return refused


@pytest.mark.parametrize("role", sorted(USES))
def test_every_subject_a_service_uses_is_permitted_for_its_role(role: str) -> None:
    perms = role_permissions(role)
    assert perms is not None
    refused = [f"{use.name}: {r}" for use in USES[role] for r in _refused(perms, use)]
    assert not refused, f"{role} would be refused: {refused}"
    # Replies to its requests and JetStream's acks come back on its inbox.
    assert perms.may_subscribe("_INBOX.abc.1")


def _streams_names(package: str) -> dict[str, set[str]]:
    """libs.streams names each module of ``services/<package>`` imports."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "services" / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "libs.streams":
                out.setdefault(str(path.relative_to(ROOT)), set()).update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("role", sorted(PACKAGES))
def test_every_subject_builder_a_service_imports_is_listed_for_its_role(role: str) -> None:
    listed = {use.name for use in USES[role]} | NOT_SUBJECTS
    found = _streams_names(PACKAGES[role])
    assert found, f"services/{PACKAGES[role]} imports nothing of libs.streams: is PACKAGES out of date?"
    unlisted = {module: sorted(names - listed) for module, names in found.items() if names - listed}
    assert not unlisted, (f"{role}'s code uses libs.streams names this test does not list (add what it "
                          f"publishes/subscribes/reads to USES and to role_permissions): {unlisted}")


def test_the_refusal_check_refuses() -> None:
    """The checks above can fail: the sink-worker may not write a changefeed event."""
    perms = role_permissions(SINK_WORKER)
    assert perms is not None
    assert _refused(perms, Use("x", publish=(domain_events_subject("changefeeds"),)))
    assert _refused(perms, Use("x", owns=(domain_stream("changefeeds"),)))
    assert _refused(perms, Use("x", reads=((domain_stream("schedule"), domain_events_subject("schedule")),)))


def test_the_incidents_subject_carries_table_incidents_only() -> None:
    for event_type in ("table.stopped", "table.unique_conflict_overwritten"):
        check_subject(table_incidents_subject(), event_type)
    for event_type in ("changefeed.created", "changefeed.state_changed", "table.action_requested"):
        with pytest.raises(ContractError, match=r"not accepted on sluice\.ctl\.changefeeds\.incidents"):
            check_subject(table_incidents_subject(), event_type)
    check_subject(domain_events_subject("changefeeds"), "table.action_requested")
    folded = domain_fold_subjects("changefeeds")
    assert folded == [domain_events_subject("changefeeds"), table_incidents_subject()]
    assert domain_fold_subjects("schedule") == [domain_events_subject("schedule")]


def test_a_capture_writes_only_its_own_sources_health() -> None:
    perms = role_permissions(CAPTURE)
    assert perms is not None
    assert perms.may_publish(f"$KV.{SOURCE_HEALTH_BUCKET}.{SOURCE}")
    assert not perms.may_publish(f"$KV.{SOURCE_HEALTH_BUCKET}.src2")
