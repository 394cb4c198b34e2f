"""/api/v1 tables, members, sources, rebalance and status: where every span runs and how far
it is, read from the read models plus the span checkpoints and snapshot progress in KV;
moves, drains and rebalances go to the scheduler leader."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, HTTPException, Query, Response
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError
from sqlmodel import Session, select

from contracts.events.changefeeds import ChangefeedSpec
from contracts.events.rows import CaptureRejectedV2
from contracts.events.scheduling import ScheduleRequestV1, SpanRefV1
from contracts.events.shard_ddl import DdlCommandV1
from contracts.registry import REGISTRY, ContractError
from libs.scheduling.model import Span as WorkerSpan
from libs.streams import (
    LEADER_BUCKET,
    PREPARE_BUCKET,
    ROWS_STREAM,
    SNAPSHOT_BUCKET,
    SOURCE_HEALTH_BUCKET,
    command_subject,
    rejected_subject,
    resolved_subject,
    token,
)
from services.api.auth import require_read, require_write
from services.api.commands import request_json, schedule_request
from services.api.context import ApiContext, get_ctx, js_of, kv_json, projections_of, span_checkpoint
from services.api.models import ChangefeedRow, MemberRow, SpanRow
from services.api.routes.changefeeds import list_changefeeds, load_changefeed, with_stopped_tables
from services.api.schemas import (
    Accepted,
    CheckpointOut,
    MemberOut,
    MoveIn,
    SourceOut,
    StatusOut,
    TableOut,
    lag_seconds,
    redact_url,
    stopped_text,
    waiting_for,
)

router = APIRouter(tags=["cluster"])


async def table_out(ctx: ApiContext, row: SpanRow) -> TableOut:
    span = WorkerSpan(row.changefeed, row.source, row.database, row.table)
    key = span.kv_key
    stored = await span_checkpoint(ctx, span)
    checkpoint = CheckpointOut(stream_seq=stored[0], ts=stored[1]) if stored is not None else None
    checkpoint_ts = max(row.checkpoint_ts, checkpoint.ts if checkpoint else 0)
    # A table stopped by an incident (refused by its downstream, or one that cannot be
    # replicated) shows it until an operator acts on it, whatever its set's state.
    stopped = projections_of(ctx).changefeeds.state.stopped.get(
        (row.changefeed, row.source, row.database, row.table))
    state, error = row.state, row.error
    members = tuple(json.loads(row.members_json))
    snapshot = await kv_json(ctx, SNAPSHOT_BUCKET, key)
    prepare = await kv_json(ctx, PREPARE_BUCKET, key) if state in ("absent", "prepare", "commit") else None
    if stopped is not None:
        state, error = "stopped", stopped_text(stopped)
    return TableOut(changefeed=row.changefeed, source=row.source, database=row.database,
                    table=row.table, key=row.key, state=state, primary=row.primary,
                    secondary=row.secondary, members=json.loads(row.members_json), error=error,
                    incident=stopped.model_dump(mode="json") if stopped is not None else None,
                    checkpoint_ts=checkpoint_ts, resolved_ts=row.resolved_ts,
                    lag_s=lag_seconds(checkpoint_ts), checkpoint=checkpoint, snapshot=snapshot,
                    waiting_for=waiting_for(state, (row.primary, row.secondary, *members), prepare,
                                            snapshot, time.time()))


def _span_row(ctx: ApiContext, changefeed_id: str, source: str, database: str, table: str) -> SpanRow:
    load_changefeed(ctx, changefeed_id)  # 404 for an unknown changefeed
    with Session(projections_of(ctx).engine) as session:
        row = session.exec(select(SpanRow).where(
            SpanRow.changefeed == changefeed_id, SpanRow.source == source,
            SpanRow.database == database, SpanRow.table == table)).first()
    if row is None:
        raise HTTPException(404, f"changefeed {changefeed_id!r} has no table {source}/{database}.{table}")
    return row


TABLES_PAGE = 500
"""Tables per page of ``changefeed tables`` unless the request asks for another ``limit``."""


@router.get("/changefeeds/{changefeed_id}/tables", response_model=list[TableOut],
            dependencies=[Depends(require_read)], responses={404: {"description": "Unknown changefeed"}})
async def get_tables(
        changefeed_id: str, response: Response, ctx: ApiContext = Depends(get_ctx),
        limit: int = Query(TABLES_PAGE, ge=1, le=10_000, description="Tables in this page."),
        after: str | None = Query(None, description="Start after the table with this `key` (the last "
                                                    "one of the previous page; `X-Next-After`)."),
) -> list[TableOut]:
    """The changefeed's tables ordered by `key`, a page at a time: each table's stored
    checkpoint and initial-load progress are read for the page only. When more follow, the
    `X-Next-After` header holds the `after` of the next page (and `Link` its URL)."""
    load_changefeed(ctx, changefeed_id)
    query = select(SpanRow).where(SpanRow.changefeed == changefeed_id)
    if after is not None:
        query = query.where(SpanRow.key > after)
    with Session(projections_of(ctx).engine) as session:
        rows = list(session.exec(query.order_by(SpanRow.key).limit(limit + 1)))
    if len(rows) > limit:
        rows = rows[:limit]
        cursor = rows[-1].key
        response.headers["X-Next-After"] = cursor
        response.headers["Link"] = (f"</api/v1/changefeeds/{quote(changefeed_id, safe='')}/tables?"
                                    f"{urlencode({'limit': limit, 'after': cursor})}>; rel=\"next\"")
    return list(await asyncio.gather(*(table_out(ctx, r) for r in rows)))


@router.get("/changefeeds/{changefeed_id}/tables/{source}/{database}/{table}", response_model=TableOut,
            dependencies=[Depends(require_read)], responses={404: {"description": "Unknown table"}})
async def get_table(changefeed_id: str, source: str, database: str, table: str,
                    ctx: ApiContext = Depends(get_ctx)) -> TableOut:
    return await table_out(ctx, _span_row(ctx, changefeed_id, source, database, table))


@router.post("/changefeeds/{changefeed_id}/tables/{source}/{database}/{table}/move", status_code=202,
             response_model=Accepted, dependencies=[Depends(require_write)],
             responses={404: {"description": "Unknown table or member"},
                        409: {"description": "The table is not replicating, or the move is refused"},
                        503: {"description": "No scheduler leader"}})
async def move_table(changefeed_id: str, source: str, database: str, table: str, body: MoveIn,
                     ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    row = _span_row(ctx, changefeed_id, source, database, table)
    if row.state != "replicating":
        raise HTTPException(409, f"table {source}/{database}.{table} is {row.state}, not replicating: "
                                 "only a replicating table can move")
    if body.dest not in projections_of(ctx).members.state.members:
        raise HTTPException(404, f"member {body.dest!r} is not alive")
    answer = await schedule_request(ctx, ScheduleRequestV1(
        kind="move", span=SpanRefV1(changefeed=changefeed_id, source=source, database=database,
                                    table=table),
        dest=body.dest, requested_by=ctx.requested_by))
    return Accepted(detail=f"move accepted by scheduler leader {answer.leader}",
                    follow=f"/api/v1/changefeeds/{changefeed_id}/tables/{source}/{database}/{table}",
                    events="/api/v1/events?domain=schedule&domain=replication")


@router.post("/rebalance", status_code=202, response_model=Accepted, dependencies=[Depends(require_write)],
             responses={409: {"description": "Refused"}, 503: {"description": "No scheduler leader"}})
async def rebalance(ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    answer = await schedule_request(ctx, ScheduleRequestV1(kind="rebalance", requested_by=ctx.requested_by))
    return Accepted(detail=f"rebalance accepted by scheduler leader {answer.leader}",
                    follow="/api/v1/members", events="/api/v1/events?domain=schedule")


# -- members --------------------------------------------------------------------------------------

def list_members(ctx: ApiContext) -> list[MemberOut]:
    with Session(projections_of(ctx).engine) as session:
        members = list(session.exec(select(MemberRow).order_by(MemberRow.member_id)))
        spans = list(session.exec(select(SpanRow)))
    primary = Counter(s.primary for s in spans if s.primary)
    secondary = Counter(s.secondary for s in spans if s.secondary)
    owned = Counter((s.secondary or s.primary) for s in spans
                    if (s.secondary or s.primary) and s.state not in ("absent", "removing"))
    return [MemberOut(member_id=m.member_id, incarnation=m.incarnation, address=m.address,
                      draining=m.draining, tables=owned[m.member_id], primary=primary[m.member_id],
                      secondary=secondary[m.member_id]) for m in members]


@router.get("/members", response_model=list[MemberOut], dependencies=[Depends(require_read)])
async def get_members(ctx: ApiContext = Depends(get_ctx)) -> list[MemberOut]:
    return list_members(ctx)


@router.get("/members/{member_id}", response_model=MemberOut, dependencies=[Depends(require_read)],
            responses={404: {"description": "Unknown member"}})
async def get_member(member_id: str, ctx: ApiContext = Depends(get_ctx)) -> MemberOut:
    for m in list_members(ctx):
        if m.member_id == member_id:
            return m
    raise HTTPException(404, f"member {member_id!r} is not alive")


@router.post("/members/{member_id}/drain", status_code=202, response_model=Accepted,
             dependencies=[Depends(require_write)],
             responses={404: {"description": "Unknown member"}, 409: {"description": "Refused"},
                        503: {"description": "No scheduler leader"}})
async def drain_member(member_id: str, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    if member_id not in projections_of(ctx).members.state.members:
        raise HTTPException(404, f"member {member_id!r} is not alive")
    answer = await schedule_request(ctx, ScheduleRequestV1(kind="drain", member_id=member_id,
                                                           requested_by=ctx.requested_by))
    return Accepted(detail=f"drain accepted by scheduler leader {answer.leader}",
                    follow=f"/api/v1/members/{member_id}", events="/api/v1/events?domain=schedule")


# -- sources --------------------------------------------------------------------------------------

async def _resolved_ts(ctx: ApiContext, source: str) -> tuple[int | None, int]:
    """The newest resolved mark's ts and its stream sequence (0: none)."""
    try:
        msg = await js_of(ctx).get_last_msg(ROWS_STREAM, resolved_subject(source))
    except (NotFoundError, NatsError):
        return None, 0
    try:
        body = json.loads(msg.data or b"{}")
        return int(body["data"]["ts"]), int(msg.seq or 0)
    except (ValueError, KeyError, TypeError):
        return None, int(msg.seq or 0)


