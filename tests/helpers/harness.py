"""The in-process data path harness of the sort/apply tests: a source that publishes row
events, a pipeline over them, and the rows a sink holds."""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any
from uuid import uuid4

from nats.js import JetStreamContext, api
from pyspark.sql import SparkSession

from contracts import REGISTRY
from contracts.events.rows import (
    ColumnV1,
    DdlExecutedV1,
    ResolvedAdvancedV1,
    RowImageV2,
    RowsChangedV2,
    RowsChangedV4,
    RowsPartV1,
    SourcePositionV1,
    TableMetaV1,
    TableMetaV2,
)
from libs.scheduling.model import Span
from libs.streams import (
    ROWS_STREAM,
    ddl_subject,
    resolved_subject,
    rows_subject,
)
from libs.telemetry.tracing import publish_span
from services.sink_worker.round.pipeline import Pipeline
from services.sink_worker.round.work import RoundReport
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.span.checkpoints import Checkpoint, CheckpointStore
from services.sink_worker.span.runtime import PipelineOptions, SpanConfig
from services.sink_worker.span.target import choose_key

_POS = SourcePositionV1(binlog_file="bin.000001", binlog_pos=4)


_seq = itertools.count(1)


def col(name: str, kind: str = "int", sql_type: str = "int(11)", nullable: bool = True) -> ColumnV1:
    return ColumnV1(name=name, kind=kind, sql_type=sql_type, nullable=nullable)


PEOPLE = TableMetaV1(
    columns=[col("id", nullable=False), col("name", "string", "varchar(11)"), col("age")],
    primary_key=["id"], unique_keys=[["name"]])


