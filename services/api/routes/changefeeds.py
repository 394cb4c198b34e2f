"""/api/v1/changefeeds: create, read, update, pause, resume, delete.

Commands are appended to the changefeeds stream with the expected last sequence of what the
read model has folded, so two api replicas cannot both create one id or resume a feed the
other just deleted: the loser re-reads and is refused with 409. The answer comes once this
replica's read model shows the change (read your own write)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Response
from fastapi.exceptions import RequestValidationError
from sqlmodel import Session, select

from contracts.events.changefeeds import ChangefeedSpec
from contracts.events.table_incidents import TableStoppedV2
from libs.changefeeds import record_changefeed, record_state, record_update
from libs.eventstore import AppendConflict
from libs.routing import unique_conflict_warnings
from libs.scheduling.model import Span as WorkerSpan
from libs.stream_origin import stream_origin, uncovered
from libs.streams import SYNCPOINT_BUCKET, token
from libs.syncpoints import SyncpointRecord
from services.api.auth import require_read, require_write
from services.api.context import ApiContext, get_ctx, js_of, kv_json, projections_of, span_checkpoint
from services.api.models import ChangefeedRow, SpanRow
from services.api.prechecks import CheckResult, run_checks
from services.api.schemas import (
    Accepted,
    ChangefeedOut,
    StoppedTableOut,
    lag_seconds,
    redact_spec,
    stopped_text,
    unredact_url,
)
from services.api.source_refs import ChangefeedSpecIn, resolve_spec
from services.api.validation import binding_problems, password_problems, spec_problems

router = APIRouter(prefix="/changefeeds", tags=["changefeeds"])
_lock = asyncio.Lock()
_ATTEMPTS = 5


def changefeed_out(row: ChangefeedRow, spans: list[SpanRow]) -> ChangefeedOut:
    spec = ChangefeedSpec.model_validate_json(row.spec_json)
    by_state = Counter(s.state for s in spans)
    return ChangefeedOut(id=row.id, state=row.state, spec=redact_spec(spec),
                         checkpoint_ts=row.checkpoint_ts, resolved_ts=row.resolved_ts,
                         lag_s=lag_seconds(row.checkpoint_ts), tables=len(spans),
                         tables_by_state=dict(sorted(by_state.items())),
                         failed_checks=json.loads(row.failed_checks_json))


async def with_stopped_tables(ctx: ApiContext, out: ChangefeedOut) -> ChangefeedOut:
    """``out`` with the tables an open incident stops (the changefeeds log) and where each
    stopped (its stored checkpoint): the ones its checkpoint does not cover."""
    stopped = sorted((key, event) for key, event in projections_of(ctx).changefeeds.state.stopped.items()
                     if key[0] == out.id)
    spans = [WorkerSpan(*key) for key, _ in stopped]
    positions = await asyncio.gather(*(span_checkpoint(ctx, span) for span in spans))
    out.stopped_tables = [
        StoppedTableOut(source=span.source, database=span.database, table=span.table,
                        incident=event.incident, kind=event.kind, reason=stopped_text(event),
                        checkpoint_ts=stopped_at(event, position))
        for span, (_, event), position in zip(spans, stopped, positions, strict=True)]
    return out


def stopped_at(event: TableStoppedV2, stored: tuple[int, int] | None) -> int | None:
    """Where a stopped table stands: its stored checkpoint; before its first one, an
    unreplicable table stopped where its first round started (``upto_ts``), a refused one is
    unknown (None)."""
    if stored is not None:
        return stored[1]
    return event.upto_ts if event.kind == "unreplicable" else None


def list_changefeeds(ctx: ApiContext) -> list[ChangefeedOut]:
    with Session(projections_of(ctx).engine) as session:
        rows = list(session.exec(select(ChangefeedRow).order_by(ChangefeedRow.id)))
        spans = list(session.exec(select(SpanRow)))
    by_cf: dict[str, list[SpanRow]] = {}
    for s in spans:
        by_cf.setdefault(s.changefeed, []).append(s)
    return [changefeed_out(r, by_cf.get(r.id, [])) for r in rows]


def load_changefeed(ctx: ApiContext, changefeed_id: str) -> ChangefeedOut:
    with Session(projections_of(ctx).engine) as session:
        row = session.get(ChangefeedRow, changefeed_id)
        if row is None:
            raise HTTPException(404, f"changefeed {changefeed_id!r} does not exist")
        spans = list(session.exec(select(SpanRow).where(SpanRow.changefeed == changefeed_id)))
    return changefeed_out(row, spans)


Append = Callable[[int | None], Awaitable[int]]


async def _command(ctx: ApiContext, check: Callable[[], None], append: Append) -> int:
    """Check against the read model, append fenced on what it folded; on a conflict catch up
    and check again. Returns the event's sequence once the read model shows it."""
    proj = projections_of(ctx)
    async with _lock:
        for _ in range(_ATTEMPTS):
            check()
            seen = proj.seen_seq("changefeeds")
            try:
                seq = await append(seen or None)
            except AppendConflict as exc:
                target = exc.actual_last_seq or seen + 1
                await proj.wait_seen("changefeeds", target, ctx.settings.api_command_timeout_s)
                continue
            await proj.wait_folded("changefeeds", seq, ctx.settings.api_command_timeout_s)
            return seq
    raise HTTPException(409, "the changefeeds log kept changing under this request; try again")


