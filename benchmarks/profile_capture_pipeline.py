"""Capture's own cost per transaction, apart from the binlog parse: a profile harness.

    .venv/bin/python -m benchmarks.profile_capture_pipeline --items ITEMS.pickle
        [--record-seconds 3] [--repeat 3] [--profile PATH]

``bench_capture_drain`` measures the drain as a whole: the library's parse on the reader thread
and Sluice's work on the event loop share one GIL, and on a shared machine its wall-clock
moves with the other engineers' load. This splits off Sluice's part and measures it in CPU
time, on the same input for every code version:

1. **Record** (when ``ITEMS`` does not exist yet): a private MariaDB (``libs/localservers``),
   ``sysbench oltp_write_only`` (8 threads, ``--record-seconds``), and capture's own reader
   (``BinlogReader``: the library's parse plus the conversion into items) over that binlog; the
   items are pickled to ``ITEMS``, with the reader's CPU seconds.
2. **Pipeline**: a private MariaDB with the same sysbench tables (information_schema only) and
   a nats-server with the ROWS stream; ``SourcePipeline.handle_batch`` over the items in the
   reader's batch size with a real ``Publisher`` (every ack awaited), ``--repeat`` times (the
   stream purged between), reporting process CPU seconds and us per transaction / per row
   change. ``--profile PATH``: the last repeat under cProfile.

Comparing two code versions: record once, then run each version's harness on the same pickle
(from its own checkout), one after the other. Under ``valgrind --tool=callgrind`` the
``--repeat 0`` run (start-up and unpickle alone) subtracted from a ``--repeat 1`` run gives the
pipeline's instruction count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import pickle
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
import pymysql  # noqa: E402
from nats.js.errors import NotFoundError  # noqa: E402

from benchmarks import sysbench  # noqa: E402
from benchmarks.bench_capture_drain import position  # noqa: E402
from libs.config import Settings  # noqa: E402
from libs.localservers.mariadb import MariaDB  # noqa: E402
from libs.localservers.nats_server import NatsServer  # noqa: E402
from libs.streams import ROWS_STREAM, resolved_subject  # noqa: E402
from libs.streams_setup import ensure_rows_stream  # noqa: E402
from services.capture.binlog_reader import BinlogReader, Commit, Heartbeat, Item, Position  # noqa: E402
from services.capture.pipeline import MetaStore, SourcePipeline, StartState  # noqa: E402
from services.capture.publisher import Publisher  # noqa: E402

SOURCE = "src1"
TABLES = 4
BATCH = 200  # items per handle_batch: about what the reader hands over while a backlog drains


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def record(db: MariaDB, path: Path, seconds: int) -> None:
    start = position(db)
    load = sysbench.run(db, "oltp_write_only", tables=TABLES, table_size=1000, threads=8, seconds=seconds)
    end = position(db)
    _say(f"recorded {load.transactions:,} transactions, binlog {start} -> {end}")
    reader = BinlogReader({"host": "127.0.0.1", "port": db.port, "user": "root", "password": ""},
                          4200, Position(*start))
    cpu = time.process_time()
    reader.start()
    items: list[Item] = []
    try:
        while True:
            got = [i for i in reader.take() if not isinstance(i, Heartbeat)]
            items.extend(got)
            if any(isinstance(i, Commit) and (i.position.file, i.position.pos) >= end for i in got):
                break
    finally:
        reader.stop()
        reader.join(10)
    cpu = time.process_time() - cpu
    rows = sum(len(getattr(i, "images", ())) for i in items)
    _say(f"reader (parse + items): {len(items):,} items, {rows:,} rows in {cpu:.2f} CPU s "
         f"= {cpu / rows * 1e6:.1f} us a row change")
    path.write_bytes(pickle.dumps({"start": start, "items": items}))


async def pipeline_runs(nats_server: NatsServer, db: MariaDB, data: dict[str, Any], repeat: int,
                        profile: Path | None) -> None:
    items: list[Item] = data["items"]
    start = Position(*data["start"])
    rows = sum(len(getattr(i, "images", ())) for i in items)
    txns = sum(1 for i in items if isinstance(i, Commit))
    nc = await nats.connect(**nats_server.client_options())
    js = nc.jetstream()
    settings = Settings(nats_url=nats_server.url, source_id=SOURCE)
    await ensure_rows_stream(js, settings)
    try:
        for run in range(repeat):
            await js.purge_stream(ROWS_STREAM)
            publisher = Publisher(js, SOURCE, "capture/harness", is_valid=lambda: True,
                                  max_payload=lambda: nc.max_payload)
            with contextlib.suppress(NotFoundError):  # a purge may leave the previous run's mark
                last = await js.get_last_msg(ROWS_STREAM, resolved_subject(SOURCE))
                publisher.resolved_stream_seq = int(last.seq or 0)
            meta = MetaStore(lambda: pymysql.connect(host="127.0.0.1", port=db.port, user="root",
                                                     password="", charset="utf8mb4"))
            pipeline = SourcePipeline(SOURCE, publisher, meta, StartState(start, 0, 1))
            # The first batch reads information_schema: not part of the per-transaction cost.
            await pipeline.handle_batch(items[:BATCH], caught_up=False)
            profiler = cProfile.Profile() if profile is not None and run == repeat - 1 else None
            cpu, wall = time.process_time(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
            for at in range(BATCH, len(items), BATCH):
                await pipeline.handle_batch(items[at:at + BATCH], caught_up=at + BATCH >= len(items))
            await publisher.flush()
            if profiler is not None:
                profiler.disable()
                assert profile is not None
                profiler.dump_stats(str(profile))
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            await publisher.close()
            await asyncio.to_thread(meta.close)
            _say(f"pipeline run {run + 1}: {txns:,} transactions, {rows:,} rows: {cpu:.2f} CPU s "
                 f"({wall:.2f} s wall) = {cpu / txns * 1e6:.1f} us a transaction, "
                 f"{cpu / rows * 1e6:.1f} us a row change{' (cProfile)' if profiler else ''}")
    finally:
        await nc.close()


def pickle_cost(items: list[Item], batch: int = 500) -> None:
    """CPU of the reader child's hand-over alone: pickling the items in batches as the child
    sends them, and unpickling them as capture receives them."""
    rows = sum(len(getattr(i, "images", ())) for i in items)
    batches = [items[at:at + batch] for at in range(0, len(items), batch)]
    cpu = time.process_time()
    blobs = [pickle.dumps(b, pickle.HIGHEST_PROTOCOL) for b in batches]
    dumps = time.process_time() - cpu
    cpu = time.process_time()
    for blob in blobs:
        pickle.loads(blob)
    loads = time.process_time() - cpu
    size = sum(len(b) for b in blobs)
    _say(f"pickle in batches of {batch} items: {size / rows:.0f} bytes, dumps {dumps / rows * 1e6:.1f} us "
         f"(reader child), loads {loads / rows * 1e6:.1f} us (capture) a row change")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=Path, required=True)
    parser.add_argument("--record-seconds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--dir", type=Path, default=ROOT / ".sluice" / "profile-capture-pipeline")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    db = MariaDB(data_dir=args.dir / "source").start()
    nats_server: NatsServer | None = None
    try:
        sysbench.prepare(db, TABLES, 1000)
        if not args.items.exists():
            record(db, args.items, args.record_seconds)
        data = pickle.loads(args.items.read_bytes())
        pickle_cost(data["items"])
        nats_server = NatsServer(data_dir=args.dir / "nats").start()
        asyncio.run(pipeline_runs(nats_server, db, data, args.repeat, args.profile))
    finally:
        db.stop()
        if nats_server is not None:
            nats_server.stop()


if __name__ == "__main__":
    main()
