"""NATS authentication and per-service permissions against the real nats-server and services:
no anonymous client, no service publishing what is not its own (rows, dispatches, another
source's rows), a read-only consumer, a forged row that never reaches a downstream, and TLS with
client certificates (a service included)."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1
from libs.changefeeds import record_changefeed, record_state
from libs.config import Settings
from libs.localservers.common import find_binary, free_port, port_open, wait_until
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.localservers.service_process import ServiceProcess
from libs.nats_auth import (
    API,
    READER,
    SINK_WORKER,
    capture_role,
    compose_roles,
    env_authorization_config,
    password_variable,
)
from libs.nats_tls import client_context
from libs.streams import LEADER_BUCKET, ROWS_STREAM, dispatch_subject, resolved_subject, rows_subject
from libs.streams_setup import ensure_rows_stream
from tests.helpers.worker_env import STANDALONE_WORKER_ENV

pytestmark = pytest.mark.integration


class Errors:
    """The asynchronous errors a client's server sends (permission violations among them)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def on_error(self, exc: Exception) -> None:
        self.seen.append(str(exc))

    async def wait_violation(self, subject: str, within: float = 10) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if any("permissions violation" in e.lower() and subject.lower() in e.lower() for e in self.seen):
                return
            await asyncio.sleep(0.05)
        pytest.fail(f"no permissions violation for {subject!r} within {within}s; errors: {self.seen}")


async def connect_as(server: NatsServer, role: str, errors: Errors) -> Client:
    return await nats.connect(**server.client_options(role), error_cb=errors.on_error, allow_reconnect=False)


@pytest.fixture
async def rows_js(js: JetStreamContext) -> JetStreamContext:
    await ensure_rows_stream(js, Settings())
    return js


@pytest.fixture
async def everything(nc: Client) -> AsyncIterator[list[Msg]]:
    """What the admin client sees on every Sluice subject."""
    seen: list[Msg] = []

    async def keep(msg: Msg) -> None:
        seen.append(msg)

    sub = await nc.subscribe("sluice.>", cb=keep)
    await nc.flush()
    yield seen
    await sub.unsubscribe()


async def _wait_for(seen: list[Msg], subject: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if any(m.subject == subject for m in seen):
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"{subject} never arrived within {within}s")


async def test_a_client_without_credentials_cannot_connect(nats_server: NatsServer) -> None:
    errors = Errors()
    refused = {"error_cb": errors.on_error, "allow_reconnect": False, "connect_timeout": 5}
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(nats_server.plain_url, **refused)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(nats_server.plain_url, user=API, password="not-the-password", **refused)


@pytest.mark.parametrize("role", [API, SINK_WORKER])
async def test_api_and_sink_worker_cannot_publish_rows_or_dispatches(
    nats_server: NatsServer, rows_js: JetStreamContext, everything: list[Msg], role: str,
) -> None:
    row = rows_subject("natsauth", "db", f"t_{role.replace('-', '_')}")
    dispatch = dispatch_subject(f"w-{role}")
    before = (await rows_js.stream_info(ROWS_STREAM)).state.last_seq
    errors = Errors()
    client = await connect_as(nats_server, role, errors)
    try:
        await client.publish(row, b"{}")
        await client.publish(dispatch, b"{}")
        with pytest.raises(nats.errors.TimeoutError):
            await client.jetstream().publish(row, b"{}", timeout=1)
        await errors.wait_violation(row)
        await errors.wait_violation(dispatch)
        # A subject the role may publish, after the refused ones: once it arrived, so would they.
        sentinel = "sluice.cmd.natsauth_sentinel" if role == API else "sluice.hb.natsauth_sentinel"
        await client.publish(sentinel, b"sentinel")
        await _wait_for(everything, sentinel)
    finally:
        await client.close()
    assert not [m.subject for m in everything if m.subject in (row, dispatch)]
    assert (await rows_js.stream_info(ROWS_STREAM)).state.last_seq == before


