"""The NATS sink: a changefeed's merged, ordered changes republished to a JetStream stream.

Sink URL: ``nats://[user:pass@]host:port[,host:port]/<STREAM>?subject=<prefix>&format=sluice|debezium``
(``tls://`` for TLS). Every row change of a span's batch becomes one message on
``<prefix>.<target schema>.<target table>`` in the order the sort job fixed, ``(ts, seq, part)``
and then the row's index in its message: no collapse to the last image, unlike the database
sinks. A DDL barrier is published after the batch it ends, on ``<prefix>.<schema>.<table>.ddl``.

Idempotence: every message carries ``Nats-Msg-Id: <changefeed>:<event id>:<row>`` (the event id
is capture's deterministic id of the rows message), so re-publishing a batch after a crash, from
an older checkpoint, is dropped by the stream's duplicate window (``SLUICE_DEDUP_WINDOW_S`` when
the sink creates the stream). The pipeline advances the span's checkpoint only after every
message of the batch is acknowledged.

Formats:

- ``sluice`` (default): a Sluice envelope of type ``sink.row_changed`` v1
  (``contracts/events/sink.py``, schema in ``contracts/schemas/``); DDL: the captured
  ``ddl.executed`` event, re-enveloped with the same id.
- ``debezium``: ``{"before", "after", "op": "c"|"u"|"d", "source": {...}, "ts_ms", "transaction"}``
  with ``source`` holding the changefeed (``name``), source id, database, table, the commit time
  (``ts_ms``) and Sluice's order fields; DDL: ``{"source", "ddl", "ts_ms"}``. Values keep the
  row-change contract's JSON encoding.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

import nats
from nats.aio.client import Client
from nats.js import api
from nats.js.errors import NotFoundError

from contracts import REGISTRY
from contracts.events.rows import DdlExecutedV1, RowsChangedV2
from contracts.events.sink import SinkRowChangedV1
from libs.secret_refs import SecretError, is_reference, resolve_password
from libs.streams import token
from libs.telemetry.tracing import inject_headers
from libs.ts import LOGICAL_BITS

StreamFormat = Literal["sluice", "debezium"]
_SCHEMES = {"nats": "nats", "tls": "tls"}
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")
_SUBJECT_PREFIX = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
_DEBEZIUM_OPS = {"insert": "c", "update": "u", "delete": "d"}
_PRODUCER = "sink-worker"


class StreamUrlError(ValueError):
    """A NATS sink URL that cannot be used, with what is wrong with it."""


@dataclass(frozen=True)
class StreamSinkUrl:
    scheme: str
    hosts: tuple[str, ...]
    stream: str
    subject_prefix: str
    format: StreamFormat
    user: str | None = None
    password: str | None = None

    @property
    def servers(self) -> list[str]:
        return [f"{self.scheme}://{h}" for h in self.hosts]

    def redacted(self) -> str:
        auth = f"{self.user}:***@" if self.password else (f"{self.user}@" if self.user else "")
        return (f"{self.scheme}://{auth}{','.join(self.hosts)}/{self.stream}"
                f"?subject={self.subject_prefix}&format={self.format}")


def server_host_port(server: str) -> tuple[str, int]:
    parts = urlsplit(f"nats://{server}")
    try:
        port = parts.port
    except ValueError:
        raise StreamUrlError(f"bad port in NATS server {server!r}") from None
    return parts.hostname or "", port or 4222


def is_stream_sink(url: str) -> bool:
    return urlsplit(url).scheme.lower() in _SCHEMES


def parse_stream_url(url: str, *, resolve_secrets: bool = True) -> StreamSinkUrl:
    """``resolve_secrets=False`` checks the URL's form only (the api, before a worker runs it)."""
    parts = urlsplit(url)
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise StreamUrlError(f"not a NATS sink URL (scheme {parts.scheme!r}; use nats:// or tls://)")
    netloc = parts.netloc
    user = password = None
    if "@" in netloc:
        auth, netloc = netloc.rsplit("@", 1)
        user, _, pw = auth.partition(":")
        user, password = unquote(user) or None, unquote(pw) or None
    hosts = tuple(h for h in netloc.split(",") if h)
    if not hosts:
        raise StreamUrlError("a NATS sink URL needs a host: nats://host:4222/<STREAM>")
    if password is not None and is_reference(password) and resolve_secrets:
        try:
            # Every server of the URL may get the password: the secret must be bound to each.
            password = resolve_password(password, [server_host_port(h) for h in hosts])
        except SecretError as exc:
            raise StreamUrlError(str(exc)) from None
    stream = parts.path.strip("/")
    if not stream or not _STREAM_NAME.match(stream):
        raise StreamUrlError(f"stream name {stream!r} must be letters, digits, '_' or '-' "
                             "(nats://host:4222/<STREAM>)")
    query = parse_qs(parts.query)
    unknown = set(query) - {"subject", "format"}
    if unknown:
        raise StreamUrlError(f"unknown NATS sink options {sorted(unknown)}; use subject= and format=")
    prefix = query.get("subject", [f"sluice.out.{stream.lower()}"])[-1]
    if not _SUBJECT_PREFIX.match(prefix):
        raise StreamUrlError(f"subject prefix {prefix!r} must be dot-separated tokens without wildcards")
    fmt = query.get("format", ["sluice"])[-1]
    if fmt not in ("sluice", "debezium"):
        raise StreamUrlError(f"format {fmt!r} is not one of 'sluice', 'debezium'")
    return StreamSinkUrl(scheme=scheme, hosts=hosts, stream=stream, subject_prefix=prefix,
                         format="debezium" if fmt == "debezium" else "sluice", user=user, password=password)


