"""The demo: a whole Sluice system on this machine merging 8 live shards into one table.

Started by the README's first command (``bash infra/dev.sh demo``). It starts nats-server, two
MariaDB sources with ROW binlogs, the downstream (SQLite by default, ``--downstream postgres``
or ``mariadb``) and every service as its own process, with the real control plane: capture per
source, two replicas each of member, scheduler, replication-manager and ddl-lock, two
sink-workers (``--workers``; Spark local[1] each) that run only the spans the control plane
dispatches to them, and the api.

Each source holds two schemas (``shop_a``, ``shop_b``) with two shard tables each
(``orders_1``, ``orders_2``): 8 shards, every one with its own id range, that already hold
rows. The demo creates, through the api, a changefeed whose route rule merges all 8 into the
one target table ``shop.orders``; its initial load copies the existing rows, then it streams.
A light workload (a tenth of ``--rate``) runs while every span copies its shard and starts; then
paced inserts, updates and deletes run on every shard at ``--rate`` for ``--seconds``, and
meanwhile each shard in turn gets ``ALTER TABLE ... ADD COLUMN coupon``: the ddl-lock leader
holds the lock until all 8 shards reached the DDL, has one shard execute it on the target and
the 7 others skip it.

Every 2 s it prints, read from the api (the control plane's view): the changefeed checkpoint
lag, where every span runs (worker and replication state), the DDL lock (shards synced and
waiting) and, as they happen, the lock's events from the api's event feed (created, each
shard's Info, exec, skips, resolved). Upstream changes/s counts the row changes the workload
committed. Downstream changes/s counts the row changes the target is known to hold: for each
shard, those committed no later than its span's checkpoint as the api reports it (the workload
notes every commit's time). It moves when checkpoints do, so it stands still while a span waits
at the DDL lock or a Spark round runs, and jumps after.

Once the changefeed checkpoint passes the end of the workload, it compares the target with
the merge of the 8 shards (row count and checksum, ``services.sink_worker.validation.verify``) and prints
EQUAL or DIFFERENT. Unless ``--no-wait`` is given it then leaves the system up (the api's /docs
URL and a CLI command are printed) until Ctrl-C or SIGTERM. Either way it stops every process
and exits 0 for EQUAL, 1 otherwise (130 when stopped before the comparison). The system runs
from a child process in its own process group, so the terminal's Ctrl-C reaches only the demo,
which stops the api and sink-workers, then capture and the control services, then the databases
and nats-server, in that order.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--downstream", choices=["sqlite", "postgres", "mariadb"], default="sqlite")
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="how long the workload runs once every span streams "
                             "(the DDL rollout is within it)")
    parser.add_argument("--rate", type=float, default=500.0, help="target upstream row changes/s")
    parser.add_argument("--txn-rows", type=int, default=10, help="row changes per transaction")
    parser.add_argument("--seed", type=int, default=7, help="seed of the workload and the DDL order")
    parser.add_argument("--workers", type=int, default=2, help="sink-workers (each runs Spark local[1])")
    parser.add_argument("--warmup-timeout", type=float, default=300.0,
                        help="how long every span may take to copy its rows and start streaming")
    parser.add_argument("--converge-timeout", type=float, default=300.0,
                        help="how long the target may take to catch up after the workload")
    parser.add_argument("--no-wait", action="store_true", help="stop after the checksum comparison")
    parser.add_argument("--dir", type=Path, default=ROOT / ".sluice" / "demo", help="data and logs")
    parser.add_argument("--nats-sync-interval", default=None,
                        help="JetStream fsync interval of the demo's nats-server: always (before "
                             "each acknowledgement) or a duration such as 1s. Default: the server's "
                             "(about 2 min): the demo starts from an empty directory on every run, "
                             "so no acknowledged write has to outlive an OS crash")
    return parser


# --help needs none of what `infra/dev.sh demo` installs: answered before the imports that do.
if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    build_parser().parse_args()

import httpx  # noqa: E402

from contracts.events.changefeeds import RouteRuleV1  # noqa: E402
from libs.localservers.mariadb import MariaDB  # noqa: E402
from libs.localservers.postgres import PostgreSQL  # noqa: E402
from libs.localservers.service_process import ServiceProcess  # noqa: E402
from libs.localservers.system import LocalSystem  # noqa: E402
from services.sink_worker.validation.verify import ShardRef, Verification, verify_target  # noqa: E402

CHANGEFEED = "demo"
SCHEMAS = ("shop_a", "shop_b")
TABLES = ("orders_1", "orders_2")
TARGET = ("shop", "orders")
CREATE_SHARD = (
    "CREATE TABLE {table} (id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL,"
    " amount DECIMAL(12,2) NOT NULL, status ENUM('new','paid','shipped','cancelled') NOT NULL,"
    " note VARCHAR(64) NULL, created_at DATETIME(6) NOT NULL, attrs JSON NULL)"
)
SHARD_DDL = "ALTER TABLE {table} ADD COLUMN coupon VARCHAR(16) NULL"
SEED_ROWS = 250  # rows every shard holds before the changefeed exists (the initial load copies them)
ID_RANGE = 1_000_000_000  # shard n owns ids n * ID_RANGE + 1 ...: the merge keeps every row
TICK_S = 2.0
CHILD_ENV = "SLUICE_DEMO_SUPERVISED"

Shard = tuple[int, str, str]  # (source index, schema, table)
T = TypeVar("T")


class Stopped(Exception):
    """Ctrl-C, SIGTERM or the demo's own parent gone: unwind and stop everything."""


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shard_name(system: LocalSystem, shard: Shard) -> str:
    i, schema, table = shard
    return f"{system.source_id(i)}/{schema}.{table}"


