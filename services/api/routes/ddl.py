"""/api/v1/ddl-locks: shard DDL locks as the ddl-lock leader holds them (request/reply on
``sluice.cmd.ddl``); unlock with exec or skip, force-remove. The leader validates; its
404/409/422 come back as they are."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException

from contracts.events.shard_ddl import DdlCommandV1
from libs.streams import command_subject
from services.api.auth import require_read, require_write
from services.api.commands import request_json
from services.api.context import ApiContext, get_ctx
from services.api.schemas import Accepted, ReasonIn, UnlockIn

router = APIRouter(prefix="/ddl-locks", tags=["ddl"])
_RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {"description": "Unknown lock"}, 409: {"description": "Refused by the ddl-lock leader"},
    503: {"description": "No ddl-lock leader"}}


async def _ask(ctx: ApiContext, command: DdlCommandV1) -> dict[str, Any]:
    return await request_json(ctx, command_subject("ddl"), command, "ddl-lock")


def _lock_of(answer: dict[str, Any]) -> dict[str, Any]:
    lock = answer.get("lock")
    if not isinstance(lock, dict):
        raise HTTPException(502, "the ddl-lock leader answered without a lock")
    return lock


@router.get("", dependencies=[Depends(require_read)], responses=_RESPONSES)
async def list_locks(ctx: ApiContext = Depends(get_ctx)) -> list[dict[str, Any]]:
    locks = (await _ask(ctx, DdlCommandV1(action="list"))).get("locks")
    if not isinstance(locks, list):
        raise HTTPException(502, "the ddl-lock leader answered without a lock list")
    return [lk for lk in locks if isinstance(lk, dict)]


@router.get("/{changefeed}/{target}", dependencies=[Depends(require_read)], responses=_RESPONSES)
async def show_lock(changefeed: str, target: str, ctx: ApiContext = Depends(get_ctx)) -> dict[str, Any]:
    """``target`` is the downstream table, ``schema.table``."""
    return _lock_of(await _ask(ctx, DdlCommandV1(action="show", changefeed=changefeed, target=target)))


@router.post("/{changefeed}/{target}/unlock", status_code=202, response_model=Accepted,
             dependencies=[Depends(require_write)], responses=_RESPONSES)
async def unlock(changefeed: str, target: str, body: UnlockIn,
                 ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    await _ask(ctx, DdlCommandV1(action="unlock", changefeed=changefeed, target=target, mode=body.mode,
                                 owner=body.owner, requested_by=ctx.requested_by, reason=body.reason))
    return Accepted(detail=f"unlock ({body.mode}) accepted by the ddl-lock leader",
                    follow=f"/api/v1/ddl-locks/{changefeed}/{target}", events="/api/v1/events?domain=ddl")


@router.post("/{changefeed}/{target}/force-remove", status_code=202, response_model=Accepted,
             dependencies=[Depends(require_write)], responses=_RESPONSES)
async def force_remove(changefeed: str, target: str, body: ReasonIn,
                       ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    await _ask(ctx, DdlCommandV1(action="force_remove", changefeed=changefeed, target=target,
                                 requested_by=ctx.requested_by, reason=body.reason))
    return Accepted(detail="lock removal accepted by the ddl-lock leader",
                    follow=f"/api/v1/ddl-locks/{changefeed}/{target}", events="/api/v1/events?domain=ddl")
