"""What the control-plane process tests watch and drive: the whole system as real processes
(``LocalSystem`` with the control plane on), a paced workload on several tables, and a
recorder of everything the replication-manager records (checkpoint advances, set changes,
rebuilds), every member event, and every dispatch and answer on the wire."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import REGISTRY, ContractError
from contracts.events.leadership import LeaderElectedV1
from contracts.events.members import MemberDrainingV1, MemberJoinedV2, MemberLeftV1
from contracts.events.scheduling import (
    CheckpointAdvancedV1,
    DispatchRequestV1,
    DispatchResponseV1,
    RebuiltV1,
    ScheduleRequestAnsweredV1,
    ScheduleRequestV1,
    SetChangedV1,
    SpanRefV1,
)
from libs.control.follow import DomainFollower
from libs.eventstore import StoredEvent
from libs.localservers.service_process import ServiceProcess
from libs.localservers.system import LocalSystem
from libs.streams import command_subject
from services.sink_worker.validation.verify import ShardRef, Verification, verify_target

TABLES = [f"t{i}" for i in range(8)]


class Workload:
    """Paced transactions over ``tables`` of one database: inserts, updates, deletes."""

    def __init__(self, conn: Any, db: str, seed: int = 4, tables: list[str] = TABLES) -> None:
        self.conn = conn
        self.db = db
        self.tables = list(tables)
        self.rng = random.Random(seed)
        self.ids: dict[str, list[int]] = {t: [] for t in self.tables}
        self.next_id = 0
        self.txns = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def create(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE IF NOT EXISTS `{self.db}`")
            for t in self.tables:
                cur.execute(f"CREATE TABLE IF NOT EXISTS `{self.db}`.`{t}` (id BIGINT PRIMARY KEY, "
                            "v INT NOT NULL, note VARCHAR(40) NULL)")

    def transaction(self) -> None:
        rng = self.rng
        with self.conn.cursor() as cur:
            cur.execute("BEGIN")
            for t in rng.sample(self.tables, 2):
                ids = self.ids[t]
                roll = rng.random()
                if roll < 0.6 or len(ids) < 5:
                    self.next_id += 1
                    cur.execute(f"INSERT INTO `{self.db}`.`{t}` VALUES (%s, %s, %s)",
                                (self.next_id, rng.randrange(1000), rng.choice([None, "x", "ü 🚀"])))
                    ids.append(self.next_id)
                elif roll < 0.9:
                    cur.execute(f"UPDATE `{self.db}`.`{t}` SET v = v + 1 WHERE id = %s", (rng.choice(ids),))
                else:
                    victim = ids.pop(rng.randrange(len(ids)))
                    cur.execute(f"DELETE FROM `{self.db}`.`{t}` WHERE id = %s", (victim,))
            cur.execute("COMMIT")
        self.txns += 1

    def start(self, per_second: float) -> None:
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                self.transaction()
                self._stop.wait(1.0 / per_second)  # pacing, not synchronisation

        self._thread = threading.Thread(target=loop, name="control-plane-workload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


@dataclass
class Advance:
    seq: int
    epoch: int
    changefeed: str
    checkpoint_ts: int
    resolved_ts: int
    at: float


@dataclass
class Dispatched:
    at: float
    member: str
    epoch: int
    action: str
    span: str
    reply: str
    answer: DispatchResponseV1 | None = None


@dataclass
class Recorder:
    """Everything the control plane records or says, with the wall time it was seen."""

    advances: list[Advance] = field(default_factory=list)
    sets: dict[str, SetChangedV1] = field(default_factory=dict)
    set_history: list[tuple[float, int, SetChangedV1]] = field(default_factory=list)
    rebuilt: list[tuple[float, int, RebuiltV1]] = field(default_factory=list)
    elected: list[tuple[float, int]] = field(default_factory=list)
    member_events: list[tuple[float, Any]] = field(default_factory=list)
    dispatches: list[Dispatched] = field(default_factory=list)
    _by_reply: dict[str, Dispatched] = field(default_factory=dict)
    _inboxes: set[str] = field(default_factory=set)
    nc: Client | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def _on_replication(self, stored: StoredEvent) -> None:
        now, ev, epoch = time.time(), stored.event, stored.envelope.epoch
        if isinstance(ev, CheckpointAdvancedV1):
            self.advances.append(Advance(stored.seq, epoch, ev.changefeed, ev.checkpoint_ts,
                                         ev.resolved_ts, now))
        elif isinstance(ev, SetChangedV1):
            key = _key(ev.span)
            if ev.removed:
                self.sets.pop(key, None)
            else:
                self.sets[key] = ev
            self.set_history.append((now, epoch, ev))
        elif isinstance(ev, RebuiltV1):
            self.rebuilt.append((now, epoch, ev))
        elif isinstance(ev, LeaderElectedV1):
            self.elected.append((now, ev.epoch))

    def _on_member(self, stored: StoredEvent) -> None:
        if isinstance(stored.event, MemberJoinedV2 | MemberLeftV1 | MemberDrainingV1):
            self.member_events.append((time.time(), stored.event))

    async def _on_dispatch(self, msg: Msg) -> None:
        try:
            req = REGISTRY.decode(msg.data).event
        except ContractError:
            return
        if isinstance(req, DispatchRequestV1):
            d = Dispatched(time.time(), req.member_id, req.epoch, req.action, _key(req.span), msg.reply)
            self.dispatches.append(d)
            self._by_reply[msg.reply] = d
            # Answers go to the sender's inbox prefix: listen there (not on all of _INBOX.>, which
            # carries every JetStream delivery of every process). The first answers to a new
            # sender may be missed; the checks treat an unseen answer as unknown.
            prefix = msg.reply.rsplit(".", 1)[0]
            if prefix not in self._inboxes and self.nc is not None:
                self._inboxes.add(prefix)
                await self.nc.subscribe(prefix + ".*", cb=self._on_inbox)

    async def _on_inbox(self, msg: Msg) -> None:
        d = self._by_reply.pop(msg.subject, None)
        if d is None:
            return
        try:
            answer = REGISTRY.decode(msg.data).event
        except ContractError:
            return
        if isinstance(answer, DispatchResponseV1):
            d.answer = answer

    async def start(self, url: str | list[str]) -> None:
        # Reconnect for as long as it takes: the chaos suite restarts the nats-server under it
        # (a list: the nodes of a cluster, one of which may be down).
        self.nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        js = self.nc.jetstream()
        await self.nc.subscribe("sluice.dispatch.*", cb=self._on_dispatch)
        for domain, handler in (("replication", self._on_replication), ("members", self._on_member)):
            follower: DomainFollower[None] = DomainFollower(
                js, domain, lambda s, _e: s, lambda: None, on_event=handler, name=f"test_{domain}")
            follower.loaded = True  # read every event from seq 1, none folded from a snapshot
            self._tasks.append(asyncio.create_task(follower.run(self._stop)))

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.nc is not None:
            await self.nc.close()

    # -- views --------------------------------------------------------------------------------

    def placement(self) -> dict[str, str | None]:
        """span -> primary of every Replicating set (None for sets in any other state)."""
        return {k: (s.primary if s.state == "replicating" and not s.error else None)
                for k, s in self.sets.items()}

    def loads(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for primary in self.placement().values():
            if primary is not None:
                out[primary] = out.get(primary, 0) + 1
        return out

    def all_replicating(self, spans: int) -> bool:
        p = self.placement()
        return len(p) == spans and all(v is not None for v in p.values())

    async def request(self, req: ScheduleRequestV1) -> ScheduleRequestAnsweredV1:
        assert self.nc is not None
        payload = REGISTRY.encode(req, producer="test/operator")
        msg = await self.nc.request(command_subject("schedule"), payload, timeout=5)
        answer = REGISTRY.decode(msg.data).event
        assert isinstance(answer, ScheduleRequestAnsweredV1)
        return answer


def _key(ref: SpanRefV1) -> str:
    return f"{ref.changefeed}/{ref.source}/{ref.database}/{ref.table}"


def read_writer_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def double_writes(entries: list[dict[str, Any]]) -> list[str]:
    """Pairs of writes of one span by two member processes whose rounds overlapped in time."""
    by_span: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        if e.get("event") == "wrote":
            by_span.setdefault(e["span"], []).append(e)
    problems = []
    for span, writes in by_span.items():
        writes.sort(key=lambda e: e["t0"])
        for a, b in itertools.pairwise(writes):
            if a["incarnation"] != b["incarnation"] and b["t0"] < a["t1"]:
                problems.append(f"{span}: {a['member']} wrote until {a['t1']:.3f}, "
                                f"{b['member']} from {b['t0']:.3f}")
    return problems


def verify_all(source_url: str, db: str, sink_url: str) -> list[Verification]:
    return [verify_target([ShardRef(source_url, db, t)], sink_url, db, t) for t in TABLES]


async def eventually(check: Callable[[], Awaitable[Any] | Any], within: float, what: str,
                     interval: float = 0.2, diagnostics: Callable[[], str] | None = None) -> Any:
    """Poll ``check`` until it returns something truthy, failing after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{diagnostics()}" if diagnostics is not None else ""
            raise AssertionError(f"timed out after {within:.0f}s waiting for {what}{extra}")
        await asyncio.sleep(interval)  # polling a condition against a deadline


def diagnostics(system: LocalSystem, recorder: Recorder) -> str:
    """Where every span runs and what every process says (leadership, agent) with its log tail."""
    lines = [f"placement: {recorder.placement()}"]
    for name, proc in system.processes.items():
        h = proc.health() if proc.alive() else None
        state = {k: h.get(k) for k in ("leader", "epoch", "replication", "scheduling", "members")
                 if h and k in h} if h else "down"
        agent = {k: v["state"] for k, v in (h or {}).get("agent", {}).get("tables", {}).items()}
        lines.append(f"--- {name}: {state} {agent if agent else ''}\n{proc.tail_log(6)}")
    return "\n".join(lines)


async def health(proc: ServiceProcess) -> dict[str, Any] | None:
    return await asyncio.to_thread(proc.health)


async def leader_of(system: LocalSystem, service: str) -> ServiceProcess | None:
    """The replica of ``service`` (process name prefix) that says it leads."""
    for name, proc in list(system.processes.items()):
        if name.rsplit("-", 1)[0] == service and proc.alive():
            h = await health(proc)
            if h and h.get("leader"):
                return proc
    return None
