"""The apply path against the database's own ceiling (issue 3): one run, one MariaDB.

    .venv/bin/python -m benchmarks.apply [--rows 1000000] [--seed 7] [--spark default tuned cold]
        [--skip naive insert load] [--naive-budget-s 120] [--warmup-rows 100000] [--fast-db]
        [--profile DIR]

Starts a private nats-server and a private MariaDB (durable commits, as a production
downstream; ``--fast-db`` for the test servers' non-durable settings), generates ``--rows``
mixed row changes (inserts, updates of which some change the primary key or a unique key,
deletes) on four tables with a realistic column mix, and publishes them to JetStream the way
capture does: one ``RowsChangedV2`` per (transaction, table), split in parts of at most 500
rows, then a resolved mark. Then, each into its own database of the same MariaDB:

- the Spark apply path, end to end from JetStream to the target tables through the real
  ``Pipeline`` (pull, sort job, apply job, checkpoints): default options, tuned ones, and
  default options on a cold worker. Each runs in a fresh subprocess whose whole process tree
  (Python driver, Spark JVM, Python workers) is sampled for the peak RSS and CPU seconds. Its
  clock starts at the first round, with Spark and its Python workers started, and (not cold)
  after the worker applied a separate warm-up workload, as a long-running worker has (JIT,
  codegen, class loading);
- row-at-a-time autocommit apply of the same changes, in commit order (the naive baseline),
  time-boxed by ``--naive-budget-s`` and checked against the state after what it applied;
- single-connection multi-row ``INSERT`` (pymysql ``executemany``, which batches rows into
  ~1 MB statements) of the final rows;
- ``LOAD DATA LOCAL INFILE`` of the final rows (the file is written before the clock starts).

Baselines get their values already decoded (only the database work is timed), so they are as
fast as they can be. Every result is checked against the expected final state (row count and
``libs.checksum`` digest per table): a wrong result fails the run instead of reporting a speed.

Rates: the Spark path and the naive apply are "row changes per second" (the input); INSERT and
LOAD DATA are "final rows per second". The collapse to the final image per key is part of what
the apply path does, so the issue's target compares exactly these; the "s vs INSERT" column
compares wall times, i.e. how long each takes to bring a table to the same final state.

``--profile DIR`` attaches py-spy (``pip install py-spy``) to the Spark runs' Python processes,
records the JVM with Java Flight Recorder and its per-thread CPU, and keeps Spark's event log
(``python -m benchmarks.spark_stages DIR/<run>-eventlog`` prints the stage timings).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
from nats.js import api

from benchmarks.memory import MemorySampler, cpu_seconds
from benchmarks.output import Figures, add_json_option
from contracts import REGISTRY
from contracts.events.rows import (
    ColumnKind,
    ColumnV1,
    ResolvedAdvancedV1,
    RowImageV2,
    RowOp,
    RowsChangedV2,
    SourcePositionV1,
    TableMetaV1,
)
from libs.checksum import table_checksum
from libs.codec.decode import decode_row, format_time
from libs.config import Settings
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.streams import resolved_subject, rows_subject
from libs.streams_setup import ensure_rows_stream
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.mysql import MySQLSink
from services.sink_worker.span.target import choose_key

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "bench1"
DATABASE = "shop"  # the Spark path writes to the database the events name
PART_ROWS = 500  # capture's part_rows default


def _col(name: str, kind: ColumnKind, sql_type: str, nullable: bool = True) -> ColumnV1:
    return ColumnV1(name=name, kind=kind, sql_type=sql_type, nullable=nullable)


TABLES: dict[str, TableMetaV1] = {
    "customers": TableMetaV1(columns=[
        _col("id", "int", "int(11)", False), _col("email", "string", "varchar(64)", False),
        _col("name", "string", "varchar(64)"), _col("balance", "decimal", "decimal(12,2)"),
        _col("tier", "string", "enum('bronze','silver','gold')"),
        _col("created_at", "datetime", "datetime(6)"), _col("updated_at", "timestamp", "timestamp(6)"),
    ], primary_key=["id"], unique_keys=[["email"]]),
    "orders": TableMetaV1(columns=[
        _col("id", "int", "bigint(20)", False), _col("customer_id", "int", "int(11)"),
        _col("status", "string", "varchar(16)"), _col("amount", "decimal", "decimal(12,2)"),
        _col("placed_at", "datetime", "datetime(6)"), _col("note", "string", "text"),
        _col("attrs", "json", "longtext"),
    ], primary_key=["id"]),
    "order_items": TableMetaV1(columns=[
        _col("order_id", "int", "bigint(20)", False), _col("line_no", "int", "int(11)", False),
        _col("sku", "string", "varchar(32)"), _col("qty", "int", "int(11)"),
        _col("price", "decimal", "decimal(10,2)"), _col("discount", "float", "double"),
    ], primary_key=["order_id", "line_no"]),
    "audit_log": TableMetaV1(columns=[
        _col("id", "int", "bigint(20)", False), _col("kind", "string", "varchar(16)"),
        _col("payload", "bytes", "blob"), _col("day", "date", "date"),
        _col("flags", "set", "set('a','b','c')"), _col("elapsed", "time", "time(6)"),
    ], primary_key=["id"]),
}
TABLE_WEIGHTS = {"orders": 0.35, "order_items": 0.35, "customers": 0.15, "audit_log": 0.15}
SINGLE_INT_KEY = ("customers", "orders", "audit_log")

Image = dict[str, Any]
Key = tuple[Any, ...]


# --------------------------------------------------------------------------- the workload


@dataclass
class Change:
    table: str
    op: RowOp
    before: Image | None
    after: Image | None


@dataclass
class Workload:
    source: str
    database: str
    rows: int
    messages: list[tuple[str, bytes, str]]  # (subject, payload, Nats-Msg-Id)
    changes: list[Change]  # in commit order
    final: dict[str, dict[Key, Image]]  # table -> key -> image (contract encoding)
    first_ts: int
    last_ts: int
    transactions: int = 0
    ops: dict[str, int] = field(default_factory=dict)

    def final_rows(self) -> int:
        return sum(len(t) for t in self.final.values())


class _Table:
    """One table's current upstream state, with O(1) random picks."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.meta = TABLES[name]
        self.key = tuple(self.meta.primary_key)
        self.rows: dict[Key, Image] = {}
        self._keys: list[Key] = []
        self._pos: dict[Key, int] = {}

    def put(self, image: Image) -> None:
        k = tuple(image[c] for c in self.key)
        if k not in self._pos:
            self._pos[k] = len(self._keys)
            self._keys.append(k)
        self.rows[k] = image

    def remove(self, k: Key) -> None:
        del self.rows[k]
        i = self._pos.pop(k)
        last = self._keys.pop()
        if i < len(self._keys):
            self._keys[i] = last
            self._pos[last] = i

    def pick(self, rnd: random.Random) -> Key:
        return self._keys[rnd.randrange(len(self._keys))]


