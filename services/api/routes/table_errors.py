"""/api/v1 operator decisions on a table stopped by an incident (poison isolation, tables that
cannot be replicated).

A sink-worker records ``table.stopped`` in the changefeeds log when the downstream refuses one
of a table's changes for good (kind ``refused``) or the table cannot be replicated as the
changefeed says (kind ``unreplicable``: no usable key, rules that do not fit); the table's GET
shows it (``state: stopped`` and ``incident``). The operator answers here with the incident's
id: ``skip`` (the refused change goes to the dead letters and the table goes on), ``retry``, or
``resume`` after fixing the downstream or the table. The
decision is appended to the changefeeds log, fenced like every changefeed command; the worker
that runs the table folds it from there (so it reaches whichever worker runs it, also after a
move or a restart) and acts only on the incident it names."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException

from contracts.events.table_incidents import TableAction, TableActionRequestedV1, TableRefV1
from libs.changefeeds import record_table_event
from services.api.auth import require_write
from services.api.context import ApiContext, get_ctx, js_of, projections_of
from services.api.routes.changefeeds import _command
from services.api.routes.cluster import _span_row
from services.api.schemas import Accepted

router = APIRouter(tags=["cluster"])


@router.post("/changefeeds/{changefeed_id}/tables/{source}/{database}/{table}/errors/{incident}/{action}",
             status_code=202, response_model=Accepted, dependencies=[Depends(require_write)],
             responses={404: {"description": "Unknown changefeed or table"},
                        409: {"description": "The table is not stopped by this incident"},
                        422: {"description": "Unknown action, or a skip without a single refused row"}})
async def act_on_table_error(changefeed_id: str, source: str, database: str, table: str, incident: str,
                             action: TableAction, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    _span_row(ctx, changefeed_id, source, database, table)  # 404s
    view = projections_of(ctx).changefeeds
    key = (changefeed_id, source, database, table)

    def check() -> None:
        stopped = view.state.stopped.get(key)
        if stopped is None:
            raise HTTPException(409, f"table {source}/{database}.{table} is not stopped by an incident")
        if stopped.incident != incident:
            raise HTTPException(409, f"table {source}/{database}.{table} is stopped by incident "
                                     f"{stopped.incident!r}, not {incident!r}")
        if action == "skip" and stopped.kind == "unreplicable":
            raise HTTPException(422, "the table as a whole cannot be replicated, so there is no row to "
                                     f"skip: fix it ({stopped.error}) and resume")
        if action == "skip" and stopped.key is None:
            raise HTTPException(422, "no single row reproduces this refusal, so there is nothing to skip: "
                                     "fix the downstream and resume")

    event = TableActionRequestedV1(table=TableRefV1(changefeed=changefeed_id, source=source,
                                                    database=database, table=table),
                                   incident=incident, action=action, requested_by=ctx.requested_by)
    seq = await _command(ctx, check, lambda expected: record_table_event(
        js_of(ctx), event, ctx.requested_by, expected_last_subject_seq=expected))
    return Accepted(detail=f"{action} recorded; the worker running the table carries it out", seq=seq,
                    follow=f"/api/v1/changefeeds/{changefeed_id}/tables/{source}/{database}/{table}",
                    events=f"/api/v1/events?since=changefeeds:{seq - 1}")
