"""The sources registry: a source's URL entered once, read by changefeeds naming the source by id
and by a capture started with only its source id (libs/sources.py, api /sources, `sluice source`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from contracts.events.changefeeds import ChangefeedCreatedV4, ChangefeedSpecV4, SourceRefV1
from contracts.events.sources import SourceRegisteredV1, SourceRemovedV1
from libs.changefeeds import ChangefeedView
from libs.localservers.common import wait_until
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.localservers.service_process import ServiceProcess
from libs.sources import readers, resolve_sources
from libs.streams import ROWS_STREAM, resolved_subject
from services.cli.app import app
from tests.api_stack import wait_ready

URL = "mysql://repl:secret:shop-pw@shop1.internal:3306/"


def _view(*events: Any) -> ChangefeedView:
    view = ChangefeedView()
    for event in events:
        assert view.apply(event) is False or not isinstance(event, SourceRegisteredV1 | SourceRemovedV1)
    return view


def test_registry_folds_and_resolves_sources_by_id() -> None:
    spec = ChangefeedSpecV4(id="cf", sources=[SourceRefV1(id="shop1", url=URL)], sink_url="sqlite:///x.db")
    view = _view(SourceRegisteredV1(id="shop1", url=URL), SourceRegisteredV1(id="shop2", url=URL + "x"),
                 SourceRemovedV1(id="shop2"), ChangefeedCreatedV4(spec=spec))
    assert view.sources == {"shop1": URL}
    assert readers(view, "shop1") == {"cf": URL} and readers(view, "shop2") == {}
    refs, problems = resolve_sources(view, [("shop1", None), ("legacy", "mysql://u@h:3306/")])
    assert problems == [] and refs == [SourceRefV1(id="shop1", url=URL),
                                       SourceRefV1(id="legacy", url="mysql://u@h:3306/")]
    refs, problems = resolve_sources(view, [("shop2", None), ("shop1", "mysql://other@h:3306/")])
    assert refs == []
    assert [p.index for p in problems] == [0, 1]
    assert "sluice source add shop2" in problems[0].message
    assert "registered with another URL" in problems[1].message


def test_a_registered_url_is_a_mysql_url_without_a_literal_password() -> None:
    from services.api.routes.sources import _url_problems

    assert _url_problems(URL) == []
    for bad, why in (("mysql://repl:hunter2@h:3306/", "secret"), ("postgresql://u@h/db", "MySQL or MariaDB"),
                     ("mysql://u@h:99999/", "Port out of range"), ("mysql://[", "refused"),
                     ("ftp://h/", "unsupported database URL scheme")):
        problems = _url_problems(bad)
        assert len(problems) == 1 and why in problems[0]["msg"], (bad, problems)
        assert "hunter2" not in problems[0]["msg"]


# ----------------------------------------------------------------------------- processes

TOKEN = "registry-token-4c1d"
PASSWORD = "reg-canary-pw-61b7"


@dataclass
class Registry:
    nats: NatsServer
    api: ServiceProcess
    mariadb: MariaDB
    tmp: Path
    env: dict[str, str]

    @property
    def source_url(self) -> str:
        return f"mysql://regrepl:secret:reg-pw@127.0.0.1:{self.mariadb.port}/"

    def sluice(self, *args: str) -> tuple[int, str]:
        result = CliRunner().invoke(app, ["--url", self.api.base_url, "--token", TOKEN, *args],
                                    env={"COLUMNS": "320"})
        return result.exit_code, result.output

    def sources(self) -> dict[str, dict[str, Any]]:
        code, out = self.sluice("--json", "source", "list")
        assert code == 0, out
        return {s["id"]: s for s in json.loads(out)}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, mariadb: MariaDB) -> Iterator[Registry]:
    tmp = tmp_path_factory.mktemp("registry")
    mariadb.execute("CREATE USER IF NOT EXISTS 'regrepl'@'%' IDENTIFIED BY '" + PASSWORD + "'",
                    "GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO 'regrepl'@'%'",
                    "CREATE DATABASE IF NOT EXISTS reg_shop",
                    "CREATE TABLE IF NOT EXISTS reg_shop.t (id INT PRIMARY KEY)")
    server = NatsServer(data_dir=tmp / "nats").start()
    env = {"SLUICE_NATS_URL": server.url, "SLUICE_LEASE_TTL_S": "1.5", "SLUICE_LOG_JSON": "true",
           "SLUICE_STATE_DB_URL": f"sqlite:///{tmp / 'state.db'}", "SLUICE_API_TOKEN": TOKEN,
           "SLUICE_SECRET_REG_PW": PASSWORD,
           # localhost too: the test moves the source to it and expects the registry's 409.
           "SLUICE_SECRETS_HOSTS": (f"reg-pw=127.0.0.1:{mariadb.port},localhost:{mariadb.port};"
                                    f"reg-bad-pw=127.0.0.1:{mariadb.port}"),
           "SLUICE_SECRET_REG_BAD_PW": "not-the-password"}
    api = ServiceProcess("services.api", env, tmp / "logs").start()
    try:
        api.wait_healthy(60)
        with httpx.Client(base_url=api.base_url, timeout=30) as client:
            wait_ready(client)
        yield Registry(server, api, mariadb, tmp, env)
    finally:
        api.terminate()
        server.stop()


@pytest.mark.integration
def test_one_command_per_shard_and_a_capture_started_with_only_its_id(
        registry: Registry, replica_server_id: int, processes: list[ServiceProcess]) -> None:
    # Started before its source is registered: it waits, saying for what.
    capture = ServiceProcess("services.capture", {
        **registry.env, "SLUICE_SOURCE_ID": "regshop", "SLUICE_SOURCE_URL": "",
        "SLUICE_SOURCE_SERVER_ID": str(replica_server_id)}, registry.tmp / "logs")
    processes.append(capture.start())
    wait_until(lambda: "sources registry" in str((capture.health() or {}).get("problem")), 60,
               "the capture to report that it waits for its source in the registry")

    code, out = registry.sluice("source", "add", "regshop",
                                f"mysql://regrepl:{PASSWORD}@127.0.0.1:{registry.mariadb.port}/")
    assert code == 1 and "secret" in out and PASSWORD not in out, out
    # The source's checks run at registration, as at changefeed creation: a wrong password is
    # refused with the server's words, and nothing is registered.
    wrong = registry.source_url.replace("secret:reg-pw", "secret:reg-bad-pw")
    code, out = registry.sluice("source", "add", "regshop", wrong)
    assert code == 1 and "422" in out and "Access denied" in out, out
    assert "regshop" not in registry.sources()
    code, out = registry.sluice("source", "add", "regshop", registry.source_url)
    assert code == 0, out
    wait_until(lambda: (capture.health() or {}).get("state") == "reading", 60,
               "the capture reading the registered source's binlog")
    wait_until(lambda: registry.sources().get("regshop", {}).get("resolved_ts") is not None, 60,
               "a resolved mark of the capture started with only SLUICE_SOURCE_ID")
    assert registry.sources()["regshop"]["registered"] is True

    spec_file = registry.tmp / "reg-cf.json"
    spec_file.write_text(json.dumps({
        "id": "reg-cf", "sources": [{"id": "regshop"}], "filter": {"include": ["reg_shop.*"]},
        "sink_url": f"sqlite:///{registry.tmp / 'reg.db'}", "initial_load": "binlog-only"}))
    code, out = registry.sluice("changefeed", "create", str(spec_file))
    assert code == 0, out
    # A new shard: one command registers it and adds it to the changefeed.
    code, out = registry.sluice("source", "add", "regshop2", registry.source_url, "--changefeed", "reg-cf")
    assert code == 0, out
    code, out = registry.sluice("--json", "changefeed", "get", "reg-cf")
    assert code == 0, out
    assert json.loads(out)["spec"]["sources"] == [{"id": "regshop", "url": registry.source_url},
                                                 {"id": "regshop2", "url": registry.source_url}]

    code, out = registry.sluice("source", "remove", "regshop")
    assert code == 1 and "409" in out and "reg-cf" in out, out
    moved = registry.source_url.replace("127.0.0.1", "localhost")
    code, out = registry.sluice("source", "add", "regshop", moved)
    assert code == 1 and "409" in out, out
    assert registry.sluice("changefeed", "delete", "reg-cf")[0] == 0
    for source in ("regshop", "regshop2"):
        code, out = registry.sluice("source", "remove", source)
        assert code == 0, out
    assert "regshop2" not in registry.sources()
    assert not registry.nats.service_violations(), registry.nats.service_violations()
    assert PASSWORD not in registry.api.log_path.read_text() + capture.log_path.read_text()


@pytest.mark.integration
def test_a_capture_waiting_for_its_source_stops_at_once(
        registry: Registry, replica_server_id: int, processes: list[ServiceProcess]) -> None:
    capture = ServiceProcess("services.capture", {
        **registry.env, "SLUICE_SOURCE_ID": "never-added", "SLUICE_SOURCE_URL": "",
        "SLUICE_SOURCE_SERVER_ID": str(replica_server_id)}, registry.tmp / "logs")
    processes.append(capture.start())
    wait_until(lambda: "sources registry" in str((capture.health() or {}).get("problem")), 60,
               "the capture to report that it waits for its source in the registry")
    status, _ = capture.get_json("/readyz")
    assert status == 503, "not ready while it has no source to read"
    assert capture.terminate(timeout=15) == 0


@pytest.mark.integration
def test_a_capture_that_cannot_log_in_shows_why_and_since_when_in_the_api_and_cli(
        registry: Registry, replica_server_id: int, processes: list[ServiceProcess]) -> None:
    wrong = registry.source_url.replace("secret:reg-pw", "secret:reg-bad-pw")
    code, out = registry.sluice("source", "add", "regbad", wrong, "--skip-checks")
    assert code == 0, out
    capture = ServiceProcess("services.capture", {
        **registry.env, "SLUICE_SOURCE_ID": "regbad", "SLUICE_SOURCE_URL": "",
        "SLUICE_SOURCE_SERVER_ID": str(replica_server_id)}, registry.tmp / "logs")
    processes.append(capture.start())

    def failing() -> bool:
        source = registry.sources().get("regbad", {})
        return "Access denied" in str(source.get("problem")) and bool(source.get("problem_since"))

    wait_until(failing, 60, "the api showing why capture cannot read regbad, and since when")
    source = registry.sources()["regbad"]
    assert source["problem_kind"] == "source_error" and source["problem_since"].endswith(" UTC"), source
    assert "not-the-password" not in json.dumps(source)
    code, out = registry.sluice("source", "list")
    assert code == 0 and "Access denied" in out and f"(since {source['problem_since']})" in out, out
    assert capture.terminate(timeout=15) == 0
    assert registry.sluice("source", "remove", "regbad")[0] == 0


def _purge_resolved_marks(server: NatsServer, source: str) -> None:
    """The fix a binlog_purged rejection names: capture then starts at the current position."""
    import asyncio

    import nats

    async def purge() -> None:
        nc = await nats.connect(**server.client_options())
        try:
            await nc.jetstream().purge_stream(ROWS_STREAM, subject=resolved_subject(source))
        finally:
            await nc.close()

    asyncio.run(purge())


@pytest.mark.integration
def test_a_purged_binlog_is_a_rejection_an_unhealthy_capture_and_a_source_problem(
        registry: Registry, mariadb_factory: Callable[..., MariaDB], replica_server_id: int,
        processes: list[ServiceProcess]) -> None:
    # A private server: purging binlogs of the shared one would pull them from under other tests.
    source = mariadb_factory()
    source.execute("CREATE DATABASE pg_shop", "CREATE TABLE pg_shop.t (id INT PRIMARY KEY)")
    code, out = registry.sluice("source", "add", "purgesrc", source.url)
    assert code == 0, out
    env = {**registry.env, "SLUICE_SOURCE_ID": "purgesrc", "SLUICE_SOURCE_URL": "",
           "SLUICE_SOURCE_SERVER_ID": str(replica_server_id)}

    def capture_process() -> ServiceProcess:
        process = ServiceProcess("services.capture", env, registry.tmp / "logs",
                                 instance_id=f"capture-purgesrc-{len(processes)}").start()
        processes.append(process)
        return process

    def resolved_ts() -> int | None:
        found = registry.sources().get("purgesrc", {}).get("resolved_ts")
        return int(found) if found is not None else None

    capture = capture_process()
    wait_until(lambda: resolved_ts() is not None, 60, "a first resolved mark")
    source.execute("INSERT INTO pg_shop.t VALUES (1)")
    first = resolved_ts()
    wait_until(lambda: (resolved_ts() or 0) > (first or 0), 60, "a resolved mark past the insert")
    capture.kill()
    # While capture is down, the source moves on and purges the binlog it was reading.
    source.execute("INSERT INTO pg_shop.t VALUES (2)", "FLUSH BINARY LOGS", "FLUSH BINARY LOGS")
    newest = source.binlog_files()[-1]

    def purged() -> bool:
        # MariaDB keeps a file until its binlog checkpoint (InnoDB's flush) and any reader of it
        # (the killed capture's dump thread) are gone: ask again until it lets go.
        source.execute(f"PURGE BINARY LOGS TO '{newest}'")
        return source.binlog_files() == [newest]

    wait_until(purged, 30, "the source to purge its older binlogs")

    capture = capture_process()

    def unhealthy() -> dict[str, Any] | None:
        try:
            status, body = capture.get_json("/healthz")
        except OSError:  # not listening yet
            return None
        return body if status == 503 else None

    wait_until(lambda: unhealthy() is not None, 60, "capture's /healthz to answer 503 for the purged binlog")
    body = unhealthy()
    assert body is not None and body["status"] == "unhealthy" and body["state"] == "binlog-purged", body
    assert "initial load" in body["problem"] and "purge" in body["problem"], body
    wait_until(lambda: registry.sources()["purgesrc"].get("problem_kind") == "binlog_purged", 30,
               "the api's source status to name the purged binlog")
    assert "initial_load snapshot" in registry.sources()["purgesrc"]["problem"]
    code, out = registry.sluice("sources")
    assert code == 0 and "binlog" in out and "initial" in out, out
    assert capture.alive(), "capture keeps running (and looking) instead of exiting"

    # The fix it names: without the old marks capture starts at the source's current position,
    # and the problem is gone from the source status once a newer mark follows the rejection.
    capture.kill()
    _purge_resolved_marks(registry.nats, "purgesrc")
    capture = capture_process()
    wait_until(lambda: capture.health() is not None and (capture.health() or {}).get("state") == "reading",
               60, "the capture reading again after the fix")
    wait_until(lambda: registry.sources()["purgesrc"].get("problem") is None, 60,
               "the source's problem to clear after a newer resolved mark")
    code, out = registry.sluice("source", "remove", "purgesrc")
    assert code == 0, out
