"""Shard merge and pessimistic shard DDL with real processes: nats-server, 2 MariaDB sources
with capture, each with 2 schemas x 2 tables (8 shards) routed into one target, 2 replicas of
member, scheduler, replication-manager and ddl-lock, 3 sink-workers (Spark), SQLite downstream.

One system for the module; the tests run in file order, each leaving it healthy for the next.
A paced workload keeps writing to every shard that still exists. Each shard's ids live in its own
range, so the merged target keeps every shard's rows under their own keys.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from contracts import REGISTRY
from contracts.events.changefeeds import RouteRuleV1
from libs.localservers.service_process import ServiceProcess
from libs.localservers.system import LocalSystem
from libs.streams import command_subject, domain_events_subject, domain_stream
from services.sink_worker.validation.verify import ShardRef, verify_target
from tests.helpers.control_plane import eventually, leader_of
from tests.helpers.worker_env import MEMBER_WORKER_ENV

pytestmark = pytest.mark.integration

CF = "merge"
SCHEMAS = ("shard_a", "shard_b")
TABLES = ("orders_1", "orders_2")
TARGET = ("merged", "orders")
WORKER_MODULE = "tests.helpers.shard_ddl_worker"


class ShardWorkload:
    """Paced transactions over every shard; a shard's inserts fill the columns its DDLs added."""

    def __init__(self, conns: list[Any]) -> None:
        self.conns = conns
        self.shards = [(i, s, t) for i in range(len(conns)) for s in SCHEMAS for t in TABLES]
        self.rng = random.Random(7)
        self.ids: dict[tuple[int, str, str], list[int]] = {k: [] for k in self.shards}
        self.next_id = {k: n * 1_000_000 for n, k in enumerate(self.shards)}
        self.added: dict[tuple[int, str, str], list[str]] = {k: [] for k in self.shards}
        self.gone: set[tuple[int, str, str]] = set()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def create(self) -> None:
        for i, conn in enumerate(self.conns):
            with conn.cursor() as cur:
                for s in SCHEMAS:
                    cur.execute(f"CREATE DATABASE IF NOT EXISTS `{s}`")
                    for t in TABLES:
                        cur.execute(f"CREATE TABLE IF NOT EXISTS `{s}`.`{t}` (id BIGINT PRIMARY KEY, "
                                    "v INT NOT NULL, label VARCHAR(40) NULL)")
            del i

    def write(self, shard: tuple[int, str, str]) -> None:
        i, s, t = shard
        rng = self.rng
        ids = self.ids[shard]
        with self.conns[i].cursor() as cur:
            roll = rng.random()
            if roll < 0.6 or len(ids) < 4:
                self.next_id[shard] += 1
                new = self.next_id[shard]
                cols = ["id", "v", "label", *self.added[shard]]
                values = [new, rng.randrange(1000), rng.choice([None, "x", "ü"]),
                          *(f"{c}-{new}" for c in self.added[shard])]
                cur.execute(f"INSERT INTO `{s}`.`{t}` ({', '.join(cols)}) VALUES "
                            f"({', '.join(['%s'] * len(cols))})", values)
                ids.append(new)
            elif roll < 0.9:
                cur.execute(f"UPDATE `{s}`.`{t}` SET v = v + 1 WHERE id = %s", (rng.choice(ids),))
            else:
                victim = ids.pop(rng.randrange(len(ids)))
                cur.execute(f"DELETE FROM `{s}`.`{t}` WHERE id = %s", (victim,))

    def round(self) -> None:
        with self.lock:
            for shard in self.shards:
                if shard not in self.gone:
                    self.write(shard)

    def ddl(self, shard: tuple[int, str, str], statement: str, column: str | None = None) -> None:
        i, s, t = shard
        with self.lock, self.conns[i].cursor() as cur:
            cur.execute(statement.format(table=f"`{s}`.`{t}`"))
            if column is not None:
                self.added[shard].append(column)
            if statement.upper().startswith("DROP"):
                self.gone.add(shard)

    def start(self, per_second: float) -> None:
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                self.round()
                self._stop.wait(1.0 / per_second)  # pacing, not synchronisation

        self._thread = threading.Thread(target=loop, name="shard-workload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


class Merge:
    def __init__(self, system: LocalSystem, workload: ShardWorkload, nc: Client, crash_marker: Path) -> None:
        self.system = system
        self.workload = workload
        self.nc = nc
        self.crash_marker = crash_marker

    def diagnostics(self) -> str:
        lines = []
        for name, proc in self.system.processes.items():
            if name.startswith(("ddl-lock", "sink-worker")):
                h = proc.health() if proc.alive() else None
                state = (h or {}).get("ddl_locks") or [
                    (s["span"], s["state"], s.get("error")) for s in (h or {}).get("spans", [])]
                lines.append(f"--- {name}: {'down' if h is None else state}\n{proc.tail_log(5)}")
        return "\n".join(lines)

    async def wait(self, check: Any, within: float, what: str) -> Any:
        return await eventually(check, within, what, interval=0.3, diagnostics=self.diagnostics)

    async def command(self, body: dict[str, Any]) -> dict[str, Any]:
        msg = await self.nc.request(command_subject("ddl"), json.dumps(body).encode(), timeout=10)
        answer: dict[str, Any] = json.loads(msg.data)
        return answer

    async def locks(self) -> list[dict[str, Any]]:
        try:
            answer = await self.command({"action": "list"})
        except Exception:
            return [{"state": "no leader"}]
        return list(answer["locks"])

    async def no_locks(self) -> bool:
        return await self.locks() == []

    async def ddl_events(self) -> list[tuple[str, dict[str, Any]]]:
        js = self.nc.jetstream()
        try:
            info = await js.stream_info(domain_stream("ddl"))
        except NotFoundError:
            return []
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                raw = await js.get_msg(domain_stream("ddl"), seq)
            except NotFoundError:
                continue
            if raw.subject != domain_events_subject("ddl"):
                continue
            env = REGISTRY.decode(raw.data or b"").envelope
            out.append((env.type, env.data))
        return out

    def target_columns(self) -> list[str]:
        path = self.system.sink_url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as db:
            return [r[1] for r in db.execute(f"PRAGMA table_info({TARGET[1]})")]

    def target_has(self, column: str) -> bool:
        try:
            return column in self.target_columns()
        except sqlite3.Error:
            return False

    def target_ids(self) -> set[int]:
        path = self.system.sink_url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as db:
            return {r[0] for r in db.execute(f"SELECT id FROM {TARGET[1]}")}

    def shard_refs(self) -> list[ShardRef]:
        return [ShardRef(self.system.source_dbs[i].url, s, t) for (i, s, t) in self.workload.shards
                if (i, s, t) not in self.workload.gone]

    async def converged(self) -> bool:
        """Downstream equals the merge of the shards (workload paused by the caller)."""
        try:
            result = await asyncio.to_thread(verify_target, self.shard_refs(), self.system.sink_url, *TARGET)
        except Exception:
            return False
        return result.ok

    def worker_logs(self) -> str:
        return "\n".join(p.log_path.read_text(errors="replace") for n, p in self.system.processes.items()
                         if n.startswith("sink-worker") and p.log_path.exists())

    def execs_logged(self, statement_part: str) -> int:
        pattern = re.compile(r'"shard DDL carried out".*"kind": "exec"')
        return sum(1 for line in self.worker_logs().splitlines()
                   if pattern.search(line) and statement_part in line)

    def start_worker(self, n: int) -> ServiceProcess:
        env = {"SLUICE_SINK_STANDALONE": "false", **self.system.worker_env,
               "SHARD_DDL_CRASH_MARKER": str(self.crash_marker)}
        return self.system._start(f"sink-worker-{n}", WORKER_MODULE, env)

    async def alter_all(self, statement: str, column: str | None, gap_s: float = 0.0) -> None:
        for shard in self.workload.shards:
            if shard in self.workload.gone:
                continue
            await asyncio.to_thread(self.workload.ddl, shard, statement, column)
            if gap_s:
                await asyncio.sleep(gap_s)  # pacing of the rollout, not synchronisation


@pytest.fixture(scope="module")
async def merge(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Merge]:
    base = tmp_path_factory.mktemp("shard-ddl")
    system = LocalSystem(
        base_dir=base, sources=2, control_replicas=2, workers=0, lease_ttl_s=3.0, with_api=False,
        control_services=("member", "scheduler", "replication_manager", "ddl_lock"), standalone_workers=False,
        control_env={"SLUICE_REPLICATION_TICK_S": "1", "SLUICE_DDL_LOCK_RESEND_S": "3",
                     "SLUICE_DDL_LOCK_DISCOVERY_INTERVAL_S": "1"},
        worker_env={**MEMBER_WORKER_ENV,
                    "SLUICE_SHARD_DDL_INFO_RESEND_S": "2", "SLUICE_SINK_DISCOVERY_INTERVAL_S": "1"},
    )
    workload: ShardWorkload | None = None
    nc: Client | None = None
    try:
        system.start_infra()
        assert system.nats is not None
        workload = ShardWorkload([db.connect() for db in system.source_dbs])
        workload.create()
        system.start_services()
        crash_marker = base / "crash-after-exec"
        nc = await nats.connect(system.nats.url)
        m = Merge(system, workload, nc, crash_marker)
        for n in (1, 2, 3):
            m.start_worker(n)
        await asyncio.to_thread(system.wait_healthy, 120)
        spec = system.changefeed_spec(CF, include=[f"{s}.*" for s in SCHEMAS]).model_copy(update={"routes": [
            RouteRuleV1(database="shard_*", table="orders_*", target_schema=TARGET[0], target_table=TARGET[1],
                        name="orders")]})
        await system.create_changefeed(spec)
        workload.round()  # every shard gets a subject in the ROWS stream: a span
        workload.start(per_second=3)
        yield m
    finally:
        if workload is not None:
            workload.stop()
        if nc is not None:
            await nc.close()
        for name, proc in system.processes.items():
            if name.startswith("sink-worker"):
                proc.kill()
        system.stop()


async def test_every_shard_merges_into_the_routed_target(merge: Merge) -> None:
    def every_shard_there() -> bool:
        try:
            ids = merge.target_ids()
        except sqlite3.Error:
            return False
        return {i // 1_000_000 for i in ids} == set(range(len(merge.workload.shards)))

    await merge.wait(every_shard_there, 240, "rows of every shard merged into the target")
    path = merge.system.sink_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert TARGET[1] in tables and not tables & set(TABLES)  # routed: no per-shard tables


async def test_add_column_rollout_under_load_applies_once(merge: Merge) -> None:
    await merge.alter_all("ALTER TABLE {table} ADD COLUMN note VARCHAR(40) NULL", "note", gap_s=0.4)
    await merge.wait(lambda: merge.target_has("note"), 90, "the target to gain the column")
    await merge.wait(merge.no_locks, 60, "the lock to resolve")
    events = await merge.ddl_events()
    execs = _execs(events, "note ")
    skips = [d for t, d in events if t == "shard_ddl.operation_issued" and d["kind"] == "skip"]
    resolved = [d for t, d in events if t == "shard_ddl.lock_resolved"]
    assert len(execs) == 1
    assert "`merged`.`orders`" in execs[0]["ddls"][0]  # rewritten to the target
    assert len(skips) == 7 and len(resolved) == 1 and len(resolved[0]["settled"]) == 8
    assert merge.execs_logged("note") == 1
    merge.workload.stop()
    await merge.wait(merge.converged, 90, "downstream to equal the merged upstream")
    merge.workload.start(per_second=3)


async def test_ddls_capture_reads_behind_each_other_still_reach_the_target(merge: Merge) -> None:
    """Captures paused across two DDLs of every shard: the first one's shape is never read from
    the catalog (already past the second), so it travels without metadata; the target still
    takes both and ends equal to the merge."""
    captures = [p for name, p in merge.system.processes.items() if name.startswith("capture")]
    assert captures
    for p in captures:
        p.pause()
    try:
        await merge.alter_all("ALTER TABLE {table} ADD COLUMN lag1 VARCHAR(40) NULL", "lag1")
        await merge.alter_all("ALTER TABLE {table} ADD COLUMN lag2 VARCHAR(40) NULL", "lag2")
    finally:
        for p in captures:
            p.resume()
    await merge.wait(lambda: merge.target_has("lag1") and merge.target_has("lag2"), 150,
                     "the target to gain both columns")
    await merge.wait(merge.no_locks, 90, "both locks to resolve")
    assert "shard DDL without table metadata" in merge.worker_logs(), "the case this test is for"
    merge.workload.stop()
    await merge.wait(merge.converged, 90, "downstream to equal the merged upstream")
    merge.workload.start(per_second=3)


def _execs(events: list[tuple[str, dict[str, Any]]], column: str) -> list[dict[str, Any]]:
    return [d for t, d in events
            if t == "shard_ddl.operation_issued" and d["kind"] == "exec" and column in d["ddls"][0]]


async def test_ddl_lock_leader_killed_while_the_exec_is_in_flight(merge: Merge) -> None:
    await merge.wait(merge.no_locks, 90, "no lock left from before")
    before = len(await merge.ddl_events())
    await merge.alter_all("ALTER TABLE {table} ADD COLUMN note2 VARCHAR(40) NULL", "note2")

    async def exec_issued() -> bool:
        return bool(_execs((await merge.ddl_events())[before:], "note2"))

    await merge.wait(exec_issued, 90, "the exec operation")
    leader = await leader_of(merge.system, "ddl-lock")
    assert leader is not None
    leader.kill()
    await merge.wait(lambda: merge.target_has("note2"), 90, "the target to gain note2")
    await merge.wait(merge.no_locks, 90, "a new leader to resolve the lock")
    events = (await merge.ddl_events())[before:]
    assert len(_execs(events, "note2")) == 1
    assert sum(1 for t, _ in events if t == "leader.elected") >= 1
    assert merge.execs_logged("note2") == 1  # re-sent exec answered with its done, not run again
    new = merge.system.start_control("ddl_lock", int(leader.instance_id.rsplit("-", 1)[1]))
    await asyncio.to_thread(new.wait_healthy, 60)


async def test_owner_worker_killed_between_exec_and_done(merge: Merge) -> None:
    await merge.wait(merge.no_locks, 90, "no lock left from before")
    merge.crash_marker.write_text("armed")
    workers_before = {n for n, p in merge.system.processes.items()
                      if n.startswith("sink-worker") and p.alive()}
    await merge.alter_all("ALTER TABLE {table} ADD COLUMN note3 VARCHAR(40) NULL", "note3")
    await merge.wait(lambda: not merge.crash_marker.exists(), 90, "the owner to execute and die")
    await merge.wait(lambda: merge.target_has("note3"), 30, "the target to have note3")
    await merge.wait(merge.no_locks, 150, "the lock to resolve after the owner's span moved")
    dead = [n for n in workers_before if not merge.system.processes[n].alive()]
    assert len(dead) == 1
    events = await merge.ddl_events()
    created = [d for t, d in events if t == "shard_ddl.lock_created" and "note3" in d["ddls"][0]]
    resolved = [d for t, d in events if t == "shard_ddl.lock_resolved"]
    assert created and resolved
    n = int(dead[0].rsplit("-", 1)[1])
    proc = merge.start_worker(n)
    await asyncio.to_thread(proc.wait_healthy, 90)


async def test_conflicting_ddls_show_a_conflict_until_unlocked_with_skip(merge: Merge) -> None:
    shards = [s for s in merge.workload.shards if s not in merge.workload.gone]
    for k, shard in enumerate(shards):
        name = "ix_v" if k % 2 == 0 else "ix_value"
        await asyncio.to_thread(merge.workload.ddl, shard, f"ALTER TABLE {{table}} ADD INDEX {name} (v)")

    async def conflict() -> dict[str, Any] | None:
        # The operator decides once every shard waits at its DDL: a shard arriving after the
        # decision with a DDL unlike the lock's is a new conflict to look at.
        locks = await merge.locks()
        return next((lk for lk in locks if lk.get("state") == "conflict"
                     and all(sh["state"] == "blocked" for sh in lk["shards"])
                     and len(lk["shards"]) == len(shards)), None)

    lock = await merge.wait(conflict, 90, "the lock to show the conflict with every shard waiting")
    assert lock["conflict"] is not None and len(lock["conflict"]["statements"]) == 2
    bad = await merge.command({"action": "unlock", "changefeed": CF, "target": "merged.orders",
                               "mode": "skip", "requested_by": "", "reason": ""})
    assert bad["ok"] is False and bad["code"] == 422
    missing = await merge.command({"action": "show", "changefeed": CF, "target": "merged.nothing"})
    assert missing == {"ok": False, "code": 404, "error": missing["error"]}
    answer = await merge.command({"action": "unlock", "changefeed": CF, "target": "merged.orders",
                                  "mode": "skip", "owner": None, "requested_by": "test@ops",
                                  "reason": "index names differ; the target needs none"})
    assert answer["ok"] is True, answer
    await merge.wait(merge.no_locks, 90, "the lock to resolve after the skip")
    events = await merge.ddl_events()
    unlocked = [d for t, d in events if t == "shard_ddl.unlocked"]
    assert unlocked and unlocked[-1]["by"] == "test@ops" and unlocked[-1]["mode"] == "skip"
    # Replication resumed on every shard: rows inserted after the unlock reach the target.
    marks = {shard: merge.workload.next_id[shard] for shard in shards}

    def resumed() -> bool:
        ids = merge.target_ids()
        # Shard n's ids are n * 1_000_000 + k: a new one lies above the mark, in the same million.
        return all(any(mark < i <= (mark // 1_000_000 + 1) * 1_000_000 for i in ids)
                   for mark in marks.values())

    await merge.wait(resumed, 90, "rows inserted after the unlock on every shard")


async def test_a_shard_dropped_while_the_lock_waits_resolves_with_the_rest(merge: Merge) -> None:
    shards = [s for s in merge.workload.shards if s not in merge.workload.gone]
    dropped, rest = shards[-1], shards[:-1]
    for shard in rest:
        await asyncio.to_thread(merge.workload.ddl, shard,
                                "ALTER TABLE {table} ADD COLUMN note4 VARCHAR(40) NULL", "note4")

    async def waiting() -> bool:
        locks = await merge.locks()
        return any(lk.get("state") == "waiting" and "note4" in lk["ddls"][0] for lk in locks)

    await merge.wait(waiting, 90, "the lock to wait for the last shard")
    await asyncio.to_thread(merge.workload.ddl, dropped, "DROP TABLE {table}")
    await merge.wait(merge.no_locks, 90, "the lock to resolve without the dropped shard")
    await merge.wait(lambda: merge.target_has("note4"), 30, "the target to gain note4")
    merge.workload.stop()
    # The merged target keeps the dropped shard's rows; the other shards must match exactly.
    refs = merge.shard_refs()

    lo = merge.workload.shards.index(dropped) * 1_000_000

    def rest_converged() -> bool:
        diff = verify_target(refs, merge.system.sink_url, *TARGET).diff
        # The merged target keeps the dropped shard's rows (its id range); nothing else differs.
        return (not diff.missing and not diff.different and not diff.duplicate_keys
                and all(lo < int(k[0]) <= lo + 1_000_000 for k in diff.extra))

    await merge.wait(lambda: asyncio.to_thread(rest_converged), 90, "the other shards to converge")