class Generator:
    """Seeded: the same ``--seed`` and ``--rows`` give the same changes."""

    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.tables = {name: _Table(name) for name in TABLES}
        self.next_id = {name: 1 for name in TABLES}
        self.next_email = 1
        self.base = datetime(2024, 1, 1)

    def _ts_text(self) -> str:
        return (self.base + timedelta(seconds=self.rnd.randrange(30_000_000),
                                      microseconds=self.rnd.randrange(1_000_000))).isoformat(timespec="microseconds")

    def _text(self, lo: int, hi: int) -> str:
        n = self.rnd.randint(lo, hi)
        return "".join(self.rnd.choices("abcdefghijklmnopqrstuvwxyz     ", k=n)).strip() or "x"

    def _fresh_id(self, table: str) -> int:
        i = self.next_id[table]
        self.next_id[table] += 1
        return i

    def _email(self) -> str:
        self.next_email += 1
        return f"user{self.next_email}@example.com"

    def row(self, table: str, key: Key | None = None, old: Image | None = None) -> Image:
        r = self.rnd
        if table == "customers":
            return {"id": key[0] if key else self._fresh_id(table),
                    "email": old["email"] if old and r.random() < 0.8 else self._email(),
                    "name": self._text(4, 24),
                    "balance": f"{r.randrange(-10_000_00, 1_000_000_00) / 100:.2f}",
                    "tier": r.choice(("bronze", "silver", "gold")),
                    "created_at": old["created_at"] if old else self._ts_text(),
                    "updated_at": self._ts_text()}
        if table == "orders":
            emoji = " \U0001f680" if r.random() < 0.1 else ""
            note = None if r.random() < 0.4 else self._text(10, 120) + emoji
            return {"id": key[0] if key else self._fresh_id(table), "customer_id": r.randrange(1, 200_000),
                    "status": r.choice(("new", "paid", "shipped", "cancelled", "returned")),
                    "amount": f"{r.randrange(1, 500_000_00) / 100:.2f}", "placed_at": self._ts_text(),
                    "note": note,
                    "attrs": json.dumps({"channel": r.choice(("web", "app", "pos")), "items": r.randint(1, 9),
                                         "gift": r.random() < 0.1})}
        if table == "order_items":
            if key is None:
                key = (r.randrange(1, 300_000), self._fresh_id(table))
            return {"order_id": key[0], "line_no": key[1], "sku": f"SKU-{r.randrange(100_000):06d}",
                    "qty": r.randint(1, 20), "price": f"{r.randrange(1, 100_000) / 100:.2f}",
                    "discount": None if r.random() < 0.5 else round(r.random() * 0.3, 4)}
        payload = base64.b64encode(r.randbytes(r.randint(16, 200))).decode()
        return {"id": key[0] if key else self._fresh_id(table),
                "kind": r.choice(("login", "export", "api", "job")),
                "payload": payload, "day": date.fromordinal(738_886 + r.randrange(700)).isoformat(),
                "flags": ",".join(f for f in ("a", "b", "c") if r.random() < 0.5),
                "elapsed": format_time(timedelta(microseconds=r.randrange(0, 3_600_000_000)), 6)}

    def change(self, table: str) -> Change:
        t = self.tables[table]
        r = self.rnd
        x = r.random()
        if len(t.rows) < 100 or x < 0.50:
            image = self.row(table)
            t.put(image)
            return Change(table, "insert", None, image)
        k = t.pick(r)
        before = t.rows[k]
        if x < 0.88:
            if table in SINGLE_INT_KEY and r.random() < 0.03:
                new_key: Key = (self._fresh_id(table),)  # an update that moves the row to a new key
            else:
                new_key = k
            after = self.row(table, new_key, before)
            if new_key != k:
                t.remove(k)
            t.put(after)
            return Change(table, "update", before, after)
        t.remove(k)
        return Change(table, "delete", before, None)

    def txn_size(self) -> int:
        # Mostly small OLTP transactions, some batch jobs: about 80 rows per transaction.
        x = self.rnd.random()
        if x < 0.70:
            return self.rnd.randint(1, 20)
        if x < 0.95:
            return self.rnd.randint(20, 200)
        return self.rnd.randint(200, 2000)