def _accepted(changefeed_id: str, seq: int, detail: str) -> Accepted:
    return Accepted(detail=detail, seq=seq, follow=f"/api/v1/changefeeds/{changefeed_id}",
                    events=f"/api/v1/events?since=changefeeds:{seq - 1}")


SKIP_CHECKS = Query(False, description="Record the changefeed even when creation checks fail; "
                                      "the failures are shown as its failed_checks.")


async def _prechecks(spec: ChangefeedSpec, skip: bool) -> CheckResult:
    """Run the creation checks; refuse with 422 (each failure with its fix) unless skipped."""
    checks = await run_checks(spec)
    failed = checks.failed
    if failed and not skip:
        raise RequestValidationError([
            {"loc": ["checks", f.check, f.target], "msg": f.message, "type": f"precheck.{f.check}"}
            for f in failed])
    return checks


def _validate(spec: ChangefeedSpec, password_checked: bool = False) -> None:
    problems = (([] if password_checked else password_problems(spec)) + spec_problems(spec)
                + binding_problems(spec))
    if problems:
        raise RequestValidationError(problems)


async def syncpoint_view(ctx: ApiContext, changefeed_id: str) -> dict[str, Any] | None:
    """The changefeed's syncpoints as the replication-manager leader last wrote them."""
    raw = await kv_json(ctx, SYNCPOINT_BUCKET, token(changefeed_id))
    if raw is None:
        return None
    try:
        return SyncpointRecord.model_validate(raw).view()
    except ValueError:
        return None


async def with_details(ctx: ApiContext, out: ChangefeedOut) -> ChangefeedOut:
    out = await with_stopped_tables(ctx, out)
    if out.spec.get("syncpoint_interval") is not None:
        out.syncpoint = await syncpoint_view(ctx, out.id)
    return out


@router.get("", response_model=list[ChangefeedOut], dependencies=[Depends(require_read)])
async def get_changefeeds(ctx: ApiContext = Depends(get_ctx)) -> list[ChangefeedOut]:
    return list(await asyncio.gather(*(with_details(ctx, out) for out in list_changefeeds(ctx))))


@router.get("/{changefeed_id}", response_model=ChangefeedOut, dependencies=[Depends(require_read)],
            responses={404: {"description": "Unknown changefeed"}})
async def get_changefeed(changefeed_id: str, ctx: ApiContext = Depends(get_ctx)) -> ChangefeedOut:
    return await with_details(ctx, load_changefeed(ctx, changefeed_id))


@router.get("/{changefeed_id}/syncpoint", dependencies=[Depends(require_read)],
            responses={404: {"description": "Unknown changefeed"}})
async def get_syncpoint(changefeed_id: str, ctx: ApiContext = Depends(get_ctx)) -> dict[str, Any]:
    """The last syncpoint (every table of the changefeed at one upstream ts, recorded in the
    downstream's sluice_syncpoint table) and the pending one; ``last_ts`` null before the first."""
    out = load_changefeed(ctx, changefeed_id)
    view = await syncpoint_view(ctx, changefeed_id)
    return {"changefeed": changefeed_id, "syncpoint_interval": out.spec.get("syncpoint_interval"),
            "syncpoint_hold_s": out.spec.get("syncpoint_hold_s"),
            **(view or SyncpointRecord(changefeed=changefeed_id).view())}


@router.post("", status_code=202, response_model=Accepted, dependencies=[Depends(require_write)],
             responses={409: {"description": "The id exists"}, 422: {"description": "Invalid spec"}})
async def create_changefeed(spec_in: ChangefeedSpecIn, response: Response,
                            ctx: ApiContext = Depends(get_ctx), skip_checks: bool = SKIP_CHECKS) -> Accepted:
    spec = resolve_spec(ctx, spec_in)  # sources given by id only take their registered URL
    _validate(spec)
    view = projections_of(ctx).changefeeds
    if spec.id in view.state.specs:  # before connecting anywhere; checked again when appending
        raise HTTPException(409, f"changefeed {spec.id!r} exists "
                                 f"({view.state.states.get(spec.id, 'running')})")
    await _start_points_in_stream(ctx, spec)
    checks = await _prechecks(spec, skip_checks)
    failed = checks.failed

    def check() -> None:
        if spec.id in view.state.specs:
            raise HTTPException(409, f"changefeed {spec.id!r} exists "
                                     f"({view.state.states.get(spec.id, 'running')})")

    seq = await _command(ctx, check, lambda expected: record_changefeed(
        js_of(ctx), spec, ctx.requested_by, expected_last_subject_seq=expected,
        failed_checks=failed))
    response.headers["Location"] = f"/api/v1/changefeeds/{spec.id}"
    accepted = _accepted(spec.id, seq, "changefeed recorded; the scheduler starts its tables"
                         + (f" (accepted with {len(failed)} failed checks: see its failed_checks)"
                            if failed else ""))
    accepted.warnings = unique_conflict_warnings(spec) + checks.warnings
    return accepted


