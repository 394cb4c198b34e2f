"""The NATS sink in process: every change of a span's batch republished in order, both envelopes,
idempotent on re-apply, DDL after its batch; plus the sink URL's parsing."""

from __future__ import annotations

import json
from typing import Any
from uuid import uuid4

import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from contracts import REGISTRY
from contracts.events.rows import DdlExecutedV1, RowImageV2, RowsChangedV2, SourcePositionV1
from contracts.events.sink import SinkRowChangedV1
from libs.localservers.nats_server import NatsServer
from services.sink_worker.sinks.nats_stream import (
    ChangeSource,
    StreamUrlError,
    ddl_message,
    is_stream_sink,
    parse_stream_url,
    row_messages,
)
from services.sink_worker.span.checkpoints import Checkpoint, CheckpointStore
from tests import test_sort_apply as data_path
from tests.helpers.harness import PEOPLE, Harness, dele, ins, upd
from tests.helpers.nats_sink import read_stream

rows_js = data_path.rows_js
checkpoints = data_path.checkpoints


def test_sink_url_parsing() -> None:
    url = parse_stream_url("nats://u:p%40ss@h1:4222,h2:4222/CHANGES?subject=shop.out&format=debezium")
    assert url.servers == ["nats://h1:4222", "nats://h2:4222"]
    assert (url.stream, url.subject_prefix, url.format) == ("CHANGES", "shop.out", "debezium")
    assert (url.user, url.password) == ("u", "p@ss")
    assert "p@ss" not in url.redacted()
    default = parse_stream_url("nats://h:4222/CHANGES")
    assert (default.subject_prefix, default.format) == ("sluice.out.changes", "sluice")
    assert is_stream_sink("nats://h/S") and not is_stream_sink("sqlite:///x.db")
    for bad, why in [("nats://h:4222/", "stream name"), ("nats://h:4222/A.B", "stream name"),
                     ("nats://h/S?subject=a.*", "subject prefix"), ("nats://h/S?format=avro", "format"),
                     ("nats://h/S?compress=1", "unknown"), ("nats:///S", "host")]:
        with pytest.raises(StreamUrlError, match=why):
            parse_stream_url(bad)


def _source_event(ts: int, rows: list[RowImageV2], part: int = 0) -> ChangeSource:
    return ChangeSource(f"ev-{ts}-{part}", RowsChangedV2(
        source="s1", database="shop_1", table="people_1", ts=ts << 18, seq=ts * 10 + part, part=part,
        last_part=True, position=SourcePositionV1(binlog_file="b.000001", binlog_pos=ts), meta=PEOPLE,
        rows=rows))


@pytest.mark.parametrize("fmt", ["sluice", "debezium"])
def test_messages_keep_every_change_in_order_with_stable_ids(fmt: str) -> None:
    target = parse_stream_url(f"nats://h:4222/S?subject=out&format={fmt}")
    # Given out of order: the messages follow (ts, seq, part), then the row index.
    events = [_source_event(2, [dele(1, "ann", 2)]),
              _source_event(1, [upd((1, "ann", 1), (1, "ann", 2))], part=1),
              _source_event(1, [ins(1, "ann", 1)], part=0)]
    msgs = row_messages(target, "cf", "shop", "people", ["id"], events)
    again = row_messages(target, "cf", "shop", "people", ["id"], list(reversed(events)))
    assert [m.msg_id for m in msgs] == [m.msg_id for m in again] == [
        "cf:ev-1-0:0", "cf:ev-1-1:0", "cf:ev-2-0:0"]
    assert {m.subject for m in msgs} == {"out.shop.people"}
    ddl = ddl_message(target, "cf", "shop", "people", ChangeSource("ev-3", DdlExecutedV1(
        source="s1", database="shop_1", table="people_1", ts=3 << 18, seq=30, statement="ALTER TABLE x",
        position=SourcePositionV1(binlog_file="b.000001", binlog_pos=3), meta_after=PEOPLE)))
    assert (ddl.subject, ddl.msg_id) == ("out.shop.people.ddl", "cf:ev-3:ddl")
    if fmt == "sluice":
        decoded = [REGISTRY.decode(m.payload).event for m in msgs]
        assert all(isinstance(e, SinkRowChangedV1) for e in decoded)
        assert [(e.op, e.database, e.target_schema, e.ts >> 18, e.part) for e in decoded] == [
            ("insert", "shop_1", "shop", 1, 0), ("update", "shop_1", "shop", 1, 1),
            ("delete", "shop_1", "shop", 2, 0)]
        assert isinstance(REGISTRY.decode(ddl.payload).event, DdlExecutedV1)
    else:
        bodies = [json.loads(m.payload) for m in msgs]
        assert [b["op"] for b in bodies] == ["c", "u", "d"]
        assert bodies[1]["before"] == {"id": 1, "name": "ann", "age": 1}
        assert bodies[1]["after"] == {"id": 1, "name": "ann", "age": 2} and bodies[2]["after"] is None
        wanted = {"name": "cf", "server": "s1", "db": "shop_1", "table": "people_1", "ts_ms": 1,
                  "part": 0, "row": 0}
        assert {k: bodies[0]["source"][k] for k in wanted} == wanted
        assert json.loads(ddl.payload)["ddl"] == "ALTER TABLE x"