def generate(total: int, seed: int, source: str = SOURCE, database: str = DATABASE) -> Workload:
    gen = Generator(seed)
    names = list(TABLE_WEIGHTS)
    weights = [TABLE_WEIGHTS[n] for n in names]
    first_ts = ts = (int(time.time() * 1000) - 3_600_000) << 18
    seq = 0
    messages: list[tuple[str, bytes, str]] = []
    changes: list[Change] = []
    ops = {"insert": 0, "update": 0, "delete": 0, "key_change": 0}
    txns = 0
    while len(changes) < total:
        n = min(gen.txn_size(), total - len(changes))
        touched = gen.rnd.choices(names, weights, k=1 if gen.rnd.random() < 0.7 else 2)
        ts += 1 << 18
        txns += 1
        per_table: dict[str, list[Change]] = {}
        for _ in range(n):
            c = gen.change(gen.rnd.choice(touched))
            changes.append(c)
            ops[c.op] += 1
            if c.op == "update" and c.before is not None and c.after is not None and \
                    [c.before[k] for k in TABLES[c.table].primary_key] != \
                    [c.after[k] for k in TABLES[c.table].primary_key]:
                ops["key_change"] += 1
            per_table.setdefault(c.table, []).append(c)
        for table, rows in per_table.items():
            parts = [rows[i:i + PART_ROWS] for i in range(0, len(rows), PART_ROWS)]
            for part, chunk in enumerate(parts):
                seq += 1
                event = RowsChangedV2.model_construct(
                    source=source, database=database, table=table, ts=ts, seq=seq, part=part,
                    last_part=part == len(parts) - 1,
                    position=SourcePositionV1(binlog_file="binlog.000001", binlog_pos=4 + seq * 100),
                    meta=TABLES[table],
                    rows=[RowImageV2.model_construct(op=c.op, before=c.before, after=c.after) for c in chunk])
                msg_id = f"{source}:binlog.000001:{4 + txns * 100}:{database}.{table}:{part}"
                data = REGISTRY.encode(event, producer="bench-capture", event_id=msg_id)
                messages.append((rows_subject(source, database, table), data, msg_id))
    final = {name: dict(t.rows) for name, t in gen.tables.items()}
    return Workload(source=source, database=database, rows=len(changes), messages=messages, changes=changes,
                    final=final, first_ts=first_ts,
                    last_ts=ts, transactions=txns, ops=ops)


