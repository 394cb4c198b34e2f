"""Large values stay out of the Spark jobs (``services/sink_worker/round/large_values.py``): the
substitution itself (pure; in one part of a message of several too), a pipeline round with a
real SparkSession and SQLite that writes rows whose values went through the jobs as references
(a threshold of 1 KiB stands in for the 1 MiB default, so the rows stay small), and a MariaDB
downstream refusing a row above its max_allowed_packet for good."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass

import pymysql
import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from contracts import REGISTRY
from contracts.events.rows import RowImageV2, RowsChangedV2, RowsChangedV4, TableMetaV1
from libs.localservers.mariadb import MariaDB
from libs.scheduling.model import Span
from libs.streams import rows_subject
from services.sink_worker.round.apply_job import event_images, event_rows, explode_event
from services.sink_worker.round.large_values import REF_FIELD, LargeKeyError, LargeValues, holds_ref
from services.sink_worker.round.pipeline import Pipeline
from services.sink_worker.round.pull import PulledEvent, decode_for_span
from services.sink_worker.round.sort_job import SpanInput, event_records, run_sort
from services.sink_worker.sinks.base import TargetTable, Upsert
from services.sink_worker.sinks.error_class import classify
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.span.checkpoints import CheckpointStore
from services.sink_worker.span.runtime import PipelineOptions
from tests import test_sort_apply as data_path
from tests.helpers.harness import _POS, Harness, col, fetch_rows

rows_js = data_path.rows_js
checkpoints = data_path.checkpoints
sqlite_url = data_path.sqlite_url

DOCS = TableMetaV1(columns=[col("id", nullable=False), col("note", "string", "varchar(20)"),
                            col("b", "bytes", "longblob"), col("t", "string", "longtext")],
                   primary_key=["id"])
TAGS = TableMetaV1(columns=[col("tag", "string", "varchar(4000)", nullable=False), col("n")],
                   primary_key=["tag"])


@dataclass
class _Msg:
    subject: str
    data: bytes
    headers: dict[str, str] | None = None


def _event(rows: list[RowImageV2], meta: TableMetaV1 = DOCS) -> PulledEvent:
    event = RowsChangedV2(source="s", database="d", table="t", ts=7, seq=1, position=_POS, meta=meta,
                          rows=rows)
    data = REGISTRY.encode(event, producer="test", event_id="e1")
    return PulledEvent(stream_seq=3, subject="x", event_id="e1", event=event, data=data)


def _b64(n: int, fill: bytes = b"\x00\xff") -> str:
    return base64.b64encode((fill * n)[:n]).decode()


def test_values_above_the_threshold_become_references_and_come_back() -> None:
    big, text = _b64(3000), "ü" * 2000
    e = _event([RowImageV2(op="insert", after={"id": 1, "note": "n", "b": big, "t": "small"}, ordinal=4),
                RowImageV2(op="update", before={"id": 2, "note": "x", "b": big, "t": None},
                           after={"id": 3, "note": "y", "b": "AA==", "t": text}, ordinal=7)])
    large = LargeValues(1024)
    assert large.needs_strip(e)
    [record] = event_records("span", [e], large, ("id",))
    body = record[8]
    assert record[9] == -1  # the part alone, whatever body it came in
    assert isinstance(body, bytes) and len(body) < 1024
    assert len(large) == 3 and large.bytes_held == 2 * len(big) + len(text)
    rows = event_rows(body)
    assert rows[0]["after"]["note"] == "n" and rows[0]["after"]["t"] == "small"
    assert large.is_ref(rows[0]["after"]["b"]) and holds_ref(rows[0]["after"])
    assert large.is_ref(rows[1]["before"]["b"]) and large.is_ref(rows[1]["after"]["t"])
    assert rows[1]["after"]["b"] == "AA==" and rows[1]["before"]["t"] is None
    assert [r["ordinal"] for r in rows] == [4, 7]  # a table group merges by it
    # The apply job's explode keys and orders the stripped rows as it would the real ones.
    records = list(explode_event({"span": (0, ("id",), None)}, "span", 7, 1, 0, body))
    assert [(r[1], r[6], r[7]) for r in records] == [("[1]", 0, "upsert"), ("[2]", 0, "delete"),
                                                      ("[3]", 1, "upsert")]
    assert large.resolve(records[0][8]) == {"id": 1, "note": "n", "b": big, "t": "small"}
    assert large.resolve(records[2][8]) == {"id": 3, "note": "y", "b": "AA==", "t": text}
    # The store holds the pulled event's own values, not copies.
    assert isinstance(e.event, RowsChangedV2) and e.event.rows[0].after is not None
    assert large.values[rows[0]["after"]["b"][REF_FIELD]] is e.event.rows[0].after["b"]


def test_the_apply_job_reads_rows_changed_v1_bodies_as_they_are() -> None:
    body = json.dumps({"type": "rows.changed", "version": 1, "id": "old",
                       "data": {"rows": [{"op": "insert", "before": None, "after": {"id": 1}}]}}).encode()
    assert event_rows(body) == [{"op": "insert", "before": None, "after": {"id": 1}}]
    records = list(explode_event({"span": (0, ("id",), None)}, "span", 7, 1, 0, body))
    assert [(r[1], r[7]) for r in records] == [("[1]", "upsert")]


def test_small_bodies_and_other_tokens_are_left_alone() -> None:
    e = _event([RowImageV2(op="insert", after={"id": 1, "note": "n", "b": "AA==", "t": "x"})])
    large = LargeValues(len(e.data) + 1)
    assert not large.needs_strip(e)
    assert event_records("span", [e], large, ("id",))[0][8] is e.data
    many = _event([RowImageV2(op="insert", after={"id": i, "note": "n" * 20, "b": None, "t": None})
                   for i in range(100)])
    large = LargeValues(1024)
    assert large.needs_strip(many) and large.strip(many, ("id",)) is many.data and not large
    # A reference of another round (or a JSON value shaped like one) is a value, not a reference.
    forged = {REF_FIELD: "0123:0"}
    assert not large.is_ref(forged) and large.resolve({"j": forged}) == {"j": forged}


def test_a_large_key_value_is_refused() -> None:
    e = _event([RowImageV2(op="insert", after={"tag": "k" * 5000, "n": 1})], TAGS)
    with pytest.raises(LargeKeyError, match="key column 'tag' holds a value of 5000 bytes"):
        LargeValues(1024).strip(e, ("tag",))


@pytest.mark.integration
async def test_a_round_writes_large_values_it_kept_out_of_spark(
        rows_js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
        sqlite_url: str) -> None:
    h = Harness(rows_js, checkpoints, spark, sqlite_url)
    h.pipeline = Pipeline(rows_js, checkpoints, lambda: spark,
                          PipelineOptions(apply_partitions=3, checkpoint_interval_s=0.0,
                                          large_value_bytes=1024))
    await h.run("docs", "tags")
    src = h.source
    big = {i: _b64(2000 * i, bytes([i, 255 - i])) for i in (1, 2, 3)}
    await src.txn(h.db, "docs", [
        RowImageV2(op="insert", after={"id": i, "note": f"n{i}", "b": big[i], "t": "é" * 3000 * i})
        for i in (1, 2, 3)] + [RowImageV2(op="insert", after={"id": 9, "note": "small", "b": "AA==",
                                                             "t": "t"})], meta=DOCS)
    # Later images of the same keys: the last one wins, large or not; a key change; a delete.
    await src.txn(h.db, "docs", [
        RowImageV2(op="update", before={"id": 1, "note": "n1", "b": big[1], "t": None},
                   after={"id": 1, "note": "small now", "b": "AQI=", "t": None}),
        RowImageV2(op="update", before={"id": 2, "note": "n2", "b": big[2], "t": None},
                   after={"id": 20, "note": "moved", "b": big[2], "t": "z" * 5000}),
        RowImageV2(op="delete", before={"id": 3, "note": "n3", "b": big[3], "t": None}),
        RowImageV2(op="update", before={"id": 9, "note": "small", "b": "AA==", "t": "t"},
                   after={"id": 9, "note": "large now", "b": big[3], "t": "t"})], meta=DOCS)
    await src.txn(h.db, "tags", [RowImageV2(op="insert", after={"tag": "k" * 5000, "n": 1})], meta=TAGS)
    await src.resolve()
    report = await h.pipeline.round()
    assert report.errors and "LargeKeyError" in report.errors[0], report.errors
    rows = {r["id"]: r for r in fetch_rows(sqlite_url, h.db, "docs", DOCS)}
    assert sorted(rows) == [1, 9, 20], [s.get("error") for s in h.pipeline.status()]
    assert rows[1] == {"id": 1, "note": "small now", "b": b"\x01\x02", "t": None}
    assert rows[20] == {"id": 20, "note": "moved", "b": base64.b64decode(big[2]), "t": "z" * 5000}
    assert rows[9] == {"id": 9, "note": "large now", "b": base64.b64decode(big[3]), "t": "t"}
    status = {s["table"]: s for s in h.pipeline.status()}
    # Three upserts (two of them written by the driver); the deletes met no row downstream.
    assert status["docs"]["state"] == "replicating" and status["docs"]["rows_written"] == 3
    # The large key stops its table with a visible incident; nothing of it is written.
    tags = status["tags"]
    assert tags["state"] == "error" and "key column 'tag'" in tags["error"]
    assert tags["incident"]["statement"] == "upsert" and tags["incident"]["key"] is None
    assert json.dumps(tags)  # the status (api, CLI, healthz) carries it as it is
    assert await h.checkpoint("tags") is None


@pytest.mark.integration
def test_a_row_above_the_downstreams_max_allowed_packet_is_a_permanent_refusal(
        mariadb_factory: Callable[..., MariaDB]) -> None:
    # The server would drop the connection (2006, retried forever): the sink says 1153 instead,
    # so the table stops with an incident naming the row (services/sink_worker/incidents/poison.py).
    server = mariadb_factory()
    server.execute("SET GLOBAL max_allowed_packet = 4194304", "CREATE DATABASE pk")
    table = TargetTable(schema="pk", name="docs", meta=DOCS, key=("id",))
    sink = open_sink(server.url)
    sink.ensure_table(table)
    fits = {"id": 1, "note": "fits", "b": b"\x00" * (3 * 1024 * 1024 // 2), "t": None}
    too_large = {"id": 2, "note": "too large", "b": b"\x00" * (3 * 1024 * 1024), "t": None}
    assert sink.apply_partition(table, [Upsert(key=(1,), row=fits)]).upserted == 1
    with pytest.raises(pymysql.err.OperationalError, match="max_allowed_packet") as refused:
        sink.apply_partition(table, [Upsert(key=(2,), row=too_large)])
    assert classify("mysql", refused.value) == "permanent"
    assert [r["id"] for r in sink.fetch_rows(table)] == [1]


def test_a_large_value_in_one_part_of_a_message_of_several_makes_only_that_part_its_own_body() -> None:
    text = "ü" * 2000

    def part(i: int, t: str) -> dict[str, object]:
        return {"event_id": f"p{i}", "ts": 10 + i, "seq": 20 + i, "part": 0, "last_part": True,
                "position": _POS.model_dump(),
                "rows": [{"op": "insert", "after": {"id": i, "note": "n", "b": None, "t": t}, "ordinal": 0}]}

    first = part(0, "small")
    data = {"source": "s", "database": "d", "table": "t", "meta": DOCS.model_dump(), "event_id": "p0",
            **{k: first[k] for k in ("ts", "seq", "part", "last_part", "position", "rows")},
            "more": [part(1, text), part(2, "small")]}
    raw = json.dumps({"type": "rows.changed", "version": 4, "id": "m", "time": "2026-11-28T00:00:00Z",
                      "producer": "test", "epoch": 0, "data": data}).encode()

    entry = decode_for_span(Span.of("cf", "s", "d", "t"), _Msg(rows_subject("s", "d", "t"), raw), 5)
    assert isinstance(entry.event, RowsChangedV4) and len(entry.expanded()) == 3
    large = LargeValues(1024)
    records = event_records("span", entry.expanded(), large, ("id",))
    # The part with the large value has a body of its own with a reference; the others stay
    # parts of the message's bytes.
    assert [r[9] for r in records] == [0, -1, 2]
    assert records[0][8] is raw and records[2][8] is raw and records[1][8] is not raw
    assert len(large) == 1 and large.bytes_held == len(text)
    batch = run_sort(records, [SpanInput("span", 0, 100)]).batch(["span"])
    assert [(e[1], e[5]) for e in batch] == [(10, [0]), (11, []), (12, [2])]
    images = [(ts, rows[0]["after"]) for e in batch for ts, _, _, rows in event_images(*e[1:])]
    assert [ts for ts, _ in images] == [10, 11, 12]
    assert large.is_ref(images[1][1]["t"]) and large.resolve(images[1][1])["t"] == text
    assert images[0][1]["t"] == images[2][1]["t"] == "small"
