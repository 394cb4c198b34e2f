"""Commands to the leaders over core NATS request/reply, with their answers mapped to HTTP.

No responders means the domain has no leader at that moment (503); no answer in
``SLUICE_API_COMMAND_TIMEOUT_S`` is 504; an answer that is not what the contract says is 502."""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import BaseModel

from contracts import REGISTRY, ContractError
from contracts.events.scheduling import ScheduleRequestAnsweredV1, ScheduleRequestV1
from libs.streams import command_subject
from services.api.context import ApiContext


async def request_raw(ctx: ApiContext, subject: str, payload: bytes, who: str) -> bytes:
    assert ctx.nc is not None
    try:
        msg = await ctx.nc.request(subject, payload, timeout=ctx.settings.api_command_timeout_s)
    except NoRespondersError:
        raise HTTPException(503, f"no {who} leader is answering right now; try again shortly") from None
    except (TimeoutError, NatsTimeoutError):
        raise HTTPException(504, f"the {who} leader did not answer in "
                                 f"{ctx.settings.api_command_timeout_s:g} s") from None
    return bytes(msg.data or b"")


async def request_json(ctx: ApiContext, subject: str, body: dict[str, Any] | BaseModel,
                       who: str) -> dict[str, Any]:
    """Send ``body`` (a registered contract goes in its envelope); return the answer when
    ``ok``, raise its ``code`` and ``error`` otherwise."""
    payload = (REGISTRY.encode(body, producer=ctx.producer) if isinstance(body, BaseModel)
               else json.dumps(body).encode())
    raw = await request_raw(ctx, subject, payload, who)
    try:
        answer = json.loads(raw)
    except ValueError:
        raise HTTPException(502, f"the {who} leader sent an answer that is not JSON") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
        raise HTTPException(502, f"the {who} leader sent an answer without 'ok'")
    if not answer["ok"]:
        code = answer.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 409
        raise HTTPException(status, str(answer.get("error") or f"refused by the {who} leader"))
    return answer


async def schedule_request(ctx: ApiContext, req: ScheduleRequestV1) -> ScheduleRequestAnsweredV1:
    """An operator request to the scheduler leader; refusals are 409 with its reason."""
    raw = await request_raw(ctx, command_subject("schedule"),
                            REGISTRY.encode(req, producer=ctx.producer), "scheduler")
    try:
        decoded = REGISTRY.decode(raw)
    except ContractError as exc:
        raise HTTPException(502, f"the scheduler leader sent an unreadable answer: {exc}") from None
    if not isinstance(decoded.event, ScheduleRequestAnsweredV1):
        raise HTTPException(502, f"the scheduler leader answered with {decoded.envelope.type}")
    answer = decoded.event
    if not answer.accepted:
        raise HTTPException(409, answer.reason or "refused by the scheduler leader")
    return answer