async def publish(nats_url: str, work: Workload) -> float:
    """Publish like capture: pipelined acks, then a resolved mark once every ack is in."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_rows_stream(js, Settings(nats_url=nats_url))
        started = time.monotonic()
        window: list[asyncio.Future[Any]] = []
        for subject, data, msg_id in work.messages:
            window.append(await js.publish_async(subject, data, headers={api.Header.MSG_ID.value: msg_id},
                                                 wait_stall=30.0))
            if len(window) >= 512:
                await asyncio.gather(*window)
                window.clear()
        await asyncio.gather(*window)
        position = SourcePositionV1(binlog_file="binlog.000001", binlog_pos=4 + len(work.messages) * 100)
        mark = REGISTRY.encode(ResolvedAdvancedV1(source=work.source, ts=work.last_ts, position=position),
                               producer="bench-capture")
        await js.publish(resolved_subject(work.source), mark, headers={api.Header.ROLLUP.value: "sub"})
        return time.monotonic() - started
    finally:
        await nc.close()


# --------------------------------------------------------------------------- targets and checks


def target(table: str, schema: str) -> TargetTable:
    meta = TABLES[table]
    key = choose_key(meta, "primary")
    unique = tuple(tuple(uk) for uk in meta.unique_keys if tuple(uk) != key)
    return TargetTable(schema=schema, name=table, meta=meta, key=key, unique_keys=unique)


def expected_checksums(work: Workload, upto: int | None = None) -> dict[str, tuple[int, str]]:
    """Count and digest per table of the final state, or of the state after the first ``upto``
    changes (replayed here from the empty tables)."""
    final = work.final
    if upto is not None:
        final = {table: {} for table in TABLES}
        for c in work.changes[:upto]:
            key_cols = TABLES[c.table].primary_key
            if c.before is not None:
                final[c.table].pop(tuple(c.before[k] for k in key_cols), None)
            if c.after is not None:
                final[c.table][tuple(c.after[k] for k in key_cols)] = c.after
    out = {}
    for table, rows in final.items():
        meta = TABLES[table]
        decoded = [decode_row(meta, image) for image in rows.values()]
        out[table] = table_checksum(decoded, meta.columns, meta.primary_key)
    return out


def verify(db: MariaDB, schema: str, expected: dict[str, tuple[int, str]], what: str) -> None:
    sink = MySQLSink(db.url)
    for table in TABLES:
        tt = target(table, schema)
        got = table_checksum(sink.fetch_rows(tt), tt.meta.columns, tt.key)
        if got != expected[table]:
            want = expected[table]
            raise SystemExit(f"{what}: {schema}.{table} differs from the expected final state: "
                             f"{got[0]} rows / {got[1][:12]} vs {want[0]} rows / {want[1][:12]}")


def create_tables(db: MariaDB, schema: str) -> None:
    db.execute(f"DROP DATABASE IF EXISTS `{schema}`")
    sink = MySQLSink(db.url)
    for table in TABLES:
        sink.ensure_table(target(table, schema))


# --------------------------------------------------------------------------- baselines


def _decoded_changes(work: Workload) -> list[tuple[str, str, Image | None, Image | None]]:
    return [(c.table, c.op, decode_row(TABLES[c.table], c.before) if c.before else None,
             decode_row(TABLES[c.table], c.after) if c.after else None) for c in work.changes]


def _adapt(v: Any) -> Any:
    # As MySQLSink._adapt: pymysql renders a negative timedelta wrongly.
    return format_time(v, 6) if isinstance(v, timedelta) else v


def _connect(db: MariaDB, schema: str) -> Any:
    return db.connect(schema, binary_prefix=True, init_command="SET time_zone = '+00:00'")


def naive_apply(db: MariaDB, schema: str, work: Workload, budget_s: float) -> tuple[int, float]:
    """Row-at-a-time autocommit apply, in commit order: what a simple replicator does. Stops
    after ``budget_s`` (a commit per row on a durable server is slow); returns how many
    changes it applied and in how long."""
    create_tables(db, schema)
    changes = _decoded_changes(work)
    sql: dict[tuple[str, str], str] = {}
    for table, meta in TABLES.items():
        cols = [c.name for c in meta.columns]
        key = meta.primary_key
        where = " AND ".join(f"`{k}` = %s" for k in key)
        sql[(table, "insert")] = (f"INSERT INTO `{table}` ({', '.join(f'`{c}`' for c in cols)}) "
                                  f"VALUES ({', '.join(['%s'] * len(cols))})")
        assignments = ", ".join(f"`{c}` = %s" for c in cols)
        sql[(table, "update")] = f"UPDATE `{table}` SET {assignments} WHERE {where}"
        sql[(table, "delete")] = f"DELETE FROM `{table}` WHERE {where}"
    params: list[tuple[str, list[Any]]] = []
    for table, op, before, after in changes:
        key = TABLES[table].primary_key
        if op == "insert":
            assert after is not None
            params.append((sql[(table, op)], [_adapt(v) for v in after.values()]))
        elif op == "update":
            assert before is not None and after is not None
            params.append((sql[(table, op)], [_adapt(v) for v in after.values()] + [before[k] for k in key]))
        else:
            assert before is not None
            params.append((sql[(table, op)], [before[k] for k in key]))
    conn = _connect(db, schema)
    try:
        with conn.cursor() as cur:
            started = time.monotonic()
            applied = 0
            for statement, args in params:
                cur.execute(statement, args)
                applied += 1
                if applied % 1000 == 0 and time.monotonic() - started > budget_s:
                    break
            return applied, time.monotonic() - started
    finally:
        conn.close()


def _final_decoded(work: Workload) -> dict[str, list[list[Any]]]:
    return {table: [[_adapt(v) for v in decode_row(TABLES[table], image).values()] for image in rows.values()]
            for table, rows in work.final.items()}


def multirow_insert(db: MariaDB, schema: str, work: Workload) -> float:
    """The final rows over one connection, pymysql ``executemany`` (multi-row ~1 MB statements)."""
    create_tables(db, schema)
    final = _final_decoded(work)
    conn = _connect(db, schema)
    try:
        with conn.cursor() as cur:
            started = time.monotonic()
            for table, rows in final.items():
                cols = [c.name for c in TABLES[table].columns]
                cur.executemany(f"INSERT INTO `{table}` ({', '.join(f'`{c}`' for c in cols)}) "
                                f"VALUES ({', '.join(['%s'] * len(cols))})", rows)
            return time.monotonic() - started
    finally:
        conn.close()


def _tsv_field(v: Any) -> bytes:
    if v is None:
        return b"\\N"
    if isinstance(v, bytes):
        return v.hex().encode()  # loaded through UNHEX(): no charset conversion of binary data
    if isinstance(v, datetime):
        return v.isoformat(sep=" ").encode()
    text = str(v)
    return (text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
            .replace("\0", "\\0").encode())


def load_data(db: MariaDB, schema: str, work: Workload, tmp: Path) -> float:
    """``LOAD DATA LOCAL INFILE`` of the final rows; the files are written before the clock."""
    create_tables(db, schema)
    files: dict[str, Path] = {}
    for table, rows in _final_decoded(work).items():
        path = files[table] = tmp / f"{table}.tsv"
        with open(path, "wb") as f:
            for row in rows:
                f.write(b"\t".join(_tsv_field(v) for v in row) + b"\n")
    conn = _connect(db, schema)
    try:
        with conn.cursor() as cur:
            started = time.monotonic()
            for table, path in files.items():
                cols, sets = [], []
                for c in TABLES[table].columns:
                    if c.kind == "bytes":
                        cols.append(f"@{c.name}")
                        sets.append(f"`{c.name}` = UNHEX(@{c.name})")
                    else:
                        cols.append(f"`{c.name}`")
                set_clause = f" SET {', '.join(sets)}" if sets else ""
                cur.execute(f"LOAD DATA LOCAL INFILE %s INTO TABLE `{table}` CHARACTER SET utf8mb4 "
                            f"({', '.join(cols)}){set_clause}", (str(path),))
            return time.monotonic() - started
    finally:
        conn.close()


# --------------------------------------------------------------------------- the Spark path


@dataclass(frozen=True)
class SparkConfig:
    label: str
    max_events_per_round: int
    apply_partitions: int
    shuffle_partitions: int
    warm: bool = True
    """Run a warm-up workload first (JIT, codegen, class loading), as a long-running worker is."""
    java_options: str = ""


def _part(pid: int, root: int, argv: list[bytes]) -> str:
    if pid == root:
        return "driver"
    line = b" ".join(argv)
    return "jvm" if argv[0].endswith(b"java") else (
        "python workers" if b"pyspark.daemon" in line else
        "driver" if b"benchmarks.apply" in line else "other")


class RssSampler(MemorySampler):
    """Peak of the summed RSS of one process tree (the driver, the Spark JVM, its Python
    workers), and their CPU."""

    def __init__(self, pid: int, interval: float = 0.2, only: frozenset[str] | None = None) -> None:
        super().__init__(lambda: {"driver": pid}, _part, interval=interval, only=only, jvm_part="jvm")

    @property
    def peak(self) -> int:
        return self.peaks.get("driver", 0)

    @property
    def peak_parts_of_tree(self) -> dict[str, int]:
        return self.peak_parts.get("driver", {})


@dataclass
class SparkRun:
    config: SparkConfig
    seconds: float
    rounds: int
    rows_written: int
    phases: dict[str, float]
    peak_rss: int
    peak_parts: dict[str, int]
    cpu: dict[str, float]  # CPU seconds by part of the worker's tree, and of MariaDB ("mariadb")
    locks: dict[str, int]  # InnoDB row-lock waits, their total ms, deadlocks during the run


_LOCK_STATUS = ("Innodb_row_lock_waits", "Innodb_row_lock_time", "Innodb_deadlocks")


def lock_status(db: MariaDB) -> dict[str, int]:
    rows = db.execute("SHOW GLOBAL STATUS WHERE Variable_name IN ("
                      + ", ".join(f"'{name}'" for name in _LOCK_STATUS) + ")")
    return {str(name): int(value) for name, value in rows}


WORKER_SPEC_ENV = "BENCH_WORKER_SPEC"


def run_spark_path(nats_url: str, db: MariaDB, work: Workload, config: SparkConfig, tmp: Path,
                   profile: Path | None, warmup: Workload | None) -> SparkRun:
    db.execute(f"DROP DATABASE IF EXISTS `{work.database}`")
    spec: dict[str, Any] = {
        "nats_url": nats_url, "sink_url": db.url, "changefeed": f"bench{config.label}",
        "run": [work.source, work.database, work.last_ts],
        "max_events_per_round": config.max_events_per_round,
        "apply_partitions": config.apply_partitions, "shuffle_partitions": config.shuffle_partitions,
        "java_options": config.java_options}
    if config.warm and warmup is not None:
        db.execute(f"DROP DATABASE IF EXISTS `{warmup.database}`")
        spec["warmup"] = [warmup.source, warmup.database, warmup.last_ts]
    log_path = tmp / f"worker-{config.label}.log"
    env = {**os.environ, WORKER_SPEC_ENV: json.dumps(spec)}
    if os.environ.get("BENCH_JAVA_OPTIONS"):  # experiments with JVM flags
        env["JDK_JAVA_OPTIONS"] = os.environ["BENCH_JAVA_OPTIONS"]
    if profile is not None:
        # Java Flight Recorder in the Spark JVM (read it with `jfr print --events jdk.ExecutionSample`).
        profile.mkdir(parents=True, exist_ok=True)
        env["JDK_JAVA_OPTIONS"] = (f"-XX:StartFlightRecording=filename={profile / (config.label + '.jfr')},"
                                   "settings=profile")
        # Spark's event log: stage and task timings (benchmarks/spark_stages.py sums them up).
        events = profile / f"{config.label}-eventlog"
        events.mkdir(exist_ok=True)
        env["PYSPARK_SUBMIT_ARGS"] = ("--conf spark.eventLog.enabled=true "
                                      "--conf spark.eventLog.compress=false "
                                      f"--conf spark.eventLog.dir={events} pyspark-shell")
    with open(log_path, "wb") as log:
        # The spec holds the NATS admin URL, password included: in the child's environment (its
        # user's only), never in its command line (every local user's, through ps).
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.apply", "--worker"],
                                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
    sampler = RssSampler(proc.pid)
    sampler.start()
    assert db.proc is not None and proc.stdout is not None
    # The worker's stdout is shared with the JVM's: its own lines start with "BENCH ".
    while True:
        line = proc.stdout.readline()
        if not line or line.startswith(b"BENCH clock"):
            break
    sampler.start_clock()
    db_cpu = cpu_seconds(db.proc.pid)
    locks_before = lock_status(db)
    spy: subprocess.Popen[bytes] | None = None
    if profile is not None:
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        profile.mkdir(parents=True, exist_ok=True)
        out_file = profile / f"{config.label}.folded"
        with open(profile / "py-spy.log", "ab") as spy_log:
            spy = subprocess.Popen([py_spy, "record", "--pid", str(proc.pid), "--subprocesses",
                                    "--rate", "100", "--nonblocking", "--format", "raw", "-o", str(out_file)],
                                   stdout=subprocess.DEVNULL, stderr=spy_log)
    # The worker prints its result, then waits for stdin to close: the last sample sees it whole.
    out = b""
    while line:
        line = proc.stdout.readline()
        if line.startswith(b"BENCH {"):
            out = line[len(b"BENCH "):]
            break
    sampler.done.set()
    sampler.join()
    sampler.sample()
    proc.communicate()
    if spy is not None:
        spy.wait(60)
    if proc.returncode != 0:
        raise SystemExit(f"pipeline worker failed ({proc.returncode}); log {log_path}:\n"
                         + log_path.read_text(errors="replace")[-4000:])
    result = json.loads(out)
    cpu = {**sampler.cpu_by_part(), "mariadb": cpu_seconds(db.proc.pid) - db_cpu}
    locks = {k: v - locks_before.get(k, 0) for k, v in lock_status(db).items()}
    if profile is not None:
        threads = sorted(sampler.jvm_thread_cpu().items(), key=lambda kv: -kv[1])
        (profile / f"{config.label}.jvm-threads.txt").write_text(
            "".join(f"{v:8.2f} s  {k}\n" for k, v in threads if v >= 0.01))
    return SparkRun(config, result["seconds"], result["rounds"], result["rows_written"], result["phases"],
                    sampler.peak, sampler.peak_parts_of_tree, cpu, locks)


async def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """In the subprocess: the real Pipeline over every table until its checkpoints pass final_ts."""
    from prometheus_client import REGISTRY as METRICS

    from libs.scheduling.model import Span
    from libs.spark import get_spark
    from services.sink_worker.round.pipeline import Pipeline
    from services.sink_worker.span.checkpoints import CheckpointStore
    from services.sink_worker.span.runtime import PipelineOptions, SpanConfig

    settings = Settings(nats_url=spec["nats_url"], spark_shuffle_partitions=spec["shuffle_partitions"],
                        spark_driver_java_options=spec["java_options"])
    spark = get_spark(settings)
    # A running worker has its Python workers up (and their imports done) long before: do that
    # outside the clock.
    def warm(rows: Iterable[int]) -> Iterator[int]:
        import libs.codec.decode  # noqa: F401

        yield sum(rows)

    spark.sparkContext.parallelize(range(8), 4).mapPartitions(warm).collect()
    nc = await nats.connect(spec["nats_url"])
    try:
        js = nc.jetstream()
        checkpoints = await CheckpointStore(js).open()
        options = PipelineOptions(max_events_per_round=spec["max_events_per_round"],
                                  apply_partitions=spec["apply_partitions"])

        async def drain(changefeed: str, source: str, database: str, final_ts: int,
                        timeline: list[tuple[int, int, float, float]]) -> tuple[int, int, float]:
            """Rounds of a fresh pipeline over the workload's tables until all of it is applied."""
            pipeline = Pipeline(js, checkpoints, lambda: spark, options)
            config = SpanConfig(sink_url=spec["sink_url"])
            await pipeline.set_spans({Span.of(changefeed, source, database, t): config for t in TABLES})
            rows = rounds = 0
            pull_s = 0.0
            started = time.monotonic()
            try:
                while True:
                    report = await pipeline.round()
                    rounds += 1
                    if report.errors:
                        raise RuntimeError(f"round {rounds} failed: {report.errors}")
                    rows += report.rows_written
                    pull_s += report.pull_s
                    timeline.append((report.batch_events, report.rows_written, round(report.pull_s, 2),
                                     round(report.duration_s, 2)))
                    spans = pipeline.spans.values()
                    if all(rt.checkpoint is not None and rt.checkpoint.ts >= final_ts for rt in spans):
                        return rounds, rows, pull_s
                    if time.monotonic() - started > 3600:
                        raise RuntimeError("the pipeline did not reach the final ts within an hour")
            finally:
                await pipeline.close()

        def total(name: str) -> float:
            return float(METRICS.get_sample_value(f"{name}_sum") or 0.0)

        if spec.get("warmup"):
            source, database, final_ts = spec["warmup"]
            warm_rounds: list[tuple[int, int, float, float]] = []
            await drain(f"{spec['changefeed']}warm", source, database, final_ts, warm_rounds)
            print(f"warm-up rounds (events, rows written, pull s, round s): {warm_rounds}", file=sys.stderr)
        before = {name: total(name) for name in ("sluice_sink_sort_seconds", "sluice_sink_apply_seconds")}
        source, database, final_ts = spec["run"]
        timeline: list[tuple[int, int, float, float]] = []
        print("BENCH clock", flush=True)
        started = time.monotonic()
        rounds, rows, pull_s = await drain(spec["changefeed"], source, database, final_ts, timeline)
        seconds = time.monotonic() - started
        phases = {"pull": pull_s, **{name.split("_")[2]: total(name) - before[name] for name in before}}
        print(f"rounds (events, rows written, pull s, round s): {timeline}", file=sys.stderr)
        return {"seconds": seconds, "rounds": rounds, "rows_written": int(rows), "phases": phases}
    finally:
        await nc.close()


