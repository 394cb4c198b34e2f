"""examples/consume_changes.py against a real nats-server: both sink envelopes, garbage reported
and skipped, a durable consumer resumes where it stopped."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from uuid import uuid4

from nats.js import JetStreamContext

from contracts.events.rows import ColumnV1, RowImageV2, RowsChangedV2, SourcePositionV1, TableMetaV1
from libs.localservers.nats_server import NatsServer
from services.sink_worker.sinks.nats_stream import ChangeSource, StreamPublisher, row_messages

ROOT = Path(__file__).resolve().parents[1]
META = TableMetaV1(columns=[ColumnV1(name="id", kind="int", sql_type="int", nullable=False),
                            ColumnV1(name="v", kind="string", sql_type="varchar(9)")], primary_key=["id"])


def _event(ts: int, rows: list[RowImageV2]) -> ChangeSource:
    return ChangeSource(f"ev-{ts}", RowsChangedV2(
        source="s1", database="shop", table="t", ts=ts << 18, seq=ts, part=0, last_part=True,
        position=SourcePositionV1(binlog_file="b.000001", binlog_pos=ts), meta=META, rows=rows))


def _run(url: str, stream: str, subject: str, *extra: str) -> tuple[list[dict[str, object]], str]:
    out = subprocess.run([sys.executable, "-m", "examples.consume_changes", "--nats", url, "--stream", stream,
                          "--subject", subject, *extra], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()], out.stderr


async def test_example_consumer_reads_both_envelopes_and_resumes(
        js: JetStreamContext, nats_server: NatsServer) -> None:
    events = [_event(1, [RowImageV2(op="insert", after={"id": 1, "v": "a"})]),
              _event(2, [RowImageV2(op="update", before={"id": 1, "v": "a"}, after={"id": 1, "v": "b"}),
                         RowImageV2(op="delete", before={"id": 1, "v": "b"})])]
    for fmt in ("sluice", "debezium"):
        stream = f"EX_{uuid4().hex[:6].upper()}"
        prefix = f"ex.{stream.lower()}"
        publisher = StreamPublisher(f"{nats_server.url}/{stream}?subject={prefix}&format={fmt}")
        try:
            assert await publisher.publish(
                row_messages(publisher.target, "cf", "shop", "t", ["id"], events[:1])) == 1
            await js.publish(f"{prefix}.shop.t", b"\xff not json", stream=stream)
            durable = f"app_{fmt}"
            lines, err = await asyncio.to_thread(_run, nats_server.url, stream, f"{prefix}.>",
                                                 "--durable", durable, "--max", "2")
            assert [(c["op"], c["after"]) for c in lines] == [("insert", {"id": 1, "v": "a"})], fmt
            assert "skipped" in err and "not JSON" in err
            # More changes later: the durable consumer resumes after what it acknowledged.
            await publisher.publish(row_messages(publisher.target, "cf", "shop", "t", ["id"], events))
            lines, _ = await asyncio.to_thread(_run, nats_server.url, stream, f"{prefix}.>",
                                               "--durable", durable, "--idle-exit", "2")
            assert [(c["op"], c["before"], c["after"]) for c in lines] == [
                ("update", {"id": 1, "v": "a"}, {"id": 1, "v": "b"}),
                ("delete", {"id": 1, "v": "b"}, None)], fmt
            assert {c["table"] for c in lines} == {"t"}
        finally:
            await publisher.close()
