"""What every route needs: settings, the NATS connection, the read models."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from libs.config import Settings
from libs.nats_client import read_json
from libs.scheduling.model import Span
from libs.streams import CHECKPOINT_BUCKET
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


_buckets: dict[tuple[int, str], KeyValue] = {}


async def _bucket(ctx: ApiContext, bucket: str) -> KeyValue:
    # Bound once per connection (binding asks the server for the stream); a bucket that does
    # not exist yet is asked for again next time.
    key = (id(ctx.nc), bucket)
    if key not in _buckets:
        _buckets[key] = await js_of(ctx).key_value(bucket)
    return _buckets[key]


async def kv_json(ctx: ApiContext, bucket: str, key: str) -> dict[str, Any] | None:
    """A JSON value from a KV bucket; None when the bucket or key is absent or unreadable."""
    try:
        kv = await _bucket(ctx, bucket)
    except BucketNotFoundError:
        return None
    return await read_json(kv, key)


async def span_checkpoint(ctx: ApiContext, span: Span) -> tuple[int, int] | None:
    """The span's stored checkpoint (stream sequence, ts) as its worker wrote it: exact, unlike
    the replication sets, which record progress only with a change of state."""
    cp = await kv_json(ctx, CHECKPOINT_BUCKET, span.kv_key)
    if cp is None:
        return None
    with contextlib.suppress(TypeError, ValueError):
        return int(cp.get("stream_seq", 0)), int(cp.get("ts", 0))
    return None
