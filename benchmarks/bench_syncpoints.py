"""What syncpoints cost a changefeed's lag, against a changefeed without them in the same run.

    .venv/bin/python -m benchmarks.bench_syncpoints [--downstream mariadb] [--rate 250]
        [--load-s 60] [--feeds 0/0 5/1 20/1] [--tables 4] [--table-size 10000] [--json PATH]

One ``LocalSystem`` (nats-server, a MariaDB source, the control plane with one replica per
service, one sink-worker placed by the scheduler, capture, the api). ``sysbench oltp_write_only``
tables on the source, then one changefeed per ``--feeds`` entry ``interval/hold`` (seconds;
``0/0``: no ``syncpoint_interval``, the **baseline**), each over the same ``sbtest.*`` tables
routed to a target schema of its own on the same downstream: the feeds share the worker, its
rounds, the source and the load, so the only difference between them is the syncpoints.

sysbench ``oltp_write_only`` at ``--rate`` transactions a second (4 row changes each: one
``UPDATE`` by key, one by a non-key column, a ``DELETE`` and an ``INSERT``) for ``--load-s``;
every 0.5 s each feed's lag (now - its changefeed checkpoint, from the replication stream). Per
feed: lag p50 / p99 / max and its mean, beside the baseline's in the same samples; the
syncpoints released and abandoned (``syncpoint.*`` events), how far behind T's commit time each
was reached and released; the verdict of every feed's targets against the source.

What a syncpoint should cost: the changefeed checkpoint is capped at T until every span has
reached it, then held for ``syncpoint_hold_s``; so once an interval, the lag rises by the spread
between the fastest and slowest span at T plus the hold, and between syncpoints it is the
baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import sysbench  # noqa: E402
from benchmarks.e2e_figures import pct  # noqa: E402
from benchmarks.output import Figures, add_json_option  # noqa: E402
from contracts.events.changefeeds import ChangefeedSpec, RouteRuleV1, current_spec  # noqa: E402
from contracts.events.syncpoints import SyncpointEndedV1, SyncpointReachedV1  # noqa: E402
from libs.eventstore import EventStore  # noqa: E402
from libs.localservers.common import wait_until  # noqa: E402
from libs.localservers.mariadb import MariaDB  # noqa: E402
from libs.localservers.postgres import PostgreSQL  # noqa: E402
from libs.localservers.system import LocalSystem  # noqa: E402
from libs.streams import domain_events_subject, domain_stream  # noqa: E402
from libs.telemetry.metrics import lag_seconds  # noqa: E402
from libs.ts import ts_seconds  # noqa: E402
from tests.helpers.control_plane import Recorder  # noqa: E402


def _say(text: str) -> None:
    load = "/".join(f"{x:.1f}" for x in __import__("os").getloadavg())
    print(f"[{time.strftime('%H:%M:%S')}] {text} (load {load})", flush=True)


class Feed:
    def __init__(self, text: str) -> None:
        interval, _, hold = text.partition("/")
        self.interval = float(interval)
        self.hold = float(hold or 0)
        self.id = "sp-base" if not self.interval else f"sp-{self.interval:g}-{self.hold:g}".replace(".", "_")
        self.schema = self.id.replace("-", "_")
        self.lags: list[float] = []

    @property
    def baseline(self) -> bool:
        return not self.interval

    def describe(self) -> str:
        return ("no syncpoints (baseline)" if self.baseline
                else f"syncpoint_interval {self.interval:g} s, hold {self.hold:g} s")

    def spec(self, system: LocalSystem) -> ChangefeedSpec:
        base = current_spec(system.changefeed_spec(self.id, include=["sbtest.*"]))
        return ChangefeedSpec.model_validate({
            **base.model_dump(), "initial_load": "snapshot",
            "routes": [RouteRuleV1(database="sbtest", target_schema=self.schema).model_dump()],
            "syncpoint_interval": self.interval or None, "syncpoint_hold_s": self.hold})


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _digest(rows: list[tuple[object, ...]]) -> str:
    h = hashlib.sha256()
    for r in rows:
        h.update(repr((int(r[0]), int(r[1]), str(r[2]).rstrip(), str(r[3]).rstrip())).encode())  # type: ignore[call-overload]
    return h.hexdigest()


def verdict(source: MariaDB, down: MariaDB | PostgreSQL, schema: str, tables: int) -> bool:
    query = "SELECT id, k, c, pad FROM {s}.sbtest{n} ORDER BY id"
    return all(_digest(source.execute(query.format(s="sbtest", n=n)))
               == _digest(down.execute(query.format(s=schema, n=n))) for n in range(1, tables + 1))


async def syncpoint_outcomes(system: LocalSystem,
                             holds: dict[str, float]) -> dict[str, dict[str, list[float]]]:
    """Per changefeed: how far behind T's commit time each released syncpoint was reached and
    released, and how many were abandoned (the replication stream's ``syncpoint.*`` events)."""
    import nats

    from libs.nats_auth import API

    assert system.nats is not None
    nc = await nats.connect(**system.nats.client_options(API))
    out: dict[str, dict[str, list[float]]] = {}
    try:
        store = EventStore(nc.jetstream(), domain_stream("replication"), producer="bench")
        reached: dict[tuple[str, int], float] = {}
        async for stored in store.replay(domain_events_subject("replication")):
            ev = stored.event
            if isinstance(ev, SyncpointReachedV1):
                reached[(ev.changefeed, ev.ts)] = ev.hold_until - holds.get(ev.changefeed, 0.0)
            elif isinstance(ev, SyncpointEndedV1):
                f = out.setdefault(ev.changefeed, {"reached": [], "released": [], "abandoned": []})
                key = (ev.changefeed, ev.ts)
                if ev.outcome == "abandoned" or key not in reached:
                    f["abandoned"].append(1.0)
                else:
                    f["reached"].append(reached[key] - ts_seconds(ev.ts))
                    f["released"].append(ev.ended_at - ts_seconds(ev.ts))
    finally:
        await nc.close()
    return out


async def run(args: argparse.Namespace, out: Figures) -> None:
    base_dir = args.dir / args.downstream
    shutil.rmtree(base_dir, ignore_errors=True)
    feeds = [Feed(f) for f in args.feeds]
    if not any(f.baseline for f in feeds):
        raise SystemExit("--feeds needs a 0/0 entry: the baseline without syncpoints")
    system = LocalSystem(base_dir=base_dir, sources=1, downstream=args.downstream, control_replicas=1,
                         workers=1, with_api=True, standalone_workers=False, initial_load="snapshot")
    rec = Recorder()
    try:
        system.start_infra()
        assert system.nats is not None and system.downstream_db is not None
        source = system.source_dbs[0]
        await asyncio.to_thread(sysbench.prepare, source, args.tables, args.table_size)
        await rec.start(system.nats.url)
        system.start_services()
        await asyncio.to_thread(system.wait_healthy, 240)
        for f in feeds:
            await system.create_changefeed(f.spec(system), "bench")

        def lag(f: Feed) -> float | None:
            mine = [a.checkpoint_ts for a in rec.advances if a.changefeed == f.id]
            return lag_seconds(max(mine)) if mine else None

        def all_near() -> bool:
            return all((x := lag(f)) is not None and x < 2.0 + f.hold for f in feeds)

        started = time.time()
        await asyncio.to_thread(wait_until, all_near, args.catch_up_limit_s,
                                "every feed's initial load done and its checkpoint near", 0.5)
        _say(f"{len(feeds)} changefeeds loaded and near after {time.time() - started:.1f} s")
        proc = sysbench.start_run(source, "oltp_write_only", tables=args.tables, table_size=args.table_size,
                                  threads=args.threads, seconds=args.load_s, rate=args.rate)
        while proc.poll() is None:
            samples = {f.id: lag(f) for f in feeds}
            if all(v is not None for v in samples.values()):
                for f in feeds:
                    f.lags.append(samples[f.id])  # type: ignore[arg-type]
            await asyncio.sleep(0.5)
        result = await asyncio.to_thread(sysbench.finish, proc, "oltp_write_only", args.threads)
        ended_ms = int(time.time() * 1000)
        _say(f"sysbench: {result.tps:,.0f} TPS, {result.rows_per_s:,.0f} row changes/s "
             f"({result.row_changes / max(1, result.transactions):.1f} row changes a transaction)")

        def caught_up() -> bool:
            return all((x := lag(f)) is not None and time.time() - x >= ended_ms / 1000 for f in feeds)

        await asyncio.to_thread(wait_until, caught_up, args.catch_up_limit_s, "every feed past the load", 0.5)
        outcomes = await syncpoint_outcomes(system, {f.id: f.hold for f in feeds})
        base = next(f for f in feeds if f.baseline)
        what = (f"oltp_write_only {args.threads} threads at {args.rate:g} txn/s ({result.tps:,.0f} TPS, "
                f"4 row changes a transaction), {args.load_s} s, into {args.downstream}, {len(feeds)} "
                "changefeeds on one worker")
        for f in feeds:
            equal = await asyncio.to_thread(verdict, source, system.downstream_db, f.schema, args.tables)
            mean, base_mean = _mean(f.lags), _mean(base.lags)
            o = outcomes.get(f.id, {"reached": [], "released": [], "abandoned": []})
            sp = ("" if f.baseline else
                  f"; {len(o['released'])} syncpoints released, {len(o['abandoned'])} abandoned, reached "
                  f"{_mean(o['reached']):.2f} s and "
                  f"released {_mean(o['released']):.2f} s "
                  "behind T's commit time on average")
            _say(f"{f.describe()}: lag p50 {pct(f.lags, .5):.2f} p99 {pct(f.lags, .99):.2f} max "
                 f"{max(f.lags, default=float('nan')):.2f} mean {mean:.2f} s{sp}; "
                 f"{'EQUAL' if equal else 'DIFFERENT'}")
            out.add(f"lag p99 (now - changefeed checkpoint, every 0.5 s; p50 {pct(f.lags, .5):.2f} s, "
                    f"max {max(f.lags, default=float('nan')):.2f} s, mean {mean:.2f} s{sp}), "
                    f"{f.describe()}, {what}",
                    pct(f.lags, .99), "s",
                    baseline=None if f.baseline else (
                        f"same run without syncpoints: p99 {pct(base.lags, .99):.2f} s, p50 "
                        f"{pct(base.lags, .5):.2f} s, mean {base_mean:.2f} s (cost: mean "
                        f"{mean - base_mean:+.2f} s)"))
            out.add(f"verdict of {f.id}: ordered row hash of every table against the source",
                    1.0 if equal else 0.0, "equal", target="EQUAL", met=equal)
        out.extra["lags"] = {f.id: f.lags for f in feeds}
        out.extra["syncpoints"] = outcomes
    finally:
        await rec.stop()
        for name, proc_ in system.processes.items():
            if name.startswith("sink-worker"):
                proc_.kill()
        system.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--downstream", choices=("mariadb", "postgres"), default="mariadb")
    # Each feed applies the whole load again on the one worker: 3 feeds at 250 txn/s are 3,000
    # row changes a second for it, which a loaded 2-core machine still keeps up with.
    parser.add_argument("--feeds", nargs="+", default=["0/0", "5/1", "20/1"],
                        help="interval/hold in seconds per changefeed; 0/0: without syncpoints")
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--table-size", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rate", type=float, default=250.0, help="sysbench transactions a second")
    parser.add_argument("--load-s", type=int, default=60)
    parser.add_argument("--catch-up-limit-s", type=float, default=600.0)
    parser.add_argument("--dir", type=Path, default=ROOT / ".sluice" / "bench-syncpoints")
    add_json_option(parser)
    args = parser.parse_args()
    args.dir = args.dir.resolve()
    sysbench.ensure_sysbench()
    out = Figures("bench_syncpoints")
    asyncio.run(run(args, out))
    out.write(args.json)


if __name__ == "__main__":
    main()
