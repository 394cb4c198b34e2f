"""Connecting to NATS with Sluice's settings, reconnect metrics included."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from libs.config import Settings
from libs.nats_auth import role_of_service
from libs.nats_tls import client_context
from libs.telemetry.metrics import NATS_RECONNECTS

log = logging.getLogger(__name__)


def redact_url(url: str) -> str:
    """``url`` (comma-separated servers) without the user info, for logs and errors. Not
    SQLAlchemy's ``make_url``: a NATS server list is not one URL, and make_url reads it as a bad port."""
    parts = []
    for one in url.split(","):
        split = urlsplit(one.strip())
        if split.password is None and split.username is None:
            parts.append(one.strip())
            continue
        host = split.hostname or ""
        netloc = f"***@{host}" + (f":{split.port}" if split.port else "")
        parts.append(urlunsplit(split._replace(netloc=netloc)))
    return ",".join(parts)


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The client TLS context of the settings: on when a CA or client certificate is set, or a
    server URL says ``tls://``."""
    wants = (settings.nats_tls_ca_file or settings.nats_tls_cert_file
             or any(s.strip().startswith("tls://") for s in settings.nats_url.split(",")))
    if not wants:
        return None
    return client_context(settings.nats_tls_ca_file, settings.nats_tls_cert_file,
                          settings.nats_tls_key_file)


def credentials(settings: Settings, service: str | None) -> tuple[str | None, str | None]:
    """The user and password a service connects with: the settings' own, or with
    ``nats_users_dir`` and no user set, the service's role and the password file of that role
    (written 0600 by ``python -m libs.nats_auth local``), so no password is on a command line
    or in a shell's environment."""
    password = settings.nats_password.get_secret_value() if settings.nats_password else None
    if settings.nats_user or not settings.nats_users_dir or service is None:
        return settings.nats_user, password
    role = role_of_service(service, settings.source_id)
    if role is None:
        return settings.nats_user, password
    path = Path(settings.nats_users_dir) / role
    try:
        return role, path.read_text().strip()
    except OSError as exc:
        raise ConnectionError(f"no NATS password for role {role!r}: cannot read {path} ({exc.strerror}); "
                              "write it with python -m libs.nats_auth local") from None


async def connect(settings: Settings, name: str, service: str | None = None) -> Client:
    async def on_reconnect() -> None:
        NATS_RECONNECTS.inc()
        log.warning("reconnected to NATS")

    async def on_disconnect() -> None:
        log.warning("disconnected from NATS")

    async def on_error(exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    user, password = credentials(settings, service)
    # The client retries forever once connected; at start-up a missing NATS must fail the
    # process within a bound, so an operator sees the error instead of a silent hang.
    connecting = nats.connect(
        servers=[s.strip() for s in settings.nats_url.split(",") if s.strip()],
        name=name,
        user=user,
        password=password,
        token=settings.nats_token.get_secret_value() if settings.nats_token else None,
        user_credentials=settings.nats_creds_file,
        tls=tls_context(settings),
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
            f"cannot connect to NATS at {redact_url(settings.nats_url)} within "
            f"{settings.nats_connect_timeout_s:.0f}s: {exc!r}"
        ) from exc


async def read_json(kv: KeyValue, key: str) -> dict[str, Any] | None:
    """A JSON object kept in a KV bucket; None when the key is absent or holds no object."""
    try:
        entry = await kv.get(key)
    except (KeyNotFoundError, NotFoundError):
        return None
    try:
        value = json.loads(entry.value or b"null")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# nats-py's own flush timeout when ``flush_within`` gives up waiting: a PONG later than this
# means the connection is dead, and its ping timer reconnects it.
_FLUSH_BACKSTOP_S = 60


async def flush_within(nc: Client, timeout_s: float) -> None:
    """``nc.flush()`` (the server answered a PING sent after everything published so far),
    raising ``TimeoutError`` after ``timeout_s``, without cancelling the PING's future.

    ``asyncio.wait_for(nc.flush(), t)`` cancels that future on timeout but leaves it in the
    client's queue of PINGs; when the late PONG arrives, nats-py's read loop calls
    ``set_result`` on the cancelled future, gets ``InvalidStateError``, logs "nats: encountered
    error" and *stops reading*: every later fetch and request on the connection times out until
    the ping timer reconnects it, minutes later. Seen under sysbench when a heartbeat's
    confirmation took over its 1 s bound (BENCHMARKS.md, "The sink under sysbench"). Here the
    flush goes on in its own task after the timeout and its PONG completes it normally."""
    task = asyncio.ensure_future(nc.flush(timeout=_FLUSH_BACKSTOP_S))
    task.add_done_callback(_retrieve)
    await asyncio.wait_for(asyncio.shield(task), timeout_s)


def _retrieve(task: asyncio.Future[None]) -> None:
    # The result of a flush nobody waits for any more: retrieved, so asyncio does not report it.
    if not task.cancelled():
        task.exception()