# ------------------------------------------------------------------------------------ workload

class ShardWorkload:
    """Paced transactions on the 8 shards, and the shard DDL on each at its planned moment.

    One thread owns the connections; ``rows`` (row changes committed) is read by the printer."""

    def __init__(self, system: LocalSystem, seed: int, rate: float, txn_rows: int) -> None:
        self.system = system
        self.conns = [db.connect() for db in system.source_dbs]
        self.shards: list[Shard] = [(i, s, t) for i in range(len(self.conns))
                                    for s in SCHEMAS for t in TABLES]
        self.rng = random.Random(seed)
        self.rate = rate
        self.txn_rows = txn_rows
        self.next_id = {sh: n * ID_RANGE for n, sh in enumerate(self.shards)}
        self.live: dict[Shard, list[int]] = {sh: [] for sh in self.shards}
        self.altered: set[Shard] = set()
        self.rows = 0
        # Per shard: commit wall times and the running count of row changes, for the
        # downstream figure (changes at or below each span's checkpoint).
        self.history: dict[Shard, tuple[list[float], list[int]]] = {sh: ([], []) for sh in self.shards}
        self.ddl_plan: list[tuple[float, Shard]] = []
        self.error: BaseException | None = None
        self._ddl_t0: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def table(shard: Shard) -> str:
        return f"`{shard[1]}`.`{shard[2]}`"

    def create(self) -> None:
        """The shards, each already holding ``SEED_ROWS`` rows, as on sources in production."""
        for i, conn in enumerate(self.conns):
            with conn.cursor() as cur:
                for schema in SCHEMAS:
                    cur.execute(f"CREATE DATABASE `{schema}`")
                for shard in (sh for sh in self.shards if sh[0] == i):
                    cur.execute(CREATE_SHARD.format(table=self.table(shard)))
                    cur.execute("BEGIN")
                    for _ in range(SEED_ROWS):
                        self._insert(cur, shard)
                    cur.execute("COMMIT")
        self.rows = 0  # the rates count the live workload only

    def _insert(self, cur: Any, shard: Shard) -> None:
        self.next_id[shard] += 1
        oid = self.next_id[shard]
        rng = self.rng
        cols = ["id", "customer_id", "amount", "status", "note", "created_at", "attrs"]
        values: list[Any] = [oid, rng.randint(1, 5000), round(rng.uniform(1, 999), 2), "new",
                             rng.choice([None, "gift 🎁", "fragile", "ünïcode", "it's"]),
                             json.dumps({"items": rng.randint(1, 5),
                                         "shard": shard_name(self.system, shard)})]
        if shard in self.altered:
            cols.append("coupon")
            values.append(rng.choice([None, f"SAVE{rng.randint(5, 50)}"]))
        marks = ["%s"] * len(values)
        marks.insert(5, "NOW(6)")
        values_sql = ", ".join(marks)
        cur.execute(f"INSERT INTO {self.table(shard)} ({', '.join(cols)}) VALUES ({values_sql})", values)
        self.live[shard].append(oid)

    def transaction(self, source: int) -> None:
        shards = [sh for sh in self.shards if sh[0] == source]
        rng = self.rng
        touched: dict[Shard, int] = {}
        with self.conns[source].cursor() as cur:
            cur.execute("BEGIN")
            for _ in range(self.txn_rows):
                shard = rng.choice(shards)
                touched[shard] = touched.get(shard, 0) + 1
                live = self.live[shard]
                roll = rng.random()
                if roll < 0.55 or len(live) < 20:
                    self._insert(cur, shard)
                elif roll < 0.85:
                    cur.execute(f"UPDATE {self.table(shard)} SET status = %s, amount = amount + 1 "
                                "WHERE id = %s",
                                (rng.choice(["paid", "shipped", "cancelled"]), rng.choice(live)))
                else:
                    victim = live.pop(rng.randrange(len(live)))
                    cur.execute(f"DELETE FROM {self.table(shard)} WHERE id = %s", (victim,))
            cur.execute("COMMIT")
        # Taken after COMMIT returned: the transaction's ts (its commit time) is not later.
        committed = time.time()
        for shard, n in touched.items():
            times, totals = self.history[shard]
            times.append(committed)
            totals.append((totals[-1] if totals else 0) + n)
        self.rows += self.txn_rows

    def changes_before(self, shard: Shard, ts: int) -> int:
        """Row changes of ``shard`` committed no later than Sluice ts ``ts`` (``ms << 18``)."""
        times, totals = self.history[shard]
        # The workload thread appends the time before the total: search only complete pairs.
        i = bisect.bisect_right(times, (ts >> 18) / 1000.0, 0, len(totals))
        return totals[i - 1] if i else 0

    def alter(self, shard: Shard) -> None:
        with self.conns[shard[0]].cursor() as cur:
            cur.execute(SHARD_DDL.format(table=self.table(shard)))
        self.altered.add(shard)
        statement = SHARD_DDL.format(table=self.table(shard))
        say(f"upstream DDL on shard {shard_name(self.system, shard)}: {statement}"
            f"  ({len(self.altered)}/{len(self.shards)} shards altered)")

    def plan_ddl(self, start_s: float, end_s: float) -> None:
        """Each shard's ALTER at its own moment in [start_s, end_s] after ``start`` (shuffled order)."""
        order = list(self.shards)
        self.rng.shuffle(order)
        step = (end_s - start_s) / max(len(order) - 1, 1)
        self.ddl_plan = [(start_s + k * step, shard) for k, shard in enumerate(order)]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="workload", daemon=True)
        self._thread.start()

    def begin_ddl_rollout(self) -> None:
        self._ddl_t0 = time.monotonic()

    def _run(self) -> None:
        next_at = time.monotonic()
        source = 0
        try:
            while not self._stop.is_set():
                if self._ddl_t0 is not None:
                    due = time.monotonic() - self._ddl_t0
                    while self.ddl_plan and self.ddl_plan[0][0] <= due:
                        self.alter(self.ddl_plan.pop(0)[1])
                self.transaction(source)
                source = (source + 1) % len(self.conns)
                # Pacing at the current rate; more than a second behind (a busy machine), the
                # backlog is dropped rather than caught up in a burst.
                next_at += self.txn_rows / self.rate
                delay = next_at - time.monotonic()
                if delay > 0:
                    self._stop.wait(delay)
                elif delay < -1.0:
                    next_at = time.monotonic()
        except BaseException as exc:
            self.error = exc
            say(f"workload failed: {exc!r}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for conn in self.conns:
            try:
                conn.close()
            except Exception:
                pass


# ------------------------------------------------------------------------- the api's view

class Api:
    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {token}"}
        self.client = httpx.Client(base_url=base_url + "/api/v1", timeout=10.0, headers=self.headers)

    def get(self, path: str) -> Any:
        resp = self.client.get(path)
        resp.raise_for_status()
        return resp.json()

    def try_get(self, path: str) -> Any:
        try:
            return self.get(path)
        except (httpx.HTTPError, ValueError):
            return None

    def close(self) -> None:
        self.client.close()


class DdlFeed:
    """Follows the ddl domain through the api's event feed and prints each lock event."""

    def __init__(self, api_url: str, headers: dict[str, str], stop: threading.Event) -> None:
        self.url = api_url + "/api/v1/events"
        self.stop = stop
        self.seq = 0
        self.counts: dict[str, int] = {}
        self.synced: set[str] = set()
        self.expected = 0
        self.client = httpx.Client(timeout=httpx.Timeout(10.0, read=60.0), headers=headers)
        self._sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._run, name="ddl-feed", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Hang up before the api stops, so it does not stop with a feed still streaming."""
        self.stop.set()
        sock = self._sock
        if sock is not None:
            # Shutting the socket down wakes the reading thread at once (closing the client
            # would not interrupt a read in progress).
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(5.0)
        self.client.close()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with self.client.stream("GET", self.url,
                                        params={"domain": "ddl", "since": f"ddl:{self.seq}"}) as resp:
                    self._sock = resp.extensions["network_stream"].get_extra_info("socket")
                    for line in resp.iter_lines():
                        if self.stop.is_set():
                            return
                        if line.startswith("data: "):
                            self._on(json.loads(line[len("data: "):]))
            except Exception:
                if self.stop.is_set():
                    return  # closed by close()
                self.stop.wait(1.0)  # the api restarting or going away: follow again from self.seq

    @staticmethod
    def _span(ref: dict[str, Any]) -> str:
        return f"{ref['source']}/{ref['database']}.{ref['table']}"

    def _on(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if not kind:
            return  # the cursor frame
        self.seq = int(event["seq"])
        data = event.get("data") or {}
        name = str(kind).removeprefix("shard_ddl.")
        self.counts[name] = self.counts.get(name, 0) + 1
        target = data.get("target") or {}
        lock = f"{data.get('changefeed')}/{target.get('database')}.{target.get('table')}"
        if name == "lock_created":
            self.expected = len(data.get("expected") or [])
            self.synced = {self._span(data["owner"])}
            say(f"DDL lock {lock} #{data.get('instance')} created by {self._span(data['owner'])} (owner), "
                f"waiting for all {self.expected} shards: {'; '.join(data.get('ddls') or [])}")
        elif name == "info_received":
            self.synced.add(self._span(data["span"]))
            say(f"DDL lock {lock}: {self._span(data['span'])} reached the DDL "
                f"({len(self.synced)}/{self.expected or '?'} shards synced)")
        elif name == "operation_issued":
            op = f"operation_issued:{data.get('kind')}"
            self.counts[op] = self.counts.get(op, 0) + 1
            say(f"DDL lock {lock}: {data.get('kind')} -> {self._span(data['span'])}")
        elif name == "done_received" and data.get("kind") == "exec":
            say(f"DDL lock {lock}: {self._span(data['span'])} executed the DDL on the target")
        elif name == "lock_resolved":
            held = float(data.get("at", 0)) - float(data.get("created_at", 0))
            say(f"DDL lock {lock} #{data.get('instance')} RESOLVED: {len(data.get('settled') or [])} shards "
                f"settled, held {held:.1f}s")
        elif name in ("exec_failed", "shard_left", "unlocked", "lock_removed"):
            say(f"DDL lock {lock}: {name} {json.dumps(data)[:300]}")


class Progress:
    """The every-2-s report, read from the api; span placement when it changed (or every 10 s)."""

    PLACEMENT_EVERY_S = 10.0

    def __init__(self, system: LocalSystem, api: Api, workload: ShardWorkload) -> None:
        self.system = system
        self.api = api
        self.workload = workload
        self.t0 = time.monotonic()
        self.last = (self.t0, 0, 0)
        self.changefeed: dict[str, Any] = {}
        self.tables: list[dict[str, Any]] = []
        self.locks: list[dict[str, Any]] = []
        self._placement: tuple[Any, ...] = ()
        self._placement_at = 0.0

    def print(self, phase: str) -> None:
        self.changefeed = self.api.try_get(f"/changefeeds/{CHANGEFEED}") or {}
        self.tables = self.api.try_get(f"/changefeeds/{CHANGEFEED}/tables") or []
        now = time.monotonic()
        up, down = self.workload.rows, self.downstream()
        t, up0, down0 = self.last
        dt = max(now - t, 1e-6)
        self.last = (now, up, down)
        locks = self.api.try_get("/ddl-locks")
        self.locks = locks if isinstance(locks, list) else []
        cf = self.changefeed
        lag_text = cf.get("checkpoint_time") or "(none yet)"
        states = cf.get("tables_by_state") or {}
        say(f"{phase:<8} t={now - self.t0:5.1f}s  upstream {(up - up0) / dt:6,.0f} changes/s ({up:,})  "
            f"downstream {(down - down0) / dt:6,.0f} changes/s ({down:,} checkpointed)  "
            f"checkpoint {lag_text}  "
            f"spans: {', '.join(f'{n} {s}' for s, n in sorted(states.items())) or 'none yet'}")
        self._print_placement(now)
        for lk in self.locks:
            shards = lk.get("shards") or []
            synced = [s for s in shards if s.get("state") != "waiting_info"]
            waiting = [s["span"].split("/", 1)[-1] for s in shards if s.get("state") == "waiting_info"]
            say(f"    DDL lock {lk.get('changefeed')}/{lk.get('target')} #{lk.get('instance')}: "
                f"{lk.get('state')}, owner {str(lk.get('owner')).split('/', 1)[-1]}, "
                f"{len(synced)}/{len(shards)} shards synced"
                + (f", waiting for {', '.join(waiting)}" if waiting else ""))

    def downstream(self) -> int:
        """Row changes the target holds for sure: each shard's changes committed at or before its
        span's checkpoint (the api's view of the span's checkpoint)."""
        by_name = {shard_name(self.system, sh): sh for sh in self.workload.shards}
        total = 0
        for tb in self.tables:
            shard = by_name.get(f"{tb['source']}/{tb['database']}.{tb['table']}")
            if shard is not None and tb.get("checkpoint_ts"):
                total += self.workload.changes_before(shard, int(tb["checkpoint_ts"]))
        return total

    def _print_placement(self, now: float, force: bool = False) -> None:
        by_worker: dict[str, list[str]] = {}
        signature = []
        for tb in self.tables:
            owner = tb.get("primary") or tb.get("secondary") or "(none)"
            text = f"{tb['source']}/{tb['database']}.{tb['table']}"
            detail = [] if tb.get("state") == "replicating" else [str(tb.get("state"))]
            if tb.get("primary") and tb.get("secondary"):
                detail.append(f"moving to {tb['secondary']}")
            # What it waits for (its worker's prepare phase: Spark warming up, the commit; or its
            # initial load's progress), from the api; the time waited stays out of the signature.
            waiting = str(tb.get("waiting_for") or "")
            signature.append((text, owner, tuple(detail), waiting.rsplit(", ", 1)[0]))
            if waiting:
                detail.append(waiting if waiting.startswith("initial load") else f"waiting for {waiting}")
            if tb.get("checkpoint_ts") and tb.get("lag_s") is not None:
                detail.append(f"lag {tb['lag_s']:.1f}s")
            by_worker.setdefault(owner, []).append(f"{text} ({', '.join(detail)})" if detail else text)
        fresh = now - self._placement_at < self.PLACEMENT_EVERY_S
        if not force and tuple(signature) == self._placement and fresh:
            return
        self._placement, self._placement_at = tuple(signature), now
        for owner, spans in sorted(by_worker.items()):
            say(f"    {owner:<14} {'  '.join(spans)}")

    def placement(self) -> None:
        self._print_placement(time.monotonic(), force=True)

    def all_streaming(self) -> bool:
        """Every shard is a span, replicating, its initial load done."""
        return len(self.tables) >= len(self.workload.shards) and all(
            tb.get("state") == "replicating" and (tb.get("snapshot") or {}).get("state", "done") == "done"
            for tb in self.tables)


# ------------------------------------------------------------------------------- the system

def verify(system: LocalSystem, workload: ShardWorkload) -> Verification | str:
    refs = [ShardRef(system.source_dbs[i].url, s, t) for (i, s, t) in workload.shards]
    try:
        return verify_target(refs, system.sink_url, *TARGET)
    except Exception as exc:  # the target may not exist yet, or lack a column for a moment
        return f"cannot compare yet: {exc}"


def shutdown(system: LocalSystem) -> None:
    """Stop in dependency order, each group at once: the api and sink-workers (they drain), then
    capture and the control services, then the databases and nats-server."""
    groups: list[Callable[[str], bool]] = [
        lambda n: n.startswith(("api", "sink-worker")),
        lambda n: True,
    ]
    for in_group in groups:
        procs = [p for n, p in system.processes.items() if in_group(n) and p.alive()]
        for p in procs:
            assert p.proc is not None
            p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            _wait_stopped(p)
    system.stop()


def _wait_stopped(p: ServiceProcess) -> None:
    assert p.proc is not None
    try:
        p.proc.wait(30)
    except subprocess.TimeoutExpired:
        say(f"{p.instance_id} did not stop within 30 s of SIGTERM: killing it")
        p.kill()


def in_thread(fn: Callable[[], T], stop: threading.Event) -> T:
    """``fn()`` on a thread, so a stop request is not held up by a long database read."""
    box: list[T] = []
    thread = threading.Thread(target=lambda: box.append(fn()), name="verify", daemon=True)
    thread.start()
    while thread.is_alive():
        if stop.wait(0.5):
            raise Stopped
    return box[0]


def wait_for(check: Callable[[], bool], timeout: float, what: str, stop: threading.Event,
             tick: Callable[[], None] | None = None, interval: float = 0.5) -> None:
    """Wait until ``check`` holds (deadline ``timeout``), calling ``tick`` every ``TICK_S``."""
    deadline = time.monotonic() + timeout
    next_tick = time.monotonic() + TICK_S
    while not check():
        if stop.is_set():
            raise Stopped
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        stop.wait(interval)
        if tick is not None and time.monotonic() >= next_tick:
            tick()
            next_tick += TICK_S


def server_lines(system: LocalSystem) -> list[str]:
    """Where each of the demo's servers listens, as whom to log in and what it holds, so a user
    can look at the data (every server listens on 127.0.0.1 only)."""
    lines = []
    for i, db in enumerate(system.source_dbs):
        lines.append(f"source {system.source_id(i)}: MariaDB 127.0.0.1:{db.port}, user root (no password), "
                     f"databases {', '.join(SCHEMAS)}:  mysql -h 127.0.0.1 -P {db.port} -u root {SCHEMAS[0]}")
    target = f"{TARGET[0]}.{TARGET[1]}"
    if isinstance(system.downstream_db, PostgreSQL):
        port = system.downstream_db.port
        lines.append(f"downstream: PostgreSQL 127.0.0.1:{port}, user postgres (no password), table "
                     f"{target} in database postgres:  psql -h 127.0.0.1 -p {port} -U postgres postgres")
    elif isinstance(system.downstream_db, MariaDB):
        port = system.downstream_db.port
        lines.append(f"downstream: MariaDB 127.0.0.1:{port}, user root (no password), table {target}:  "
                     f"mysql -h 127.0.0.1 -P {port} -u root {TARGET[0]}")
    else:
        # One SQLite file is one namespace: the schema is not part of the name.
        path = system.sink_url.removeprefix("sqlite:///")
        lines.append(f"downstream: SQLite {path}, table {TARGET[1]}:  "
                     f"sqlite3 {path} 'SELECT count(*) FROM {TARGET[1]}'")
    if system.nats is not None:
        lines.append(f"NATS: {system.nats.plain_url}, each service as its own user; read-only user 'reader' "
                     f"(password in {system.nats.data_dir / 'auth.json'}, 0600)")
    return lines


def run(args: argparse.Namespace, stop: threading.Event) -> int:
    shutil.rmtree(args.dir, ignore_errors=True)
    system = LocalSystem(
        base_dir=args.dir, sources=2, downstream=args.downstream, control_replicas=2,
        workers=args.workers, standalone_workers=False, initial_load="snapshot",
        nats_sync_interval=args.nats_sync_interval,
        control_env={"SLUICE_REPLICATION_TICK_S": "1", "SLUICE_DDL_LOCK_RESEND_S": "3",
                     "SLUICE_DDL_LOCK_DISCOVERY_INTERVAL_S": "1",
                     "SLUICE_SCHEDULER_DISCOVERY_INTERVAL_S": "1"},
        # Sized for a 2-core machine: one Spark core and a small driver per worker.
        worker_env={"SLUICE_SPARK_MASTER": "local[1]", "SLUICE_SPARK_SHUFFLE_PARTITIONS": "2",
                    "SLUICE_SPARK_DRIVER_MEMORY": "512m", "SLUICE_SINK_APPLY_PARTITIONS": "2",
                    "SLUICE_SHARD_DDL_INFO_RESEND_S": "2", "SLUICE_SINK_DISCOVERY_INTERVAL_S": "1"},
    )
    workload: ShardWorkload | None = None
    api: Api | None = None
    ddl_feed: DdlFeed | None = None
    begun = time.monotonic()
    try:
        say(f"starting nats-server, 2 MariaDB sources (ROW binlog) and the {args.downstream} downstream "
            f"in {args.dir}")
        system.start_infra()
        assert system.nats is not None
        say(f"NATS requires a user: each service connects as its own role with least-privilege "
            f"permissions; the stack's passwords are in {system.nats.data_dir / 'auth.json'} (0600)")
        for line in server_lines(system):
            say(line)
        workload = ShardWorkload(system, args.seed, args.rate, args.txn_rows)
        workload.create()
        say(f"each source holds {', '.join(f'{s}.{t}' for s in SCHEMAS for t in TABLES)}: "
            f"{len(workload.shards)} shards with {SEED_ROWS} rows each, disjoint id ranges")
        if stop.is_set():
            raise Stopped
        say(f"starting every service: capture per source; member, scheduler, replication-manager and "
            f"ddl-lock with 2 replicas each; {args.workers} sink-workers (Spark local); the api")
        system.start_services()
        for proc in system.processes.values():
            wait_for(functools.partial(_healthy, proc), 120, f"{proc.instance_id} /healthz", stop)
        api = Api(system.processes["api-1"].base_url, system.api_token)
        # The token goes to a file only the user can read, never to the terminal or its scrollback.
        token_file = args.dir / "api-token"
        token_file.unlink(missing_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(system.api_token)
        say(f"the api runs with auth on; its operator token is in {token_file} (0600) "
            "(Authorization: Bearer <token>, or SLUICE_API_TOKEN for the CLI)")
        a = api
        services = ("member", "scheduler", "replication-manager", "ddl-lock")
        wait_for(lambda: len(a.try_get("/members") or []) >= args.workers
                 and {ld["service"] for ld in a.try_get("/leaders") or []} >= set(services),
                 120, "every sink-worker to join and every control service to elect a leader", stop)
        # A member takes spans only once it reported to the replication-manager leader; a
        # changefeed created before that would start every span on the first worker and stay
        # there until the periodic balance.
        wait_for(functools.partial(_scheduler_sees, system, args.workers), 120,
                 "the scheduler to see every sink-worker as usable", stop)
        for ld in api.get("/leaders"):
            if ld["service"] in services:
                say(f"    leader of {ld['service']:<20} {ld['leader']} (epoch {ld['epoch']})")
        say(f"    members: {', '.join(m['member_id'] for m in api.get('/members'))}")

        spec = system.changefeed_spec(CHANGEFEED, include=[f"{s}.*" for s in SCHEMAS]).model_copy(update={
            "routes": [RouteRuleV1(source="*", database="shop_*", table="orders_*", target_schema=TARGET[0],
                                   target_table=TARGET[1], name="orders")]})
        resp = api.client.post("/changefeeds", json=spec.model_dump(mode="json"))
        if resp.status_code != 202:
            raise RuntimeError(f"the api refused the changefeed: {resp.status_code} {resp.text}")
        say(f"changefeed '{CHANGEFEED}' created through the api: route *:shop_*.orders_* -> "
            f"{TARGET[0]}.{TARGET[1]} on {system.sink_url} (initial load: copy, then stream)")

        ddl_feed = DdlFeed(api.base_url, api.headers, stop)
        ddl_feed.start()
        progress = Progress(system, api, workload)
        workload.plan_ddl(args.seconds * 0.2, args.seconds * 0.6)
        # A light load first: every shard's first change makes it a span, and the initial load
        # copies what the shards hold while the workers' Spark sessions start.
        workload.rate = max(args.rate / 10, 20.0)
        workload.start()
        say(f"light workload (~{workload.rate:,.0f} row changes/s) while every span copies its shard's "
            "rows and starts streaming")
        wait_for(progress.all_streaming, args.warmup_timeout, "every span replicating with its initial "
                 "load done", stop, tick=lambda: progress.print("warm-up"))
        progress.print("warm-up")
        progress.placement()
        say(f"every span streams ({time.monotonic() - begun:.0f}s after start); now ~{args.rate:,.0f} row "
            f"changes/s for {args.seconds:.0f}s, and each shard gets the DDL between "
            f"{args.seconds * 0.2:.0f}s and {args.seconds * 0.6:.0f}s")
        workload.rate = args.rate
        workload.begin_ddl_rollout()
        timed = time.monotonic()
        w = workload
        wait_for(lambda: time.monotonic() - timed >= args.seconds or w.error is not None, args.seconds + 5,
                 "the workload", stop, tick=lambda: progress.print("load"))
        workload.stop()
        if workload.error is not None:
            raise RuntimeError(f"the workload failed: {workload.error!r}")
        # Every change is committed before this ts: once the changefeed checkpoint (the minimum
        # over its spans) passes it, the target holds all of them.
        end_ts = int(time.time() * 1000) << 18
        say(f"workload done: {workload.rows:,} row changes; waiting for the changefeed checkpoint to pass "
            "the last one")
        def caught_up() -> bool:
            return int(progress.changefeed.get("checkpoint_ts") or 0) >= end_ts and not progress.locks

        try:
            wait_for(caught_up, args.converge_timeout, "the checkpoint to pass the end of the workload",
                     stop, tick=lambda: progress.print("catch-up"))
        except TimeoutError as exc:
            say(f"{exc}; comparing what the target holds now")
        progress.print("caught-up")
        progress.placement()
        outcome = in_thread(functools.partial(verify, system, workload), stop)
        counts = ddl_feed.counts
        say(f"shard DDL (from the ddl event feed): locks created {counts.get('lock_created', 0)}, "
            f"shards synced {len(ddl_feed.synced)}/{ddl_feed.expected}, "
            f"exec issued {counts.get('operation_issued:exec', 0)}, "
            f"skip issued {counts.get('operation_issued:skip', 0)}, "
            f"resolved {counts.get('lock_resolved', 0)}")
        ok = isinstance(outcome, Verification) and outcome.ok
        if isinstance(outcome, Verification):
            say(f"checksum {TARGET[0]}.{TARGET[1]} vs the {len(workload.shards)} shards: upstream "
                f"{outcome.diff.upstream_count:,} rows {outcome.upstream_digest[:16]}  downstream "
                f"{outcome.diff.downstream_count:,} rows {outcome.downstream_digest[:16]}  -> "
                f"{'EQUAL' if ok else 'DIFFERENT'}")
            if not ok:
                say(str(outcome.diff))
        else:
            say(f"checksum {TARGET[0]}.{TARGET[1]}: {outcome} -> DIFFERENT")
        say(f"RESULT: {'EQUAL' if ok else 'DIFFERENT'} ({time.monotonic() - begun:.0f}s after start)")
        say(f"API docs: {api.base_url}/docs   logs: {args.dir / 'logs'}")
        for line in server_lines(system):
            say(line)
        assert system.nats is not None
        say(f"read the streams as the read-only NATS user: user 'reader', password from "
            f"{system.nats.data_dir / 'auth.json'}, server {system.nats.plain_url}")
        say(f"    curl -H \"Authorization: Bearer $(cat {token_file})\" {api.base_url}/api/v1/changefeeds")
        say(f"CLI: SLUICE_API_URL={api.base_url} SLUICE_API_TOKEN=$(cat {token_file}) "
            ".venv/bin/sluice status   "
            f"(also: changefeed tables {CHANGEFEED}, member list, ddl list)")
        if not args.no_wait:
            say("the system keeps running; press Ctrl-C to stop it")
            stop.wait()
        return 0 if ok else 1
    except Stopped:
        say("interrupted")
        return 130
    except TimeoutError as exc:
        say(f"giving up: {exc}")
        return 1
    finally:
        stop.set()
        if workload is not None:
            workload.stop()
        if ddl_feed is not None:
            ddl_feed.close()
        if api is not None:
            api.close()
        say("stopping every service and server")
        shutdown(system)
        say("stopped")


def _scheduler_sees(system: LocalSystem, workers: int) -> bool:
    for name, proc in system.processes.items():
        health = proc.health() if name.startswith("scheduler-") else None
        if health and health.get("leader"):
            return len(health.get("scheduling", {}).get("usable_members", [])) >= workers
    return False


def _healthy(proc: ServiceProcess) -> bool:
    if not proc.alive():
        raise RuntimeError(f"{proc.instance_id} exited; log:\n{proc.tail_log()}")
    return proc.health() is not None


# ------------------------------------------------------------------------- process handling

def supervise() -> int:
    """Run the demo in a child in its own process group and forward Ctrl-C/SIGTERM to it, so a
    terminal's Ctrl-C does not hit every server and service at once: the child stops them in order."""
    child = subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, CHILD_ENV: str(os.getpid())},
                             process_group=0)

    def forward(signum: int, _frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    while True:
        try:
            return child.wait()
        except InterruptedError:
            continue


def child_main(args: argparse.Namespace) -> int:
    stop = threading.Event()
    parent = int(os.environ.get(CHILD_ENV, "0"))

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if not stop.is_set():
            say(f"{signal.Signals(signum).name}: stopping")
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    def watch_parent() -> None:
        # The supervising demo process killed outright: stop rather than leave the system running.
        while not stop.wait(1.0):
            if parent and os.getppid() != parent:
                say("the demo's parent process is gone: stopping")
                stop.set()

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    return run(args, stop)


def main() -> int:
    args = build_parser().parse_args()
    # The demo's state (NATS passwords, the servers' data, logs) is for its user alone; the
    # processes it starts inherit the mask.
    os.umask(0o077)
    if os.environ.get(CHILD_ENV) is None:
        return supervise()
    return child_main(args)


if __name__ == "__main__":
    sys.exit(main())