async def test_a_capture_publishes_its_own_source_only(
    nats_server: NatsServer, rows_js: JetStreamContext,
) -> None:
    errors = Errors()
    client = await connect_as(nats_server, capture_role("nats_a"), errors)
    try:
        js = client.jetstream()
        ack = await js.publish(rows_subject("nats_a", "db", "t"), b"{}", timeout=5)
        assert ack.stream == ROWS_STREAM
        await js.publish(resolved_subject("nats_a"), b"{}", timeout=5)
        for subject in (rows_subject("nats_b", "db", "t"), resolved_subject("nats_b")):
            with pytest.raises(nats.errors.TimeoutError):
                await js.publish(subject, b"{}", timeout=1)
            await errors.wait_violation(subject)
        # Nor can it purge or delete the stream every source shares.
        with pytest.raises(nats.errors.TimeoutError):
            await js.purge_stream(ROWS_STREAM)
        await errors.wait_violation(f"$JS.API.STREAM.PURGE.{ROWS_STREAM}")
    finally:
        await client.close()
    with pytest.raises(nats.js.errors.NotFoundError):
        await rows_js.get_last_msg(ROWS_STREAM, rows_subject("nats_b", "db", "t"))


async def test_a_read_only_consumer_reads_rows_and_publishes_nothing(
    nats_server: NatsServer, rows_js: JetStreamContext,
) -> None:
    subject = rows_subject("nats_reader", "db", "t")
    await rows_js.publish(subject, b'{"marker": 1}')
    errors = Errors()
    client = await connect_as(nats_server, READER, errors)
    try:
        js = client.jetstream()
        sub = await js.pull_subscribe(subject, stream=ROWS_STREAM)
        msgs = await sub.fetch(1, timeout=5)
        assert [json.loads(m.data) for m in msgs] == [{"marker": 1}]
        await msgs[0].ack()
        last = await js.get_last_msg(ROWS_STREAM, subject)
        assert last.data == b'{"marker": 1}'
        await sub.unsubscribe()
        await client.publish(subject, b"{}")
        await errors.wait_violation(subject)
        with pytest.raises(nats.errors.TimeoutError):
            await js.delete_stream(ROWS_STREAM)
        await errors.wait_violation(f"$JS.API.STREAM.DELETE.{ROWS_STREAM}")
    finally:
        await client.close()
    assert (await rows_js.stream_info(ROWS_STREAM)).config.name == ROWS_STREAM


# ------------------------------------------------------------------ a forged row, end to end

def _downstream_ids(path: Path, table: str) -> set[int]:
    try:
        with sqlite3.connect(path) as conn:
            return {int(r[0]) for r in conn.execute(f'SELECT id FROM "{table}"')}
    except sqlite3.OperationalError:  # the table appears with the first applied batch
        return set()


async def _last(js: JetStreamContext, subject: str) -> dict[str, Any]:
    msg = await js.get_last_msg(ROWS_STREAM, subject)
    return dict(json.loads(msg.data or b"{}"))


def _forged(real: dict[str, Any], resolved_ts: int, row_id: int) -> bytes:
    """A copy of a captured row event with another row in it, placed after the source's last
    resolved mark so the next mark covers it."""
    event = json.loads(json.dumps(real))
    event["id"] = f"forged-{uuid.uuid4()}"
    event["data"]["ts"] = resolved_ts + 1
    event["data"]["rows"] = [{"op": "insert", "before": None, "after": {"id": row_id, "name": "forged"}}]
    return json.dumps(event).encode()


