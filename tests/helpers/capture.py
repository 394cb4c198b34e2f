"""Helpers for the capture tests (no tests here): run a capture, read a source's messages back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from contracts.events.rows import (
    CaptureRejectedV2,
    DdlExecutedV1,
    ResolvedAdvancedV1,
    RowsChangedV2,
    parts_of,
)
from contracts.registry import REGISTRY
from libs.chunks import ChunkJoiner, chunk_info
from libs.config import Settings
from libs.localservers.mariadb import MariaDB
from libs.streams import ROWS_STREAM, rejected_subject, resolved_subject, token
from services.capture.service import Capture


async def eventually(predicate: Callable[[], Awaitable[bool]], within: float, what: str,
                     interval: float = 0.1) -> None:
    deadline = time.monotonic() + within
    while True:
        if await predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(interval)


def capture_settings(nats_url: str, source: str, source_url: str, server_id: int,
                     instance: str = "") -> Settings:
    return Settings(nats_url=nats_url, source_id=source, source_url=source_url,
                    source_server_id=server_id, lease_ttl_s=1.5,
                    instance_id=instance or f"capture-{source}-inproc")


@contextlib.asynccontextmanager
async def running_capture(settings: Settings) -> AsyncIterator[Capture]:
    """A capture in this process, with its own NATS connection; stopped cleanly on exit."""
    nc = await nats.connect(settings.nats_url)
    capture = Capture(settings, nc.jetstream(), producer=f"capture/{settings.instance_id}")
    task = asyncio.create_task(capture.run())
    try:
        yield capture
    finally:
        capture.stopping.set()
        try:
            await asyncio.wait_for(task, 20)
        finally:
            await nc.drain()
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def wait_reading(capture: Capture, within: float = 20) -> None:
    async def reading() -> bool:
        return capture.status.get("state") == "reading"

    await eventually(reading, within, f"capture of {capture.source} reading; status {capture.status}")


def binlog_position(db: MariaDB) -> tuple[str, int]:
    row = db.execute("SHOW MASTER STATUS")[0]
    return str(row[0]), int(row[1])


async def last_resolved(js: JetStreamContext,
                        source: str) -> tuple[ResolvedAdvancedV1, dict[str, str]] | None:
    try:
        raw = await js.get_last_msg(ROWS_STREAM, resolved_subject(source))
    except NotFoundError:
        return None
    event = REGISTRY.decode(raw.data or b"").event
    assert isinstance(event, ResolvedAdvancedV1)
    return event, dict(raw.headers or {})


async def wait_resolved_past(js: JetStreamContext, source: str, position: tuple[str, int],
                             within: float = 30) -> ResolvedAdvancedV1:
    """Until the source's resolved mark covers ``position`` of its binlog."""
    found: list[ResolvedAdvancedV1] = []

    async def covered() -> bool:
        got = await last_resolved(js, source)
        if got is None:
            return False
        mark = got[0]
        if (mark.position.binlog_file, mark.position.binlog_pos) >= position:
            found.append(mark)
            return True
        return False

    await eventually(covered, within, f"resolved mark of {source} past {position}")
    return found[-1]


@dataclass
class Stored:
    seq: int
    subject: str
    headers: dict[str, str]
    id: str
    event: Any
    producer: str = ""
    chunks: int = 0
    """Chunk messages it was stored as (0: one message)."""
    message_id: str = ""
    """The id of the message it came in: its own, or a ``rows.changed`` v4 message's of several
    transactions (``read_messages`` gives each part of such a message as a ``Stored`` of its own)."""