@dataclass(frozen=True)
class StreamMessage:
    subject: str
    msg_id: str
    payload: bytes


@dataclass(frozen=True)
class ChangeSource:
    """One captured event of a span's batch, as the driver holds it."""

    event_id: str
    event: RowsChangedV2 | DdlExecutedV1
    row_ids: tuple[int, ...] | None = None
    """Each row's index in the captured event, when table rules left rows out (message ids
    stay those of the captured rows)."""


def target_subject(prefix: str, schema: str | None, table: str) -> str:
    return f"{prefix}.{token(schema or '_')}.{token(table)}"


def row_messages(target: StreamSinkUrl, changefeed: str, target_schema: str | None, target_table: str,
                 key: Sequence[str], events: Iterable[ChangeSource]) -> list[StreamMessage]:
    """Every row change of ``events`` (already deduplicated and cut), in ``(ts, seq, part, row)``
    order, as messages for ``target``."""
    subject = target_subject(target.subject_prefix, target_schema, target_table)
    out: list[StreamMessage] = []
    ordered = sorted((e for e in events if isinstance(e.event, RowsChangedV2)),
                     key=lambda e: (e.event.ts, e.event.seq, _part(e.event)))
    for e in ordered:
        ev = e.event
        assert isinstance(ev, RowsChangedV2)
        ids = e.row_ids if e.row_ids is not None else range(len(ev.rows))
        for i, row in zip(ids, ev.rows, strict=True):
            msg_id = f"{changefeed}:{e.event_id}:{i}"
            if target.format == "debezium":
                body: dict[str, Any] = {
                    "before": row.before, "after": row.after, "op": _DEBEZIUM_OPS[row.op],
                    "source": _debezium_source(changefeed, ev, e.event_id, i),
                    "ts_ms": int(time.time() * 1000), "transaction": None,
                }
                payload = json.dumps(body, separators=(",", ":")).encode()
            else:
                change = SinkRowChangedV1(
                    changefeed=changefeed, source=ev.source, database=ev.database, table=ev.table,
                    target_schema=target_schema, target_table=target_table, ts=ev.ts, seq=ev.seq,
                    part=ev.part, row=i, op=row.op, key=list(key), before=row.before, after=row.after,
                    event_id=e.event_id)
                payload = REGISTRY.encode(change, producer=_PRODUCER, event_id=msg_id)
            out.append(StreamMessage(subject, msg_id, payload))
    return out


