"""Who may publish and subscribe what on NATS: the one permission table, and the nats-server
authorization config and per-service credentials generated from it.

Every service connects as its role's user. A role's permissions list the subjects it publishes
(data, control, JetStream API) and subscribes; anything not listed is refused by the server
(a "Permissions Violation"). The table follows the code: libs/streams.py spells every subject and
stream, and each role gets only the calls its service makes (see DESIGN.md, "NATS permissions").

JetStream is reached through ``$JS.API.<op>.<stream>...`` subjects, so stream rights are subject
rights too: a role that only reads a stream gets its info, message-get and consumer subjects; a
role that owns a stream may also create and update it; no role but ``admin`` may purge or
delete a stream. A KV bucket is the stream ``KV_<bucket>``, written through ``$KV.<bucket>.<key>``.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.streams import (
    CHECKPOINT_BUCKET,
    DEADLETTER_STREAM,
    DOMAINS,
    LEADER_BUCKET,
    PREPARE_BUCKET,
    ROWS_STREAM,
    SNAPSHOT_BUCKET,
    SOURCE_HEALTH_BUCKET,
    SYNCPOINT_BUCKET,
    VALIDATION_BUCKET,
    domain_stream,
    table_incidents_subject,
    token,
)

ADMIN = "admin"
READER = "reader"
API = "api"
MEMBER = "member"
SCHEDULER = "scheduler"
REPLICATION_MANAGER = "replication-manager"
DDL_LOCK = "ddl-lock"
SINK_WORKER = "sink-worker"
CAPTURE_PREFIX = "capture."
# The user a NATS node's cluster route logs in as (compose); no client connects as it.
ROUTE_USER = "route"

# Roles every stack issues up front; a capture's role is per source (``capture_role``).
FIXED_ROLES = (ADMIN, READER, API, MEMBER, SCHEDULER, REPLICATION_MANAGER, DDL_LOCK, SINK_WORKER)
CONTROL_ROLES = (MEMBER, SCHEDULER, REPLICATION_MANAGER, DDL_LOCK)

# The control domain each leader-elected service writes (its lease key is the service name).
_DOMAIN_OF = {MEMBER: "members", SCHEDULER: "schedule", REPLICATION_MANAGER: "replication",
              DDL_LOCK: "ddl"}

# Replies to requests (and JetStream's answers to API calls and publishes) come back here.
INBOX = "_INBOX.>"


def capture_role(source: str) -> str:
    return f"{CAPTURE_PREFIX}{token(source)}"


def role_of_service(service: str, source_id: str = "src1") -> str | None:
    """The role a service process runs as: ``service`` is its runtime name (``sink-worker``) or
    module (``services.sink_worker``); None for anything that is not a Sluice service."""
    name = service.removeprefix("services.").replace("_", "-")
    if name == "capture":
        return capture_role(source_id)
    if name in (API, SINK_WORKER, *CONTROL_ROLES):
        return name
    return None


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, tok in enumerate(want):
        if tok == ">":
            return len(have) > i
        if i >= len(have) or (tok != "*" and tok != have[i]):
            return False
    return len(have) == len(want)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    """May answer requests it received (publish to their reply subjects only)."""

    def may_publish(self, subject: str) -> bool:
        return any(matches(p, subject) for p in self.publish)

    def may_subscribe(self, subject: str) -> bool:
        return any(matches(p, subject) for p in self.subscribe)

    def as_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"publish": {"allow": list(self.publish)},
                                  "subscribe": {"allow": list(self.subscribe)}}
        if self.allow_responses:
            config["allow_responses"] = True
        return config


# ------------------------------------------------------------------ building blocks

def js_read(stream: str) -> list[str]:
    """Read a stream: its info, single messages, and consumers of its own (pull, ordered)."""
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.API.CONSUMER.NAMES.{stream}",
        f"$JS.API.CONSUMER.LIST.{stream}",
        f"$JS.ACK.{stream}.>",
    ]


def js_own(stream: str) -> list[str]:
    """Create and reconfigure a stream it writes, besides reading it. Never purge or delete."""
    return [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}", *js_read(stream)]


def kv_read(bucket: str) -> list[str]:
    return js_read(f"KV_{bucket}")


def kv_write(bucket: str, keys: Iterable[str] = (">",)) -> list[str]:
    """Create the bucket and put/delete ``keys`` (subject patterns below ``$KV.<bucket>.``)."""
    return [*js_own(f"KV_{bucket}"), *(f"$KV.{bucket}.{k}" for k in keys)]


def _lease(key: str) -> tuple[list[str], list[str]]:
    """A leader-elected role holding ``key`` in the leader bucket: write its own lease, answer
    liveness probes of its own term and probe the holder of the same key."""
    alive = f"sluice.leader.alive.{token(LEADER_BUCKET)}.{token(key)}.*"
    return [*kv_write(LEADER_BUCKET, [key]), alive], [alive]


def _domain_writer(domain: str) -> list[str]:
    return [*js_own(domain_stream(domain)), f"sluice.ctl.{domain}.>"]


def _domain_reader(*domains: str) -> list[str]:
    return [subject for d in domains for subject in js_read(domain_stream(d))]


_COMMON_PUB = ["$JS.API.INFO"]


def _dead_letters() -> list[str]:
    """Park what cannot be processed (an undecodable event, a poisoned row) in the dead-letter
    stream, creating it on first use."""
    return [*js_own(DEADLETTER_STREAM), "sluice.deadletter.>"]


def _control(role: str, *, follows: Iterable[str], pub: Iterable[str] = (), sub: Iterable[str] = (),
             responses: bool = True) -> Permissions:
    lease_pub, lease_sub = _lease(role)
    publish = [*_COMMON_PUB, *lease_pub, *_domain_writer(_DOMAIN_OF[role]), *_domain_reader(*follows),
               *_dead_letters(), *pub]
    subscribe = [INBOX, *lease_sub, f"sluice.cmd.leader.{token(role)}", *sub]
    return Permissions(tuple(publish), tuple(subscribe), allow_responses=responses)


def role_permissions(role: str) -> Permissions | None:
    """The permissions of ``role``; None for ``admin`` (everything)."""
    if role == ADMIN:
        return None
    if role == READER:
        # Event-stream consumers: every Sluice stream and bucket, read-only.
        streams = [ROWS_STREAM, DEADLETTER_STREAM, *(domain_stream(d) for d in DOMAINS),
                   *(f"KV_{b}" for b in (LEADER_BUCKET, CHECKPOINT_BUCKET, SNAPSHOT_BUCKET, PREPARE_BUCKET,
                                              VALIDATION_BUCKET, SOURCE_HEALTH_BUCKET, SYNCPOINT_BUCKET))]
        return Permissions(tuple([*_COMMON_PUB, "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST",
                                  *(s for st in streams for s in js_read(st))]), (INBOX,))
    if role.startswith(CAPTURE_PREFIX):
        source = role.removeprefix(CAPTURE_PREFIX)
        lease_pub, lease_sub = _lease(role)
        return Permissions(
            tuple([*_COMMON_PUB, *js_own(ROWS_STREAM), *lease_pub,
                   f"sluice.rows.{source}.>", f"sluice.ddl.{source}.>", f"sluice.resolved.{source}",
                   # Why it cannot read its source, under its own key only (libs/source_health.py).
                   *kv_write(SOURCE_HEALTH_BUCKET, [source]),
                   # Started without SLUICE_SOURCE_URL it reads its URL from the sources registry
                   # (libs/sources.py, in the changefeeds log), parking what it cannot decode there.
                   *_domain_reader("changefeeds"), *_dead_letters()]),
            (INBOX, *lease_sub))
    if role == MEMBER:
        # It probes a silent member's liveness subject (libs.streams.member_probe_subject).
        return _control(MEMBER, follows=(), pub=["sluice.member.alive.*.*"], sub=["sluice.hb.*"])
    if role == SCHEDULER:
        return _control(SCHEDULER, follows=("members", "replication", "changefeeds"),
                        pub=js_read(ROWS_STREAM), sub=["sluice.cmd.schedule"])
    if role == REPLICATION_MANAGER:
        # Syncpoints: it reads the resolved marks and writes each changefeed's cap.
        return _control(REPLICATION_MANAGER, follows=("members", "schedule", "changefeeds"),
                        pub=["sluice.dispatch.*", "sluice.announce.*", *js_read(ROWS_STREAM),
                             *kv_write(SYNCPOINT_BUCKET)], sub=["sluice.hb.*"])
    if role == DDL_LOCK:
        return _control(DDL_LOCK, follows=("changefeeds",),
                        pub=[*js_read(ROWS_STREAM), "sluice.shardddl.ops.*"],
                        sub=["sluice.shardddl.report", "sluice.cmd.ddl"])
    if role == SINK_WORKER:
        return Permissions(
            tuple([*_COMMON_PUB, *js_read(ROWS_STREAM), *_domain_reader("changefeeds"), *_dead_letters(),
                   *kv_write(CHECKPOINT_BUCKET), *kv_write(SNAPSHOT_BUCKET), *kv_write(PREPARE_BUCKET),
                   *kv_read(LEADER_BUCKET), *kv_read(SYNCPOINT_BUCKET),
                   # Validation status of the spans it runs (it only reads compare requests).
                   *kv_write(VALIDATION_BUCKET),
                   "sluice.hb.*", "sluice.shardddl.report",
                   # A table its downstream refused for good (table.stopped,
                   # table.unique_conflict_overwritten) goes to the changefeeds' incidents
                   # subject, which carries nothing else; changefeed events it cannot write.
                   table_incidents_subject("changefeeds")]),
            (INBOX, "sluice.dispatch.*", "sluice.announce.*", "sluice.shardddl.ops.*",
             # Answers the member leader's probe while its connection is up.
             "sluice.member.alive.*.*",
             # New resolved marks wake an idle worker's rounds (services.sink_worker.round.wakeup).
             "sluice.resolved.*"),
            allow_responses=True)
    if role == API:
        # Commands to leaders, the changefeeds it records, the dead letters it parks (an event its
        # projections cannot read), replays or discards; everything else it only reads.
        return Permissions(
            tuple([*_COMMON_PUB, "sluice.cmd.>", *_domain_writer("changefeeds"), *_dead_letters(),
                   *_domain_reader("members", "schedule", "replication", "ddl"),
                   *js_own(DEADLETTER_STREAM), f"$JS.API.STREAM.MSG.DELETE.{DEADLETTER_STREAM}",
                   *js_read(ROWS_STREAM),
                   *kv_read(LEADER_BUCKET), *kv_read(CHECKPOINT_BUCKET), *kv_read(SNAPSHOT_BUCKET),
                   *kv_read(PREPARE_BUCKET), *kv_read(SOURCE_HEALTH_BUCKET), *kv_read(SYNCPOINT_BUCKET),
                   # Validation: reads the workers' status, writes only compare requests.
                   *kv_write(VALIDATION_BUCKET, ["*.request"])]),
            (INBOX,))
    raise ValueError(f"unknown NATS role {role!r}")


def may_publish_as(user: str | None, subject: str) -> bool:
    """Whether the server lets ``user`` publish ``subject``, as far as the table knows: a user
    that is not one of its roles (or none) is left to the server to decide."""
    if user is None:
        return True
    try:
        perms = role_permissions(user)
    except ValueError:
        return True
    return perms is None or perms.may_publish(subject)


# ------------------------------------------------------------------ credentials of a stack

@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a stack's TLS: its CA, the server's pair, and one client pair."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


@dataclass
class StackAuth:
    """The users of one stack and their passwords. Kept in a 0600 JSON file beside the server's
    data, so a restarted server (and the processes that read the file) keep the same ones."""

    passwords: dict[str, str] = field(default_factory=dict)

    @classmethod
    def issue(cls, roles: Iterable[str] = FIXED_ROLES) -> StackAuth:
        auth = cls()
        for role in roles:
            auth.add(role)
        return auth

    def add(self, role: str) -> bool:
        """Issue a password for ``role``; False when it has one already."""
        if role in self.passwords:
            return False
        role_permissions(role)  # refuses an unknown role before it gets a password
        self.passwords[role] = secrets.token_urlsafe(24)
        return True

    def rotate(self, role: str) -> None:
        """A new password for ``role``; the server takes it at its next reload."""
        self.passwords.pop(role, None)
        self.add(role)

    def password(self, role: str) -> str:
        return self.passwords[role]

    def authorization(self) -> dict[str, Any]:
        users = []
        for role in sorted(self.passwords):
            user: dict[str, Any] = {"user": role, "password": self.passwords[role]}
            perms = role_permissions(role)
            if perms is not None:
                user["permissions"] = perms.as_config()
            users.append(user)
        return {"users": users}

    def service_env(self, role: str, tls: TlsFiles | None = None) -> dict[str, str]:
        """The settings a service of ``role`` connects with."""
        env = {"SLUICE_NATS_USER": role, "SLUICE_NATS_PASSWORD": self.passwords[role]}
        if tls is not None:
            env |= {"SLUICE_NATS_TLS_CA_FILE": str(tls.ca),
                    "SLUICE_NATS_TLS_CERT_FILE": str(tls.client_cert),
                    "SLUICE_NATS_TLS_KEY_FILE": str(tls.client_key)}
        return env

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text(json.dumps(self.passwords, indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: Path) -> StackAuth:
        return cls(passwords=dict(json.loads(path.read_text())))

    @classmethod
    def load_or_issue(cls, path: Path, roles: Iterable[str] = FIXED_ROLES) -> StackAuth:
        auth = cls.load(path) if path.exists() else cls()
        for role in roles:
            auth.add(role)
        auth.save(path)
        return auth


def server_config(*, host: str, port: int, store_dir: Path | None, auth: StackAuth | None,
                  tls: TlsFiles | None = None, server_name: str | None = None,
                  sync_interval: str | None = None, extra: dict[str, Any] | None = None) -> str:
    """A nats-server config file (JSON is valid NATS config syntax). ``sync_interval`` is
    JetStream's fsync interval (``always``: before each acknowledgement); None keeps the
    server's default (about every 2 minutes)."""
    config: dict[str, Any] = {"host": host, "port": port}
    if server_name:
        config["server_name"] = server_name
    if store_dir is not None:
        config["jetstream"] = {"store_dir": str(store_dir)}
        if sync_interval:
            config["jetstream"]["sync_interval"] = sync_interval
    if auth is not None:
        config["authorization"] = auth.authorization()
    if tls is not None:
        # verify: every client must present a certificate the CA signed.
        config["tls"] = {"cert_file": str(tls.server_cert), "key_file": str(tls.server_key),
                         "ca_file": str(tls.ca), "verify": True, "timeout": 5}
    config |= extra or {}
    return json.dumps(config, indent=1)