async def read_messages(js: JetStreamContext, subject: str) -> list[Stored]:
    """Every message on ``subject`` (wildcards allowed) in stream order."""
    try:
        info = await js.stream_info(ROWS_STREAM, subjects_filter=subject)
    except NotFoundError:
        return []
    if not info.state.subjects:
        return []
    sub = await js.pull_subscribe(subject, stream=ROWS_STREAM, config=api.ConsumerConfig(
        ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL, inactive_threshold=30))
    out: list[Stored] = []
    joiner = ChunkJoiner()
    chunked: dict[str, int] = {}
    try:
        while True:
            try:
                msgs: list[Msg] = await sub.fetch(1000, timeout=2)
            except nats.errors.TimeoutError:
                break
            for msg in msgs:
                seq, data, headers = int(msg.metadata.sequence.stream), msg.data, dict(msg.headers or {})
                info = chunk_info(headers)
                if info is not None:  # a message over max_payload: read as the whole it was cut from
                    chunked[info.of] = chunked.get(info.of, 0) + 1
                    joined = joiner.add(info, seq, data, headers)
                    if joined is None:
                        continue
                    seq, data, headers = joined.first_seq, joined.data, joined.headers
                decoded = REGISTRY.decode(data)
                env_id = decoded.envelope.id
                events = parts_of(decoded.event, env_id) if isinstance(decoded.event, RowsChangedV2) \
                    else [(env_id, decoded.event)]
                for event_id, event in events:
                    out.append(Stored(seq, msg.subject, headers, event_id, event, decoded.envelope.producer,
                                      chunked.get(env_id, 0), env_id))
            if msgs and msgs[-1].metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out


async def source_messages(js: JetStreamContext, source: str) -> list[Stored]:
    """Rows, DDL and rejections of ``source`` (resolved marks are rolled up: read them apart)."""
    return await read_messages(js, f"sluice.*.{token(source)}.>")


def rows_of(messages: list[Stored]) -> list[RowsChangedV2]:
    return [m.event for m in messages if isinstance(m.event, RowsChangedV2)]


def ddl_of(messages: list[Stored]) -> list[DdlExecutedV1]:
    return [m.event for m in messages if isinstance(m.event, DdlExecutedV1)]


async def rejections(js: JetStreamContext, source: str) -> list[CaptureRejectedV2]:
    return [m.event for m in await read_messages(js, rejected_subject(source))]


def check_order(messages: list[Stored]) -> None:
    """Per table (its rows and DDL subjects), seq strictly increasing in stream order and ts
    strictly increasing between transactions; every seq once. (Across tables stream order is
    not seq order since a message may carry several transactions of one table: each table's
    batch goes out when it ends.)"""
    ordered = [m for m in messages if isinstance(m.event, RowsChangedV2 | DdlExecutedV1)]
    seqs = [m.event.seq for m in ordered]
    assert len(set(seqs)) == len(seqs), seqs
    for table in {(m.event.database, m.event.table) for m in ordered}:
        mine = [m for m in ordered if (m.event.database, m.event.table) == table]
        table_seqs = [m.event.seq for m in mine]
        assert table_seqs == sorted(table_seqs), (table, table_seqs)
        last_ts, last_txn = -1, None
        for m in mine:
            ev = m.event
            txn = (ev.position.binlog_file, ev.position.binlog_pos)
            if txn == last_txn:
                assert ev.ts == last_ts, f"one transaction, two ts: {m.id}"
            else:
                assert ev.ts > last_ts, f"ts not increasing at {m.id}: {ev.ts} <= {last_ts}"
            last_ts, last_txn = ev.ts, txn


def replay(events: list[RowsChangedV2], table: str, key: str) -> dict[Any, dict[str, Any]]:
    """The table's rows as the events build it (ordered by ts, seq), by primary key value."""
    state: dict[Any, dict[str, Any]] = {}
    for ev in sorted((e for e in events if e.table == table), key=lambda e: (e.ts, e.seq)):
        for row in ev.rows:
            if row.before is not None:
                state.pop(row.before[key], None)
            if row.after is not None:
                state[row.after[key]] = row.after
    return state


def fresh_database(db: MariaDB, name: str, *tables: str) -> None:
    db.execute(f"DROP DATABASE IF EXISTS {name}", f"CREATE DATABASE {name}")
    db.execute(*tables, database=name)
