"""A running api for the api, fuzz and CLI tests: a private nats-server (so changefeeds the
tests create never reach other tests' streams), the api and a scheduler as real processes,
control-domain events written by the test as their leaders would, and a ddl-lock responder
that answers ``sluice.cmd.ddl`` with the lock protocol (a test peer on the real server).

Async peers run on a background event loop so the tests themselves can be plain functions
driving the api over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from contracts import REGISTRY
from contracts.events.leadership import LeaderElectedV1
from contracts.events.members import MemberJoinedV2
from contracts.events.rows import ResolvedAdvancedV1, SourcePositionV1
from contracts.events.scheduling import CheckpointAdvancedV1, RebuiltV1, SetChangedV1, SpanRefV1
from libs.eventstore import DomainLog, EventStore
from libs.localservers.common import wait_until
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.localservers.service_process import ServiceProcess
from libs.nats_auth import SINK_WORKER
from libs.scheduling.model import Span as WorkerSpan
from libs.streams import (
    CHECKPOINT_BUCKET,
    ROWS_STREAM,
    ROWS_SUBJECTS,
    SNAPSHOT_BUCKET,
    command_subject,
    domain_events_subject,
    resolved_subject,
    rows_subject,
)

T = TypeVar("T")
TOKEN = "test-token-7f3a9c"
VIEWER_TOKEN = "viewer-token-2b8e41"
ALICE_TOKEN = "alice-token-90d1c7"
# The source user's password: given to the api only as the secret "src-pw"; the secrets test
# greps every stream, answer and log for it.
CANARY = "canary-pw-5d1f0e7a93"
SECRET = "src-pw"
CF = "orders"
# ts of 10 s ago: physical ms << 18.


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class DdlResponder:
    """The ddl-lock leader's request/reply protocol over a fixed set of locks."""

    locks: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    sub: Subscription | None = None

    async def start(self, nc: Client) -> None:
        self.sub = await nc.subscribe(command_subject("ddl"), cb=self._on)

    async def stop(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
            self.sub = None

    async def _on(self, msg: Msg) -> None:
        req = REGISTRY.decode(msg.data).event.model_dump()  # a shard_ddl.command
        self.requests.append(req)
        key = (req.get("changefeed"), req.get("target"))
        action = req.get("action")
        if action == "list":
            answer: dict[str, Any] = {"ok": True, "locks": list(self.locks.values())}
        elif key not in self.locks:
            answer = {"ok": False, "code": 404, "error": f"no lock for {key[1]} in {key[0]}"}
        elif action == "show":
            answer = {"ok": True, "lock": self.locks[key]}
        elif action == "unlock" and self.locks[key]["state"] != "error":
            answer = {"ok": False, "code": 409, "error": "the lock is not in error; nothing to unlock"}
        elif action in ("unlock", "force_remove"):
            self.locks.pop(key)
            answer = {"ok": True}
        else:
            answer = {"ok": False, "code": 422, "error": f"unknown action {action!r}"}
        await msg.respond(json.dumps(answer).encode())


def lock_view(changefeed: str, target: str, state: str) -> dict[str, Any]:
    return {"changefeed": changefeed, "target": target, "state": state, "owner": None,
            "ddls": ["ALTER TABLE t ADD c INT"], "conflict": "shards sent different DDL" if state == "error"
            else None, "error": None, "created_at": "2026-01-01T00:00:00Z",
            "shards": [{"span": f"{changefeed}/src1/shop.t", "state": "waiting", "ddls": []}]}


@dataclass
class ApiStack:
    nats: NatsServer
    api: ServiceProcess
    scheduler: ServiceProcess
    bg: BackgroundLoop
    nc: Client
    ddl: DdlResponder
    tmp: Path
    env: dict[str, str]
    source: MariaDB
    responses: list[str] = field(default_factory=list)
    """Every api answer the tests' clients received (the secrets test greps them)."""
    w2_incarnations: int = 0
    ts: int = 0
    """The ts the scenario was last stamped with (``seed_scenario``): 10 s before that moment."""

    @property
    def source_url(self) -> str:
        """The test source as a changefeed names it: its password is a secret reference."""
        return f"mysql://repl:secret:{SECRET}@127.0.0.1:{self.source.port}/"

    @property
    def url(self) -> str:
        return self.api.base_url

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}

        def keep(resp: httpx.Response) -> None:
            if "text/event-stream" not in resp.headers.get("content-type", ""):
                resp.read()
                self.responses.append(resp.text)

        return httpx.Client(base_url=self.url, headers=headers, timeout=30,
                            event_hooks={"response": [keep]})

    def append(self, domain: str, *events: Any, subject: str | None = None) -> int:
        async def go() -> int:
            store = EventStore(self.nc.jetstream(), f"SLUICE_{domain.upper()}", producer="test-peer")
            seq = 0
            for ev in events:
                seq = await store.append(subject or domain_events_subject(domain), ev)
            return seq

        return self.bg.run(go())

    def seed_scenario(self) -> int:
        """The scenario the read tests assert, stamped now (its ts is 10 s ago), so what they see
        depends neither on when the session's stack started nor on what earlier tests changed:
        tables a and b replicating on w1 and c prepared on w2, the changefeed's checkpoint and
        src1's resolved mark at ts, table a's checkpoint (seq 42, ts + 1) and its initial load
        copying 500/1000, members w1 and w2 ready and not draining (w2 rejoins as a new
        incarnation, which no earlier drain names). Returns ts once the api's read model and the
        scheduler show it."""
        ts = self.ts = stamp()
        self.w2_incarnations += 1
        w2 = f"i2-{self.w2_incarnations}"

        async def resolved() -> None:
            await EventStore(self.nc.jetstream(), ROWS_STREAM, producer="test-peer").append(
                resolved_subject("src1"), ResolvedAdvancedV1(
                    source="src1", ts=ts, position=SourcePositionV1(binlog_file="bin.000001", binlog_pos=4)))

        self.bg.run(resolved())
        self.append("members", *scenario_members(w2))
        self.append("replication", *scenario_sets(ts),
                    RebuiltV1(members={"w1": "i1", "w2": w2}, sets=3, waited_s=0.1),
                    CheckpointAdvancedV1(changefeed=CF, checkpoint_ts=ts, resolved_ts=ts))
        key = WorkerSpan(CF, "src1", "shop", "a").kv_key
        self.kv_put(CHECKPOINT_BUCKET, key, {"stream_seq": 42, "ts": ts + 1})
        self.kv_put(SNAPSHOT_BUCKET, key, SNAPSHOT_COPYING)
        with self.client() as c:
            def shown() -> bool:
                tables = {t["table"]: t for t in c.get(f"/api/v1/changefeeds/{CF}/tables").json()}
                cf = c.get(f"/api/v1/changefeeds/{CF}").json()
                src = next((s for s in c.get("/api/v1/sources").json() if s["id"] == "src1"), {})
                return (cf["checkpoint_ts"] == ts and src.get("resolved_ts") == ts
                        and tables["a"]["checkpoint_ts"] == ts + 1
                        and (tables["a"]["snapshot"] or {}).get("rows_copied") == 500
                        and (tables["c"]["state"], tables["c"]["secondary"]) == ("prepare", "w2")
                        and tables["a"]["primary"] == tables["b"]["primary"] == "w1"
                        and not any(m["draining"] for m in c.get("/api/v1/members").json()))

            wait_until(shown, 30, "the api to show the scenario stamped now")

        def scheduler_sees_it() -> bool:
            sched = (self.scheduler.health() or {}).get("scheduling", {})
            return bool(sched.get("replication_ready")) and len(sched.get("usable_members", [])) == 2

        wait_until(scheduler_sees_it, 30, "the scheduler to see both members usable")
        return ts

    def kv_put(self, bucket: str, key: str, value: dict[str, Any]) -> None:
        async def go() -> None:
            js = self.nc.jetstream()
            try:
                kv = await js.key_value(bucket)
            except Exception:
                kv = await js.create_key_value(api.KeyValueConfig(bucket=bucket, history=1))
            await kv.put(key, json.dumps(value).encode())

        self.bg.run(go())


