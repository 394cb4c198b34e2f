"""A source's capture health as the api shows it: while capture's sessions with the source fail
(it cannot connect, a wrong password, the source refused, a purged binlog), the reason, its kind
and since when, in the KV bucket ``SOURCE_HEALTH_BUCKET`` under the source's token. Capture
writes it (``SourceHealth.failing``) and deletes it once a session reads (``SourceHealth.reading``);
the api reads it (``read``) beside capture's rejection events, which tell only the kinds a
rejection has."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from libs.streams import SOURCE_HEALTH_BUCKET, token

log = logging.getLogger(__name__)


def utc_text(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def entry(kind: str, problem: str, since: float, instance: str, now: float | None = None) -> dict[str, Any]:
    """The value stored for a failing source (no secret: capture's messages name host and user)."""
    return {"kind": kind, "problem": problem, "since": since, "since_utc": utc_text(since),
            "updated": time.time() if now is None else now, "instance": instance}


@dataclass
class SourceHealth:
    """Capture's writer. Failures to write are logged, never raised: the health report must not
    be what stops capture."""

    js: JetStreamContext
    source: str
    instance: str
    replicas: int = 1
    _kv: KeyValue | None = field(default=None, repr=False)
    _written: bool = field(default=True, repr=False)
    """Assumed written at start: a previous process may have left an entry to clear."""

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self.js.create_key_value(bucket=SOURCE_HEALTH_BUCKET, history=1,
                                                      replicas=self.replicas)
        return self._kv

    async def failing(self, kind: str, problem: str, since: float) -> None:
        try:
            kv = await self._bucket()
            await kv.put(token(self.source), json.dumps(entry(kind, problem, since, self.instance)).encode())
            self._written = True
        except (NatsError, OSError) as exc:
            log.warning("cannot record the source's health: %r", exc, extra={"source": self.source})

    async def reading(self) -> None:
        if not self._written:
            return
        try:
            kv = await self._bucket()
            await kv.delete(token(self.source))
            self._written = False
        except (KeyNotFoundError, NotFoundError):
            self._written = False
        except (NatsError, OSError) as exc:
            log.warning("cannot clear the source's health: %r", exc, extra={"source": self.source})
