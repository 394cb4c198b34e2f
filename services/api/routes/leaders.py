"""/api/v1/leaders: who holds each lease in the leader bucket (and its epoch); resign asks the
current leader to step down (request/reply on ``sluice.cmd.leader.<service>``)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, HTTPException
from nats.js.errors import BucketNotFoundError, NoKeysError, NotFoundError

from libs.election import Election
from libs.streams import LEADER_BUCKET, leader_command_subject
from services.api.auth import require_read, require_write
from services.api.commands import request_json
from services.api.context import ApiContext, get_ctx, js_of
from services.api.schemas import Accepted, LeaderOut, ResignIn

router = APIRouter(prefix="/leaders", tags=["leaders"])


async def list_leaders(ctx: ApiContext) -> list[LeaderOut]:
    try:
        kv = await js_of(ctx).key_value(LEADER_BUCKET)
        keys = await kv.keys()
    except (BucketNotFoundError, NoKeysError, NotFoundError):
        return []
    out = []
    for key in sorted(keys):
        try:
            entry = await kv.get(key)
        except NotFoundError:  # expired between keys() and get()
            continue
        raw = entry.value or b"{}"
        try:
            json.loads(raw)
        except ValueError:
            continue
        info = Election._decode(raw, int(entry.revision or 0))
        out.append(LeaderOut(service=key, leader=info.candidate, epoch=info.epoch, revision=info.revision))
    return out


@router.get("", response_model=list[LeaderOut], dependencies=[Depends(require_read)])
async def get_leaders(ctx: ApiContext = Depends(get_ctx)) -> list[LeaderOut]:
    return await list_leaders(ctx)


@router.get("/{service}", response_model=LeaderOut, dependencies=[Depends(require_read)],
            responses={404: {"description": "No leader now"}})
async def get_leader(service: str, ctx: ApiContext = Depends(get_ctx)) -> LeaderOut:
    for leader in await list_leaders(ctx):
        if leader.service == service:
            return leader
    raise HTTPException(404, f"{service!r} has no leader now")


@router.post("/{service}/resign", status_code=202, response_model=Accepted,
             dependencies=[Depends(require_write)],
             responses={404: {"description": "No leader now"},
                        409: {"description": "The leader is at another epoch"},
                        503: {"description": "No leader answering"}})
async def resign(service: str, body: ResignIn, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    await get_leader(service, ctx)  # 404 when nobody holds the lease
    req = {"action": "resign", "epoch": body.epoch, "requested_by": ctx.requested_by,
           "reason": body.reason}
    answer = await request_json(ctx, leader_command_subject(service), req, service)
    return Accepted(detail=f"{answer.get('leader')} (epoch {answer.get('epoch')}) is stepping down",
                    follow=f"/api/v1/leaders/{service}")
