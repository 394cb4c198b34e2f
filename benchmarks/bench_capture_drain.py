"""Capture drain: a backlog of sysbench transactions read by capture into the ROWS stream.

    .venv/bin/python -m benchmarks.bench_capture_drain [--tables 4] [--table-size 100000]
        [--threads 8] [--seconds 60] [--reader process|thread] [--json PATH] [--profile PATH]

One MariaDB source (``libs/localservers``, ROW binlog) and one nats-server with JetStream:

1. ``sysbench oltp_write_only prepare`` (its default table shape) and capture started once, so
   its first resolved mark pins the source's position after the prepare; capture stopped.
2. ``sysbench oltp_write_only`` with ``--threads`` for ``--seconds`` while capture is stopped:
   the backlog (binlog from P0 to P1).
3. **Parse-only floor:** pymysqlreplication (the binlog library capture uses) reads P0..P1 in
   this process, with the same event types and every row decoded, nothing else: the rate at
   which capture could go if Sluice cost nothing; then the same with capture's table-map
   cache, and with the cache and capture's compiled row decoder (``rows_decode.py``; what
   capture's reader does by default, ``SLUICE_CAPTURE_FAST_ROWS``).
4. **Capture's reader alone** (``BinlogReader`` on a thread of this process: the parse, the
   table-map cache, the compiled decoder and the conversion into items, nothing published),
   once with every event read by the library and once with the hot events read from the
   packets' bytes (``SLUICE_CAPTURE_DIRECT_EVENTS``, the default): its CPU a row change.
5. **Drain:** capture started again as its own process (``python -m services.capture``, the
   README's settings); from the moment it says it is reading until its resolved mark passes P1
   (every row of the backlog acknowledged in the stream). Rows/s = the backlog's row changes
   (from the parse) / that time. Capture's RSS (process tree) is sampled throughout.

``--reader``: capture's binlog reader in its child process (``process``, the default, as
``SLUICE_CAPTURE_READER_PROCESS`` defaults) or on a thread of capture (``thread``). Capture's
CPU is reported per process (capture, and its reader child when there is one) per row change:
on this shared machine CPU time moves less with the others' load than rows/s does.

``--profile PATH`` runs the drain in this process under cProfile instead (capture's own code,
the same settings) and writes the stats to PATH: the "where the time goes" of BENCHMARKS.md.
Target (issue 29): >= 30,000 row changes/s on the 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import shutil
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
from nats.js import JetStreamContext  # noqa: E402
from nats.js.errors import NotFoundError  # noqa: E402
from pymysqlreplication import BinLogStreamReader  # noqa: E402

from benchmarks import sysbench  # noqa: E402
from benchmarks.memory import MemorySampler  # noqa: E402
from benchmarks.output import Figures, add_json_option  # noqa: E402
from contracts import REGISTRY  # noqa: E402
from contracts.events.rows import ResolvedAdvancedV1  # noqa: E402
from libs.config import Settings  # noqa: E402
from libs.localservers.common import wait_until  # noqa: E402
from libs.localservers.mariadb import MariaDB  # noqa: E402
from libs.localservers.nats_server import NatsServer  # noqa: E402
from libs.localservers.service_process import ServiceProcess  # noqa: E402
from libs.nats_auth import capture_role  # noqa: E402
from libs.streams import ROWS_STREAM, resolved_subject  # noqa: E402
from services.capture import table_map_cache  # noqa: E402
from services.capture.binlog_reader import _EVENTS, BinlogReader, Position, ReaderFailed, Rows  # noqa: E402
from services.capture.rows_decode import RowsDecoder, compile_decoder  # noqa: E402

SOURCE = "src1"
SERVER_ID = 4101
TARGET_ROWS_S = 30_000
READER_CHILD = b"services.capture.reader_child"  # its argv element: the reader child process


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


Pos = tuple[str, int]


def position(db: MariaDB) -> Pos:
    row = db.execute("SHOW MASTER STATUS")[0]
    return str(row[0]), int(row[1])


@dataclass(frozen=True)
class Parsed:
    rows: int
    events: int
    transactions: int
    seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


def parse_only(db: MariaDB, start: Pos, end: Pos, *, cached_maps: bool = False,
               compiled: bool = False) -> Parsed:
    """pymysqlreplication over ``start``..``end`` with every row decoded, nothing else done;
    ``cached_maps``: with capture's table-map cache (``services/capture/table_map_cache.py``),
    else the library as it is; ``compiled``: rows decoded by capture's compiled decoder
    (``services/capture/rows_decode.py``, with the table-map cache) instead of the library."""
    cached_maps = cached_maps or compiled
    decoders: dict[int, tuple[Any, RowsDecoder | None]] = {}
    if cached_maps:
        table_map_cache.install()
    else:
        table_map_cache.uninstall()
    stream = BinLogStreamReader(
        connection_settings={"host": "127.0.0.1", "port": db.port, "user": "root", "passwd": "",
                             "charset": "utf8mb4"},
        server_id=SERVER_ID + 100, resume_stream=True, blocking=False, log_file=start[0],
        log_pos=start[1], only_events=_EVENTS, enable_logging=False)
    rows = events = txns = 0
    started = time.perf_counter()
    try:
        for event in stream:
            events += 1
            here = (stream.log_file, int(event.packet.log_pos))
            if type(event).__name__.endswith("RowsEvent"):
                rows += _count_rows(event, decoders) if compiled else len(event.rows)
            elif type(event).__name__ == "XidEvent":
                txns += 1
            if here >= end and type(event).__name__ == "XidEvent":
                break
    finally:
        stream.close()
        table_map_cache.uninstall()
    return Parsed(rows, events, txns, time.perf_counter() - started)


def _count_rows(event: Any, decoders: dict[int, tuple[Any, RowsDecoder | None]]) -> int:
    """The event's rows as capture's reader decodes them (compiled, else the library)."""
    known = decoders.get(event.table_id)
    if known is None or known[0] is not event.columns:
        known = decoders[event.table_id] = (event.columns, compile_decoder(event.columns))
    decoder = known[1]
    body = decoder.body(event) if decoder is not None else None
    if decoder is None or body is None:
        return len(event.rows)
    op = "update" if type(event).__name__ == "UpdateRowsEvent" else "insert"
    return len(decoder.decode(op, *body))


@dataclass(frozen=True)
class ReaderRun:
    rows: int
    seconds: float
    cpu_s: float
    direct_events: int

    @property
    def cpu_us_a_row(self) -> float:
        return self.cpu_s / self.rows * 1e6 if self.rows else 0.0


def reader_only(db: MariaDB, start: Pos, end: Pos, *, direct: bool) -> ReaderRun:
    """Capture's whole reader (``BinlogReader``: the parse, the table-map cache, the compiled
    decoder and the conversion into items) over ``start``..``end`` on its thread in this
    process, the items taken and dropped; ``direct``: the hot events read from the packets'
    bytes (``SLUICE_CAPTURE_DIRECT_EVENTS``), else every event by the library. CPU is this
    process's (the reader thread, and the taking thread that mostly waits)."""
    reader = BinlogReader({"host": "127.0.0.1", "port": db.port, "user": "root", "password": "",
                           "charset": "utf8mb4"}, SERVER_ID + 200, Position(*start), heartbeat_s=0.5,
                          direct=direct)
    rows = 0
    cpu0, started = time.process_time(), time.perf_counter()
    reader.start()
    try:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            items = reader.take(max_items=2000, wait=0.5, linger=0.002)
            for item in items:
                if isinstance(item, ReaderFailed):
                    raise RuntimeError(f"the reader failed: {item.error!r}")
                if isinstance(item, Rows):
                    rows += len(item.images)
            last = items[-1] if items else None
            if last is not None and not isinstance(last, ReaderFailed) and tuple(last.position) >= end:
                break
        else:
            raise TimeoutError(f"the reader did not reach {end}")
        return ReaderRun(rows, time.perf_counter() - started, time.process_time() - cpu0,
                         reader.decoded.direct)
    finally:
        reader.stop()
        reader.join(5)