# --------------------------------------------------------------------------- report


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def print_report(work: Workload, spark_runs: Sequence[SparkRun], baselines: dict[str, float],
                 publish_s: float, naive_rows: int, durable: bool) -> None:
    final = work.final_rows()
    insert_s, load_s = baselines.get("insert"), baselines.get("load")
    insert_rate = final / insert_s if insert_s else None
    load_rate = final / load_s if load_s else None
    print()
    print(f"workload: {work.rows:,} row changes ({work.ops['insert']:,} inserts, "
          f"{work.ops['update']:,} updates "
          f"of which {work.ops['key_change']:,} change the key, {work.ops['delete']:,} deletes) in "
          f"{work.transactions:,} transactions, {len(work.messages):,} messages on {len(TABLES)} tables; "
          f"{final:,} final rows; published in {publish_s:.1f} s; MariaDB "
          f"{'durable (flush_log_at_trx_commit=1, sync_binlog=1)' if durable else 'not durable (2, 0)'}")
    print()
    header = (f"{'measure':<58} {'rows':>10} {'seconds':>8} {'rows/s':>9} {'/INSERT':>8} {'/LOAD':>7} "
              f"{'s vs INSERT':>11}")
    print(header)
    print("-" * len(header))

    def line(label: str, rows: int, seconds: float) -> None:
        rate = rows / seconds
        vs_insert = f"{rate / insert_rate:.2f}" if insert_rate else "-"
        vs_load = f"{rate / load_rate:.2f}" if load_rate else "-"
        time_ratio = f"{seconds / insert_s:.2f}x" if insert_s else "-"
        print(f"{label:<58} {rows:>10,} {seconds:>8.1f} {rate:>9,.0f} {vs_insert:>8} {vs_load:>7} "
              f"{time_ratio:>11}")

    for run in spark_runs:
        c = run.config
        line(f"Spark apply path, {c.label} ({c.max_events_per_round} ev/round, "
             f"{c.apply_partitions}/{c.shuffle_partitions} part.{', C1 JIT' if c.java_options else ''}"
             f"{'' if c.warm else ', cold'})", work.rows, run.seconds)
    if "naive" in baselines:
        what = "" if naive_rows == work.rows else " (first changes, time-boxed)"
        line(f"row-at-a-time autocommit apply{what}", naive_rows, baselines["naive"])
    if insert_s:
        line("single-connection multi-row INSERT of the final rows", final, insert_s)
    if load_s:
        line("LOAD DATA LOCAL INFILE of the final rows", final, load_s)
    print()
    for run in spark_runs:
        parts = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(run.peak_parts.items()))
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in run.phases.items())
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in sorted(run.cpu.items()))
        locks = ", ".join(f"{k.removeprefix('Innodb_')} {v}" for k, v in run.locks.items())
        print(f"Spark {run.config.label}: {run.rounds} rounds ({phases}); peak RSS of the worker "
              f"{_mib(run.peak_rss)} ({parts}); CPU s: {cpu}; {locks}")
    for run in spark_runs:
        rate = work.rows / run.seconds
        rss_met = rss_target(run.peak_rss / 2**20, work.rows)[1]
        rss = "-" if rss_met is None else ("met" if rss_met else "NOT met")
        if insert_rate:
            met_insert = "met" if rate >= insert_rate else "NOT met"
            print(f"target ({run.config.label}): >= 1.0x multi-row INSERT: {met_insert}; "
                  f"peak RSS <= 1.5 GiB at {RSS_TARGET_ROWS:,} changes: {rss}")