async def test_a_row_forged_with_another_services_credentials_never_reaches_the_downstream(
    nats_server: NatsServer, rows_js: JetStreamContext, service_env: dict[str, str], tmp_path: Path,
    mariadb: MariaDB, processes: list[ServiceProcess],
) -> None:
    db, table, source = "natsauth_forge", "items", "nats_forge"
    log_from = nats_server.log_size()
    mariadb.execute(f"DROP DATABASE IF EXISTS {db}", f"CREATE DATABASE {db}",
                    f"CREATE TABLE {db}.{table} (id INT PRIMARY KEY, name VARCHAR(32))")
    downstream = tmp_path / "down.db"
    logs = tmp_path / "logs"
    capture = ServiceProcess("services.capture", {
        **service_env, "SLUICE_SOURCE_ID": source,
        "SLUICE_SOURCE_URL": f"{mariadb.url_for(db)}?heartbeat=0.3",
        "SLUICE_SOURCE_SERVER_ID": "4790"}, logs, instance_id="capture-forge").start()
    processes.append(capture)
    spec = ChangefeedSpecV2(id="natsauth-forge", sources=[SourceRefV1(id=source, url=mariadb.url)],
                            filter=TableFilterV1(include=[f"{db}.*"]), sink_url=f"sqlite:///{downstream}",
                            initial_load="binlog-only")
    await record_changefeed(rows_js, spec, requested_by="test")
    try:
        worker = ServiceProcess("services.sink_worker", {
            **service_env, **STANDALONE_WORKER_ENV}, logs,
            instance_id="worker-forge").start()
        processes.append(worker)
        capture.wait_healthy(60)
        worker.wait_healthy(60)
        # A new source starts at the binlog's current position: the row goes in once capture has
        # taken it (healthy came first once, and a row written before it was never read).
        await asyncio.to_thread(wait_until, lambda: (capture.health() or {}).get("state") == "reading", 60,
                                "capture reading")
        mariadb.execute(f"INSERT INTO {db}.{table} VALUES (1, 'real')")
        await asyncio.to_thread(wait_until, lambda: _downstream_ids(downstream, table) == {1}, 300,
                                "the real row downstream")
        real = await _last(rows_js, rows_subject(source, db, table))
        resolved = await _last(rows_js, resolved_subject(source))
        subject = rows_subject(source, db, table)
        for role in (API, SINK_WORKER):
            errors = Errors()
            client = await connect_as(nats_server, role, errors)
            try:
                with pytest.raises(nats.errors.TimeoutError):
                    await client.jetstream().publish(subject, _forged(real, resolved["data"]["ts"], 666),
                                                     timeout=1)
                await errors.wait_violation(subject)
            finally:
                await client.close()
        # The same forgery from the one user allowed to publish this source's rows lands: the
        # event itself is well formed, only the credentials kept it out.
        resolved = await _last(rows_js, resolved_subject(source))
        errors = Errors()
        owner = await connect_as(nats_server, capture_role(source), errors)
        try:
            await owner.jetstream().publish(subject, _forged(real, resolved["data"]["ts"], 777), timeout=5)
        finally:
            await owner.close()
        mariadb.execute(f"INSERT INTO {db}.{table} VALUES (2, 'real')")
        await asyncio.to_thread(wait_until, lambda: {1, 2, 777} <= _downstream_ids(downstream, table), 300,
                                "the second real row and the capture-published one downstream")
        assert 666 not in _downstream_ids(downstream, table)
        # The test's own clients were refused on purpose; the capture and the sink-worker, running
        # with their roles' credentials, never were.
        assert not nats_server.service_violations(since=log_from)
    finally:
        await record_state(rows_js, spec.id, "deleted", requested_by="test", reason="test over")


# ------------------------------------------------------------------ TLS with client certificates

@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(data_dir=tmp_path / "nats-tls", tls=True).start()
    yield server
    server.stop()


async def test_tls_with_a_client_certificate_works_and_without_one_is_refused(tls_server: NatsServer) -> None:
    assert tls_server.tls_files is not None
    client = await nats.connect(**tls_server.client_options(API), allow_reconnect=False)
    try:
        ack = await client.jetstream().account_info()
        assert ack.streams >= 0
        assert client.connected_url is not None and client.connected_url.scheme == "tls"
    finally:
        await client.close()
    options = tls_server.client_options(API)
    # The CA is trusted but no client certificate is presented: the handshake is refused.
    options["tls"] = client_context(str(tls_server.tls_files.ca))
    errors = Errors()
    with pytest.raises((nats.errors.Error, ssl.SSLError, OSError, asyncio.TimeoutError)):
        await nats.connect(**options, error_cb=errors.on_error, allow_reconnect=False, connect_timeout=5)
    # Nor in plain text.
    with pytest.raises((nats.errors.Error, OSError, asyncio.TimeoutError)):
        await nats.connect(f"nats://127.0.0.1:{tls_server.port}", user=API,
                           password=tls_server.client_options(API)["password"], error_cb=errors.on_error,
                           allow_reconnect=False, connect_timeout=5)


