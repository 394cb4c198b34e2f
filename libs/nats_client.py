"""Connecting to NATS with Sluice's settings, reconnect metrics included."""

from __future__ import annotations

import asyncio
import logging

import nats
from nats.aio.client import Client

from libs.config import Settings
from libs.telemetry.metrics import NATS_RECONNECTS

log = logging.getLogger(__name__)


async def connect(settings: Settings, name: str) -> Client:
    async def on_reconnect() -> None:
        NATS_RECONNECTS.inc()
        log.warning("reconnected to NATS")

    async def on_disconnect() -> None:
        log.warning("disconnected from NATS")

    async def on_error(exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    # The client retries forever once connected; at start-up a missing NATS must fail the
    # process within a bound, so an operator sees the error instead of a silent hang.
    connecting = nats.connect(
        servers=[s.strip() for s in settings.nats_url.split(",") if s.strip()],
        name=name,
        user=settings.nats_user,
        password=settings.nats_password.get_secret_value() if settings.nats_password else None,
        token=settings.nats_token.get_secret_value() if settings.nats_token else None,
        user_credentials=settings.nats_creds_file,
        reconnected_cb=on_reconnect,
        disconnected_cb=on_disconnect,
        error_cb=on_error,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
    )
    try:
        return await asyncio.wait_for(connecting, timeout=settings.nats_connect_timeout_s)
    except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
        raise ConnectionError(
            f"cannot connect to NATS at {settings.nats_url} within "
            f"{settings.nats_connect_timeout_s:.0f}s: {exc!r}"
        ) from exc
