"""The self-fence with real processes: a SIGSTOPped worker, stopped past its fence bound, writes
nothing once its spans have moved, and after SIGCONT it starts over as a new incarnation.

The model is the chaos suite's writer-log check: every worker appends each round that wrote a
span (with the round's start and end) and each hand-over to a shared writer log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from libs.localservers.system import LocalSystem
from tests.helpers.control_plane import TABLES, Recorder, Workload, eventually, health, read_writer_log
from tests.helpers.worker_env import MEMBER_WORKER_ENV, SINK_TEST_PACING, SPARK_TEST_JAVA_OPTIONS

pytestmark = pytest.mark.integration

DB = "fence"
SPANS = len(TABLES)
FENCE_S = 1.0


@pytest.fixture
async def system(tmp_path: Path) -> AsyncIterator[tuple[LocalSystem, Recorder, Path]]:
    writer_log = tmp_path / "writers.jsonl"
    system = LocalSystem(
        base_dir=tmp_path, sources=1, control_replicas=1, workers=2, lease_ttl_s=2.0, with_api=False,
        control_services=("member", "scheduler", "replication_manager"), standalone_workers=False,
        initial_load="binlog-only",
        # Balance every 2 s: the worker whose Spark warms first takes every span, and the test
        # needs both workers holding spans (the default period is a minute).
        control_env={"SLUICE_REPLICATION_TICK_S": "1", "SLUICE_MEMBER_FENCE_S": str(FENCE_S),
                     "SLUICE_SCHEDULER_BALANCE_INTERVAL_S": "2"},
        worker_env={**MEMBER_WORKER_ENV,
                    "SLUICE_SPARK_DRIVER_JAVA_OPTIONS": SPARK_TEST_JAVA_OPTIONS, **SINK_TEST_PACING,
                    "SLUICE_SINK_WRITER_LOG": str(writer_log), "SLUICE_MEMBER_FENCE_S": str(FENCE_S)},
    )
    recorder = Recorder()
    workload: Workload | None = None
    try:
        system.start_infra()
        assert system.nats is not None
        await recorder.start(system.nats.url)
        workload = Workload(system.source_dbs[0].connect(), DB)
        workload.create()
        system.start_services()
        await asyncio.to_thread(system.wait_healthy, 90)
        await system.create_changefeed(system.changefeed_spec("fence", include=[f"{DB}.*"]))
        for _ in range(3):
            workload.transaction()
        workload.start(per_second=8)
        yield system, recorder, writer_log
    finally:
        if workload is not None:
            workload.stop()
        await recorder.stop()
        for name, proc in system.processes.items():
            if name.startswith("sink-worker"):
                proc.kill()
        system.stop()


@pytest.mark.timeout(600)
async def test_a_sigstopped_worker_never_writes_after_its_spans_moved(
        system: tuple[LocalSystem, Recorder, Path]) -> None:
    sys_, rec, writer_log = system
    await eventually(lambda: rec.all_replicating(SPANS) and len(rec.loads()) == 2, 240,
                     "every span replicating on the two workers")
    loads = rec.loads()
    victim = max(sorted(loads), key=lambda m: loads[m])
    proc = sys_.processes[victim]
    before = await health(proc) or {}
    incarnation = before["agent"]["incarnation"]
    lost = [s for s, p in rec.placement().items() if p == victim]
    await eventually(lambda: any(e["event"] == "wrote" and e["member"] == victim
                                 for e in read_writer_log(writer_log)), 120, f"{victim} writing")
    proc.pause()
    stopped_at = time.time()
    try:
        await eventually(lambda: all(rec.placement().get(s) not in (None, victim) for s in lost)
                         and rec.all_replicating(SPANS), 120, f"{victim}'s spans replicating elsewhere")
        moved_at = time.time()
        def new_owner_wrote() -> bool:
            written = {e["span"] for e in read_writer_log(writer_log)
                       if e["event"] == "wrote" and e["member"] != victim and e["t0"] >= stopped_at}
            return written >= set(lost)

        await eventually(new_owner_wrote, 120, "the new owner writing every moved span")
    finally:
        proc.resume()
    assert moved_at - stopped_at > FENCE_S, "the spans moved before the fence bound"

    async def started_over() -> bool:
        h = await health(proc) or {}
        agent = h.get("agent") or {}
        return bool(agent.get("fenced")) and agent.get("incarnation") != incarnation

    await eventually(started_over, 60, f"{victim} starting over as a new incarnation")
    # Give the resumed process the chance to do whatever it would: a round of the new owner
    # later than the resume shows time went on.
    resumed_at = time.time()
    await eventually(lambda: any(e["event"] == "wrote" and e["t0"] >= resumed_at
                                 for e in read_writer_log(writer_log)), 60, "a round after the resume")
    late = [e for e in read_writer_log(writer_log)
            if e["event"] == "wrote" and e["incarnation"] == incarnation and e["t0"] >= moved_at]
    assert not late, f"the fenced incarnation started rounds that wrote after its spans moved: {late}"
    stopped = [e for e in read_writer_log(writer_log)
               if e["event"] == "started" and e["incarnation"] == incarnation and e["t"] >= stopped_at]
    assert not stopped, f"the fenced incarnation started spans after SIGSTOP: {stopped}"
    log = proc.log_path.read_text()
    assert "fenced: heartbeats not confirmed in time" in log, proc.tail_log()
