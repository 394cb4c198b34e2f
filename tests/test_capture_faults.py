"""Capture as real processes: SIGKILL in the middle of a load, and lease failover between two."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from contracts.events.rows import RowsChangedV2
from libs.localservers.mariadb import MariaDB
from libs.localservers.service_process import ServiceProcess
from libs.streams import ROWS_STREAM, rows_subject
from tests.helpers.capture import (
    binlog_position,
    check_order,
    eventually,
    replay,
    rows_of,
    source_messages,
    wait_resolved_past,
)

pytestmark = pytest.mark.integration


def capture_env(service_env: dict[str, str], source: str, url: str, server_id: int) -> dict[str, str]:
    return {**service_env, "SLUICE_SOURCE_ID": source, "SLUICE_SOURCE_URL": url,
            "SLUICE_SOURCE_SERVER_ID": str(server_id)}


def start_capture(procs: list[ServiceProcess], env: dict[str, str], log_dir: Path,
                  name: str) -> ServiceProcess:
    proc = ServiceProcess("services.capture", env, log_dir, instance_id=name).start()
    procs.append(proc)
    proc.wait_healthy(timeout=60)
    return proc


def status(proc: ServiceProcess) -> dict[str, Any]:
    return proc.health() or {}


async def wait_status(proc: ServiceProcess, within: float, what: str, **expected: Any) -> None:
    async def matches() -> bool:
        if not proc.alive():
            raise AssertionError(f"{proc.instance_id} died:\n{proc.tail_log()}")
        current = await asyncio.to_thread(status, proc)
        return all(current.get(k) == v for k, v in expected.items())

    await eventually(matches, within, f"{proc.instance_id} {what}")


class Load(threading.Thread):
    """Transactions of inserts, updates and deletes on ``t`` (keys from ``offset``), on a thread
    of their own so a capture can be killed while it runs."""

    def __init__(self, db: MariaDB, database: str, txns: int, rows_per_txn: int, offset: int = 0) -> None:
        super().__init__(daemon=True)
        self.db, self.database, self.txns, self.rows_per_txn = db, database, txns, rows_per_txn
        self.offset = offset
        self.done_txns = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = self.db.connect(self.database)
            with conn.cursor() as cur:
                for t in range(self.txns):
                    base = self.offset + t * self.rows_per_txn
                    cur.execute("BEGIN")
                    cur.executemany("INSERT INTO t VALUES (%s, %s, %s)",
                                    [(base + i, f"v{base + i}", 0) for i in range(self.rows_per_txn)])
                    if t % 4 == 3:
                        cur.execute("UPDATE t SET n = n + 1, v = CONCAT(v, '+') WHERE id BETWEEN %s AND %s",
                                    (base - 2 * self.rows_per_txn, base - 1))
                        cur.execute("DELETE FROM t WHERE id = %s", (base - 3,))
                    cur.execute("COMMIT")
                    self.done_txns += 1
            conn.close()
        except BaseException as exc:
            self.error = exc


def source_table(db: MariaDB, database: str) -> dict[int, dict[str, Any]]:
    return {r[0]: {"id": r[0], "v": r[1], "n": r[2]}
            for r in db.execute("SELECT id, v, n FROM t", database=database)}


def reader_children(parent: int) -> list[int]:
    """The binlog reader child processes of ``parent``, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes()
        except OSError:  # ended while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"services.capture.reader_child" in argv:
            out.append(int(entry.name))
    return out


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a zombie holds no memory, socket or connection)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def check_exactly_once(messages: list[Any]) -> list[RowsChangedV2]:
    check_order(messages)
    ids = [m.id for m in messages]
    assert len(set(ids)) == len(ids), "a message is in the stream twice"
    rows = rows_of(messages)
    seqs = sorted(e.seq for e in rows)
    assert seqs == list(range(len(seqs))), "seq has a gap or a repeat"
    return rows


