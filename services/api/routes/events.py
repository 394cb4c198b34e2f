"""GET /api/v1/events: the control-domain streams as server-sent events.

Every event carries an ``id`` that is the whole cursor after it (``changefeeds:12,members:40``,
one stream sequence per domain), so a client that reconnects with ``since=<last id>`` (or the
standard ``Last-Event-ID`` header) misses nothing and sees nothing twice. Without a cursor the
feed starts at the end of every stream; the first message (``event: cursor``) says where that
is. ``since=members:0`` replays a domain from its beginning."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Literal
from uuid import uuid4

from fastapi import APIRouter, Depends, Header, HTTPException, Query
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError
from sse_starlette import EventSourceResponse, ServerSentEvent

from contracts import REGISTRY, ContractError
from contracts.events.changefeeds import ChangefeedSpecV2
from libs.eventstore import check_subject, filter_fields
from libs.streams import DOMAINS, domain_fold_subjects, domain_stream
from services.api.auth import require_read
from services.api.context import ApiContext, get_ctx, js_of
from services.api.schemas import redact_spec

router = APIRouter(tags=["events"])
Domain = Literal["members", "schedule", "replication", "ddl", "changefeeds"]
KEEPALIVE_S = 15.0


def parse_cursor(text: str) -> dict[str, int]:
    """``domain:seq,domain:seq`` -> {domain: seq}; raises ValueError with the reason."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        domain, sep, seq = part.partition(":")
        if not sep or domain not in DOMAINS:
            raise ValueError(f"{part!r} is not <domain>:<seq> with a domain of {', '.join(DOMAINS)}")
        if not seq.isdigit() or len(seq) > 18:
            raise ValueError(f"{part!r}: the sequence must be a non-negative integer")
        out[domain] = int(seq)
    return out


def format_cursor(cursor: dict[str, int]) -> str:
    return ",".join(f"{d}:{s}" for d, s in sorted(cursor.items()))


def _frame(event: str, data: dict[str, Any], event_id: str) -> ServerSentEvent:
    return ServerSentEvent(event=event, id=event_id, data=json.dumps(data, separators=(",", ":")))


def _keepalive() -> ServerSentEvent:
    return ServerSentEvent(comment="keep-alive")


def _decode(domain: str, seq: int, subject: str, raw: bytes) -> dict[str, Any]:
    try:
        decoded = REGISTRY.decode(raw)
        check_subject(subject, decoded.envelope.type)
    except ContractError as exc:
        return {"domain": domain, "seq": seq, "type": None, "error": f"{exc.kind}: {exc.reason}"}
    env = decoded.envelope
    version = REGISTRY.key_of(type(decoded.event))[1]
    data = decoded.event.model_dump(mode="json")
    spec = getattr(decoded.event, "spec", None)
    if isinstance(spec, ChangefeedSpecV2):
        # Changefeeds recorded before secrets were references may hold passwords.
        data["spec"] = redact_spec(spec)
    return {"domain": domain, "seq": seq, "type": env.type, "version": version,
            "time": env.time.isoformat() if hasattr(env.time, "isoformat") else str(env.time),
            "producer": env.producer, "epoch": env.epoch,
            "data": data}


async def _last_seq(js: JetStreamContext, domain: str) -> int:
    try:
        info = await js.stream_info(domain_stream(domain))
    except NotFoundError:
        return 0
    return int(info.state.last_seq or 0)


async def _pump(js: JetStreamContext, domain: str, after: int,
                out: asyncio.Queue[tuple[str, int, str, bytes]], stop: asyncio.Event) -> None:
    """Put every event of ``domain`` with seq > ``after`` on ``out``, in order, until ``stop``."""
    stream = domain_stream(domain)
    next_seq = after + 1
    while not stop.is_set():
        name = f"sse_{domain}_{uuid4().hex[:12]}"
        try:
            await js.add_consumer(stream, api.ConsumerConfig(
                name=name, ack_policy=api.AckPolicy.NONE, **filter_fields(domain_fold_subjects(domain)),
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=next_seq,
                inactive_threshold=30.0, mem_storage=True, num_replicas=1))
        except NotFoundError:  # the stream does not exist yet
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            continue
        try:
            sub = await js.pull_subscribe_bind(name, stream=stream)
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(64, timeout=1.0)
                except (TimeoutError, NatsTimeoutError):
                    continue
                for msg in msgs:
                    seq = int(msg.metadata.sequence.stream)
                    if seq >= next_seq:
                        await out.put((domain, seq, msg.subject, bytes(msg.data or b"")))
                        next_seq = seq + 1
        except asyncio.CancelledError:
            raise
        except Exception:  # a consumer lost with a server restart: start again where we were
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        finally:
            with contextlib.suppress(Exception):
                await js.delete_consumer(stream, name)


async def _feed(js: JetStreamContext, cursor: dict[str, int], limit: int | None,
                stopping: asyncio.Event | None) -> AsyncIterator[ServerSentEvent]:
    queue: asyncio.Queue[tuple[str, int, str, bytes]] = asyncio.Queue(maxsize=1024)
    stop = asyncio.Event()
    closing = stopping or asyncio.Event()
    tasks = [asyncio.create_task(_pump(js, d, s, queue, stop)) for d, s in cursor.items()]
    sent = 0
    try:
        yield _frame("cursor", {"cursor": format_cursor(cursor)}, format_cursor(cursor))
        while (limit is None or sent < limit) and not closing.is_set():
            getter = asyncio.ensure_future(queue.get())
            closed = asyncio.ensure_future(closing.wait())
            # Idle feeds get EventSourceResponse's keep-alive comment every KEEPALIVE_S.
            await asyncio.wait({getter, closed}, timeout=KEEPALIVE_S,
                               return_when=asyncio.FIRST_COMPLETED)
            closed.cancel()
            getter.cancel()  # no-op when it has an item: that one is never dropped
            await asyncio.gather(getter, closed, return_exceptions=True)
            if getter.cancelled():
                continue
            domain, seq, subject, raw = getter.result()
            cursor[domain] = seq
            sent += 1
            yield _frame("event", _decode(domain, seq, subject, raw), format_cursor(cursor))
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@router.get("/events", dependencies=[Depends(require_read)],
            response_class=EventSourceResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "Server-sent events; each id is the cursor to resume from."}})
async def events(domain: list[Domain] | None = Query(None, description="Domains to follow (default all)."),
                 since: str | None = Query(None, max_length=500,
                                           description="Resume cursor: domain:seq,... (events after it)."),
                 limit: int | None = Query(None, ge=1, le=100_000,
                                           description="Close the feed after this many events."),
                 last_event_id: str | None = Header(None, max_length=500),
                 ctx: ApiContext = Depends(get_ctx)) -> EventSourceResponse:
    wanted = list(dict.fromkeys(domain or DOMAINS))
    try:
        given = parse_cursor(since if since is not None else (last_event_id or ""))
    except ValueError as exc:
        raise HTTPException(422, [{"loc": ["query", "since"], "msg": str(exc), "type": "value_error"}]
                            ) from None
    js = js_of(ctx)
    cursor: dict[str, int] = {}
    for d in wanted:
        cursor[d] = given[d] if d in given else await _last_seq(js, d)
    # sse-starlette frames the events (``sep`` "\n" as before) and sends the keep-alive comment.
    return EventSourceResponse(_feed(js, cursor, limit, ctx.stopping), sep="\n", ping=KEEPALIVE_S,
                               ping_message_factory=_keepalive, headers={"Cache-Control": "no-cache"})
