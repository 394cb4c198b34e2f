"""Shard DDL coordination latency: a real nats-server and a real ddl-lock leader process; N
shards of one target (N = 4 and 64) driven through the worker side of the protocol
(``services.sink_worker.ddl.shard.ShardDdl``, the code the sink-worker runs) in this process,
writing to a real SQLite target.

    .venv/bin/python -m benchmarks.bench_shard_ddl [--shards 4 64] [--rounds 3]
        [--dir .sluice/bench-shard-ddl]

Per round, every shard meets the same ``ALTER TABLE ... ADD COLUMN`` (the last one a moment
after the others). Measured from the moment the last shard sends its Info:

- until the lock is resolved (its ``shard_ddl.lock_resolved`` event is in the ddl stream);
- until the first post-DDL row is written to the target by a shard other than the owner (it
  needs the owner's exec, its done, and the skip), and until every shard has written one. The
  shards act like one worker's rounds: each pass carries out every operation that came and then
  writes those shards' post-DDL rows in one batch.

Baseline, same run: the same DDL and row on a target with a single shard, which needs no lock
(the sink reconciles the target and writes the row). Not included: the Spark round that brings
a span to its DDL barrier and the round that applies the rows after it (their figures are in
the apply benchmark); this isolates what the coordination adds.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from benchmarks.output import Figures, add_json_option  # noqa: E402
from contracts import REGISTRY  # noqa: E402
from contracts.events.changefeeds import ChangefeedSpecV2, RouteRuleV1, SourceRefV1  # noqa: E402
from contracts.events.rows import ColumnV1, TableMetaV1  # noqa: E402
from libs.changefeeds import record_changefeed  # noqa: E402
from libs.config import Settings  # noqa: E402
from libs.localservers.nats_server import NatsServer  # noqa: E402
from libs.localservers.service_process import ServiceProcess  # noqa: E402
from libs.routing import Target  # noqa: E402
from libs.scheduling.model import Span  # noqa: E402
from libs.shard_ddl.lock import Operation  # noqa: E402
from libs.streams import domain_events_subject, domain_stream, rows_subject  # noqa: E402
from libs.streams_setup import ensure_rows_stream  # noqa: E402
from services.sink_worker.ddl.shard import ShardDdl  # noqa: E402
from services.sink_worker.sinks.base import TargetTable, Upsert  # noqa: E402
from services.sink_worker.sinks.factory import open_sink  # noqa: E402

TARGET = Target("merged", "t")


def _meta(columns: list[str]) -> TableMetaV1:
    cols = [ColumnV1(name="id", kind="int", sql_type="bigint", nullable=False)]
    cols += [ColumnV1(name=c, kind="string", sql_type="varchar(20)", nullable=True) for c in columns]
    return TableMetaV1(columns=cols, primary_key=["id"])


def _table(columns: list[str], name: str = "t") -> TargetTable:
    return TargetTable(schema=None, name=name, meta=_meta(columns), key=("id",))


def _write_rows(sink_url: str, columns: list[str], row_ids: list[int], name: str = "t") -> None:
    changes = [Upsert(key=(i,), row={"id": i, **{c: f"{c}-{i}" for c in columns}}) for i in row_ids]
    open_sink(sink_url).apply_partition(_table(columns, name), changes)


def _exec(sink_url: str, columns: list[str], name: str = "t") -> None:
    sink = open_sink(sink_url)
    table = _table(columns, name)
    sink.ensure_table(table)
    sink.reconcile_schema(table)


async def _resolved_after(js: object, seq: int) -> bool:
    raw = await js.get_last_msg(domain_stream("ddl"), domain_events_subject("ddl"))  # type: ignore[attr-defined]
    return raw.seq > seq and REGISTRY.decode(raw.data).envelope.type == "shard_ddl.lock_resolved"


async def _round(nc: nats.NATS, shard_ddl: ShardDdl, spans: list[Span], sink_url: str, columns: list[str],
                 column: str, base_position: int) -> tuple[float, float, float]:
    js = nc.jetstream()
    try:
        start_seq = (await js.stream_info(domain_stream("ddl"))).state.last_seq
    except Exception:
        start_seq = 0
    ddl = (f"ALTER TABLE `merged`.`t` ADD COLUMN {column} varchar(20)",)
    after = [*columns, column]
    pending = {s: base_position + i for i, s in enumerate(spans)}
    # Every shard but the last reaches the DDL first; the figures start at the last one's Info.
    for s in spans[:-1]:
        await shard_ddl.at_ddl(s, TARGET, ddl, pending[s])
    await asyncio.sleep(0.3)  # the earlier Infos are in; not synchronisation of the measurement
    t0 = time.perf_counter()
    await shard_ddl.at_ddl(spans[-1], TARGET, ddl, pending[spans[-1]])
    first_other: float | None = None
    resolved: float | None = None
    wrote: set[Span] = set()
    while len(wrote) < len(spans) or resolved is None:
        # One pass over the shards is what a worker's round does: every shard whose operation
        # came carries it out, then the rows after the DDL of all of them go in one write.
        ready: list[tuple[Span, Operation]] = []
        for s in spans:
            if s in wrote:
                continue
            op: Operation | None = await shard_ddl.at_ddl(s, TARGET, ddl, pending[s])
            if op is None:
                continue
            if op.kind == "exec":
                await asyncio.to_thread(_exec, sink_url, after)
            await shard_ddl.carried_out(op)
            ready.append((s, op))
        if ready:
            ids = [pending[s] * 1000 + spans.index(s) for s, _ in ready]
            await asyncio.to_thread(_write_rows, sink_url, after, ids)
            wrote.update(s for s, _ in ready)
            if first_other is None and any(op.kind == "skip" for _, op in ready):
                first_other = time.perf_counter() - t0
        if resolved is None and await _resolved_after(js, start_seq):
            resolved = time.perf_counter() - t0
        if time.perf_counter() - t0 > 60:
            raise RuntimeError(f"round did not finish: {len(wrote)}/{len(spans)} shards wrote")
        await asyncio.sleep(0.002)  # polling the shards' operations
    all_wrote = time.perf_counter() - t0
    columns.append(column)
    assert first_other is not None
    return resolved, first_other, all_wrote


def _baseline(sink_url: str, rounds: int) -> list[float]:
    out = []
    cols: list[str] = []
    _exec(sink_url, cols, "single")
    for r in range(rounds):
        cols = [*cols, f"c{r}"]
        t0 = time.perf_counter()
        _exec(sink_url, cols, "single")
        _write_rows(sink_url, cols, [r + 1], "single")
        out.append(time.perf_counter() - t0)
    return out


def _fmt(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:.0f} ms (min {min(values) * 1000:.0f}, max " \
           f"{max(values) * 1000:.0f}, n={len(values)})"


def _fresh_dir(base: Path) -> None:
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)


def _ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def main(shard_counts: list[int], rounds: int, base: Path, out: Figures | None = None) -> None:
    out = out or Figures("bench_shard_ddl")
    _fresh_dir(base)
    server = NatsServer(data_dir=base / "nats").start()
    proc: ServiceProcess | None = None
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_rows_stream(js, Settings())
        single = _baseline(f"sqlite:///{base}/single.db", rounds)
        print(f"baseline single-shard DDL + first row: {_fmt(single)}")
        for n in shard_counts:
            cf = f"bench{n}"
            sink_url = f"sqlite:///{base}/target{n}.db"
            spans = [Span(cf, f"src{n}", f"db_{i:03d}", "t") for i in range(n)]
            for s in spans:  # a subject per shard in the ROWS stream: the group the leader sees
                await js.publish(rows_subject(s.source, s.database, s.table), b"{}")
            route = RouteRuleV1(database="db_*", table="t", target_schema="merged", target_table="t")
            spec = ChangefeedSpecV2(id=cf, sources=[SourceRefV1(id=f"src{n}", url="mysql://127.0.0.1/")],
                                    sink_url=sink_url, routes=[route])
            await record_changefeed(js, spec, "bench")
            if proc is None:
                proc = ServiceProcess("services.ddl_lock", {
                    "SLUICE_NATS_URL": server.url, "SLUICE_DDL_LOCK_DISCOVERY_INTERVAL_S": "0.5",
                    "SLUICE_LOG_LEVEL": "WARNING"}, base / "logs", instance_id="ddl-lock-1").start()
                await asyncio.to_thread(proc.wait_healthy, 60)
            shard_ddl = ShardDdl(nc, producer="bench", info_resend_s=5.0)
            await shard_ddl.start()
            await asyncio.to_thread(_exec, sink_url, [])
            columns: list[str] = []
            figures = []
            for r in range(rounds + 1):  # round 0 warms the leader's discovery and the sink up
                await asyncio.sleep(1.0 if r == 0 else 0.2)
                got = await _round(nc, shard_ddl, spans, sink_url, columns, f"c{r}", 10_000 * (r + 1))
                if r:
                    figures.append(got)
            await shard_ddl.close()
            print(f"{n:>3} shards: last Info -> lock resolved {_fmt([f[0] for f in figures])}; "
                  f"-> first non-owner post-DDL row {_fmt([f[1] for f in figures])}; "
                  f"-> every shard's post-DDL row {_fmt([f[2] for f in figures])}")
            baseline = f"single-shard target's DDL + first row, no lock: median {_ms(single):.0f} ms"
            resolved = _ms([f[0] for f in figures])
            out.add(f"{n} shards: last shard's Info -> lock resolved (median of {rounds})", resolved, "ms",
                    baseline=baseline, target="< 1 s" if n >= 64 else None,
                    met=resolved < 1000 if n >= 64 else None)
            out.add(f"{n} shards: last shard's Info -> every shard's post-DDL row written "
                    f"(median of {rounds})", _ms([f[2] for f in figures]), "ms", baseline=baseline)
        await nc.close()
    finally:
        if proc is not None and proc.alive():
            proc.terminate()
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=ROOT / ".sluice" / "bench-shard-ddl")
    add_json_option(parser)
    args = parser.parse_args()
    figures = Figures("bench_shard_ddl")
    asyncio.run(main(args.shards, args.rounds, args.dir, figures))
    figures.write(args.json)
