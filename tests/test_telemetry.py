"""Traces cross process boundaries through NATS headers; logs carry trace ids, never secrets."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from libs.config import Settings
from libs.localservers.nats_server import NatsServer
from libs.nats_client import connect
from libs.telemetry.logs import JsonFormatter
from libs.telemetry.metrics import NATS_RECONNECTS, render_latest
from libs.telemetry.tracing import process_span, setup_tracing, tracer

EXPORTER = InMemorySpanExporter()
setup_tracing("test", extra_processor=SimpleSpanProcessor(EXPORTER))


async def test_trace_continues_in_consumer_of_another_process(nc: Client, nats_server: NatsServer) -> None:
    subject = "test.trace.rows"
    received: asyncio.Queue[Msg] = asyncio.Queue()

    async def handler(msg: Msg) -> None:
        await received.put(msg)

    sub = await nc.subscribe(subject, cb=handler)
    await nc.flush()
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "tests.helpers.traced_publisher", nats_server.url, subject],
        capture_output=True, text=True, timeout=60, check=True)
    ids = json.loads(out.stdout.strip().splitlines()[-1])
    msg = await asyncio.wait_for(received.get(), timeout=10)
    await sub.unsubscribe()

    EXPORTER.clear()
    with process_span(subject, msg.headers):
        pass
    spans = [s for s in EXPORTER.get_finished_spans() if s.name == f"process {subject}"]
    assert len(spans) == 1
    span = spans[0]
    assert span.kind == SpanKind.CONSUMER
    assert format(span.context.trace_id, "032x") == ids["trace_id"]
    assert span.parent is not None
    assert format(span.parent.span_id, "016x") == ids["span_id"]
    assert span.attributes is not None and span.attributes["messaging.destination.name"] == subject


def test_json_log_carries_trace_id_and_hides_secrets() -> None:
    formatter = JsonFormatter("unit")
    with tracer().start_as_current_span("op") as span:
        record = logging.makeLogRecord({"msg": "connecting %s", "args": ("db",), "levelname": "INFO",
                                        "name": "t", "nats_password": "hunter2", "table": "orders"})
        line = json.loads(formatter.format(record))
    assert line["msg"] == "connecting db"
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert line["nats_password"] == "***"
    assert line["table"] == "orders"
    assert "hunter2" not in json.dumps(line)


def test_settings_secrets_are_not_in_repr() -> None:
    s = Settings(nats_password="hunter2", nats_token="tok-123")
    assert s.nats_password is not None and s.nats_password.get_secret_value() == "hunter2"
    assert "hunter2" not in repr(s) and "tok-123" not in repr(s)
    assert "hunter2" not in s.model_dump_json()


@pytest.mark.integration
async def test_nats_reconnects_are_counted(tmp_path: Path) -> None:
    server = NatsServer(data_dir=tmp_path / "nats").start()
    nc = await connect(Settings(nats_url=server.url), name="reconnect-test")
    try:
        before = NATS_RECONNECTS._value.get()
        server.restart()  # same port and data: the client reconnects by itself
        deadline = time.monotonic() + 30
        while NATS_RECONNECTS._value.get() <= before:
            assert time.monotonic() < deadline, "no reconnect counted"
            await asyncio.sleep(0.1)  # polling the counter with a deadline
        assert nc.is_connected
        text = render_latest()[0].decode()
        assert f"sluice_nats_reconnects_total {before + 1}" in text
    finally:
        await nc.close()
        server.stop()