async def _resolved(js: JetStreamContext) -> Pos | None:
    try:
        raw = await js.get_last_msg(ROWS_STREAM, resolved_subject(SOURCE))
    except NotFoundError:
        return None
    event = REGISTRY.decode(raw.data or b"").event
    assert isinstance(event, ResolvedAdvancedV1)
    return event.position.binlog_file, event.position.binlog_pos


async def wait_resolved(nats_server: NatsServer, past: Pos, limit_s: float) -> float:
    """Until the source's resolved mark is at ``past`` or beyond; the perf_counter then."""
    nc = await nats.connect(**nats_server.client_options())
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            got = await _resolved(js)
            if got is not None and got >= past:
                return time.perf_counter()
            await asyncio.sleep(0.02)
        raise TimeoutError(f"resolved mark not past {past} within {limit_s} s (last {got})")
    finally:
        await nc.close()


def capture_process(nats_server: NatsServer, db: MariaDB, log_dir: Path,
                    reader: str = "process") -> ServiceProcess:
    env = {"SLUICE_NATS_URL": nats_server.url, "SLUICE_SOURCE_ID": SOURCE,
           "SLUICE_SOURCE_URL": f"{db.url}?start=current", "SLUICE_SOURCE_SERVER_ID": str(SERVER_ID),
           "SLUICE_STATE_DB_URL": f"sqlite:///{log_dir / 'state.db'}",
           "SLUICE_CAPTURE_READER_PROCESS": "true" if reader == "process" else "false"}
    return ServiceProcess("services.capture", env, log_dir, instance_id="capture-src1")


