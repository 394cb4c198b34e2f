"""The capture service: one active binlog reader per source, held by a lease.

Replicas of one source campaign for the lease ``capture.<source>``. The holder runs reading
sessions; each starts from the newest resolved mark of the source in the ROWS stream (its
position, ts and next seq), so a restart or a successor continues exactly where the stream
ends, and re-publishes whatever was in flight with the same ids. A session that fails
(source down, NATS hiccup, fenced) is simply started again from the stream while the lease
holds; the lease lost ends it at once.

Rejected tables: a table stopped for an unsupported type or statement-based DML stays stopped
across restarts (its rejection events are read back at every session start). To capture it
again after fixing the cause, an operator purges the rejections of the source:
``nats stream purge SLUICE_ROWS --subject sluice.rows.<source>.rejected``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time
from typing import Any

import pymysql
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from contracts.events.rows import CaptureRejectedV2, ResolvedAdvancedV1, SourcePositionV1
from contracts.registry import REGISTRY, ContractError
from libs.chunks import chunk_info
from libs.config import Settings
from libs.election import Election, Leadership
from libs.gtid import move_refusal
from libs.service import ServiceRuntime
from libs.source_health import SourceHealth, utc_text
from libs.sources import SourceUrlWatch, registered_url
from libs.stream_origin import STREAM_ORIGIN_HEADER, StreamOrigin
from libs.streams import ROWS_STREAM, rejected_subject, resolved_subject, token
from libs.streams_setup import ensure_rows_stream
from services.capture import metrics
from services.capture.binlog_reader import BinlogReader, Position
from services.capture.pipeline import (
    STOPPING_KINDS,
    CaptureStopped,
    MetaStore,
    SourcePipeline,
    StartState,
    TableKey,
    publish_rejection,
)
from services.capture.publisher import (
    NEXT_SEQ_HEADER,
    SOURCE_SERVER_HEADER,
    XA_PREPARED_HEADER,
    Fenced,
    LeaseLost,
    Publisher,
)
from services.capture.reader_process import ReaderProcess
from services.capture.source import (
    ServerGtids,
    SourceOptions,
    check_source,
    connect,
    current_position,
    earliest_position,
    gtid_at,
    server_gtids,
)
from services.capture.ts_clock import TsClock, wall_ms
from services.capture.xa import XaResume

log = logging.getLogger(__name__)

RETRY_REFUSED_S = 5.0
RETRY_PURGED_S = 30.0
MAX_BACKOFF_S = 10.0
# ER_MASTER_FATAL_ERROR_READING_BINLOG: the server cannot send the binlog from the position asked
# for (purged, or a position past the file's end).
BINLOG_UNAVAILABLE = 1236


class SourceRefused(Exception):
    """The source is configured so that capture cannot read it correctly."""


class BinlogPurged(Exception):
    """The source no longer holds the binlog capture must read next."""


def binlog_unavailable(exc: BaseException) -> bool:
    return (isinstance(exc, pymysql.err.OperationalError) and bool(exc.args)
            and exc.args[0] == BINLOG_UNAVAILABLE)


def purged_message(source: str, position: Position, server_said: str) -> str:
    return (f"the source no longer has the binlog capture must read next ({position}): the server "
            f"says {server_said!r}. The changes after the last published mark are gone from the "
            f"source, so capture stops instead of skipping them. Fix: a new initial load - purge this "
            f"source's resolved marks (nats stream purge {ROWS_STREAM} --subject "
            f"{resolved_subject(source)}) so capture starts at the source's current position, then "
            f"delete and create again each changefeed that reads it with initial_load snapshot; keep "
            f"binlogs (binlog_expire_logs_seconds) longer than capture may be stopped")


def lease_name(source: str) -> str:
    return f"capture.{token(source)}"


async def load_start(js: JetStreamContext, source: str) -> tuple[StartState, int] | None:
    """The newest resolved mark of ``source`` as a start state, with its stream sequence."""
    try:
        raw = await js.get_last_msg(ROWS_STREAM, resolved_subject(source))
    except NotFoundError:
        return None
    event = REGISTRY.decode(raw.data or b"").event
    if not isinstance(event, ResolvedAdvancedV1):
        raise ContractError("invalid_data", f"{resolved_subject(source)} holds a {type(event).__name__}")
    next_seq = (raw.headers or {}).get(NEXT_SEQ_HEADER)
    if next_seq is None:
        raise ContractError("invalid_data", f"resolved mark at seq {raw.seq} has no {NEXT_SEQ_HEADER}")
    position = Position(event.position.binlog_file, event.position.binlog_pos)
    headers = raw.headers or {}
    prepared = headers.get(XA_PREPARED_HEADER)
    try:
        xa = XaResume.from_header(prepared) if prepared else None
    except (ValueError, KeyError, TypeError) as exc:
        raise ContractError("invalid_data", f"resolved mark at seq {raw.seq}: bad {XA_PREPARED_HEADER}: "
                                            f"{exc}") from None
    origin_header = headers.get(STREAM_ORIGIN_HEADER)
    try:
        origin = StreamOrigin.parse(origin_header) if origin_header else None
    except ValueError as exc:
        raise ContractError("invalid_data", f"resolved mark at seq {raw.seq}: {exc}") from None
    gtid = event.position.gtid
    return StartState(position, event.ts, int(next_seq), xa, gtid=gtid, ids_by_gtid=gtid is not None,
                      server=headers.get(SOURCE_SERVER_HEADER), origin=origin), int(raw.seq or 0)


async def load_tail_cuts(js: JetStreamContext, source: str, after_seq: int) -> dict[str, int]:
    """How the row messages stored after the mark at stream sequence ``after_seq`` were cut:
    each message's first transaction part's id -> its number of parts (1: a message of its own).

    A batch that ended because the reader had caught up is the one cut the binlog does not
    decide; its mark follows at once, but a capture killed before that mark was stored re-reads
    from the mark before, where the binlog alone would cut those transactions otherwise, and
    JetStream would store them again under other ids. The re-read cuts where these messages
    were cut instead (``SourcePipeline``'s ``cuts``), so it republishes them id for id and the
    duplicate window drops them. Headers only: the ids are in ``Nats-Msg-Id``."""
    cuts: dict[str, int] = {}
    sub = await js.pull_subscribe(
        f"sluice.rows.{token(source)}.*.*", stream=ROWS_STREAM, config=api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=after_seq + 1, headers_only=True, inactive_threshold=30.0,
            mem_storage=True))
    try:
        while True:
            try:
                msgs = await sub.fetch(1000, timeout=1.0)
            except (TimeoutError, NatsTimeoutError):
                return cuts
            for msg in msgs:
                msg_id = (msg.headers or {}).get(api.Header.MSG_ID.value, "")
                if chunk_info(msg.headers) is not None:
                    continue  # a chunk: its whole is a message of one part
                first, _, count = msg_id.rpartition("+")
                if first and count.isdigit():
                    cuts[first] = int(count)
                elif msg_id:
                    cuts[msg_id] = 1
            if not msgs or not msgs[-1].metadata.num_pending:
                return cuts
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


def placed_stops(stopped: dict[TableKey, Position | None], mark: Position) -> dict[TableKey, Position | None]:
    """Stopped tables after a move to another server, whose positions the old ones are not: a
    table stopped at or before the mark stays stopped from anywhere (everything read now is
    after the mark); one stopped after it is read again, and what stopped it stops it again at
    the same transaction."""
    return {key: None for key, since in stopped.items()
            if since is None or (since.file, since.pos) <= (mark.file, mark.pos)}


async def load_stopped(js: JetStreamContext, source: str) -> dict[TableKey, Position | None]:
    """Tables an earlier session stopped, from the source's rejection events."""
    stopped: dict[TableKey, Position | None] = {}
    seq = 1
    subject = rejected_subject(source)
    while True:
        try:
            raw = await js.get_msg(ROWS_STREAM, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return stopped
        seq = int(raw.seq or seq) + 1
        try:
            event = REGISTRY.decode(raw.data or b"").event
        except ContractError as exc:
            log.warning("undecodable rejection at seq %s: %s", raw.seq, exc)
            continue
        if isinstance(event, CaptureRejectedV2) and event.kind in STOPPING_KINDS and event.table:
            pos = event.position
            since = Position(pos.binlog_file, pos.binlog_pos) if pos is not None else None
            stopped.setdefault((event.database, event.table), since)


class Capture:
    def __init__(self, settings: Settings, js: JetStreamContext, *, producer: str,
                 status: dict[str, Any] | None = None, stopping: asyncio.Event | None = None) -> None:
        self.settings = settings
        self.js = js
        self.source = settings.source_id
        self.producer = producer
        self.status = status if status is not None else {}
        self.stopping = stopping or asyncio.Event()
        self.options: SourceOptions | None = None
        self._reported: set[tuple[str, str]] = set()
        self._purged_reported: set[Position] = set()
        self._pipeline: SourcePipeline | None = None
        self._url = settings.source_url
        self._watch: SourceUrlWatch | None = None
        self.health = SourceHealth(js, self.source, settings.instance_id, replicas=settings.stream_replicas)
        self._show(state="starting", lease=False)

    # ----------------------------------------------------------------- status

    def _show(self, **fields: Any) -> None:
        self.status.update({"source": self.source, **fields})

    async def _failing(self, state: str, problem: str, **fields: Any) -> None:
        """A session that failed: the reason, and since when sessions fail (kept across retries),
        in /healthz, the metric and the source's health entry the api shows."""
        since = self.status.get("problem_since") or time.time()
        metrics.SOURCE_FAILING_SINCE.labels(self.source).set(since)
        self._show(state=state, problem=problem, problem_since=since, problem_since_utc=utc_text(since),
                   **fields)
        await self.health.failing(state.replace("-", "_"), problem, since)

    def ready(self) -> bool:
        """Ready while standing by or reading; not while refused, failing or starting."""
        return self.status.get("state") in ("standby", "reading")

    def _show_progress(self, reader: BinlogReader | ReaderProcess, pipeline: SourcePipeline) -> None:
        self._show(position=str(pipeline.position), read_position=str(reader.position),
                   last_ts=pipeline.clock.last, resolved_ts=pipeline.resolved_ts,
                   resolved_position=str(pipeline.resolved_position), next_seq=pipeline.next_seq,
                   stopped_tables=sorted(".".join(key) for key in pipeline.stopped),
                   xa_prepared=len(pipeline.xa), xa_spilled_bytes=pipeline.xa.spilled,
                   xa_recovering=pipeline.recovering,
                   cascading_foreign_keys=sorted(fk.describe() for fk in pipeline.cascading))

    # ------------------------------------------------------------------- run

    async def run(self) -> None:
        url = self.settings.source_url
        if not url:
            # --- sources registry: started with only its source id ---
            self._show(state="starting",
                       problem=f"waiting for source {self.source!r} in the sources registry")
            # Followed for as long as capture runs: `sluice source set-url` moves it.
            self._watch = SourceUrlWatch(self.js, self.source, settings=self.settings)
            self._watch.start()
            found = await registered_url(self.js, self.source, self.stopping, settings=self.settings,
                                         watch=self._watch)
            if found is None:
                await self._watch.close()
                self._show(state="stopped", lease=False)
                return
            url = found
            self.status.pop("problem", None)
            log.info("source URL from the sources registry", extra={"source": self.source})
            # --- end sources registry ---
        self._url = url
        try:
            self.options = SourceOptions.parse(url)
        except ValueError as exc:
            log.error("capture cannot start: bad source URL: %s", exc, extra={"source": self.source})
            self._show(state="refused", problem=f"bad source URL: {exc}")
            await self.stopping.wait()
            return
        while not self.stopping.is_set():
            try:
                await ensure_rows_stream(self.js, self.settings)
                break
            except (NatsError, OSError) as exc:
                log.warning("ROWS stream not available yet: %s", exc)
                await self._sleep(1.0)
        election = Election(self.js, lease_name(self.source), self.settings.instance_id,
                            self.settings.lease_ttl_s, replicas=self.settings.stream_replicas)
        while not self.stopping.is_set():
            self._show(state="standby", lease=False)
            try:
                await election.setup()
                leadership = await election.campaign(self.stopping)
            except (NatsError, OSError) as exc:
                log.warning("capture lease not available yet: %s", exc)
                await self._sleep(election.poll_interval)
                continue
            if leadership is None:
                break
            await self._term(election, leadership)
        if self._watch is not None:
            await self._watch.close()
        self._show(state="stopped", lease=False)

    async def _sleep(self, seconds: float) -> None:
        """Sleep unless capture stops, or the registry moves the source (a retry then starts at
        once with the new server)."""
        if self._watch is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), seconds)
            return
        deadline = time.monotonic() + seconds
        stop = asyncio.create_task(self.stopping.wait())
        try:
            while not self._moved() and not stop.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                change = asyncio.create_task(self._watch.wait_change(left))
                try:
                    await asyncio.wait({stop, change}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    change.cancel()
        finally:
            stop.cancel()

    def _moved(self) -> bool:
        """The registry names another URL for the source than the one this session reads."""
        url = self._watch.url() if self._watch is not None else None
        return url is not None and url != self._url

    async def _term(self, election: Election, leadership: Leadership) -> None:
        log.info("capture lease won", extra={"source": self.source, "epoch": leadership.epoch})
        self._show(lease=True, epoch=leadership.epoch)
        keeper = asyncio.create_task(election.keep(leadership), name=f"capture-{self.source}-lease")
        work = asyncio.create_task(self._sessions(leadership), name=f"capture-{self.source}")
        lost = asyncio.create_task(leadership.lost.wait())
        stop = asyncio.create_task(self.stopping.wait())
        try:
            while True:
                timeout = max(0.0, leadership.deadline - time.monotonic())
                await asyncio.wait({work, lost, stop}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not leadership.valid() or self.stopping.is_set() or work.done():
                    break
        finally:
            for task in (work, lost, stop):
                task.cancel()
            await asyncio.gather(work, lost, stop, return_exceptions=True)
            if leadership.valid():
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
                await election.resign(leadership)
            else:
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
            self._show(lease=False)
            log.info("capture lease released", extra={"source": self.source,
                                                      "reason": leadership.lost_reason or "stopped"})

    async def _sessions(self, leadership: Leadership) -> None:
        # A failed session is retried after 0.5 s, doubling up to MAX_BACKOFF_S; a session that
        # ends any other way (_attempt) starts the next call, and so the backoff, afresh.
        retrying = AsyncRetrying(retry=retry_if_exception_type(Exception),
                                 wait=wait_exponential(multiplier=0.5, max=MAX_BACKOFF_S),
                                 stop=lambda _: not leadership.valid() or self.stopping.is_set(),
                                 sleep=self._sleep, reraise=True)
        while leadership.valid() and not self.stopping.is_set():
            try:
                if await retrying(self._attempt, leadership):
                    return
            except Exception:
                return  # failed as the lease ended or the service stops: nothing to retry for

    async def _attempt(self, leadership: Leadership) -> bool:
        """One session; True when reading must end for this term (lease lost, capture stopped).
        A failure is logged and raised for the backoff."""
        outcome = "error"
        try:
            await self._session(leadership)
            outcome = "ended"
        except LeaseLost:
            outcome = "lease-lost"
            return True
        except SourceRefused as exc:
            outcome = "refused"
            await self._failing("refused", str(exc))
            await self._sleep(RETRY_REFUSED_S)
        except BinlogPurged as exc:
            # Nothing this process can do brings the binlog back: say so where an operator looks
            # (/healthz unhealthy, the rejection event, the api's source status) and look again
            # now and then, for a source restored from a backup with its binlogs.
            outcome = "binlog-purged"
            await self._failing("binlog-purged", str(exc), unhealthy=str(exc))
            await self._sleep(RETRY_PURGED_S)
        except CaptureStopped as exc:
            outcome = "stopped"
            self._show(state="refused", problem=str(exc))
            await self.stopping.wait()
            return True
        except Fenced as exc:
            outcome = "fenced"
            log.warning("capture fenced, restarting from the stream: %s", exc,
                        extra={"source": self.source})
        except Exception as exc:  # every failure restarts from the stream
            log.error("capture session failed: %r", exc, extra={"source": self.source},
                      exc_info=not isinstance(exc, OSError | NatsError | pymysql.err.MySQLError))
            await self._failing("source-error", repr(exc))
            raise
        finally:
            metrics.SESSIONS.labels(self.source, outcome).inc()
        return False

    async def _session(self, leadership: Leadership) -> None:
        # Parsed again for every session: its secret is read again, so a corrected password
        # file (or variable) is used at the next attempt, without a restart.
        if self._watch is not None and self._watch.url():
            self._url = self._watch.url() or self._url
        self.options = SourceOptions.parse(self._url)
        nc = self.js._nc
        publisher = Publisher(self.js, self.source, self.producer, is_valid=leadership.valid,
                              epoch=leadership.epoch, max_payload=lambda: nc.max_payload,
                              max_message_bytes=self.settings.capture_max_message_bytes)
        try:
            await self._read(leadership, publisher)
        finally:
            await publisher.close()

    async def _read(self, leadership: Leadership, publisher: Publisher) -> None:
        assert self.options is not None
        options = self.options
        conn = await asyncio.to_thread(connect, options)
        try:
            problems = await asyncio.to_thread(check_source, conn)
            if problems:
                for kind, message in problems:
                    if (kind, message) not in self._reported:
                        self._reported.add((kind, message))
                        await publish_rejection(publisher, self.source, kind, ("", ""),
                                                message + "; capture does not read this source", None)
                await publisher.flush()
                raise SourceRefused("; ".join(m for _, m in problems))
            self._reported.clear()
            gtids = await asyncio.to_thread(server_gtids, conn)
            restored = await load_start(self.js, self.source)
            start_gtid: str | None = None
            cuts: dict[str, int] = {}
            if restored is None:
                start = await self._first_start(conn, publisher, gtids)
            else:
                start, publisher.resolved_stream_seq = restored
                publisher.origin = start.origin
                cuts = await load_tail_cuts(self.js, self.source, publisher.resolved_stream_seq)
                start, start_gtid = await self._place(conn, start, gtids)
            stopped = await load_stopped(self.js, self.source)
            if start_gtid is not None:
                stopped = placed_stops(stopped, start.position)
        finally:
            await asyncio.to_thread(conn.close)
        # Prepared XA transactions still undecided at the mark: their groups are read again first.
        read_from = start.xa.begin if start.xa is not None else start.position
        log.info("capture reading", extra={"source": self.source, "position": str(start.position),
                                           "ts": start.ts, "next_seq": start.next_seq,
                                           "stopped_tables": len(stopped), "read_from": str(read_from),
                                           "xa_prepared": len(start.xa.xids) if start.xa else 0})
        meta = MetaStore(lambda: connect(options))
        pipeline = SourcePipeline(self.source, publisher, meta, start, databases=options.databases,
                                  stopped=stopped, server=gtids.server_id,
                                  xa_memory_bytes=self.settings.capture_xa_memory_bytes,
                                  batch_transactions=self.settings.capture_batch_transactions,
                                  cuts=cuts)
        reader_class = ReaderProcess if self.settings.capture_reader_process else BinlogReader
        reader = reader_class(options.connection_kwargs(), self.settings.source_server_id,
                              read_from, heartbeat_s=options.heartbeat_s,
                              only_schemas=sorted(options.databases) if options.databases else None,
                              fast_rows=self.settings.capture_fast_rows, start_gtid=start_gtid,
                              direct=self.settings.capture_direct_events)
        self._pipeline = pipeline
        reader.start()
        self._show(state="reading", problem=None, problem_since=None, problem_since_utc=None)
        metrics.SOURCE_FAILING_SINCE.labels(self.source).set(0)
        await self.health.reading()
        loop = asyncio.get_running_loop()
        try:
            while not self.stopping.is_set():
                if not leadership.valid():
                    raise LeaseLost(f"capture lease of {self.source} lost")
                items = await loop.run_in_executor(None, reader.take)
                try:
                    await pipeline.handle_batch(items, caught_up=not reader.pending())
                except pymysql.err.OperationalError as exc:
                    if not binlog_unavailable(exc):
                        raise
                    await self._binlog_purged(publisher, pipeline.committed, exc)
                if items and self.status.get("unhealthy"):  # the binlog is readable again
                    self._show(unhealthy=None)
                self._show_progress(reader, pipeline)
                if self._moved():
                    log.info("the source moved to another server: reading it from there",
                             extra={"source": self.source})
                    return
        finally:
            reader.stop()
            publisher.discard()
            pipeline.xa.close()
            await asyncio.to_thread(meta.close)

    async def _binlog_purged(self, publisher: Publisher, position: Position,
                             exc: pymysql.err.OperationalError) -> None:
        message = purged_message(self.source, position, str(exc.args[1] if len(exc.args) > 1 else exc))
        if position not in self._purged_reported:  # once per process and position, not per retry
            self._purged_reported.add(position)
            await publish_rejection(publisher, self.source, "binlog_purged", ("", ""), message, position)
            await publisher.flush()
        raise BinlogPurged(message) from None

    async def _place(self, conn: Any, start: StartState, gtids: ServerGtids) -> tuple[StartState, str | None]:
        """Where this session reads from: the mark's file and position on the server that wrote
        it; on another server (a failover, ``sluice source set-url``), the GTID returned, once this
        server holds everything the mark covers. Refused (``SourceRefused``) otherwise."""
        if start.server is None or start.server == gtids.server_id:
            if start.gtid is None and gtids.mariadb:
                # A mark of an older capture: the GTID position there, from the binlog itself.
                found = await asyncio.to_thread(gtid_at, conn, start.position)
                start = dataclasses.replace(start, gtid=found)
            return start, None
        refusal = move_refusal(start.gtid, xa_prepared=start.xa is not None, mariadb=gtids.mariadb,
                               server_pos=gtids.binlog_pos, server_state=gtids.binlog_state)
        if refusal is not None:
            raise SourceRefused(f"the source's server changed (server_id {start.server} wrote the "
                                f"stream's last mark, this is {gtids.server_id}) and capture does not "
                                f"continue here: {refusal}")
        log.info("capture continues the stream on another server, by GTID", extra={
            "source": self.source, "from_server": start.server, "server": gtids.server_id,
            "gtid": start.gtid, "server_gtid": gtids.binlog_pos})
        return start, start.gtid

    async def _first_start(self, conn: Any, publisher: Publisher, gtids: ServerGtids) -> StartState:
        """Nothing in the stream for this source: pin the start with a first resolved mark, so
        a restart before any change cannot pick a later 'current' position and skip changes."""
        assert self.options is not None
        locate = earliest_position if self.options.start == "earliest" else current_position
        position = await asyncio.to_thread(locate, conn)
        gtid = await asyncio.to_thread(gtid_at, conn, position) if gtids.mariadb else None
        ts = TsClock(0).resolve(wall_ms())
        origin = publisher.origin = StreamOrigin(position.file, position.pos, ts)
        mark = ResolvedAdvancedV1(source=self.source, ts=ts, position=SourcePositionV1(
            binlog_file=position.file, binlog_pos=position.pos, gtid=gtid))
        await publisher.resolved(mark, f"{self.source}:resolved:{position.file}:{position.pos}:{ts}", 0,
                                 server=gtids.server_id)
        log.info("capture starts a new source", extra={"source": self.source, "position": str(position),
                                                       "start": self.options.start, "gtid": gtid})
        if gtid is None:
            log.warning("the source has no GTID position capture can follow: it resumes by binlog "
                        "file and position only, and cannot move to another server "
                        "(`sluice source set-url`) without a new initial load",
                        extra={"source": self.source})
        return StartState(position, ts, 0, gtid=gtid, ids_by_gtid=gtid is not None, server=gtids.server_id,
                          origin=origin)


async def main(runtime: ServiceRuntime) -> None:
    # The cyclic GC's full collections walk every tracked object and hold the GIL throughout,
    # from whichever thread allocates (the reader's unpickling thread, mostly): during a large
    # transaction they come every few batches, and walking the start-up heap too made the
    # longest one 0.26 s instead of 0.17 s with no load (BENCHMARKS.md). That heap lives as long
    # as the process: out of the collector's walk, it walks only the transaction's objects.
    gc.freeze()
    capture = Capture(runtime.settings, runtime.nc.jetstream(), producer=runtime.producer,
                      status=runtime.status, stopping=runtime.stopping)
    runtime.add_ready_check("capture", capture.ready)
    await capture.run()
