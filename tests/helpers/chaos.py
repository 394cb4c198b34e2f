"""The chaos suite's moving parts: a workload that survives its source restarting, the seeded
fault schedule, the garbage it injects on purpose, and the end-of-run reads of the streams
(dead letters, the epochs of every control domain) that the invariants are checked against."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pymysql
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from libs.localservers.mariadb import MariaDB
from libs.localservers.service_process import ServiceProcess
from libs.localservers.system import LocalSystem
from libs.streams import (
    DEADLETTER_STREAM,
    domain_events_subject,
    domain_stream,
    heartbeat_subject,
    rows_subject,
)
from tests.helpers.control_plane import Recorder, Workload, eventually, health, leader_of

LEADER_SERVICES = ("member", "scheduler", "replication-manager", "ddl-lock")
LEADER_DOMAINS = {"member": "members", "scheduler": "schedule", "replication-manager": "replication",
                  "ddl-lock": "ddl"}
# Every kind occurs in every run; the seed decides their order, victims and timings.
FAULT_KINDS = ("kill-worker", "kill-capture", "kill-leader", "kill-two", "stale-leader",
               "restart-nats", "restart-source", "restart-downstream", "garbage")
# Carried by every message the suite injects (dead letters keep the original headers), so a
# dead letter is either one of these or a finding.
GARBAGE_HEADER = "Sluice-Chaos-Garbage"


def chaos_seed() -> int:
    """``SLUICE_CHAOS_SEED`` to repeat a run, a fresh random seed otherwise."""
    given = os.environ.get("SLUICE_CHAOS_SEED", "").strip()
    return int(given) if given else random.SystemRandom().randrange(1, 2**31)


class ChaosWorkload(Workload):
    """``Workload`` on one source that outlives the source's restarts.

    A transaction that fails (the server went away, perhaps after COMMIT reached it) is given
    up; the workload reconnects, reloads its ids from the source (so it knows exactly what
    committed) and carries on with the next one. The final comparison reads the sources anyway.
    """

    def __init__(self, server: MariaDB, db: str, tables: list[str], seed: int, first_id: int) -> None:
        super().__init__(server.connect(), db, seed=seed, tables=tables)
        self.server = server
        self.next_id = first_id
        self.failures = 0

    def transaction(self) -> None:
        try:
            super().transaction()
        except pymysql.err.MySQLError:
            self.failures += 1
            self._reconnect()

    def _reconnect(self, within: float = 120.0) -> None:
        deadline = time.monotonic() + within
        with contextlib.suppress(Exception):
            self.conn.close()
        while not self._stop.is_set():
            try:
                self.conn = self.server.connect()
                self._reload()
                return
            except pymysql.err.MySQLError:
                if time.monotonic() > deadline:
                    raise
                self._stop.wait(0.2)  # polling the restarting server against a deadline

    def _reload(self) -> None:
        with self.conn.cursor() as cur:
            for t in self.tables:
                cur.execute(f"SELECT id FROM `{self.db}`.`{t}` ORDER BY id")
                self.ids[t] = [int(r[0]) for r in cur.fetchall()]
        self.next_id = max([self.next_id, *(i for ids in self.ids.values() for i in ids)])


# ------------------------------------------------------------------------------------ garbage


@dataclass
class Injected:
    gid: str
    subject: str
    core: bool  # core NATS (lost when nobody listens): published again until it is parked
    payload: bytes


@dataclass
class Garbage:
    """Malformed bytes and an unknown event version on subjects the services consume: a span's
    rows subject (sink-workers), the changefeeds stream (every follower of it) and a heartbeat
    subject (the member leader)."""

    nc: Client
    rows_subjects: list[str]
    injected: list[Injected] = field(default_factory=list)

    @staticmethod
    def unknown_version(event_type: str) -> bytes:
        return json.dumps({"type": event_type, "version": 99, "id": uuid.uuid4().hex,
                           "time": datetime.now(UTC).isoformat(), "producer": "chaos/garbage",
                           "epoch": 0, "data": {"from": "the future"}}).encode()

    async def _publish(self, item: Injected) -> None:
        headers = {GARBAGE_HEADER: item.gid}
        if item.core:
            await self.nc.publish(item.subject, item.payload, headers=headers)
            await self.nc.flush()
        else:
            await self.nc.jetstream().publish(item.subject, item.payload, headers=headers)

    async def inject(self, rng: random.Random) -> list[str]:
        n = len(self.injected)
        batch = [
            Injected(f"g{n}-rows-malformed", rng.choice(self.rows_subjects), False,
                     b"\x00\xffnot json {" + rng.randbytes(8)),
            Injected(f"g{n}-rows-v99", rng.choice(self.rows_subjects), False,
                     self.unknown_version("rows.changed")),
            Injected(f"g{n}-changefeeds-v99", domain_events_subject("changefeeds"), False,
                     self.unknown_version("changefeed.updated")),
            Injected(f"g{n}-heartbeat-malformed", heartbeat_subject("chaos-garbage"), True,
                     b"\xde\xad\xbe\xef"),
        ]
        for item in batch:
            await self._publish(item)
            self.injected.append(item)
        return [f"{i.gid} on {i.subject}" for i in batch]

    async def wait_parked(self, js: JetStreamContext, within: float, what: str) -> None:
        """Every injection has its dead letter; core ones are sent again while none has (nobody
        listens on a heartbeat subject between two member leaders)."""

        async def parked() -> bool:
            seen = {m.headers.get(GARBAGE_HEADER) for m in await dead_letters(js) if m.headers}
            missing = [i for i in self.injected if i.gid not in seen]
            for item in missing:
                if item.core:
                    await self._publish(item)
            return not missing

        await eventually(parked, within, what, interval=1.0)


async def dead_letters(js: JetStreamContext) -> list[api.RawStreamMsg]:
    try:
        info = await js.stream_info(DEADLETTER_STREAM)
    except NotFoundError:
        return []
    out = []
    for seq in range(int(info.state.first_seq or 1), int(info.state.last_seq or 0) + 1):
        with contextlib.suppress(NotFoundError):
            out.append(await js.get_msg(DEADLETTER_STREAM, seq=seq))
    return out


@dataclass
class DomainEvent:
    seq: int
    type: str
    epoch: int


async def domain_events(js: JetStreamContext, domain: str) -> list[DomainEvent]:
    """Every event still stored in a control domain's stream, in stream order (envelopes only:
    the test reads what the leaders wrote, not what a fold makes of it)."""
    stream = domain_stream(domain)
    info = await js.stream_info(stream)
    out = []
    for seq in range(int(info.state.first_seq or 1), int(info.state.last_seq or 0) + 1):
        try:
            msg = await js.get_msg(stream, seq=seq)
        except NotFoundError:
            continue  # an older snapshot, rolled up
        if msg.subject != domain_events_subject(domain):
            continue
        env = json.loads(msg.data or b"{}")
        out.append(DomainEvent(seq, str(env.get("type")), int(env.get("epoch", 0))))
    return out


def epochs_going_back(events: list[DomainEvent]) -> list[str]:
    """Events appended after an event of a newer epoch: a deposed leader got an append in."""
    problems, newest, newest_seq = [], 0, 0
    for e in events:
        if e.epoch < newest:
            problems.append(f"seq {e.seq} {e.type} by epoch {e.epoch} after seq {newest_seq} by "
                            f"epoch {newest}")
        elif e.epoch > newest:
            newest, newest_seq = e.epoch, e.seq
    return problems


def span_starts_going_back(entries: list[dict[str, Any]]) -> list[str]:
    """From the writer log: a span that started (on any worker) below where it had already
    started, or below the checkpoint a clean stop handed over. Span checkpoints are stored
    monotonically, so every owner starts at or past every earlier one."""
    problems = []
    floor: dict[str, tuple[int, str]] = {}
    for e in sorted((e for e in entries if e.get("event") in ("started", "stopped")), key=lambda e: e["t"]):
        ts = e.get("checkpoint_ts")
        if ts is None:
            continue
        span, where = e["span"], f"{e['event']} on {e['member']} at {e['t']:.3f} with {ts}"
        if e["event"] == "started" and span in floor and ts < floor[span][0]:
            problems.append(f"{span}: {where}, below {floor[span][1]}")
        if span not in floor or ts >= floor[span][0]:
            floor[span] = (ts, where)
    return problems


# ------------------------------------------------------------------------------------ faults


@dataclass
class StalePause:
    service: str
    name: str
    epoch: int
    paused_at: float
    resumed_at: float
    new_epoch: int


@dataclass
class FaultSchedule:
    """The seeded schedule: every kind of ``FAULT_KINDS`` once (garbage twice) in an order, with
    victims and timings, drawn from one ``random.Random(seed)``. Faults run one after another
    (``kill-two`` kills two processes at the same instant); each ends when what it stopped is
    running again, and the next follows after a random pause while the load goes on."""

    system: LocalSystem
    recorder: Recorder
    garbage: Garbage
    seed: int
    lease_ttl_s: float
    log: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    stale: list[StalePause] = field(default_factory=list)
    rng: random.Random = field(init=False)
    plan: list[str] = field(init=False)
    started: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.plan = [*FAULT_KINDS, "garbage"]
        self.rng.shuffle(self.plan)

    def note(self, what: str) -> None:
        line = (f"[chaos seed={self.seed} t={time.monotonic() - self.started:6.1f}s "
                f"advances={len(self.recorder.advances)}] {what}")
        self.log.append(line)
        print(line, flush=True)

    async def pause(self, low: float, high: float) -> None:
        # Pacing of the schedule (the seed's timing), not a synchronisation.
        await asyncio.sleep(self.rng.uniform(low, high))

    async def run(self) -> None:
        self.started = time.monotonic()
        self.note(f"plan: {', '.join(self.plan)}")
        for kind in self.plan:
            await self.pause(2.0, 5.0)
            began = time.monotonic()
            fault: Callable[[], Awaitable[str]] = getattr(self, "_" + kind.replace("-", "_"))
            detail = await fault()
            self.done.append(kind)
            self.note(f"{kind}: {detail} ({time.monotonic() - began:.1f}s)")

    # -- victims --------------------------------------------------------------------------

    def _workers(self) -> list[str]:
        return sorted(n for n in self.system.processes if n.startswith("sink-worker"))

    def _captures(self) -> list[str]:
        return sorted(n for n in self.system.processes if n.startswith("capture"))

    async def _leader(self, service: str) -> ServiceProcess:
        found: ServiceProcess = await eventually(lambda: leader_of(self.system, service), 30,
                                                 f"a {service} leader (chaos seed {self.seed})")
        return found

    async def _restart(self, procs: list[ServiceProcess]) -> None:
        for proc in procs:
            proc.start()  # same instance id, port and settings: a restarted process
        for proc in procs:
            await asyncio.to_thread(proc.wait_healthy, 90)

    async def _kill_and_restart(self, procs: list[ServiceProcess]) -> None:
        for proc in procs:
            proc.kill()
        await self.pause(0.2, 3.0)
        await self._restart(procs)

    # -- the faults -----------------------------------------------------------------------

    async def _kill_worker(self) -> str:
        proc = self.system.processes[self.rng.choice(self._workers())]
        await self._kill_and_restart([proc])
        return f"SIGKILL + restart {proc.instance_id}"

    async def _kill_capture(self) -> str:
        proc = self.system.processes[self.rng.choice(self._captures())]
        await self._kill_and_restart([proc])
        return f"SIGKILL + restart {proc.instance_id}"

    async def _kill_leader(self) -> str:
        service = self.rng.choice(LEADER_SERVICES)
        proc = await self._leader(service)
        epoch = (await health(proc) or {}).get("epoch")
        await self._kill_and_restart([proc])
        return f"SIGKILL + restart the {service} leader {proc.instance_id} (epoch {epoch})"

    async def _kill_two(self) -> str:
        candidates = [*(("process", n) for n in self._workers()), *(("process", n) for n in self._captures()),
                      *(("leader", s) for s in LEADER_SERVICES)]
        picked = self.rng.sample(candidates, 2)
        # Leaders are control processes, the named ones workers and captures: two processes.
        procs = [await self._leader(v) if k == "leader" else self.system.processes[v] for k, v in picked]
        await self._kill_and_restart(procs)
        names = [f"{p.instance_id}{' (leader)' if k == 'leader' else ''}"
                 for (k, _), p in zip(picked, procs, strict=True)]
        return "SIGKILL + restart at once: " + ", ".join(names)

    async def _stale_leader(self) -> str:
        service = self.rng.choice(LEADER_SERVICES)
        proc = await self._leader(service)
        epoch = int((await health(proc) or {})["epoch"])
        others = [p for n, p in self.system.processes.items()
                  if n.rsplit("-", 1)[0] == service and p is not proc]

        async def successor() -> int | None:
            for p in others:
                h = await health(p)
                if h and h.get("leader") and int(h["epoch"]) > epoch:
                    return int(h["epoch"])
            return None

        # Stopped for 1.5 to 3.5 lease TTLs, and in any case until a successor leads and a
        # moment more: the stale one wakes up believing it still leads, after the new leader
        # has acted (past the member TTL, a stale member leader sees every member silent).
        hold = self.rng.uniform(1.5 * self.lease_ttl_s, 3.5 * self.lease_ttl_s)
        proc.pause()
        paused_at = time.time()
        try:
            new_epoch: int = await eventually(successor, 30, f"a {service} leader after SIGSTOP of "
                                              f"{proc.instance_id} (chaos seed {self.seed})")
            # The hold is the seed's timing, not a synchronisation.
            await asyncio.sleep(max(0.5, hold - (time.time() - paused_at)))
        finally:
            proc.resume()
        resumed_at = time.time()

        async def stepped_down() -> bool:
            h = await health(proc)
            if h is None:
                return False
            return not (h.get("leader") and int(h.get("epoch") or 0) <= epoch)

        await eventually(stepped_down, 30, f"{proc.instance_id} to step down after SIGCONT "
                         f"(chaos seed {self.seed})")
        self.stale.append(StalePause(service, proc.instance_id, epoch, paused_at, resumed_at, new_epoch))
        return (f"SIGSTOP {proc.instance_id} ({service} leader, epoch {epoch}) for "
                f"{resumed_at - paused_at:.1f}s (lease TTL {self.lease_ttl_s}s), new leader epoch "
                f"{new_epoch}, SIGCONT")

    async def _restart_nats(self) -> str:
        nats_server = self.system.nats
        assert nats_server is not None
        how = self.rng.choice(["stop", "kill"])
        await asyncio.to_thread(nats_server.stop if how == "stop" else nats_server.kill)
        await self.pause(0.5, 3.0)
        await asyncio.to_thread(nats_server.start)
        return f"nats-server {how} + start on port {nats_server.port}"

    async def _restart_db(self, db: MariaDB) -> str:
        how = self.rng.choice(["stop", "kill"])
        await asyncio.to_thread(db.stop if how == "stop" else db.kill)
        await self.pause(0.5, 3.0)
        await asyncio.to_thread(db.start)
        return f"{how} + start of the MariaDB on port {db.port}"

    async def _restart_source(self) -> str:
        index = self.rng.randrange(len(self.system.source_dbs))
        how = await self._restart_db(self.system.source_dbs[index])
        return f"source {self.system.source_id(index)}: {how}"

    async def _restart_downstream(self) -> str:
        db = self.system.downstream_db
        assert isinstance(db, MariaDB), "the chaos suite restarts a MariaDB downstream"
        return "downstream: " + await self._restart_db(db)

    async def _garbage(self) -> str:
        return "injected " + "; ".join(await self.garbage.inject(self.rng))


def rows_subjects(system: LocalSystem, db: str, tables: list[str]) -> list[str]:
    return [rows_subject(system.source_id(i), db, t) for i in range(len(system.source_dbs)) for t in tables]