RSS_TARGET_MIB = 1536.0
RSS_TARGET_ROWS = 1_000_000


def rss_target(peak_mib: float, rows: int) -> tuple[str, bool | None]:
    """Issue 15: the worker's peak RSS <= 1.5 GiB applying 1M changes; a smaller run is shown
    against it but not judged (the peak grows with what a round holds)."""
    if rows >= RSS_TARGET_ROWS:
        return "<= 1.5 GiB", peak_mib <= RSS_TARGET_MIB
    return f"<= 1.5 GiB at {RSS_TARGET_ROWS:,} changes (not judged at {rows:,})", None


def figures_of(work: Workload, spark_runs: Sequence[SparkRun], baselines: dict[str, float],
               naive_rows: int, out: Figures) -> Figures:
    final = work.final_rows()
    insert_s, load_s = baselines.get("insert"), baselines.get("load")
    insert_rate = final / insert_s if insert_s else None
    load_rate = final / load_s if load_s else None
    parts = []
    if insert_rate:
        parts.append(f"multi-row INSERT {insert_rate:,.0f} rows/s")
    if load_rate:
        parts.append(f"LOAD DATA {load_rate:,.0f} rows/s")
    baseline = "; ".join(parts) + f" (of the {final:,} final rows, same database)" if parts else None
    # Issue 15: the apply at least as fast as a single-connection multi-row INSERT of the final rows.
    target = ">= 1.0x single-connection multi-row INSERT of the final rows" if insert_rate else None
    for run in spark_runs:
        c = run.config
        rate = work.rows / run.seconds
        met = rate >= insert_rate if insert_rate else None
        ratios = "".join([f"; {rate / insert_rate:.2f}x INSERT" if insert_rate else "",
                          f", {rate / load_rate:.2f}x LOAD DATA" if load_rate else ""])
        what = (f"{c.label}: {c.max_events_per_round:,} events/round, {c.apply_partitions}/"
                f"{c.shuffle_partitions} partitions{', C1 JIT' if c.java_options else ''}"
                f"{'' if c.warm else ', cold worker'}")
        out.add(f"apply path ({what}), {work.rows:,} row changes{ratios}", rate, "changes/s",
                baseline=baseline, target=target, met=met)
        parts_text = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(run.peak_parts.items()))
        rss_text, rss_met = rss_target(run.peak_rss / 2**20, work.rows)
        out.add(f"worker peak RSS, apply path ({what}), {work.rows:,} row changes (process tree: "
                f"{parts_text})", run.peak_rss / 2**20, "MiB", target=rss_text, met=rss_met)
    if "naive" in baselines:
        out.add(f"row-at-a-time autocommit apply ({naive_rows:,} changes)", naive_rows / baselines["naive"],
                "changes/s")
    return out


