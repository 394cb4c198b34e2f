"""The demo: start a whole Sluice system on this machine and replicate a live workload.

Started by the README's first command (``bash infra/dev.sh demo``). It starts nats-server, two
MariaDB sources with ROW binlogs, the downstream (SQLite by default, ``--downstream postgres``
or ``mariadb``), every service as its own process, creates a changefeed that merges the
``shop.*`` tables of both sources into one downstream, runs inserts, updates and deletes on
both sources, prints rows/s, checkpoint lag and where every span runs as it goes, and ends by
comparing downstream and upstream checksums. It then leaves the system up (the API's /docs
URL is printed) until Ctrl-C, and stops everything cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from libs.localservers.system import LocalSystem  # noqa: E402
from services.sink_worker.verify import ShardRef, verify_target  # noqa: E402

TABLES = {
    "customers": (
        "CREATE TABLE IF NOT EXISTS shop.customers ("
        " id BIGINT PRIMARY KEY, name VARCHAR(64) NOT NULL, email VARCHAR(128) NOT NULL,"
        " vip TINYINT NOT NULL DEFAULT 0, UNIQUE KEY uk_email (email))"
    ),
    "orders": (
        "CREATE TABLE IF NOT EXISTS shop.orders ("
        " id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, amount DECIMAL(12,2) NOT NULL,"
        " status ENUM('new','paid','shipped','cancelled') NOT NULL, note TEXT NULL,"
        " created_at DATETIME(6) NOT NULL, attrs JSON NULL)"
    ),
}


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Workload:
    """Random DML on one source; ids are disjoint across sources so the shards merge cleanly."""

    def __init__(self, system: LocalSystem, index: int, seed: int) -> None:
        self.conn = system.source_dbs[index].connect()
        self.base = (index + 1) * 1_000_000_000
        self.rng = random.Random(seed + index)
        self.next_id = 1
        self.live: list[int] = []
        self.rows = 0

    def step(self, txn_rows: int) -> None:
        with self.conn.cursor() as cur:
            cur.execute("BEGIN")
            for _ in range(txn_rows):
                roll = self.rng.random()
                if roll < 0.55 or len(self.live) < 20:
                    oid = self.base + self.next_id
                    self.next_id += 1
                    cid = self.base + self.rng.randint(1, 500)
                    cur.execute(
                        "INSERT INTO shop.customers (id, name, email) VALUES (%s, %s, %s)"
                        " ON DUPLICATE KEY UPDATE vip = vip + 1",
                        (cid, f"customer {cid}", f"c{cid}@example.com"))
                    cur.execute(
                        "INSERT INTO shop.orders VALUES (%s, %s, %s, 'new', %s, NOW(6), %s)",
                        (oid, cid, round(self.rng.uniform(1, 999), 2),
                         self.rng.choice([None, "gift 🎁", "fragile", "ünïcode"]),
                         json.dumps({"items": self.rng.randint(1, 5)})))
                    self.live.append(oid)
                    self.rows += 2
                elif roll < 0.85:
                    oid = self.rng.choice(self.live)
                    cur.execute("UPDATE shop.orders SET status = %s, amount = amount + 1 WHERE id = %s",
                                (self.rng.choice(["paid", "shipped"]), oid))
                    self.rows += 1
                else:
                    oid = self.live.pop(self.rng.randrange(len(self.live)))
                    cur.execute("DELETE FROM shop.orders WHERE id = %s", (oid,))
                    self.rows += 1
            cur.execute("COMMIT")


def worker_status(system: LocalSystem) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for name, proc in system.processes.items():
        if name.startswith("sink-worker") and proc.alive():
            health = proc.health() or {}
            for span in health.get("spans", []):
                spans.append({**span, "worker": name})
    return spans


def leaders(system: LocalSystem) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, proc in system.processes.items():
        health = proc.health() or {}
        if health.get("leader"):
            out[name.rsplit("-", 1)[0]] = f"{name} (epoch {health.get('epoch')})"
    return out


def print_progress(system: LocalSystem, workloads: list[Workload], started: float,
                   last: dict[str, float]) -> None:
    now = time.monotonic()
    written = sum(w.rows for w in workloads)
    spans = worker_status(system)
    applied = sum(int(s.get("rows_written") or 0) for s in spans)
    dt = max(now - last["t"], 1e-6)
    up_rate = (written - last["up"]) / dt
    down_rate = (applied - last["down"]) / dt
    last.update(t=now, up=written, down=applied)
    lags = [s["lag_s"] for s in spans if s.get("lag_s") is not None]
    say(f"t={now - started:5.1f}s upstream {written} rows ({up_rate:,.0f}/s)  "
        f"applied {applied} rows ({down_rate:,.0f}/s)  max checkpoint lag "
        f"{max(lags) if lags else float('nan'):.2f}s")
    for s in spans:
        say(f"    span {s['source']}.{s['database']}.{s['table']:<10} on {s['worker']:<14} "
            f"state={s['state']:<11} lag={s.get('lag_s')}")


def verify(system: LocalSystem, deadline_s: float) -> bool:
    shards = {t: [ShardRef(db.url, "shop", t) for db in system.source_dbs] for t in TABLES}
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            results = {t: verify_target(refs, system.sink_url, "shop", t) for t, refs in shards.items()}
        except Exception as exc:  # the target table may not exist until the first batch lands
            if time.monotonic() > deadline:
                say(f"cannot read the downstream: {exc}")
                return False
            time.sleep(1.0)
            continue
        if all(r.ok for r in results.values()) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for t, r in results.items():
        status = "EQUAL" if r.ok else "DIFFERENT"
        say(f"checksum shop.{t}: upstream {r.diff.upstream_count} rows {r.upstream_digest[:16]}  "
            f"downstream {r.diff.downstream_count} rows {r.downstream_digest[:16]}  -> {status}")
        if not r.ok:
            say(str(r.diff))
    return all(r.ok for r in results.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--downstream", choices=["sqlite", "postgres", "mariadb"], default="sqlite")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the workload runs")
    parser.add_argument("--txn-rows", type=int, default=20, help="row changes per transaction")
    parser.add_argument("--rate", type=float, default=2000.0, help="target upstream row changes/s")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-wait", action="store_true", help="stop after the checksum comparison")
    parser.add_argument("--dir", type=Path, default=ROOT / ".sluice" / "demo")
    args = parser.parse_args()

    shutil.rmtree(args.dir, ignore_errors=True)
    system = LocalSystem(base_dir=args.dir, sources=2, downstream=args.downstream)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ok = False
    try:
        say(f"starting nats-server, 2 MariaDB sources and the {args.downstream} downstream in {args.dir}")
        system.start_infra()
        for db in system.source_dbs:
            db.execute("CREATE DATABASE IF NOT EXISTS shop", *TABLES.values())
        # The tables exist before capture starts (start=current), as on a source that is already
        # in production; their CREATE TABLE is not part of the stream.
        say("starting every service (capture per source, 2 replicas of each leader-elected "
            "service, a sink-worker, the api)")
        system.start_services()
        system.wait_healthy()
        say(f"leaders: {leaders(system)}")
        spec = system.changefeed_spec("demo", include=["shop.*"])
        asyncio.run(system.create_changefeed(spec))
        say(f"changefeed 'demo' created: sources {[s.id for s in spec.sources]} -> {system.sink_url}")

        workloads = [Workload(system, i, args.seed) for i in range(len(system.source_dbs))]
        started = time.monotonic()
        last = {"t": started, "up": 0.0, "down": 0.0}
        next_print = started + 2
        while time.monotonic() - started < args.seconds and not stop.is_set():
            for w in workloads:
                w.step(args.txn_rows)
            # Pace the workload: ahead of the target rate, wait (bounded) before the next round.
            ahead = sum(w.rows for w in workloads) / args.rate - (time.monotonic() - started)
            if ahead > 0:
                stop.wait(min(ahead, 0.5))
            if time.monotonic() >= next_print:
                print_progress(system, workloads, started, last)
                next_print += 2
        say(f"workload done: {sum(w.rows for w in workloads)} row changes; waiting for replication")
        ok = verify(system, deadline_s=120)
        print_progress(system, workloads, started, last)
        say("RESULT: downstream equals upstream" if ok else "RESULT: downstream differs from upstream")
        api = system.processes.get("api-1")
        if api is not None:
            say(f"API docs: {api.base_url}/docs   (logs in {args.dir / 'logs'})")
            say(f"CLI: SLUICE_API_URL={api.base_url} .venv/bin/sluice status")
        if not args.no_wait:
            say("the system keeps running; press Ctrl-C to stop it")
            try:
                while not stop.is_set():
                    stop.wait(1.0)
            except KeyboardInterrupt:
                pass
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        say("stopping every service and server")
        system.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
