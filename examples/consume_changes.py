"""Read a changefeed's changes from NATS JetStream and print one JSON line per row change.

    python -m examples.consume_changes --nats nats://localhost:4222 --stream CHANGES \\
        --subject 'sluice.out.changes.>' --durable my-app

Works on the NATS sink's stream (``format=sluice`` envelopes or ``format=debezium`` JSON) and on
Sluice's own ``SLUICE_ROWS`` stream (``rows.changed`` / ``ddl.executed`` as capture publishes
them). Sluice envelopes are decoded with the contract registry, so an older version of an
event arrives upcast to the newest one. A message that is not a change (garbage, an unknown
type or version) is reported on stderr with the reason and acknowledged: the consumer goes on.

With ``--durable`` the position survives restarts (JetStream keeps it); each message is
acknowledged after its line is written, so a crash re-delivers at most the unacknowledged ones
(consumers should be idempotent, e.g. by ``event_id`` + ``row``, or the ``Nats-Msg-Id`` header).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import nats
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api

from contracts import REGISTRY, ContractError
from contracts.events.rows import DdlExecutedV1, RowsChangedV2, parts_of
from contracts.events.sink import SinkRowChangedV1

_DEBEZIUM_OPS = {"c": "insert", "u": "update", "d": "delete", "r": "read"}


def changes(data: bytes) -> Iterator[dict[str, Any]]:
    """The row changes (and DDL) in one message, as flat dicts; raises ValueError for anything else."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if isinstance(obj, dict) and "op" in obj and "source" in obj and "type" not in obj:  # Debezium
        src = obj["source"]
        yield {"op": _DEBEZIUM_OPS.get(obj["op"], obj["op"]), "database": src.get("db"),
               "table": src.get("table"), "ts": src.get("ts"), "before": obj.get("before"),
               "after": obj.get("after"), "id": f"{src.get('event_id')}:{src.get('row')}"}
        return
    if isinstance(obj, dict) and "ddl" in obj and "source" in obj and "type" not in obj:
        yield {"op": "ddl", "database": obj["source"].get("db"), "table": obj["source"].get("table"),
               "statement": obj["ddl"]}
        return
    try:
        decoded = REGISTRY.decode(data)
    except ContractError as exc:
        raise ValueError(f"{exc.kind}: {exc.reason}") from None
    event = decoded.event
    if isinstance(event, SinkRowChangedV1):
        yield {"op": event.op, "database": event.target_schema, "table": event.target_table,
               "ts": event.ts, "before": event.before, "after": event.after,
               "id": f"{event.event_id}:{event.row}"}
    elif isinstance(event, RowsChangedV2):
        # Several transactions in one message (v4): each with its own id and ts.
        for part_id, part in parts_of(event, decoded.envelope.id):
            for i, row in enumerate(part.rows):
                yield {"op": row.op, "database": part.database, "table": part.table, "ts": part.ts,
                       "before": row.before, "after": row.after, "id": f"{part_id}:{i}"}
    elif isinstance(event, DdlExecutedV1):
        yield {"op": "ddl", "database": event.database, "table": event.table, "ts": event.ts,
               "statement": event.statement}
    else:
        raise ValueError(f"{decoded.envelope.type} is not a change")


async def consume(url: str, stream: str, subject: str, durable: str | None, max_messages: int | None,
                  idle_exit_s: float | None, out: TextIO = sys.stdout) -> int:
    """Print the changes; returns how many messages were read. Stops after ``max_messages``, or
    after ``idle_exit_s`` without a message (both optional: by default it runs until killed)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    config = api.ConsumerConfig(durable_name=durable, filter_subject=subject,
                                ack_policy=api.AckPolicy.EXPLICIT,
                                deliver_policy=api.DeliverPolicy.ALL,
                                inactive_threshold=None if durable else 60.0)
    sub = await js.pull_subscribe(subject, durable=durable, stream=stream, config=config)
    read = 0
    idle = 0.0
    try:
        while max_messages is None or read < max_messages:
            try:
                msgs = await sub.fetch(min(100, (max_messages or 100) - read) or 1, timeout=1.0)
            except (TimeoutError, NatsTimeoutError):
                idle += 1.0
                if idle_exit_s is not None and idle >= idle_exit_s:
                    break
                continue
            idle = 0.0
            for msg in msgs:
                read += 1
                try:
                    for change in changes(msg.data):
                        out.write(json.dumps({"subject": msg.subject, **change}, sort_keys=True) + "\n")
                except ValueError as exc:
                    print(f"skipped {msg.subject} seq {msg.metadata.sequence.stream}: {exc}", file=sys.stderr)
                out.flush()
                await msg.ack()
    finally:
        # Every message handled was acknowledged already; close (a drain would wait on the
        # pull subscription's pending fetch); flush first so the last acks reach the server.
        with contextlib.suppress(Exception):
            await nc.flush()
        await nc.close()
    return read


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nats", default="nats://127.0.0.1:4222", help="NATS URL")
    parser.add_argument("--stream", required=True, help="JetStream stream (the sink URL's path)")
    parser.add_argument("--subject", required=True, help="subject filter, e.g. 'sluice.out.changes.>'")
    parser.add_argument("--durable", help="durable consumer name: resume where the last run stopped")
    parser.add_argument("--max", type=int, dest="max_messages", help="stop after this many messages")
    parser.add_argument("--idle-exit", type=float, help="stop after this many seconds without messages")
    args = parser.parse_args(argv)
    asyncio.run(consume(args.nats, args.stream, args.subject, args.durable, args.max_messages,
                        args.idle_exit))


if __name__ == "__main__":
    main()
