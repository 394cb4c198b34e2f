"""``PUT /sources/{id}/url`` (``sluice source set-url``): may a source move to another server of
its replication topology? Judged from the stream's last resolved mark (its GTID position, the
server that wrote it, prepared XA transactions) and the new server's GTIDs (``libs/gtid``); the
same judgement capture makes again before it reads the new server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pymysql
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from contracts.events.rows import ResolvedAdvancedV1
from contracts.registry import REGISTRY
from libs.dburl import parse_database_url
from libs.gtid import move_refusal
from libs.streams import ROWS_STREAM, resolved_subject
from services.capture.publisher import SOURCE_SERVER_HEADER, XA_PREPARED_HEADER
from services.capture.source import SourceOptions, connect, server_gtids


@dataclass(frozen=True)
class Mark:
    gtid: str | None
    server: str | None
    xa_prepared: bool


class MoveRefused(Exception):
    """The new server cannot continue the stream; the message says why."""


async def last_mark(js: JetStreamContext, source_id: str) -> Mark | None:
    """The source's newest resolved mark (None: capture never published one)."""
    try:
        raw = await js.get_last_msg(ROWS_STREAM, resolved_subject(source_id))
    except NotFoundError:
        return None
    event = REGISTRY.decode(raw.data or b"").event
    if not isinstance(event, ResolvedAdvancedV1):
        raise MoveRefused(f"{resolved_subject(source_id)} holds a {type(event).__name__}, not a mark")
    headers = raw.headers or {}
    return Mark(event.position.gtid, headers.get(SOURCE_SERVER_HEADER), XA_PREPARED_HEADER in headers)


def judge_blocking(url: str, mark: Mark | None) -> str:
    """Why the move is fine (a sentence for the operator); ``MoveRefused`` when it is not."""
    parse_database_url(url)  # the secret resolves, or DatabaseUrlError (a 422 before this)
    conn = connect(SourceOptions.parse(url))
    try:
        gtids = server_gtids(conn)
    except pymysql.err.MySQLError as exc:
        raise MoveRefused(f"the new server's GTID position could not be read: {exc}") from None
    finally:
        conn.close()
    if mark is None:
        return "no resolved mark yet: capture starts on the new server"
    if mark.server is not None and mark.server == gtids.server_id:
        return f"the same server (server_id {gtids.server_id}) under another address"
    refusal = move_refusal(mark.gtid, xa_prepared=mark.xa_prepared, mariadb=gtids.mariadb,
                           server_pos=gtids.binlog_pos, server_state=gtids.binlog_state)
    if refusal is not None:
        raise MoveRefused(refusal)
    return (f"server_id {gtids.server_id} holds every transaction up to the stream's mark {mark.gtid} "
            f"(its GTID position: {gtids.binlog_pos or 'empty'}); capture continues there by GTID")


async def judge(url: str, mark: Mark | None) -> str:
    return await asyncio.to_thread(judge_blocking, url, mark)
