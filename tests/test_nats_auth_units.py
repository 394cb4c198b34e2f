"""The NATS permission table, the server config it generates and the connect helper's settings
(pure logic; the process tests against a real nats-server are in test_nats_auth.py)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from pydantic import SecretStr

from libs.config import Settings
from libs.nats_auth import (
    ADMIN,
    API,
    CONTROL_ROLES,
    DDL_LOCK,
    FIXED_ROLES,
    READER,
    REPLICATION_MANAGER,
    SINK_WORKER,
    Permissions,
    StackAuth,
    capture_role,
    compose_roles,
    main,
    matches,
    may_publish_as,
    password_variable,
    role_of_service,
    role_permissions,
    server_config,
)
from libs.nats_client import redact_url, tls_context
from libs.nats_tls import issue_tls
from libs.streams import (
    CHECKPOINT_BUCKET,
    DEADLETTER_STREAM,
    DOMAINS,
    LEADER_BUCKET,
    ROWS_STREAM,
    command_subject,
    ddl_subject,
    dispatch_subject,
    domain_events_subject,
    domain_stream,
    heartbeat_subject,
    leader_command_subject,
    member_probe_subject,
    rejected_subject,
    resolved_subject,
    rows_subject,
    shard_ddl_ops_subject,
    table_incidents_subject,
)

SERVICE_ROLES = [*CONTROL_ROLES, API, SINK_WORKER, capture_role("a"), capture_role("b"), READER]


def perms(role: str) -> Permissions:
    p = role_permissions(role)
    assert p is not None, f"{role} has unlimited permissions"
    return p


@pytest.mark.parametrize(("pattern", "subject", "expected"), [
    ("sluice.rows.a.>", "sluice.rows.a.s.t", True),
    ("sluice.rows.a.>", "sluice.rows.a", False),
    ("sluice.rows.a.>", "sluice.rows.ab.s.t", False),
    ("sluice.hb.*", "sluice.hb.w1", True),
    ("sluice.hb.*", "sluice.hb.w1.x", False),
    ("$KV.b.capture.a", "$KV.b.capture.a", True),
    ("$KV.b.capture.a", "$KV.b.capture.b", False),
])
def test_subject_matching(pattern: str, subject: str, expected: bool) -> None:
    assert matches(pattern, subject) is expected


def test_only_the_capture_of_a_source_publishes_its_rows_ddl_and_resolved() -> None:
    data = [rows_subject("a", "db", "t"), ddl_subject("a", "db", "t"), resolved_subject("a"),
            rejected_subject("a")]
    for role in SERVICE_ROLES:
        for subject in data:
            assert perms(role).may_publish(subject) is (role == capture_role("a")), (role, subject)
    # Nor through the ROWS stream's other ends: no capture may publish as another source.
    assert not perms(capture_role("a")).may_publish(rows_subject("b", "db", "t"))
    assert not perms(capture_role("a")).may_publish(resolved_subject("b"))


def test_only_the_replication_manager_dispatches() -> None:
    for role in SERVICE_ROLES:
        assert perms(role).may_publish(dispatch_subject("w1")) is (role == REPLICATION_MANAGER), role


def test_api_publishes_commands_and_changefeed_events_only() -> None:
    api = perms(API)
    data_subjects = [s for s in api.publish if not s.startswith(("$JS.", "$KV.", "_INBOX"))]
    assert sorted(data_subjects) == ["sluice.cmd.>", "sluice.ctl.changefeeds.>", "sluice.deadletter.>"]
    assert api.may_publish(command_subject("schedule"))
    assert api.may_publish(leader_command_subject("scheduler"))
    assert api.may_publish(domain_events_subject("changefeeds"))
    assert not api.may_publish(domain_events_subject("schedule"))
    assert not api.may_publish(heartbeat_subject("w1"))
    assert not api.may_publish(f"$KV.{LEADER_BUCKET}.scheduler")


def test_sink_workers_cannot_publish_rows_leases_or_ddl_operations() -> None:
    worker = perms(SINK_WORKER)
    assert not worker.may_publish(rows_subject("a", "db", "t"))
    assert not worker.may_publish(f"$KV.{LEADER_BUCKET}.scheduler")
    assert not worker.may_publish(shard_ddl_ops_subject("cf"))
    assert worker.may_publish(f"$KV.{CHECKPOINT_BUCKET}.cf.a.db.t")
    assert worker.may_subscribe(dispatch_subject("w1"))


def test_only_ddl_lock_broadcasts_shard_ddl_operations() -> None:
    for role in SERVICE_ROLES:
        assert perms(role).may_publish(shard_ddl_ops_subject("cf")) is (role == DDL_LOCK), role


def test_each_domain_is_written_by_its_one_owner() -> None:
    owners = {"members": "member", "schedule": "scheduler", "replication": REPLICATION_MANAGER,
              "ddl": DDL_LOCK, "changefeeds": API}
    assert set(owners) == set(DOMAINS)
    for domain, owner in owners.items():
        for role in SERVICE_ROLES:
            assert perms(role).may_publish(domain_events_subject(domain)) is (role == owner), (domain, role)
    # Sink-workers record the tables their downstream refused for good on the changefeeds'
    # incidents subject, the one changefeeds subject they may write (the folds take only table
    # incidents from it).
    for role in SERVICE_ROLES:
        assert perms(role).may_publish(table_incidents_subject()) is (role in (API, SINK_WORKER)), role
    worker_ctl = [s for s in perms(SINK_WORKER).publish if s.startswith("sluice.ctl.")]
    assert worker_ctl == [table_incidents_subject()]


def test_no_service_purges_or_deletes_a_stream_and_leases_are_per_key() -> None:
    streams = [ROWS_STREAM, DEADLETTER_STREAM, *(domain_stream(d) for d in DOMAINS),
               f"KV_{LEADER_BUCKET}", f"KV_{CHECKPOINT_BUCKET}"]
    for role in SERVICE_ROLES:
        p = perms(role)
        for stream in streams:
            assert not p.may_publish(f"$JS.API.STREAM.DELETE.{stream}"), (role, stream)
            assert not p.may_publish(f"$JS.API.STREAM.PURGE.{stream}"), (role, stream)
        for other in CONTROL_ROLES:
            assert p.may_publish(f"$KV.{LEADER_BUCKET}.{other}") is (role == other), (role, other)
    assert perms(capture_role("a")).may_publish(f"$KV.{LEADER_BUCKET}.capture.a")
    assert not perms(capture_role("a")).may_publish(f"$KV.{LEADER_BUCKET}.capture.b")


def test_reader_publishes_nothing_but_read_calls() -> None:
    reader = perms(READER)
    assert all(s.startswith(("$JS.API.", "$JS.ACK.")) for s in reader.publish)
    assert not any(".CREATE." in s and "CONSUMER" not in s for s in reader.publish)
    assert reader.may_publish(f"$JS.API.CONSUMER.CREATE.{ROWS_STREAM}")
    assert not reader.may_publish(f"$JS.API.STREAM.UPDATE.{ROWS_STREAM}")
    assert not reader.allow_responses


def test_role_of_a_service() -> None:
    assert role_of_service("services.sink_worker") == SINK_WORKER
    assert role_of_service("replication-manager") == REPLICATION_MANAGER
    assert role_of_service("services.capture", "s-1.x") == "capture.s-1_x"
    assert role_of_service("tests.helpers.candidate") is None
    with pytest.raises(ValueError, match="unknown NATS role"):
        role_permissions("spark")


def test_server_config_lists_every_user_with_its_permissions(tmp_path: Path) -> None:
    auth = StackAuth.issue([*FIXED_ROLES, capture_role("a")])
    tls = issue_tls(tmp_path / "tls")
    config = json.loads(server_config(host="127.0.0.1", port=4999, store_dir=tmp_path / "js", auth=auth,
                                      tls=tls))
    users = {u["user"]: u for u in config["authorization"]["users"]}
    assert set(users) == {*FIXED_ROLES, "capture.a"}
    assert "permissions" not in users[ADMIN]
    assert users[API]["permissions"]["publish"]["allow"] == list(perms(API).publish)
    assert users[SINK_WORKER]["permissions"]["allow_responses"] is True
    assert len({u["password"] for u in users.values()}) == len(users), "passwords must differ"
    assert config["tls"]["verify"] is True and config["tls"]["ca_file"] == str(tls.ca)


def test_stack_auth_file_is_private_and_survives_a_reload(tmp_path: Path) -> None:
    path = tmp_path / "auth.json"
    first = StackAuth.load_or_issue(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = StackAuth.load_or_issue(path)
    assert again.passwords == first.passwords
    old = again.password(API)
    again.rotate(API)
    assert again.password(API) != old and again.password(SINK_WORKER) == first.password(SINK_WORKER)
    env = again.service_env(API)
    assert env == {"SLUICE_NATS_USER": API, "SLUICE_NATS_PASSWORD": again.password(API)}


def test_urls_are_redacted_and_tls_follows_the_settings(tmp_path: Path) -> None:
    assert redact_url("nats://admin:s3cret@h:4222,nats://h2:4222") == "nats://***@h:4222,nats://h2:4222"
    assert tls_context(Settings(nats_url="nats://h:4222")) is None
    tls = issue_tls(tmp_path)
    ctx = tls_context(Settings(nats_url="nats://h:4222", nats_tls_ca_file=str(tls.ca),
                               nats_tls_cert_file=str(tls.client_cert),
                               nats_tls_key_file=str(tls.client_key)))
    assert ctx is not None
    assert tls_context(Settings(nats_url="tls://h:4222")) is not None
    settings = Settings(nats_password=SecretStr("pw-canary"))
    assert "pw-canary" not in repr(settings) and "pw-canary" not in str(settings.model_dump())


def test_may_publish_as_follows_the_table_for_known_users_only() -> None:
    assert not may_publish_as(API, rows_subject("a", "db", "t"))
    assert may_publish_as(API, domain_events_subject("changefeeds"))
    assert may_publish_as(ADMIN, rows_subject("a", "db", "t"))
    assert may_publish_as(None, rows_subject("a", "db", "t"))
    assert may_publish_as("someone-else", rows_subject("a", "db", "t"))


def test_env_command_issues_one_password_per_compose_role(capsys: pytest.CaptureFixture[str]) -> None:
    main(["env", "src1", "src2"])
    lines = capsys.readouterr().out.splitlines()
    names = [line.split("=", 1)[0] for line in lines]
    assert names == [*(password_variable(r) for r in compose_roles(["src1", "src2"])), "SLUICE_NATS_PW_ROUTE"]
    assert "SLUICE_NATS_PW_CAPTURE_SRC2" in names
    assert all(len(line.split("=", 1)[1]) >= 24 for line in lines)
    # Each its own: no two roles (nor the cluster's routes) share a password.
    assert len({line.split("=", 1)[1] for line in lines}) == len(lines)


def test_the_member_leader_probes_a_member_and_the_member_answers() -> None:
    # Without these the probe meets "no responders" (a subscription the server refused) and the
    # member leader declares a live worker left: a false failover.
    probe = member_probe_subject("sink-worker-1", "831c15ae")
    assert perms("member").may_publish(probe)
    assert perms(SINK_WORKER).may_subscribe(probe)
    assert not perms(API).may_publish(probe)