async def test_sigkill_mid_load_leaves_no_reader_and_loses_and_duplicates_nothing(
        mariadb: MariaDB, js: JetStreamContext, service_env: dict[str, str], tmp_path: Path,
        replica_server_id: int, processes: list[ServiceProcess]) -> None:
    source = database = "cap_kill"
    mariadb.execute(f"DROP DATABASE IF EXISTS {database}", f"CREATE DATABASE {database}")
    mariadb.execute("CREATE TABLE t (id INT PRIMARY KEY, v VARCHAR(40) NOT NULL, n INT NOT NULL)",
                    database=database)
    env = capture_env(service_env, source, mariadb.url_for(database), replica_server_id)
    first = start_capture(processes, env, tmp_path / "logs", "cap-kill-1")
    await wait_status(first, 30, "reading", state="reading", lease=True)

    txns = 1000
    load = Load(mariadb, database, txns=txns, rows_per_txn=5)  # 5000 rows, plus updates and deletes
    load.start()
    subject = rows_subject(source, database, "t")
    published: list[int] = []

    async def some_published() -> bool:
        info = await js.stream_info(ROWS_STREAM, subjects_filter=subject)
        published.append((info.state.subjects or {}).get(subject, 0))
        # Messages carry several transactions each (rows.changed v4): a few are a start.
        return published[-1] >= 3

    await eventually(some_published, 30, "the first messages of the load", interval=0.02)
    assert first.proc is not None
    children = reader_children(first.proc.pid)
    assert len(children) == 1 and running(children[0]), "capture reads through no child process"
    first.kill()
    # Killed before it had published every transaction (each is one part of one table).
    stored = [m for m in await source_messages(js, source) if isinstance(m.event, RowsChangedV2)]
    assert len(stored) < txns, "the capture had published everything before the kill"

    async def reader_gone() -> bool:
        return not running(children[0])

    # The kernel kills the child with capture (PR_SET_PDEATHSIG): no orphan keeps reading.
    await eventually(reader_gone, 10, "the killed capture's reader child to end", interval=0.02)
    second = start_capture(processes, env, tmp_path / "logs", "cap-kill-2")
    await asyncio.to_thread(load.join, 60)
    assert load.error is None and load.done_txns == txns
    await wait_resolved_past(js, source, binlog_position(mariadb), within=60)
    assert status(second)["lease"] is True

    rows = check_exactly_once(await source_messages(js, source))
    assert replay(rows, "t", "id") == source_table(mariadb, database)


async def test_two_captures_one_publishes_and_the_other_takes_over(
        mariadb: MariaDB, js: JetStreamContext, service_env: dict[str, str], tmp_path: Path,
        replica_server_id: int, processes: list[ServiceProcess]) -> None:
    source = database = "cap_lease"
    mariadb.execute(f"DROP DATABASE IF EXISTS {database}", f"CREATE DATABASE {database}")
    mariadb.execute("CREATE TABLE t (id INT PRIMARY KEY, v VARCHAR(40) NOT NULL, n INT NOT NULL)",
                    database=database)
    env = capture_env(service_env, source, mariadb.url_for(database), replica_server_id)
    a = start_capture(processes, env, tmp_path / "logs", "cap-lease-a")
    b = start_capture(processes, env, tmp_path / "logs", "cap-lease-b")

    async def one_leader() -> bool:
        states = [await asyncio.to_thread(status, p) for p in (a, b)]
        return sorted(bool(s.get("lease")) for s in states) == [False, True] and \
            any(s.get("state") == "reading" for s in states)

    await eventually(one_leader, 30, "exactly one capture holding the lease")
    leader, standby = (a, b) if status(a)["lease"] else (b, a)
    assert status(standby)["state"] == "standby"

    Load(mariadb, database, txns=20, rows_per_txn=5).run()
    await wait_resolved_past(js, source, binlog_position(mariadb))
    before = await source_messages(js, source)
    assert before and {m.headers.get("Nats-Msg-Id") for m in before} == {m.message_id for m in before}
    # Only the lease holder publishes.
    assert {m.producer for m in before} == {f"capture/{leader.instance_id}"}

    leader.kill()
    second = Load(mariadb, database, txns=20, rows_per_txn=5, offset=1000)
    second.run()  # while nobody holds the lease: the standby must pick these up
    assert second.error is None
    await wait_status(standby, 30, "taking over", lease=True, state="reading")
    await wait_resolved_past(js, source, binlog_position(mariadb))

    messages = await source_messages(js, source)
    rows = check_exactly_once(messages)
    assert replay(rows, "t", "id") == source_table(mariadb, database)
    assert {m.producer for m in messages} == {f"capture/{leader.instance_id}",
                                              f"capture/{standby.instance_id}"}
    health = status(standby)
    assert health["source"] == source and health["last_ts"] >= health["resolved_ts"] > 0
    assert health["position"].startswith("binlog.")
    metrics = await asyncio.to_thread(_get_text, standby.base_url + "/metrics")
    assert f'sluice_capture_rows_published_total{{source="{source}"}}' in metrics
    assert f'sluice_capture_resolved_timestamp_seconds{{source="{source}"}}' in metrics

    # A leader frozen past its lease (SIGSTOP: a long GC pause, a stalled VM) must, once it runs
    # again, stop instead of publishing next to its successor.
    third = start_capture(processes, env, tmp_path / "logs", "cap-lease-c")
    await wait_status(third, 30, "standing by", lease=False, state="standby")
    standby.pause()
    try:
        Load(mariadb, database, txns=20, rows_per_txn=5, offset=2000).run()
        await wait_status(third, 30, "taking over from a frozen leader", lease=True, state="reading")
    finally:
        standby.resume()
    await wait_status(standby, 30, "stepping down after the freeze", lease=False)
    Load(mariadb, database, txns=5, rows_per_txn=5, offset=3000).run()
    await wait_resolved_past(js, source, binlog_position(mariadb))
    messages = await source_messages(js, source)
    rows = check_exactly_once(messages)
    assert replay(rows, "t", "id") == source_table(mariadb, database)
    assert status(third)["lease"] is True


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())
