"""/api/v1 validation of a changefeed: the status its workers record per table (counts, the
first mismatched rows, an on-demand compare's progress) and the command that starts a compare.

Workers write each table's status to the ``sluice-validation`` bucket (``libs.validation``);
the api adds them up over the changefeed's tables. A compare request is a KV entry the workers
running the changefeed's tables read at their next cycle."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Query
from nats.js.errors import BucketNotFoundError, NotFoundError
from pydantic import BaseModel, Field
from sqlmodel import Session, select

from libs.streams import VALIDATION_BUCKET
from libs.validation import (
    CompareProgress,
    CompareRequest,
    ReportedRow,
    SpanValidation,
    read_request,
    request_compare,
    span_statuses,
)
from services.api.auth import require_read, require_write
from services.api.context import ApiContext, get_ctx, js_of, projections_of
from services.api.models import SpanRow
from services.api.routes.changefeeds import load_changefeed
from services.api.schemas import Accepted

router = APIRouter(tags=["validation"])


class MismatchOut(ReportedRow):
    table: str = Field(description="source/database.table of the row.")


class TableValidationOut(BaseModel):
    table: str = Field(description="source/database.table")
    target: str = ""
    worker: str = ""
    mode: str = "off"
    rows_checked: int = 0
    pending: int = 0
    rechecking: int = 0
    mismatches: int = 0
    found_total: int = 0
    repaired_total: int = 0
    skipped_total: int = 0
    checked_at: float | None = Field(None, description="Last check (Unix seconds); None: not yet.")
    error: str | None = None
    compare: CompareProgress | None = None


class CompareOut(BaseModel):
    request: CompareRequest | None = None
    state: str = Field("none", description="none (never asked), running, done or failed (any table).")
    tables_done: int = 0
    tables: int = 0
    rows_checked: int = 0
    rows_estimate: int = 0
    candidates: int = 0


class ValidationOut(BaseModel):
    changefeed: str
    mode: str = Field(description="The changefeed's validation mode: off, fast or full.")
    rows_checked: int = 0
    pending: int = 0
    rechecking: int = Field(0, description="Rows that differed once and wait for their re-check.")
    mismatches: int = Field(0, description="Rows reported: different after their re-check.")
    found_total: int = 0
    repaired_total: int = 0
    skipped_total: int = 0
    mismatched_rows: list[MismatchOut] = Field(default_factory=list,
                                               description="The first `limit` rows reported.")
    compare: CompareOut
    tables: list[TableValidationOut]


Statuses = list[tuple[str, SpanValidation | None]]


async def _statuses(ctx: ApiContext, changefeed_id: str) -> tuple[Statuses, CompareRequest | None]:
    """Each table's status: every record its workers wrote, plus the tables the read model knows
    that have none yet (a table that never ran a check)."""
    with Session(projections_of(ctx).engine) as session:
        rows = list(session.exec(select(SpanRow).where(SpanRow.changefeed == changefeed_id)))
    names = {f"{r.source}/{r.database}.{r.table}" for r in rows}
    try:
        kv = await js_of(ctx).key_value(VALIDATION_BUCKET)
    except (BucketNotFoundError, NotFoundError):
        return [(n, None) for n in sorted(names)], None
    found: dict[str, SpanValidation | None] = dict.fromkeys(names)
    for status in await span_statuses(kv, changefeed_id):
        found[f"{status.source}/{status.database}.{status.table}"] = status
    return sorted(found.items()), await read_request(kv, changefeed_id)


@router.get("/changefeeds/{changefeed_id}/validation", response_model=ValidationOut,
            dependencies=[Depends(require_read)], responses={404: {"description": "Unknown changefeed"}})
async def get_validation(changefeed_id: str, limit: int = Query(20, ge=0, le=1000),
                         ctx: ApiContext = Depends(get_ctx)) -> ValidationOut:
    spec = load_changefeed(ctx, changefeed_id).spec
    statuses, request = await _statuses(ctx, changefeed_id)
    out = ValidationOut(changefeed=changefeed_id, mode=str(spec.get("validation", {}).get("mode", "off")),
                        compare=CompareOut(request=request), tables=[])
    states: list[str] = []
    for name, s in statuses:
        if s is None:
            out.tables.append(TableValidationOut(table=name))
            continue
        fields = s.model_dump(exclude={"reported", "changefeed", "span", "source", "database", "table",
                                       "checked_at", "checkpoint_ts"})
        table = TableValidationOut(table=name, checked_at=s.checked_at or None, **fields)
        out.tables.append(table)
        for total in ("rows_checked", "pending", "rechecking", "mismatches", "found_total", "repaired_total",
                      "skipped_total"):
            setattr(out, total, getattr(out, total) + getattr(s, total))
        for r in s.reported:
            if len(out.mismatched_rows) < limit:
                out.mismatched_rows.append(MismatchOut(table=name, **r.model_dump()))
        c = s.compare
        if request is not None and c is not None and c.request_id == request.id:
            states.append(c.state)
            out.compare.rows_checked += c.rows_checked
            out.compare.rows_estimate += c.rows_estimate
            out.compare.candidates += c.candidates
            out.compare.tables_done += c.state == "done"
    if request is not None:
        out.compare.tables = len(statuses)
        out.compare.state = ("failed" if "failed" in states else
                             "done" if out.compare.tables_done == len(statuses) else "running")
    return out


@router.post("/changefeeds/{changefeed_id}/validation/compare", status_code=202, response_model=Accepted,
             dependencies=[Depends(require_write)], responses={404: {"description": "Unknown changefeed"}})
async def start_compare(changefeed_id: str, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    load_changefeed(ctx, changefeed_id)
    request = await request_compare(js_of(ctx), changefeed_id, ctx.requested_by,
                                    replicas=ctx.settings.stream_replicas)
    return Accepted(detail=f"compare {request.id} requested at {time.strftime('%H:%M:%S')}: each table is "
                           "compared from its first key by the worker running it",
                    follow=f"/api/v1/changefeeds/{changefeed_id}/validation")