async def _source_problem(ctx: ApiContext, source: str, resolved_seq: int) -> tuple[str, str] | None:
    """(kind, message) of capture's newest rejection of the source as a whole (not of one
    table), while no resolved mark came after it: capture is stuck on it (a purged binlog, a
    source not set up for ROW binlogs)."""
    try:
        msg = await js_of(ctx).get_last_msg(ROWS_STREAM, rejected_subject(source))
    except (NotFoundError, NatsError):
        return None
    if int(msg.seq or 0) < resolved_seq:
        return None
    try:
        event = REGISTRY.decode(msg.data or b"").event
    except ContractError:
        return None
    if not isinstance(event, CaptureRejectedV2) or event.table:
        return None
    return event.kind, event.message


async def list_sources(ctx: ApiContext) -> list[SourceOut]:
    with Session(projections_of(ctx).engine) as session:
        rows = list(session.exec(select(ChangefeedRow).order_by(ChangefeedRow.id)))
    sources: dict[str, tuple[str, list[str]]] = {}
    for row in rows:
        for src in ChangefeedSpec.model_validate_json(row.spec_json).sources:
            url, feeds = sources.setdefault(src.id, (redact_url(src.url), []))
            feeds.append(row.id)
    # Registered sources no changefeed reads yet are listed too (sources registry).
    registry = projections_of(ctx).changefeeds.state.sources
    for source_id, registered_url in registry.items():
        sources.setdefault(source_id, (redact_url(registered_url), []))
    out = []
    for source_id, (url, feeds) in sorted(sources.items()):
        resolved, resolved_seq = await _resolved_ts(ctx, source_id)
        problem = await _source_problem(ctx, source_id, resolved_seq)
        # The capture's own word while its sessions fail (it cannot connect, log in, ...) comes
        # first: a rejection event exists only for some of those kinds.
        health = await kv_json(ctx, SOURCE_HEALTH_BUCKET, token(source_id))
        since = None
        if health and health.get("problem"):
            problem, since = (str(health.get("kind") or "source_error"), str(health["problem"])), \
                str(health.get("since_utc") or "") or None
        lease = await kv_json(ctx, LEADER_BUCKET, f"capture.{token(source_id)}")
        out.append(SourceOut(id=source_id, url=url, changefeeds=feeds, registered=source_id in registry,
                             resolved_ts=resolved, problem_kind=problem[0] if problem else None,
                             problem=problem[1] if problem else None, problem_since=since,
                             resolved_lag_s=lag_seconds(resolved or 0),
                             capture_leader=str(lease.get("candidate")) if lease else None))
    return out