async def test_a_service_runs_over_tls_with_its_client_certificate(tls_server: NatsServer,
                                                                   tmp_path: Path) -> None:
    env = NatsServer.credentials_for("services.member", {"SLUICE_NATS_URL": tls_server.url})
    assert env["SLUICE_NATS_USER"] == "member" and env["SLUICE_NATS_TLS_CERT_FILE"].endswith("client.pem")
    member = ServiceProcess("services.member", {"SLUICE_NATS_URL": tls_server.url,
                                                "SLUICE_LEASE_TTL_S": "1.5"}, tmp_path / "logs").start()
    admin = await nats.connect(**tls_server.client_options(), allow_reconnect=False)
    try:
        member.wait_ready(60)
        # It works as itself over TLS: it took the member lease, which only its user may write.
        # Ready does not wait for the election, so the bucket itself may not be there yet.
        deadline = time.monotonic() + 30
        lease = None
        while lease is None and time.monotonic() < deadline:
            try:
                lease = await (await admin.jetstream().key_value(LEADER_BUCKET)).get("member")
            except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
                await asyncio.sleep(0.1)
        assert lease is not None, "the member service never took its lease over TLS"
        assert env["SLUICE_NATS_PASSWORD"] not in member.log_path.read_text(), "a password in the log"
    finally:
        await admin.close()
        member.terminate()


# ------------------------------------------------------------------ the compose cluster's config

COMPOSE_AUTH = Path(__file__).resolve().parents[1] / "infra" / "nats" / "auth.conf"


def test_compose_auth_config_is_the_generated_one() -> None:
    assert COMPOSE_AUTH.read_text() == env_authorization_config(compose_roles(["src1", "src2"])), (
        "infra/nats/auth.conf is stale: "
        "python -m libs.nats_auth compose-config src1 src2 > infra/nats/auth.conf")
    assert "SLUICE_NATS_PW_" in COMPOSE_AUTH.read_text()


@pytest.fixture
def compose_nats(tmp_path: Path) -> Iterator[tuple[int, dict[str, str], int]]:
    """nats-server started as compose starts it: flags, ``-c infra/nats/auth.conf`` and the
    passwords and sync interval in its environment; with its monitoring port."""
    port, monitor = free_port(), free_port()
    passwords = {r: f"pw-{i}" for i, r in enumerate(compose_roles(["src1", "src2"]))}
    env = {**os.environ, **{password_variable(r): pw for r, pw in passwords.items()},
           "SLUICE_NATS_SYNC_INTERVAL": "always"}
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen([find_binary("nats-server"), "-c", str(COMPOSE_AUTH), "-a", "127.0.0.1",
                                 "-p", str(port), "-m", str(monitor), "-js", "-sd", str(tmp_path / "js")],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: port_open(port) or proc.poll() is not None, 15,
                   "nats-server with the compose config")
        assert proc.poll() is None, (tmp_path / "log").read_text()
        yield port, passwords, monitor
    finally:
        proc.terminate()
        proc.wait(10)


def _http_get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return bytes(resp.read())


async def test_compose_auth_config_takes_passwords_from_the_environment(
    compose_nats: tuple[int, dict[str, str], int],
) -> None:
    port, passwords, monitor = compose_nats
    # JetStream fsyncs before each acknowledgement (SLUICE_NATS_SYNC_INTERVAL).
    jsz = json.loads(await asyncio.to_thread(_http_get, f"http://127.0.0.1:{monitor}/jsz?config=true"))
    assert jsz["config"]["sync_always"] is True, jsz["config"]
    url = f"nats://127.0.0.1:{port}"
    errors = Errors()
    client = await nats.connect(url, user=API, password=passwords[API], error_cb=errors.on_error,
                                allow_reconnect=False)
    try:
        await client.publish(rows_subject("src1", "db", "t"), b"{}")
        await errors.wait_violation(rows_subject("src1", "db", "t"))
    finally:
        await client.close()
    capture = await nats.connect(url, user=capture_role("src1"), password=passwords[capture_role("src1")],
                                 allow_reconnect=False)
    try:
        info = await ensure_rows_stream(capture.jetstream(), Settings())
        assert info.config.name == ROWS_STREAM
    finally:
        await capture.close()
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(url, error_cb=errors.on_error, allow_reconnect=False)