def password_variable(role: str) -> str:
    """The environment variable that holds ``role``'s password where the stack takes its
    secrets from the environment (docker compose's ``.env``)."""
    return "SLUICE_NATS_PW_" + "".join(c if c.isalnum() else "_" for c in role).upper()


SYNC_INTERVAL_VARIABLE = "SLUICE_NATS_SYNC_INTERVAL"


def env_authorization_config(roles: Iterable[str]) -> str:
    """An ``authorization`` block for nats-server whose passwords are environment references
    (``$SLUICE_NATS_PW_<ROLE>``), so the file holds no secret, and JetStream's fsync interval
    from ``$SLUICE_NATS_SYNC_INTERVAL`` (compose's default: always)."""
    users = []
    for role in roles:
        user: dict[str, Any] = {"user": role, "password": f"@@{password_variable(role)}@@"}
        perms = role_permissions(role)
        if perms is not None:
            user["permissions"] = perms.as_config()
        users.append(user)
    text = json.dumps({"jetstream": {"sync_interval": f"@@{SYNC_INTERVAL_VARIABLE}@@"},
                       "authorization": {"users": users}}, indent=1)
    # nats-server resolves a bare $NAME from the environment; a quoted one would stay literal.
    for name in [*(password_variable(role) for role in roles), SYNC_INTERVAL_VARIABLE]:
        text = text.replace(f'"@@{name}@@"', f"${name}")
    return text + "\n"


