"""The sink-worker service: changefeeds in, spans discovered and applied, health, metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from contracts.events.changefeeds import (
    ChangefeedCreatedV2,
    ChangefeedSpecV2,
    ChangefeedStateChangedV1,
    SourceRefV1,
    TableFilterV1,
)
from libs.localservers.service_process import ServiceProcess
from libs.streams import domain_events_subject
from services.sink_worker.round.pipeline import Pipeline
from services.sink_worker.span.checkpoints import CheckpointStore
from services.sink_worker.span.runtime import PipelineOptions
from services.sink_worker.worker import ChangefeedView
from tests import test_sort_apply as data_path
from tests.helpers.harness import Harness, Source, fetch_rows, ins, people
from tests.helpers.sink_worker import _changefeeds, _get_text, _wait
from tests.helpers.worker_env import SPARK_WORKER_ENV

pytestmark = pytest.mark.integration

# Fixtures shared with the data path tests.
rows_js = data_path.rows_js
checkpoints = data_path.checkpoints
sqlite_url = data_path.sqlite_url


def test_changefeed_view_folds_create_update_pause_delete() -> None:
    spec = ChangefeedSpecV2(id="cf1", sources=[SourceRefV1(id="s1", url="mysql://u@h/")], sink_url="sqlite:///x",
                            initial_load="binlog-only")
    view = ChangefeedView()
    assert view.apply(ChangefeedCreatedV2(spec=spec))
    assert [s.id for s in view.running()] == ["cf1"]
    assert view.apply(ChangefeedStateChangedV1(id="cf1", state="paused"))
    assert view.running() == []
    assert view.apply(ChangefeedStateChangedV1(id="cf1", state="running"))
    assert not view.apply(ChangefeedStateChangedV1(id="cf1", state="running"))
    assert view.apply(ChangefeedStateChangedV1(id="cf1", state="deleted"))
    assert view.running() == [] and view.specs == {}


async def test_a_round_abandoned_on_stop_advances_no_checkpoint(
        rows_js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
        sqlite_url: str) -> None:
    h = Harness(rows_js, checkpoints, spark, sqlite_url)
    h.pipeline = Pipeline(rows_js, checkpoints, lambda: spark,
                          PipelineOptions(stop_grace_s=0.0, checkpoint_interval_s=0.0))
    await h.run("people")
    await h.source.txn(h.db, "people", [ins(1, "ann", 1)])
    await h.source.resolve()
    stopping = asyncio.Event()
    stopping.set()  # SIGTERM arrived: the round may not outlive a zero grace period
    report = await h.pipeline.round(stopping)
    assert report.abandoned
    assert await h.checkpoint("people") is None
    await h.round()  # the next owner of the span applies it from the checkpoint
    assert h.rows("people") == people((1, "ann", 1))
    cp = await h.checkpoint("people")
    assert cp is not None and cp.ts == h.source.last_ts


async def test_worker_process_follows_changefeeds_and_stops_cleanly(
        rows_js: JetStreamContext, service_env: dict[str, str], tmp_path: Path) -> None:
    sink_url = f"sqlite:///{tmp_path / 'worker-down.db'}"
    src = Source(rows_js)
    cf = f"cf{uuid4().hex[:6]}"
    store = await _changefeeds(rows_js)
    await store.append(domain_events_subject("changefeeds"), ChangefeedCreatedV2(spec=ChangefeedSpecV2(
        id=cf, sources=[SourceRefV1(id=src.name, url="mysql://u@127.0.0.1/")], sink_url=sink_url,
        filter=TableFilterV1(include=["shop.*"], exclude=["shop.secret"]),
        initial_load="binlog-only")))
    await src.txn("shop", "people", [ins(1, "ann", 1), ins(2, "bob", 2)])
    await src.txn("shop", "secret", [ins(1, "x", 1)])
    await src.txn("other", "people", [ins(1, "y", 1)])
    resolved = await src.resolve()

    env = {**service_env, **SPARK_WORKER_ENV, "SLUICE_LOG_JSON": "false",
           "SLUICE_SINK_STANDALONE": "true",  # one worker, every span: no control plane here
           # An idle worker must start a round on a new resolved mark, not after this interval.
           "SLUICE_SINK_ROUND_INTERVAL_S": "30"}
    proc = ServiceProcess("services.sink_worker", env, tmp_path / "logs").start()
    try:
        proc.wait_healthy(timeout=60)

        def spans() -> list[dict[str, Any]] | None:
            health = proc.health() or {}
            found = [s for s in health.get("spans", []) if s["changefeed"] == cf]
            done = found and all(s["checkpoint_ts"] == resolved for s in found)
            return found if done else None

        found = await _wait(spans, 120, "the span to reach the resolved ts")
        assert [(s["database"], s["table"], s["state"]) for s in found] == [("shop", "people", "replicating")]
        assert found[0]["resolved_ts"] == resolved and found[0]["rows_written"] == 2
        assert fetch_rows(sink_url, "shop", "people") == people((1, "ann", 1), (2, "bob", 2))
        text = await asyncio.to_thread(_get_text, proc.base_url + "/metrics")
        assert f'sluice_sink_rows_applied_total{{changefeed="{cf}",op="upsert"}} 2.0' in text
        assert "sluice_sink_checkpoint_lag_seconds" in text

        # Idle now; a new transaction and its resolved mark wake the worker at once.
        await src.txn("shop", "people", [ins(3, "cy", 3)])
        resolved = await src.resolve()
        woke = time.monotonic()
        await _wait(spans, 15, "a round after the new resolved mark, well before round_interval_s")
        assert time.monotonic() - woke < 15
        assert fetch_rows(sink_url, "shop", "people") == people((1, "ann", 1), (2, "bob", 2), (3, "cy", 3))

        # Paused: the worker lets go of the changefeed's spans (its checkpoints stay).
        await store.append(domain_events_subject("changefeeds"),
                           ChangefeedStateChangedV1(id=cf, state="paused"))
        await _wait(lambda: not any(s["changefeed"] == cf for s in (proc.health() or {}).get("spans", [{}])),
                    30, "the paused changefeed's spans to go")
        assert proc.terminate(timeout=30) == 0, proc.tail_log()
    finally:
        proc.kill()