# ------------------------------------------------------------------ the first hour's NATS

async def _anonymous_refused_and_member_lease(port: int, admin_password: str) -> None:
    with pytest.raises((nats.errors.NoServersError, nats.errors.Error, OSError)):
        await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False, connect_timeout=3,
                           max_reconnect_attempts=0)
    admin = await nats.connect(f"nats://127.0.0.1:{port}", user="admin", password=admin_password,
                               allow_reconnect=False)
    try:
        # The member took its lease, which only the member role may write. Its bucket may not be
        # there yet when the service reports ready (a fresh server that fsyncs every write).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                kv = await admin.jetstream().key_value(LEADER_BUCKET)
                await kv.get("member")
                return
            except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
                await asyncio.sleep(0.1)  # polling for the lease, within the deadline
        pytest.fail("the member never took its lease as its own role")
    finally:
        await admin.close()


def test_the_first_hours_nats_has_users_and_a_service_connects_as_its_role(tmp_path: Path) -> None:
    """README "The first hour": one command writes the server config and a password file per
    role (private modes); nats-server started with it refuses anonymous clients and fsyncs
    before each acknowledgement; a service given only SLUICE_NATS_USERS_DIR works as its own
    role, with no password on its command line."""
    port, directory = free_port(), tmp_path / "nats"
    local = [sys.executable, "-m", "libs.nats_auth", "local", str(directory), "shop", "--port", str(port)]
    out = subprocess.run(local, check=True, capture_output=True, text=True).stdout
    users = directory / "users"
    assert f"SLUICE_NATS_USERS_DIR={users}" in out and "nats-server -c" in out
    modes = {p.name: p.stat().st_mode & 0o777 for p in (directory, users, directory / "nats.conf",
                                                         directory / "auth.json", users / "member")}
    assert modes == {"nats": 0o700, "users": 0o700, "nats.conf": 0o600, "auth.json": 0o600,
                     "member": 0o600}, modes
    config = json.loads((directory / "nats.conf").read_text())
    assert config["jetstream"]["sync_interval"] == "always" and config["host"] == "127.0.0.1"
    member_pw = (users / "member").read_text().strip()
    with open(tmp_path / "nats.log", "wb") as log:
        server = subprocess.Popen([find_binary("nats-server"), "-c", str(directory / "nats.conf")],
                                  stdout=log, stderr=subprocess.STDOUT)
    member = ServiceProcess("services.member", {"SLUICE_NATS_URL": f"nats://127.0.0.1:{port}",
                                                "SLUICE_NATS_USERS_DIR": str(users),
                                                "SLUICE_LEASE_TTL_S": "1.5"}, tmp_path / "logs")
    try:
        wait_until(lambda: port_open(port) or server.poll() is not None, 15, "the first hour's nats-server")
        member.start().wait_ready(60)
        assert member.proc is not None
        assert member_pw.encode() not in Path(f"/proc/{member.proc.pid}/cmdline").read_bytes()
        asyncio.run(_anonymous_refused_and_member_lease(port, (users / "admin").read_text().strip()))
        assert member_pw not in member.log_path.read_text()
    finally:
        member.terminate()
        server.terminate()
        server.wait(10)
    # Again with a second source: issued passwords are kept, the new capture gets its own.
    subprocess.run([*local[:-2], "shop-2", "--port", str(port)], check=True, capture_output=True)
    assert (users / "member").read_text().strip() == member_pw
    assert (users / capture_role("shop-2")).stat().st_mode & 0o777 == 0o600