def compose_roles(sources: Iterable[str]) -> list[str]:
    return [*FIXED_ROLES, *(capture_role(s) for s in sources)]


# A single node has no replica to hold an acknowledged write while the OS loses its page cache:
# it fsyncs before each acknowledgement (DESIGN.md, "JetStream durability").
SINGLE_NODE_SYNC_INTERVAL = "always"


@dataclass(frozen=True)
class LocalStack:
    """What ``python -m libs.nats_auth local`` writes for one machine's nats-server."""

    config: Path
    users_dir: Path
    auth_file: Path


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """``text`` in a file no other user can read, from its first byte on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(text)


def write_local_stack(directory: Path, sources: Iterable[str], *, port: int = 4222,
                      sync_interval: str | None = SINGLE_NODE_SYNC_INTERVAL) -> LocalStack:
    """A nats-server config with every role's user and permissions (passwords inline, so the
    file is 0600) and one 0600 password file per role under ``users/`` (what a service reads
    with SLUICE_NATS_USERS_DIR). Passwords already issued are kept: running it again after
    adding a source only adds that source's capture user."""
    # Absolute: the server and the services may start from another directory.
    directory = private_dir(directory).resolve()
    auth_file = directory / "auth.json"
    auth = StackAuth.load_or_issue(auth_file, compose_roles(sources))
    users = private_dir(directory / "users")
    for role, password in auth.passwords.items():
        write_private(users / role, password + "\n")
    config = directory / "nats.conf"
    write_private(config, server_config(host="127.0.0.1", port=port, store_dir=directory / "jetstream",
                                        auth=auth, sync_interval=sync_interval))
    return LocalStack(config=config, users_dir=users, auth_file=auth_file)