class Source:
    """Publishes a source's events like capture does: ts per transaction, seq per message."""

    def __init__(self, js: JetStreamContext, name: str | None = None) -> None:
        self.js = js
        self.name = name or f"s{uuid4().hex[:10]}"
        self.ts = int(time.time() * 1000) << 18
        self.last_ts = 0

    def next_ts(self) -> int:
        self.ts += 1 << 18  # one millisecond per transaction
        self.last_ts = self.ts
        return self.ts

    async def publish(self, subject: str, event: Any, msg_id: str | None = None) -> int:
        data = REGISTRY.encode(event, producer="test-capture", event_id=msg_id)
        # Like capture: the publish span's context travels in the message headers.
        with publish_span(subject) as (_span, headers):
            ack = await self.js.publish(subject, data, stream=ROWS_STREAM, headers=headers)
        return int(ack.seq)

    async def txn(self, db: str, table: str, rows: list[RowImageV2], meta: TableMetaV1 = PEOPLE,
                  parts: int = 1) -> int:
        """One transaction on one table, its rows split over ``parts`` messages."""
        ts = self.next_ts()
        size = max(1, -(-len(rows) // parts))
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        for part, chunk in enumerate(chunks):
            await self.publish(rows_subject(self.name, db, table), RowsChangedV2(
                source=self.name, database=db, table=table, ts=ts, seq=next(_seq), part=part,
                last_part=part == len(chunks) - 1, position=_POS, meta=meta, rows=chunk))
        return ts

    async def batch(self, db: str, table: str, txns: list[tuple[str, list[RowImageV2]]], msg_id: str,
                    meta: TableMetaV1 = PEOPLE, ts: list[int] | None = None,
                    seqs: list[int] | None = None) -> list[int]:
        """Several whole transactions of one table in one ``rows.changed`` v4 message, as capture
        batches them: ``txns`` are (event id, rows); each gets a new ts and seq unless ``ts`` and
        ``seqs`` say (a copy of transactions published before). Their ts."""
        stamps = ts if ts is not None else [self.next_ts() for _ in txns]
        numbers = seqs if seqs is not None else [next(_seq) for _ in txns]
        more = [RowsPartV1(event_id=i, ts=t, seq=q, position=_POS, rows=r)
                for (i, r), t, q in zip(txns[1:], stamps[1:], numbers[1:], strict=True)]
        await self.publish(rows_subject(self.name, db, table), RowsChangedV4(
            source=self.name, database=db, table=table, ts=stamps[0], seq=numbers[0], position=_POS,
            meta=TableMetaV2.model_validate(meta.model_dump()), rows=txns[0][1], event_id=txns[0][0],
            more=more), msg_id=msg_id)
        return stamps

    async def ddl(self, db: str, table: str, statement: str, meta_after: TableMetaV1 | None) -> int:
        ts = self.next_ts()
        await self.publish(ddl_subject(self.name, db, table), DdlExecutedV1(
            source=self.name, database=db, table=table, ts=ts, seq=next(_seq), statement=statement,
            position=_POS, meta_after=meta_after))
        return ts

    async def resolve(self, ts: int | None = None) -> int:
        ts = self.last_ts if ts is None else ts
        data = REGISTRY.encode(ResolvedAdvancedV1(source=self.name, ts=ts, position=_POS), producer="t")
        await self.js.publish(resolved_subject(self.name), data, stream=ROWS_STREAM,
                              headers={api.Header.ROLLUP.value: "sub"})
        return ts


def ins(id_: int, name: str | None, age: int | None = None) -> RowImageV2:
    return RowImageV2(op="insert", after={"id": id_, "name": name, "age": age})


def upd(before: tuple[int, str | None, int | None], after: tuple[int, str | None, int | None]) -> RowImageV2:
    b = dict(zip(("id", "name", "age"), before, strict=True))
    a = dict(zip(("id", "name", "age"), after, strict=True))
    return RowImageV2(op="update", before=b, after=a)


def dele(id_: int, name: str | None, age: int | None = None) -> RowImageV2:
    return RowImageV2(op="delete", before={"id": id_, "name": name, "age": age})


class Harness:
    def __init__(self, js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
                 sink_url: str, db: str = "shop", key_policy: str = "primary",
                 max_events: int = 2000) -> None:
        self.js = js
        self.source = Source(js)
        self.db = db
        self.checkpoints = checkpoints
        self.sink_url = sink_url
        self.key_policy = key_policy
        self.pipeline = Pipeline(js, checkpoints, lambda: spark,
                                 PipelineOptions(max_events_per_round=max_events, apply_partitions=3,
                                                 checkpoint_interval_s=0.0))
        self.changefeed = f"cf{uuid4().hex[:6]}"

    def span(self, table: str) -> Span:
        return Span.of(self.changefeed, self.source.name, self.db, table)

    async def run(self, *tables: str) -> None:
        cfg = SpanConfig(sink_url=self.sink_url, key_policy=self.key_policy)  # type: ignore[arg-type]
        await self.pipeline.set_spans({self.span(t): cfg for t in tables})

    async def round(self) -> RoundReport:
        report = await self.pipeline.round()
        assert not report.errors, report.errors
        return report

    async def rounds_until(self, check: Callable[[], Awaitable[bool]], within_s: float = 60) -> None:
        deadline = time.monotonic() + within_s
        while True:
            await self.round()
            if await check():
                return
            assert time.monotonic() < deadline, "condition not reached in time"

    def rows(self, table: str, meta: TableMetaV1 = PEOPLE) -> list[dict[str, Any]]:
        return fetch_rows(self.sink_url, self.db, table, meta, self.key_policy)

    async def checkpoint(self, table: str) -> Checkpoint | None:
        return await self.checkpoints.get(self.span(table))


def fetch_rows(sink_url: str, db: str, table: str, meta: TableMetaV1 = PEOPLE,
               key_policy: str = "primary") -> list[dict[str, Any]]:
    target = TargetTable(schema=db, name=table, meta=meta,
                         key=choose_key(meta, key_policy))  # type: ignore[arg-type]
    return open_sink(sink_url).fetch_rows(target)


def people(*rows: tuple[int, str | None, int | None]) -> list[dict[str, Any]]:
    return [{"id": i, "name": n, "age": a} for i, n, a in rows]
