"""Capture keeps its lease while it publishes one large transaction (short lease, real servers).

The pipeline used to encode and publish a whole reader batch (up to 2,000 rows events, tens of
thousands of rows) without one event-loop turn: with the tests' 1.5 s lease the renewals, due
every 0.5 s and trusted for 1.2 s, missed their window on a loaded machine, capture lost the
lease and re-read the transaction under a new term, again and again. What stalls the loop
after that is the cyclic GC's full collections (GIL held, from the reader's unpickling thread
mostly): the capture process freezes its start-up heap out of them
(``services.capture.service.main``), and so does this test for the capture it runs in-process.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from nats.js import JetStreamContext
from prometheus_client import REGISTRY as METRICS

from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from tests.helpers.capture import (
    binlog_position,
    capture_settings,
    fresh_database,
    rows_of,
    running_capture,
    source_messages,
    wait_reading,
    wait_resolved_past,
)
from tests.helpers.loop_lag import loop_lag_probe

pytestmark = pytest.mark.integration

ROWS = 100_000
# The lease is trusted for 0.8 * 1.5 s after a renew sent every 0.5 s: a stall under 0.7 s
# cannot cost it, one past the whole trust window always does. Before the pipeline yielded,
# stalls here passed it and the lease was lost; with it, 0.13-0.58 s (the GC's full collections,
# stretched by the busy cores: BENCHMARKS.md). The property is the lease kept (asserted below);
# the stall bound is the window itself, so a slower machine's longer GC pause that the lease
# survives does not fail the test, and one that it cannot survive is named.
MAX_STALL_S = 1.2
# The loss was seen on a loaded 2-core machine: this many busy processes compete with capture
# for the cores while it reads the transaction, whatever else the machine runs.
BUSY_PROCESSES = 2


@contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """``n`` processes spinning on a core each while the block runs; killed after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)


async def test_capture_keeps_its_lease_through_a_large_transaction(
        mariadb: MariaDB, nats_server: NatsServer, js: JetStreamContext, replica_server_id: int,
        caplog: pytest.LogCaptureFixture) -> None:
    source, name = "cap_lease_load", "cap_lease_load"
    fresh_database(mariadb, name, "CREATE TABLE t (id INT PRIMARY KEY, a VARCHAR(40), b BIGINT)")
    settings = capture_settings(nats_server.url, source, mariadb.url_for(name), replica_server_id)
    assert settings.lease_ttl_s == 1.5
    lost_before = METRICS.get_sample_value("sluice_capture_sessions_total",
                                           {"source": source, "outcome": "lease-lost"}) or 0
    caplog.set_level(logging.INFO, logger="libs.election")
    started = time.monotonic()
    gc.freeze()
    try:
        async with running_capture(settings) as capture:
            await wait_reading(capture)
            epoch = capture.status["epoch"]
            with busy_cores(BUSY_PROCESSES):
                async with loop_lag_probe(0.05) as probe:
                    # One transaction of ROWS rows (a thread: the loop must stay free for capture).
                    await asyncio.to_thread(
                        mariadb.execute,
                        "SET SESSION max_recursive_iterations = 1000000",
                        "INSERT INTO t (id, a, b) WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL "
                        f"SELECT n + 1 FROM s WHERE n < {ROWS}) SELECT n, CONCAT('row-', n, '-', "
                        "REPEAT('x', 20)), n * 7 FROM s", database=name)
                    await wait_resolved_past(js, source, binlog_position(mariadb), within=80)
            assert capture.status["epoch"] == epoch and capture.status["lease"] is True, capture.status
    finally:
        gc.unfreeze()
    elapsed = time.monotonic() - started
    lost = [r for r in caplog.records if r.getMessage() == "leadership lost"
            and getattr(r, "reason", "") != "resigned"]
    assert not lost, [getattr(r, "reason", None) for r in lost]
    lost_after = METRICS.get_sample_value("sluice_capture_sessions_total",
                                          {"source": source, "outcome": "lease-lost"}) or 0
    assert lost_after == lost_before
    assert probe.max_lag < MAX_STALL_S, f"longest event-loop stall {probe.max_lag:.3f}s"
    got = rows_of(await source_messages(js, source))
    ids = sorted(r.after["id"] for e in got for r in e.rows if r.after)
    assert ids == list(range(1, ROWS + 1))
    assert elapsed < 90, f"{elapsed:.1f}s"
    print(f"rows={ROWS} max_loop_stall={probe.max_lag:.3f}s elapsed={elapsed:.1f}s")