async def test_every_change_is_republished_in_order_once(
        rows_js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
        nats_server: NatsServer) -> None:
    fmt = "sluice"  # the Debezium envelope with real processes: tests/test_observability.py
    stream = f"OUT_{uuid4().hex[:8].upper()}"
    prefix = f"out.{stream.lower()}"
    h = Harness(rows_js, checkpoints, spark, f"{nats_server.url}/{stream}?subject={prefix}&format={fmt}")
    await h.run("people")
    # Insert, update and delete of one key: a database sink would keep only the last image.
    await h.source.txn(h.db, "people", [ins(1, "ann", 1), ins(2, "bob", 2)], parts=2)
    await h.source.txn(h.db, "people", [upd((1, "ann", 1), (1, "ann", 2))])
    first_ts = await h.source.txn(h.db, "people", [dele(2, "bob", 2)])
    await h.source.resolve()
    await h.round()
    # A DDL is a barrier: published after the batch before it, then the rows after it.
    await h.source.ddl(h.db, "people", "ALTER TABLE people ADD COLUMN x int", PEOPLE)
    await h.source.txn(h.db, "people", [ins(3, "cy", 3)])
    last = await h.source.resolve()

    async def done() -> bool:
        cp = await h.checkpoint("people")
        return cp is not None and cp.ts == last

    await h.rounds_until(done)
    msgs = await read_stream(rows_js, stream)
    subject = f"{prefix}.{h.db}.people"
    assert [s for s, _, _ in msgs] == [subject] * 4 + [subject + ".ddl", subject]
    ids = [hd["Nats-Msg-Id"] for _, hd, _ in msgs]
    assert len(set(ids)) == 6 and all(i.startswith(h.changefeed + ":") for i in ids)
    assert all("traceparent" in hd for _, hd, _ in msgs)
    changes: list[tuple[str, Any, Any]] = []
    for _, _, data in msgs[:4] + msgs[5:]:
        if fmt == "sluice":
            ev = REGISTRY.decode(data).event
            assert isinstance(ev, SinkRowChangedV1)
            assert (ev.changefeed, ev.target_table, ev.key) == (h.changefeed, "people", ["id"])
            changes.append((ev.op, ev.before, ev.after))
        else:
            body = json.loads(data)
            assert body["source"]["name"] == h.changefeed and body["source"]["table"] == "people"
            assert body["source"]["ts_ms"] > 0 and body["ts_ms"] > 0
            changes.append((body["op"], body["before"], body["after"]))
    ops = {"sluice": ("insert", "update", "delete"), "debezium": ("c", "u", "d")}[fmt]
    assert changes == [
        (ops[0], None, {"id": 1, "name": "ann", "age": 1}),
        (ops[0], None, {"id": 2, "name": "bob", "age": 2}),
        (ops[1], {"id": 1, "name": "ann", "age": 1}, {"id": 1, "name": "ann", "age": 2}),
        (ops[2], {"id": 2, "name": "bob", "age": 2}, None),
        (ops[0], None, {"id": 3, "name": "cy", "age": 3}),
    ]
    ddl_body = msgs[4][2]
    if fmt == "sluice":
        assert isinstance(REGISTRY.decode(ddl_body).event, DdlExecutedV1)
    else:
        assert json.loads(ddl_body)["ddl"].startswith("ALTER TABLE people")

    # Re-applying from an older checkpoint (an operator's rewind, a crash before the checkpoint
    # was stored) publishes nothing twice: the message ids repeat within the duplicate window.
    await checkpoints.reset(h.span("people"), Checkpoint(0, first_ts - 1))
    await h.rounds_until(done)
    assert len(await read_stream(rows_js, stream)) == 6
