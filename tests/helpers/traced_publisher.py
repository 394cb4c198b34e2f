"""Publishes one message inside a trace and prints the ids, for the cross-process trace test."""

from __future__ import annotations

import asyncio
import json
import sys

import nats

from libs.telemetry.tracing import publish_span, setup_tracing, tracer


async def main(url: str, subject: str) -> None:
    setup_tracing("test-publisher")
    nc = await nats.connect(url)
    with tracer().start_as_current_span("capture-batch") as root:
        with publish_span(subject) as (span, headers):
            await nc.publish(subject, b"payload", headers=headers)
            ctx = span.get_span_context()
    await nc.flush()
    await nc.close()
    print(json.dumps({"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x"),
                      "root_span_id": format(root.get_span_context().span_id, "016x")}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