async def _start_points_in_stream(ctx: ApiContext, spec: ChangefeedSpec) -> None:
    """A binlog-only changefeed's start position or time must lie within each source's stream
    (``libs.stream_origin``): refused here with the reason, as each span would refuse it."""
    if spec.initial_load != "binlog-only" or (not spec.start_position and spec.start_time is None):
        return
    errors = []
    for source in spec.sources:
        position = spec.start_position.get(source.id)
        if position is None and spec.start_time is None:
            continue
        # A source's start position, where given, is where it starts (not the time).
        reason = uncovered(await stream_origin(js_of(ctx), source.id), position=position,
                           start_time=spec.start_time if position is None else None)
        if reason is not None:
            field = ["start_position", source.id] if position is not None else ["start_time"]
            errors.append({"loc": ["body", *field], "type": "value_error", "msg": reason})
    if errors:
        raise RequestValidationError(errors)


@router.put("/{changefeed_id}", status_code=202, response_model=Accepted,
            dependencies=[Depends(require_write)],
            responses={404: {"description": "Unknown changefeed"}, 422: {"description": "Invalid spec"}})
async def update_changefeed(changefeed_id: str, spec_in: ChangefeedSpecIn,
                            ctx: ApiContext = Depends(get_ctx), skip_checks: bool = SKIP_CHECKS) -> Accepted:
    spec = resolve_spec(ctx, spec_in)  # sources given by id only take their registered URL
    literal = password_problems(spec)
    if literal:
        raise RequestValidationError(literal)
    if spec.id != changefeed_id:
        raise RequestValidationError([{"loc": ["body", "id"], "type": "value_error",
                                       "msg": f"the id in the body ({spec.id!r}) is not the "
                                              f"changefeed in the path ({changefeed_id!r})"}])
    view = projections_of(ctx).changefeeds
    stored = view.state.specs.get(changefeed_id)
    if stored is None:
        raise HTTPException(404, f"changefeed {changefeed_id!r} does not exist")
    # Redacted passwords sent back unchanged mean "keep the stored one".
    old_sources = {s.id: s.url for s in stored.sources}
    spec = spec.model_copy(update={
        "sink_url": unredact_url(spec.sink_url, stored.sink_url),
        "sources": [s.model_copy(update={"url": unredact_url(s.url, old_sources.get(s.id, ""))})
                    for s in spec.sources]})
    # A kept password is the one stored before secrets were references (a v2 changefeed).
    _validate(spec, password_checked=True)
    checks = await _prechecks(spec, skip_checks)
    failed = checks.failed

    def check() -> None:
        if changefeed_id not in view.state.specs:
            raise HTTPException(404, f"changefeed {changefeed_id!r} does not exist")

    seq = await _command(ctx, check, lambda expected: record_update(
        js_of(ctx), spec, ctx.requested_by, expected_last_subject_seq=expected,
        failed_checks=failed))
    accepted = _accepted(changefeed_id, seq, "changefeed updated")
    accepted.warnings = unique_conflict_warnings(spec) + checks.warnings
    return accepted


async def _set_state(ctx: ApiContext, changefeed_id: str, state: Literal["running", "paused", "deleted"],
                     allowed_from: tuple[str, ...], verb: str) -> Accepted:
    view = projections_of(ctx).changefeeds

    def check() -> None:
        if changefeed_id not in view.state.specs:
            raise HTTPException(404, f"changefeed {changefeed_id!r} does not exist")
        current = view.state.states.get(changefeed_id, "running")
        if current not in allowed_from:
            raise HTTPException(409, f"changefeed {changefeed_id!r} is {current}: cannot {verb} it")

    seq = await _command(ctx, check, lambda expected: record_state(
        js_of(ctx), changefeed_id, state, ctx.requested_by, f"{verb} through the api",
        expected_last_subject_seq=expected))
    return _accepted(changefeed_id, seq, f"changefeed {state}")


_STATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {"description": "Unknown changefeed"}, 409: {"description": "Not in a state that allows it"}}


@router.post("/{changefeed_id}/pause", status_code=202, response_model=Accepted,
             dependencies=[Depends(require_write)], responses=_STATE_RESPONSES)
async def pause_changefeed(changefeed_id: str, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    return await _set_state(ctx, changefeed_id, "paused", ("running",), "pause")


@router.post("/{changefeed_id}/resume", status_code=202, response_model=Accepted,
             dependencies=[Depends(require_write)], responses=_STATE_RESPONSES)
async def resume_changefeed(changefeed_id: str, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    return await _set_state(ctx, changefeed_id, "running", ("paused",), "resume")


@router.delete("/{changefeed_id}", status_code=202, response_model=Accepted,
               dependencies=[Depends(require_write)], responses=_STATE_RESPONSES)
async def delete_changefeed(changefeed_id: str, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    return await _set_state(ctx, changefeed_id, "deleted", ("running", "paused"), "delete")
