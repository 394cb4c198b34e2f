"""What a span this worker prepares waits for, in the prepare bucket (key: the span's checkpoint
key), so the api, the CLI and the demo can say why a span shows ``prepare``: reading its
start, Spark warming up on this worker (seconds of JVM start and first plans, once per
process), or the replication-manager's commit.

Best effort: a write that fails is logged and the span prepares all the same."""

from __future__ import annotations

import json
import logging
import time
from typing import Literal

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from libs.scheduling.model import Span
from libs.streams import PREPARE_BUCKET

log = logging.getLogger(__name__)

Phase = Literal["start", "spark", "prepared"]
# Entries outlive no prepare by much: the api shows them only while the span's set is preparing.
ENTRY_TTL_S = 600.0
WAITING_FOR: dict[Phase, str] = {
    "start": "reading its checkpoint and first changes",
    "spark": "Spark warming up (JVM start and first plans, once per worker)",
    "prepared": "the replication-manager's commit (prepared)",
}


def entry(member: str, phase: Phase, now: float | None = None) -> bytes:
    return json.dumps({"member": member, "phase": phase, "waiting_for": WAITING_FOR[phase],
                       "since": round(time.time() if now is None else now, 3)}).encode()


class PrepareProgress:
    def __init__(self, js: JetStreamContext, member: str, bucket: str = PREPARE_BUCKET,
                 replicas: int = 1) -> None:
        self.js = js
        self.member = member
        self.bucket = bucket
        self.replicas = replicas
        self._kv: KeyValue | None = None

    async def _open(self) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(self.bucket)
            except BucketNotFoundError:
                self._kv = await self.js.create_key_value(
                    bucket=self.bucket, history=1, ttl=ENTRY_TTL_S, replicas=self.replicas,
                    description="Sluice: what each preparing span waits for")
        return self._kv

    async def report(self, span: Span, phase: Phase) -> None:
        try:
            kv = await self._open()
            await kv.put(span.kv_key, entry(self.member, phase))
        except Exception:  # visibility only: never fail a prepare over it
            log.warning("could not record a span's prepare phase", exc_info=True,
                        extra={"span": span.name, "phase": phase})
