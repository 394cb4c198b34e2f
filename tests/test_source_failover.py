"""Source failover by GTID with real processes: a MariaDB primary with two native GTID replicas,
capture following the sources registry, one sink-worker running one changefeed per SQL
downstream (SQLite, PostgreSQL, MariaDB) from the same source, the operator api.

Writes go to the primary under load while one replica stops applying (it lags); the primary is
killed with SIGKILL once the other replica has everything (asynchronous replication loses what
a replica had not received: that is the lagging replica's case). The up-to-date replica is
promoted and written to. Moving the source to the lagging replica is refused by the api (409,
the lost transactions named) and, when recorded behind the api's back, by capture itself; moving
it to the promoted replica (`sluice source set-url`) is accepted, capture continues there by
GTID, and every downstream ends EQUAL to the new primary with every message of the stream
published once (its seqs unique and gap-free). The three downstreams share the source, capture,
the stream and the worker (one system), so covering them costs two more changefeeds' writes,
not two more failovers."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.js import JetStreamContext
from typer.testing import CliRunner

from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1
from contracts.events.rows import RowsChangedV2, parts_of
from contracts.registry import REGISTRY
from libs.changefeeds import record_changefeed
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.localservers.service_process import ServiceProcess
from libs.sources import record_source_moved
from libs.streams import ROWS_STREAM, resolved_subject, token
from services.cli.app import app as cli_app
from services.sink_worker.validation.verify import ShardRef, Verification, verify_target
from tests.api_stack import TOKEN
from tests.helpers.converge import wait_converged
from tests.helpers.e2e import _created, _delete_changefeeds_afterwards, _worker  # noqa: F401 - fixture

pytestmark = pytest.mark.integration
DB = "failover_e2e"
SOURCE = "fo"
TABLES = ("acct", "moves")
# Replicas write what they apply to their own binlog (a promoted one must have it), and
# sequence numbers only grow in a domain: the topology the GTID comparison assumes.
GTID_ARGS = ("--log-slave-updates=ON", "--gtid-strict-mode=ON")


# The source's user logs in with a password that lives in a named secret: no response, CLI output
# or log line may ever show it.
CANARY = "fo-canary-5e71b0"
SECRET_ENV = {"SLUICE_SECRET_FO_PW": CANARY, "SLUICE_SECRETS_HOSTS": "fo-pw=127.0.0.1"}
VIEWER = "fo-viewer-token-31c9"


def _url(server: MariaDB) -> str:
    return f"mysql://repl:secret:fo-pw@127.0.0.1:{server.port}/?heartbeat=0.5"


def _gtid_pos(server: MariaDB) -> str:
    return str(server.execute("SELECT @@GLOBAL.gtid_binlog_pos")[0][0])


def _caught_up(replica: MariaDB, primary: MariaDB) -> None:
    pos = _gtid_pos(primary)
    got = replica.execute(f"SELECT MASTER_GTID_WAIT('{pos}', 30)")[0][0]
    assert got == 0, f"replica did not reach {pos}: {replica.replica_status()}"


class Writer:
    """Small transactions as fast as one connection goes: moves between accounts, inserts and
    deletes, until stopped (or the server dies)."""

    def __init__(self, server: MariaDB, first_move: int) -> None:
        self.server = server
        self.done = 0
        self.next_move = first_move
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> Writer:
        self._thread.start()
        return self

    def _run(self) -> None:
        rng = random.Random(self.next_move)
        try:
            conn = self.server.connect(DB)
            with conn.cursor() as cur:
                while not self._stop.is_set():
                    a, b = rng.sample(range(1, 21), 2)
                    amount = rng.randint(1, 50)
                    conn.begin()
                    cur.execute("UPDATE acct SET balance = balance - %s WHERE id = %s", (amount, a))
                    cur.execute("UPDATE acct SET balance = balance + %s WHERE id = %s", (amount, b))
                    cur.execute("INSERT INTO moves VALUES (%s, %s, %s, %s)", (self.next_move, a, b, amount))
                    if self.next_move % 7 == 0:
                        cur.execute("DELETE FROM moves WHERE id = %s", (self.next_move - 3,))
                    conn.commit()
                    self.next_move += 1
                    self.done += 1
            conn.close()
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert self.error is None, repr(self.error)


def _wait(what: str, check: Callable[[], bool], procs: list[ServiceProcess], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for p in procs:
            assert p.alive(), f"{p.instance_id} died:\n{p.tail_log()}"
        assert time.monotonic() < deadline, f"never {what}:\n" + "\n".join(
            f"--- {p.instance_id}\n{p.tail_log(12)}\nhealth: {p.health()}" for p in procs)
        time.sleep(0.1)


async def _mark_gtid(js: JetStreamContext) -> str | None:
    raw = await js.get_last_msg(ROWS_STREAM, resolved_subject(SOURCE))
    event = REGISTRY.decode(raw.data or b"").event
    return getattr(getattr(event, "position", None), "gtid", None)


async def _row_seqs(js: JetStreamContext) -> list[int]:
    """The seq of every rows message of the source in the stream (chunks aside: none here)."""
    sub = await js.subscribe(f"sluice.rows.{token(SOURCE)}.{token(DB)}.*", stream=ROWS_STREAM,
                             ordered_consumer=True)
    info = await js.stream_info(ROWS_STREAM)
    seqs: list[int] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=2)
            except TimeoutError:
                break
            decoded = REGISTRY.decode(msg.data)
            assert isinstance(decoded.event, RowsChangedV2)
            # Every transaction part of a message (several in a rows.changed v4 message).
            seqs.extend(part.seq for _, part in parts_of(decoded.event, decoded.envelope.id))
            if msg.metadata.sequence.stream >= info.state.last_seq:
                break
    finally:
        await sub.unsubscribe()
    return seqs


def _cli(api: ServiceProcess, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli_app, ["--url", api.base_url, "--token", TOKEN, *args],
                                env={"COLUMNS": "400"})
    return result.exit_code, result.output


async def test_a_source_moves_to_its_promoted_replica_by_gtid_and_never_to_one_that_lagged(
    js: JetStreamContext, service_env: dict[str, str], tmp_path: Path,
    mariadb_factory: Callable[..., MariaDB], postgres: PostgreSQL, processes: list[ServiceProcess],
) -> None:
    primary = mariadb_factory(extra_args=GTID_ARGS)
    promoted = mariadb_factory(extra_args=GTID_ARGS)
    lagging = mariadb_factory(extra_args=GTID_ARGS)
    primary.execute(f"CREATE USER 'repl'@'%' IDENTIFIED BY '{CANARY}'",  # replicated, like all below
                    "GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO 'repl'@'%'")
    for replica in (promoted, lagging):
        replica.replicate_from(primary)
    logs = tmp_path / "logs"
    down = mariadb_factory()
    sinks = {"sqlite": f"sqlite:///{tmp_path / 'down.db'}", "postgres": postgres.url, "mariadb": down.url}
    service_env = {**service_env, **SECRET_ENV}
    api_proc = ServiceProcess("services.api", {**service_env, "SLUICE_API_TOKEN": TOKEN,
                                               "SLUICE_API_TOKENS": f"vic:viewer:{VIEWER}"}, logs,
                              instance_id="api-fo").start()
    processes.append(api_proc)
    api_proc.wait_ready(60)  # healthy is not enough: until its read models are rebuilt it answers 503
    client = httpx.AsyncClient(base_url=api_proc.base_url, headers={"Authorization": f"Bearer {TOKEN}"},
                               timeout=30)

    added = await client.post("/api/v1/sources", json={"id": SOURCE, "url": _url(primary)})
    assert added.status_code == 202, added.text
    assert added.json()["warnings"] == []  # MariaDB: GTIDs to fail over with
    # Capture with its source id only: it follows the registry, so `set-url` reaches it.
    capture = ServiceProcess("services.capture", {**service_env, "SLUICE_SOURCE_ID": SOURCE,
                                                  "SLUICE_SOURCE_SERVER_ID": "4690"},
                             logs, instance_id="capture-fo").start()
    processes.append(capture)
    capture.wait_healthy(60)
    # Everything, the tables' creation included, reaches the downstream through the binlog.
    primary.execute(f"CREATE DATABASE {DB}",
                    f"CREATE TABLE {DB}.acct (id INT PRIMARY KEY, balance INT NOT NULL, note VARCHAR(40))",
                    f"CREATE TABLE {DB}.moves (id INT PRIMARY KEY, src INT, dst INT, amount INT)",
                    f"INSERT INTO {DB}.acct VALUES "
                    + ", ".join(f"({i}, 1000, 'a{i}')" for i in range(1, 21)))
    specs = [ChangefeedSpecV2(id=f"fo-{kind}", sources=[SourceRefV1(id=SOURCE, url=_url(primary))],
                              filter=TableFilterV1(include=[f"{DB}.*"]), sink_url=url,
                              initial_load="binlog-only") for kind, url in sinks.items()]
    for spec in specs:
        await record_changefeed(js, spec, requested_by="test")
        _created.append(spec.id)
    worker = _worker(service_env, logs, "worker-fo")
    processes.append(worker)
    worker.wait_healthy(60)

    # --- Writes under load; the lagging replica stops applying part way.
    writer = Writer(primary, 1).start()
    await asyncio.to_thread(_wait, "150 transactions", lambda: writer.done >= 150, [capture])
    await asyncio.to_thread(lagging.execute, "STOP SLAVE")
    await asyncio.to_thread(_wait, "300 transactions", lambda: writer.done >= 300, [capture])
    writer.stop()
    # The stream holds every transaction of the primary (the last mark names its GTID position);
    # the promoted replica has them all too, the lagging one not.
    final = await asyncio.to_thread(_gtid_pos, primary)
    deadline = time.monotonic() + 30
    while await _mark_gtid(js) != final:
        assert time.monotonic() < deadline, f"no mark reached {final}: {await _mark_gtid(js)}"
        await asyncio.sleep(0.1)
    await asyncio.to_thread(_caught_up, promoted, primary)
    primary.kill()  # SIGKILL
    await asyncio.to_thread(promoted.execute, "STOP SLAVE", "RESET SLAVE ALL")
    await asyncio.to_thread(lagging.execute, "RESET SLAVE ALL")

    # --- Only an operator moves a source.
    path, move = f"/api/v1/sources/{SOURCE}/url", {"url": _url(promoted)}
    async with httpx.AsyncClient(base_url=api_proc.base_url, timeout=30) as anonymous:
        assert (await anonymous.put(path, json=move)).status_code == 401
        viewer = await anonymous.put(path, json=move, headers={"Authorization": f"Bearer {VIEWER}"})
        assert viewer.status_code == 403

    # --- The lagging replica: refused by the api, with the transactions it lacks.
    refused = await client.put(path, json={"url": _url(lagging)})
    assert refused.status_code == 409, refused.text
    assert "lacks" in refused.json()["detail"] and final in refused.json()["detail"]
    code, out = await asyncio.to_thread(_cli, api_proc, "source", "set-url", SOURCE, _url(lagging))
    assert code == 1 and "409" in out and "lacks" in out
    said = [refused.text, out]
    # Recorded behind the api's back, capture refuses it itself and says why.
    await record_source_moved(js, SOURCE, _url(lagging), "test", reason="forced by the test")

    def capture_refuses() -> bool:
        health = capture.health() or {}
        return health.get("state") == "refused" and "lacks" in str(health.get("problem"))

    await asyncio.to_thread(_wait, "capture refusing the lagging replica", capture_refuses, [capture])

    # --- The promoted replica: accepted; writes go on there; capture continues by GTID.
    code, out = await asyncio.to_thread(_cli, api_proc, "source", "set-url", SOURCE, _url(promoted))
    assert code == 0 and "moved" in out, out
    said.append(out)
    writer = Writer(promoted, 100_000).start()
    await asyncio.to_thread(_wait, "writes on the promoted replica", lambda: writer.done >= 150, [capture])
    writer.stop()

    def verify() -> list[Verification]:
        return [verify_target([ShardRef(promoted.url, DB, t)], url, DB, t)
                for url in sinks.values() for t in TABLES]

    await asyncio.to_thread(wait_converged, verify, [capture, worker], 180)
    health: dict[str, Any] = capture.health() or {}
    assert health.get("state") == "reading" and not health.get("problem"), health
    for spec in specs:
        listed = (await client.get(f"/api/v1/changefeeds/{spec.id}")).json()
        assert f":{promoted.port}/" in str(listed["spec"]["sources"]), spec.id
        said.append(str(listed))
    for proc in (api_proc, capture, worker):
        said.append(proc.log_path.read_text(errors="replace"))
    assert not [text for text in said if CANARY in text], "the source's password was shown"
    seqs = await _row_seqs(js)
    assert sorted(seqs) == list(range(min(seqs), min(seqs) + len(seqs))), "a message published twice or lost"
    await client.aclose()
