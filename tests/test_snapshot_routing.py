"""The initial load's copy lands where the stream does: in the routed target, and with the
origin column when the changefeed sets one, so shards whose keys collide keep separate rows.

Real MariaDB source, real SQLite target; the copy task runs in-process (the Spark job only
distributes these tasks, ``tests/test_initial_load.py`` covers it)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from contracts.events.changefeeds import ChangefeedSpecV2, RouteRuleV1, SourceRefV1
from libs.codec.table_meta import load_table_info
from libs.localservers.mariadb import MariaDB
from libs.routing import router_for
from libs.scheduling.model import Span
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.sinks.sql_common import MADE_TABLE
from services.sink_worker.snapshot.job import CopyJob, copy_chunk
from services.sink_worker.snapshot.plan import Chunk
from services.sink_worker.span.target import shard_ref, target_for


def test_copies_of_two_shards_merge_into_the_routed_target_with_their_origin(
        mariadb: MariaDB, tmp_path: Path) -> None:
    shards = ("snaproute_a", "snaproute_b")
    for db in shards:
        mariadb.execute(f"DROP DATABASE IF EXISTS {db}", f"CREATE DATABASE {db}",
                        f"CREATE TABLE {db}.orders (id INT PRIMARY KEY, note VARCHAR(20))",
                        # the same keys in both shards: only the origin column tells them apart
                        f"INSERT INTO {db}.orders VALUES (1, '{db}-1'), (2, '{db}-2'), (3, NULL)")
    sink_url = f"sqlite:///{tmp_path / 'down.db'}"
    spec = ChangefeedSpecV2(
        id="snaproute", sources=[SourceRefV1(id="src1", url=mariadb.url)], sink_url=sink_url,
        routes=[RouteRuleV1(database="snaproute_*", table="orders", target_schema="merged",
                            target_table="all_orders")],
        origin_column="_origin")
    router = router_for(spec)
    sink = open_sink(sink_url)
    conn = mariadb.connect()
    try:
        for db in shards:
            info = load_table_info(conn, db, "orders")
            assert info is not None
            span = Span.of("snaproute", "src1", db, "orders")
            target = target_for(span, db, "orders", info.meta(), "primary", router)
            assert (target.name, target.key) == ("all_orders", ("_origin", "id"))
            ref = shard_ref(span, db, "orders")
            origin = router.origin_for(ref)
            assert origin is not None
            sink.ensure_table(target)
            job = CopyJob(source_url=mariadb.url, database=db, table="orders", chunk_key=("id",),
                          target=target, sink_url=sink_url, origin=(origin.name, origin.value(ref)))
            assert copy_chunk(job, Chunk(0, None, None)) == 3
            # re-running a chunk (a resumed copy) changes nothing
            assert copy_chunk(job, Chunk(0, None, None)) == 3
    finally:
        conn.close()
    with sqlite3.connect(tmp_path / "down.db") as down:
        rows = sorted(down.execute('SELECT "_origin", id, note FROM all_orders').fetchall())
        tables = {r[0] for r in down.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    # the routed target and the record that Sluice made it (sluice_made_targets), nothing per shard
    assert tables == {"all_orders", MADE_TABLE}
    assert rows == sorted((f"src1/{db}/orders", i, note) for db in shards
                          for i, note in ((1, f"{db}-1"), (2, f"{db}-2"), (3, None)))