# --------------------------------------------------------------------------- main


def _configs(names: Sequence[str]) -> Iterator[SparkConfig]:
    known = {
        "default": SparkConfig("default", 2000, 4, 8),
        "tuned": SparkConfig("tuned", 20000, 2, 2, java_options="-XX:TieredStopAtLevel=1"),
        "cold": SparkConfig("cold", 2000, 4, 8, warm=False),
    }
    for n in names:
        yield known[n]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=1_000_000, help="row changes to generate")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--spark", nargs="*", default=["default", "tuned", "cold"],
                        choices=["default", "tuned", "cold"],
                        help="Spark configurations to run (cold: default settings, no warm-up)")
    parser.add_argument("--warmup-rows", type=int, default=100_000,
                        help="row changes a worker applies (elsewhere) before its clock starts")
    parser.add_argument("--skip", nargs="*", default=[], choices=["naive", "insert", "load"],
                        help="baselines to leave out (quick iterations only)")
    parser.add_argument("--profile", type=Path,
                        help="attach py-spy to the Spark runs; collapsed stacks (flamegraph input) go here")
    parser.add_argument("--keep", action="store_true", help="keep the servers' temp directory")
    parser.add_argument("--naive-budget-s", type=float, default=120.0,
                        help="time box of the row-at-a-time baseline (its rate is over what it applied)")
    parser.add_argument("--fast-db", action="store_true",
                        help="MariaDB without durable commits (flush_log_at_trx_commit=2, sync_binlog=0)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args(argv)
    out = Figures("apply")
    if args.worker:
        spec = json.loads(os.environ.pop(WORKER_SPEC_ENV))
        print("BENCH " + json.dumps(asyncio.run(_worker(spec))), flush=True)
        sys.stdin.read()
        return

    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-apply-"))
    nats_server = NatsServer(tmp / "nats").start()
    # A downstream as production would run it: durable commits (the local servers' default is
    # not, for tests) and a buffer pool that holds the data set. Every measurement below runs
    # against this same server.
    db = MariaDB(tmp / "mariadb", durable=not args.fast_db,
                 extra_args=("--innodb-buffer-pool-size=2G", "--innodb-log-file-size=512M",
                             "--max-allowed-packet=64M")).start()
    try:
        _say(f"generating {args.rows:,} row changes")
        work = generate(args.rows, args.seed)
        expected = expected_checksums(work)
        _say(f"publishing {len(work.messages):,} messages")
        publish_s = asyncio.run(publish(nats_server.url, work))
        warmup = None
        if args.warmup_rows and any(c.warm for c in _configs(args.spark)):
            warmup = generate(args.warmup_rows, args.seed + 1, source="warm1", database="warmup")
            asyncio.run(publish(nats_server.url, warmup))
        runs: list[SparkRun] = []
        for config in _configs(args.spark):
            _say(f"Spark apply path, {config.label}")
            run = run_spark_path(nats_server.url, db, work, config, tmp, args.profile, warmup)
            verify(db, DATABASE, expected, f"Spark {config.label}")
            _say(f"  {run.seconds:.1f} s, {work.rows / run.seconds:,.0f} rows/s, verified")
            runs.append(run)
        baselines: dict[str, float] = {}
        naive_rows = 0
        if "naive" not in args.skip:
            _say(f"baseline naive (at most {args.naive_budget_s:.0f} s)")
            naive_rows, baselines["naive"] = naive_apply(db, "bench_naive", work, args.naive_budget_s)
            partial_state = expected_checksums(work, naive_rows) if naive_rows < work.rows else expected
            verify(db, "bench_naive", partial_state, "naive")
            _say(f"  {naive_rows:,} changes in {baselines['naive']:.1f} s, verified")
        steps: list[tuple[str, str, Callable[[], float]]] = [
            ("insert", "bench_insert", lambda: multirow_insert(db, "bench_insert", work)),
            ("load", "bench_load", lambda: load_data(db, "bench_load", work, tmp)),
        ]
        for name, schema, step in steps:
            if name in args.skip:
                continue
            _say(f"baseline {name}")
            baselines[name] = step()
            verify(db, schema, expected, name)
            _say(f"  {baselines[name]:.1f} s, verified")
        print_report(work, runs, baselines, publish_s, naive_rows, durable=not args.fast_db)
        out.extra["durable"] = not args.fast_db
        figures_of(work, runs, baselines, naive_rows, out).write(args.json)
    finally:
        db.cleanup()
        nats_server.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _say(f"kept {tmp}")


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