def stamp() -> int:
    """A ts 10 s before now: the scenario's checkpoints and resolved mark."""
    return int((time.time() - 10) * 1000) << 18


SNAPSHOT_COPYING = {"changefeed": CF, "source": "src1", "database": "shop", "table": "a", "state": "copying",
                    "rows_copied": 500, "rows_estimate": 1000, "chunks_done": 5, "chunks_total": 10,
                    "rows_per_s": 2500.0, "eta_s": 125.0}


def scenario_members(w2_incarnation: str = "i2") -> list[MemberJoinedV2]:
    return [MemberJoinedV2(member_id="w1", incarnation="i1", address="10.0.0.1"),
            MemberJoinedV2(member_id="w2", incarnation=w2_incarnation, address="10.0.0.2")]


def scenario_sets(ts: int) -> list[SetChangedV1]:
    return [SetChangedV1(span=span_ref("a"), state="replicating", primary="w1",
                         members={"w1": "primary"}, checkpoint_ts=ts, resolved_ts=ts),
            SetChangedV1(span=span_ref("b"), state="replicating", primary="w1",
                         members={"w1": "primary"}, checkpoint_ts=ts, resolved_ts=ts),
            SetChangedV1(span=span_ref("c"), state="prepare", primary="w1", secondary="w2",
                         members={"w1": "primary", "w2": "secondary"})]