@router.get("/sources", response_model=list[SourceOut], dependencies=[Depends(require_read)])
async def get_sources(ctx: ApiContext = Depends(get_ctx)) -> list[SourceOut]:
    return await list_sources(ctx)


@router.get("/sources/{source_id}", response_model=SourceOut, dependencies=[Depends(require_read)],
            responses={404: {"description": "No changefeed reads this source and it is not registered"}})
async def get_source(source_id: str, ctx: ApiContext = Depends(get_ctx)) -> SourceOut:
    for s in await list_sources(ctx):
        if s.id == source_id:
            return s
    raise HTTPException(404, f"no changefeed reads a source {source_id!r} and it is not registered")


# -- status ---------------------------------------------------------------------------------------

@router.get("/status", response_model=StatusOut, dependencies=[Depends(require_read)])
async def status(ctx: ApiContext = Depends(get_ctx)) -> StatusOut:
    """Every changefeed's lag, every member and every pending DDL lock at a glance."""
    locks: list[dict[str, Any]] = []
    error = None
    try:
        answer = await request_json(ctx, command_subject("ddl"), DdlCommandV1(action="list"), "ddl-lock")
        raw = answer.get("locks")
        locks = [lk for lk in raw if isinstance(lk, dict)] if isinstance(raw, list) else []
    except HTTPException as exc:
        error = str(exc.detail)
    changefeeds = await asyncio.gather(*(with_stopped_tables(ctx, out) for out in list_changefeeds(ctx)))
    return StatusOut(changefeeds=list(changefeeds), members=list_members(ctx), ddl_locks=locks,
                     ddl_locks_error=error)
