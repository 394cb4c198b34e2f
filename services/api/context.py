"""What every route needs: settings, the NATS connection, the read models."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import HTTPException, Request
from nats.aio.client import Client
from nats.js import JetStreamContext

from libs.config import Settings
from services.api.auth import current_principal
from services.api.projections import Projections


@dataclass
class ApiContext:
    settings: Settings
    producer: str
    nc: Client | None = None
    projections: Projections | None = None
    stopping: asyncio.Event | None = None
    """The runtime's stop signal: open event feeds end with it instead of holding up shutdown."""

    @property
    def requested_by(self) -> str:
        """The principal of the current request's token: who a command is recorded as."""
        return current_principal.get()

    def ready(self) -> bool:
        return (self.nc is not None and self.nc.is_connected and self.projections is not None
                and self.projections.ready)


def get_ctx(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    if not ctx.ready():
        raise HTTPException(503, "the api is starting: read models are being rebuilt; try again")
    return ctx


def js_of(ctx: ApiContext) -> JetStreamContext:
    assert ctx.nc is not None
    return ctx.nc.jetstream()


def projections_of(ctx: ApiContext) -> Projections:
    assert ctx.projections is not None
    return ctx.projections