def span_ref(table: str) -> SpanRefV1:
    return SpanRefV1(changefeed=CF, source="src1", database="shop", table=table)


def wait_ready(client: httpx.Client, timeout: float = 60) -> None:
    def ready() -> bool:
        try:
            return client.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout, "api ready", interval=0.1)


@pytest.fixture(scope="session")
def api_stack(tmp_path_factory: pytest.TempPathFactory, mariadb: MariaDB) -> Iterator[ApiStack]:
    tmp = tmp_path_factory.mktemp("api")
    # The source the changefeeds name: a replication user with a password, and the tables the
    # tests' routes and filters expect.
    mariadb.execute("CREATE USER IF NOT EXISTS 'repl'@'%' IDENTIFIED BY '" + CANARY + "'",
                    "GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO 'repl'@'%'",
                    "CREATE DATABASE IF NOT EXISTS shop", "CREATE DATABASE IF NOT EXISTS shop_1",
                    *(f"CREATE TABLE IF NOT EXISTS shop.{t} (id INT PRIMARY KEY)" for t in "abc"),
                    "CREATE TABLE IF NOT EXISTS shop_1.orders_1 (id INT PRIMARY KEY)")
    server = NatsServer(data_dir=tmp / "nats").start()
    bg = BackgroundLoop()
    nc: Client = bg.run(nats.connect(server.url))
    env = {"SLUICE_NATS_URL": server.url, "SLUICE_LEASE_TTL_S": "1.5", "SLUICE_LOG_JSON": "true",
           "SLUICE_STATE_DB_URL": f"sqlite:///{tmp / 'state.db'}", "SLUICE_API_TOKEN": TOKEN,
           "SLUICE_API_TOKENS": f"vic:viewer:{VIEWER_TOKEN},alice:operator:{ALICE_TOKEN}",
           "SLUICE_LOG_LEVEL": "DEBUG", "SLUICE_SECRET_SRC_PW": CANARY,
           # Where each secret may be sent: the source's own port only (the exfiltration test
           # listens on another port of 127.0.0.1); down-pw's host is a closed port.
           "SLUICE_SECRETS_HOSTS": (f"{SECRET}=127.0.0.1:{mariadb.port};down-pw=127.0.0.1;"
                                    "not-there=127.0.0.1;"
                                    f"nats-sink-pw={server.plain_url.split('://', 1)[1]}"),
           "SLUICE_SECRET_DOWN_PW": CANARY,
           # A NATS sink's user (the creation checks connect as it): the sink-worker's.
           "SLUICE_SECRET_NATS_SINK_PW": server.stack_auth.password(SINK_WORKER) if server.stack_auth else ""}

    ts = stamp()

    async def seed() -> None:
        js = nc.jetstream()
        for domain in ("members", "replication"):
            await DomainLog(js, domain, producer="test-peer").ensure()
        # Tables a, b, c of src1 exist in the ROWS stream (the scheduler discovers spans there)
        # and src1 has published up to ts.
        rows = EventStore(js, ROWS_STREAM, producer="test-peer")
        await rows.ensure(ROWS_SUBJECTS)
        for table in ("a", "b", "c"):
            await js.publish(rows_subject("src1", "shop", table), b"{}")
        await rows.append(resolved_subject("src1"), ResolvedAdvancedV1(
            source="src1", ts=ts, position=SourcePositionV1(binlog_file="bin.000001", binlog_pos=4)))

    bg.run(seed())
    ddl = DdlResponder({(CF, "shop.t"): lock_view(CF, "shop.t", "error"),
                        (CF, "shop.u"): lock_view(CF, "shop.u", "waiting")})
    bg.run(ddl.start(nc))
    api_proc = ServiceProcess("services.api", env, tmp / "logs").start()
    # No automatic balance: the tests move tables themselves and look at where they are.
    scheduler_env = {**{k: v for k, v in env.items() if not k.startswith("SLUICE_API_TOKEN")},
                     "SLUICE_SCHEDULER_BALANCE_INTERVAL_S": "3600"}
    scheduler = ServiceProcess("services.scheduler", scheduler_env, tmp / "logs").start()
    stack = ApiStack(server, api_proc, scheduler, bg, nc, ddl, tmp, env, mariadb, ts=ts)
    try:
        api_proc.wait_healthy(60)
        scheduler.wait_healthy(60)
        with stack.client() as c:
            wait_ready(c)
            spec = {"id": CF, "sources": [{"id": "src1", "url": stack.source_url}],
                    "sink_url": "sqlite:///orders.db", "initial_load": "binlog-only"}
            assert c.post("/api/v1/changefeeds", json=spec).status_code == 202

        # The scheduler must want the three spans before their replication sets appear: a set
        # of a span it does not want (yet) is one it removes.
        def scheduler_wants_them() -> bool:
            health = scheduler.health() or {}
            return int(health.get("scheduling", {}).get("wanted_spans", 0)) >= 3

        wait_until(scheduler_wants_them, 30, "the scheduler to want the changefeed's three spans")
        stack.append("members",
                     LeaderElectedV1(service="member", candidate="peer", epoch=1), *scenario_members())
        stack.append("replication",
                     LeaderElectedV1(service="replication-manager", candidate="peer", epoch=1),
                     *scenario_sets(ts),
                     RebuiltV1(members={"w1": "i1", "w2": "i2"}, sets=3, waited_s=0.1),
                     CheckpointAdvancedV1(changefeed=CF, checkpoint_ts=ts, resolved_ts=ts))
        key = WorkerSpan(CF, "src1", "shop", "a").kv_key
        stack.kv_put(CHECKPOINT_BUCKET, key, {"stream_seq": 42, "ts": ts + 1})
        stack.kv_put(SNAPSHOT_BUCKET, key, SNAPSHOT_COPYING)
        # The tests' commands go to the real scheduler: it must lead and have folded the seeded
        # replication state (ready, three sets, both members usable) or it refuses them.
        def scheduler_settled() -> bool:
            health = scheduler.health() or {}
            sched = health.get("scheduling", {})
            return (bool(health.get("leader")) and bool(sched.get("replication_ready"))
                    and int(sched.get("sets", 0)) == 3 and len(sched.get("usable_members", [])) == 2)

        wait_until(scheduler_settled, 30, "the scheduler to lead over the seeded replication state")
        with stack.client() as c:
            wait_until(lambda: len(c.get(f"/api/v1/changefeeds/{CF}/tables").json()) == 3, 30,
                       "tables in the read model")
            wait_until(lambda: len(c.get("/api/v1/members").json()) == 2, 30, "members in the read model")
        yield stack
    finally:
        # SIGTERM both at once: each has its own shutdown grace.
        for proc in (api_proc, scheduler):
            if proc.alive() and proc.proc is not None:
                proc.proc.terminate()
        for proc in (api_proc, scheduler):
            if proc.proc is not None and proc.proc.poll() is None:
                proc.terminate()
        bg.run(ddl.stop())
        bg.run(nc.drain())
        bg.stop()
        server.stop()