def ddl_message(target: StreamSinkUrl, changefeed: str, target_schema: str | None, target_table: str,
                ddl: ChangeSource) -> StreamMessage:
    ev = ddl.event
    assert isinstance(ev, DdlExecutedV1)
    subject = target_subject(target.subject_prefix, target_schema, target_table) + ".ddl"
    msg_id = f"{changefeed}:{ddl.event_id}:ddl"
    if target.format == "debezium":
        body = {"source": _debezium_source(changefeed, ev, ddl.event_id, 0), "ddl": ev.statement,
                "ts_ms": int(time.time() * 1000)}
        payload = json.dumps(body, separators=(",", ":")).encode()
    else:
        payload = REGISTRY.encode(ev, producer=_PRODUCER, event_id=msg_id)
    return StreamMessage(subject, msg_id, payload)


def _part(ev: RowsChangedV2 | DdlExecutedV1) -> int:
    return ev.part if isinstance(ev, RowsChangedV2) else 0


def _debezium_source(changefeed: str, ev: RowsChangedV2 | DdlExecutedV1, event_id: str,
                     row: int) -> dict[str, Any]:
    return {
        "version": "sluice", "connector": "sluice", "name": changefeed, "server": ev.source,
        "ts_ms": ev.ts >> LOGICAL_BITS, "db": ev.database, "table": ev.table, "snapshot": "false",
        "ts": ev.ts, "seq": ev.seq, "part": _part(ev), "row": row, "event_id": event_id,
        "sequence": json.dumps([ev.ts, ev.seq, _part(ev), row]),
    }


class StreamPublisher:
    """One connection per sink URL; creates the stream when it is missing (the user's stream is
    left as it is when it exists) and publishes a batch, returning once every message is acked."""

    def __init__(self, url: str, *, replicas: int = 1, dedup_window_s: float = 120.0,
                 ack_timeout_s: float = 30.0, window: int = 256) -> None:
        self.target = parse_stream_url(url)
        self.replicas = replicas
        self.dedup_window_s = dedup_window_s
        self.ack_timeout_s = ack_timeout_s
        self.window = window
        self._nc: Client | None = None
        self._stream_ready = False

    async def _connect(self) -> Client:
        if self._nc is None or self._nc.is_closed:
            self._nc = await nats.connect(servers=self.target.servers, user=self.target.user,
                                          password=self.target.password, name="sluice-nats-sink",
                                          connect_timeout=5, max_reconnect_attempts=-1,
                                          reconnect_time_wait=0.5)
            self._stream_ready = False
        return self._nc

    async def _ensure_stream(self, nc: Client) -> None:
        if self._stream_ready:
            return
        js = nc.jetstream()
        try:
            await js.stream_info(self.target.stream)
        except NotFoundError:
            await js.add_stream(api.StreamConfig(
                name=self.target.stream, subjects=[f"{self.target.subject_prefix}.>"],
                storage=api.StorageType.FILE, duplicate_window=self.dedup_window_s,
                num_replicas=self.replicas))
        self._stream_ready = True

    async def publish(self, messages: Sequence[StreamMessage]) -> int:
        """Publish in order and wait for every ack; returns how many the stream stored (the rest
        were duplicates within its window). Raises on the first refused or unacknowledged one."""
        if not messages:
            return 0
        nc = await self._connect()
        await self._ensure_stream(nc)
        js = nc.jetstream()
        stored = 0
        pending: list[asyncio.Future[Any]] = []

        async def settle() -> int:
            acks = await asyncio.wait_for(asyncio.gather(*pending), self.ack_timeout_s)
            pending.clear()
            return sum(1 for a in acks if not a.duplicate)

        for msg in messages:
            headers = inject_headers({api.Header.MSG_ID.value: msg.msg_id})
            pending.append(await js.publish_async(msg.subject, msg.payload, headers=headers,
                                                  stream=self.target.stream))
            if len(pending) >= self.window:
                stored += await settle()
        stored += await settle()
        return stored

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
        self._nc = None