def wait_reading(proc: ServiceProcess, timeout: float = 60) -> None:
    def reading() -> bool:
        if not proc.alive():
            raise RuntimeError(f"capture exited; log:\n{proc.tail_log()}")
        health = proc.health()
        return health is not None and health.get("state") == "reading"
    wait_until(reading, timeout, "capture reading", interval=0.01)


def rows_published(proc: ServiceProcess) -> int:
    with urllib.request.urlopen(proc.base_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("sluice_capture_rows_published_total"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


async def drain_in_process(nats_server: NatsServer, db: MariaDB, end: Pos,
                           profile: Path) -> tuple[float, int]:
    """The drain with capture in this process under cProfile; (seconds, rows published)."""
    from libs.telemetry.tracing import setup_tracing
    from services.capture import metrics
    from services.capture.service import Capture

    setup_tracing("capture")  # as the service process does: real spans, no exporter

    settings = Settings(nats_url=nats_server.url, source_id=SOURCE, source_url=f"{db.url}?start=current",
                        source_server_id=SERVER_ID, instance_id="capture-profile")
    nc = await nats.connect(**nats_server.client_options(capture_role(SOURCE)))
    capture = Capture(settings, nc.jetstream(), producer="capture/profile")
    before = metrics.ROWS_PUBLISHED.labels(SOURCE)._value.get()
    profiler = cProfile.Profile()
    task = asyncio.create_task(capture.run())
    try:
        while capture.status.get("state") != "reading":  # noqa: ASYNC110 - a dict, no event to wait on
            await asyncio.sleep(0.01)
        profiler.enable()
        started = time.perf_counter()
        js = nc.jetstream()
        while True:
            got = await _resolved(js)
            if got is not None and got >= end:
                break
            await asyncio.sleep(0.05)
        seconds = time.perf_counter() - started
        profiler.disable()
    finally:
        capture.stopping.set()
        await asyncio.wait_for(task, 30)
        await nc.close()
    profiler.dump_stats(str(profile))
    return seconds, int(metrics.ROWS_PUBLISHED.labels(SOURCE)._value.get() - before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--table-size", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--reader", choices=("process", "thread"), default="process")
    parser.add_argument("--dir", type=Path, default=ROOT / ".sluice" / "bench-capture-drain")
    parser.add_argument("--profile", type=Path, default=None,
                        help="drain in this process under cProfile; write the stats here")
    add_json_option(parser)
    args = parser.parse_args()
    figures = Figures("bench_capture_drain")
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    nats_server = NatsServer(data_dir=args.dir / "nats").start()
    db = MariaDB(data_dir=args.dir / "source").start()
    proc: ServiceProcess | None = None
    try:
        _say(f"sysbench prepare: {args.tables} tables of {args.table_size:,} rows")
        sysbench.prepare(db, args.tables, args.table_size)
        proc = capture_process(nats_server, db, args.dir / "logs").start()
        wait_reading(proc)
        start = position(db)
        asyncio.run(wait_resolved(nats_server, start, 60))
        proc.terminate(timeout=20)
        _say(f"capture pinned {start}; stopped. sysbench oltp_write_only, {args.threads} threads, "
             f"{args.seconds} s")
        load = sysbench.run(db, "oltp_write_only", tables=args.tables, table_size=args.table_size,
                            threads=args.threads, seconds=args.seconds)
        end = position(db)
        _say(f"backlog: {load.transactions:,} transactions ({load.tps:,.0f}/s), binlog {start} -> {end}")
        parsed = parse_only(db, start, end)
        _say(f"parse-only: {parsed.rows:,} rows, {parsed.transactions:,} transactions in "
             f"{parsed.seconds:.2f} s = {parsed.rows_per_s:,.0f} rows/s")
        cached = parse_only(db, start, end, cached_maps=True)
        _say(f"parse-only with capture's table-map cache: {cached.rows_per_s:,.0f} rows/s")
        compiled = parse_only(db, start, end, compiled=True)
        _say(f"parse with capture's table-map cache and compiled row decoder: "
             f"{compiled.rows_per_s:,.0f} rows/s")
        by_library = reader_only(db, start, end, direct=False)
        direct = reader_only(db, start, end, direct=True)
        for name, run in (("every event by the library", by_library), ("hot events direct", direct)):
            _say(f"capture's reader alone, {name}: {run.rows:,} rows in {run.seconds:.2f} s = "
                 f"{run.rows / run.seconds:,.0f} rows/s, CPU {run.cpu_s:.1f} s = {run.cpu_us_a_row:.0f} us "
                 f"a row change ({run.direct_events:,} events read direct)")
        if args.profile is not None:
            seconds, published = asyncio.run(drain_in_process(nats_server, db, end, args.profile))
            peak_mib = 0.0
        else:
            proc = capture_process(nats_server, db, args.dir / "logs", args.reader).start()
            sampler = MemorySampler(lambda: {"capture": proc.proc.pid} if proc and proc.proc else {},
                                    lambda _pid, _root, argv: "reader" if READER_CHILD in argv else "capture",
                                    interval=0.2)
            sampler.start()
            wait_reading(proc)
            sampler.start_clock()
            started = time.perf_counter()
            finished = asyncio.run(wait_resolved(nats_server, end, 1800))
            seconds = finished - started
            sampler.done.set()
            sampler.join()
            published = rows_published(proc)
            peak_mib = sampler.peaks.get("capture", 0) / 2**20
            by_part = sampler.cpu_by_part()
            cpu_s, reader_s = by_part.get("capture", 0.0), by_part.get("reader", 0.0)
            _say(f"capture CPU during the drain ({args.reader} reader): capture process {cpu_s:.1f} s "
                 f"({cpu_s / seconds:.0%} of one core, {cpu_s / parsed.rows * 1e6:.0f} us a row change), "
                 f"reader child {reader_s:.1f} s ({reader_s / seconds:.0%}, "
                 f"{reader_s / parsed.rows * 1e6:.0f} us a row change)")
            figures.extra["capture_cpu_s"] = cpu_s
            figures.extra["reader_child_cpu_s"] = reader_s
        rate = parsed.rows / seconds
        txn_rows = parsed.rows / max(parsed.transactions, 1)
        _say(f"drain: {published:,} rows published in {seconds:.2f} s = {rate:,.0f} rows/s "
             f"({rate / parsed.rows_per_s:.2f}x parse-only; {txn_rows:.1f} row changes a transaction); "
             f"capture peak RSS {peak_mib:,.0f} MiB")
        shape = (f"sysbench oltp_write_only backlog ({args.threads} threads, {args.seconds} s, "
                 f"{args.tables} tables of {args.table_size:,} rows): {load.transactions:,} transactions, "
                 f"{parsed.rows:,} row changes")
        figures.add(f"capture drain, {shape}; resolved mark past the backlog's end", rate, "rows/s",
                    baseline=f"parse-only (pymysqlreplication, every row decoded) {parsed.rows_per_s:,.0f} "
                             f"rows/s in the same run ({rate / parsed.rows_per_s:.2f}x of it)",
                    target=f">= {TARGET_ROWS_S:,} rows/s", met=rate >= TARGET_ROWS_S)
        figures.add(f"parse-only floor, {shape}", parsed.rows_per_s, "rows/s")
        figures.add(f"parse-only with capture's table-map cache, {shape}", cached.rows_per_s, "rows/s")
        figures.add(f"parse with the table-map cache and the compiled row decoder, {shape}",
                    compiled.rows_per_s, "rows/s")
        for name, run in (("every event by the library", by_library), ("hot events direct", direct)):
            figures.add(f"capture's reader alone ({name}), CPU a row change, {shape}",
                        run.cpu_us_a_row, "us")
        figures.add(f"sysbench oltp_write_only upstream, capture stopped ({args.threads} threads)",
                    load.tps, "transactions/s")
        if args.profile is None:
            figures.add("capture peak RSS during the drain (process tree)", peak_mib, "MiB",
                        target="<= 300 MiB", met=peak_mib <= 300)
        figures.extra["published_rows"] = published
    finally:
        if proc is not None and proc.alive():
            with contextlib.suppress(Exception):
                proc.terminate(timeout=20)
        db.stop()
        nats_server.stop()
    figures.write(args.json)


if __name__ == "__main__":
    main()
