"""Connecting to NATS with Sluice's settings, reconnect metrics included."""

from __future__ import annotations

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

    return await nats.connect(
        servers=[s.strip() for s in settings.nats_url.split(",") if s.strip()],
        name=name,
        user=settings.nats_user,
        password=settings.nats_password,
        token=settings.nats_token,
        user_credentials=settings.nats_creds_file,
        reconnected_cb=on_reconnect,
        disconnected_cb=on_disconnect,
        error_cb=on_error,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
    )