def main(argv: list[str] | None = None) -> None:
    """``python -m libs.nats_auth compose-config SOURCE...``: the authorization block of the
    compose NATS cluster (infra/nats/auth.conf), passwords read from the environment;
    ``python -m libs.nats_auth env SOURCE...``: a fresh password per role, as ``.env`` lines;
    ``python -m libs.nats_auth local DIR SOURCE...``: one machine's server config and password
    files (README, "The first hour")."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m libs.nats_auth")
    sub = parser.add_subparsers(dest="command", required=True)
    compose = sub.add_parser("compose-config", help="authorization block with $ENV passwords")
    compose.add_argument("sources", nargs="+")
    env = sub.add_parser("env", help="new random passwords as .env lines (issue or rotate)")
    env.add_argument("sources", nargs="+")
    local = sub.add_parser("local", help="one machine's nats-server config and per-role password files")
    local.add_argument("directory", type=Path)
    local.add_argument("sources", nargs="+")
    local.add_argument("--port", type=int, default=4222)
    local.add_argument("--sync-interval", default=SINGLE_NODE_SYNC_INTERVAL,
                       help="JetStream fsync interval: always (default), or a duration such as 1s")
    args = parser.parse_args(argv)
    if args.command == "local":
        stack = write_local_stack(args.directory, args.sources, port=args.port,
                                  sync_interval=args.sync_interval)
        print(f"nats-server config: {stack.config} (0600)\n"
              f"password of each role: {stack.users_dir}/<role> (0600); run every service with\n"
              f"  SLUICE_NATS_USERS_DIR={stack.users_dir}\n"
              f"start the server with\n  nats-server -c {stack.config}")
    elif args.command == "compose-config":
        print(env_authorization_config(compose_roles(args.sources)), end="")
    else:
        issued = StackAuth.issue(compose_roles(args.sources))
        for role in compose_roles(args.sources):
            print(f"{password_variable(role)}={issued.password(role)}")
        # Not a client role: the compose nodes' cluster routes log in with it.
        print(f"{password_variable(ROUTE_USER)}={secrets.token_urlsafe(24)}")


if __name__ == "__main__":
    main()
