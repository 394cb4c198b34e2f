"""Cross-shard unique conflicts in a merged target without an origin column, through the real
data path (NATS, Spark; SQLite, MariaDB and PostgreSQL downstream): another shard's row is never
removed in silence."""

from __future__ import annotations

import json
from typing import Any
from uuid import uuid4

import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from libs.routing import Router, RouteRule
from libs.scheduling.model import Span
from services.sink_worker.round.pipeline import Pipeline
from services.sink_worker.sinks.unique_guard import ORIGIN_ADVICE, UniqueConflictPolicy
from services.sink_worker.span.checkpoints import CheckpointStore
from services.sink_worker.span.runtime import PipelineOptions, SpanConfig
from tests import test_sort_apply as data_path
from tests.helpers.harness import Source, fetch_rows, ins, people, upd

pytestmark = pytest.mark.integration

# Fixtures shared with the data path tests.
rows_js = data_path.rows_js
checkpoints = data_path.checkpoints
sqlite_url = data_path.sqlite_url

class Merged:
    """Two shards (shop_a.users, shop_b.users) of one source merged into <schema>.users."""

    def __init__(self, js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
                 sink_url: str, policy: UniqueConflictPolicy) -> None:
        self.source = Source(js)
        self.schema = f"m{uuid4().hex[:8]}"
        self.sink_url = sink_url
        self.pipeline = Pipeline(js, checkpoints, lambda: spark,
                                 PipelineOptions(apply_partitions=3, checkpoint_interval_s=0.0))
        router = Router([RouteRule("shop_*", "users", self.schema, "users")])
        self.config = SpanConfig(sink_url=sink_url, router=router, on_unique_conflict=policy)
        self.a = Span.of("cfu" + self.source.name[-6:], self.source.name, "shop_a", "users")
        self.b = Span.of(self.a.changefeed, self.source.name, "shop_b", "users")

    async def start(self) -> None:
        await self.pipeline.set_spans({self.a: self.config, self.b: self.config})

    def rows(self) -> list[dict[str, Any]]:
        return fetch_rows(self.sink_url, self.schema, "users")

    def status(self, span: Span) -> dict[str, Any]:
        return next(s for s in self.pipeline.status() if s["span"] == span.name)


@pytest.fixture(params=["sqlite", "mariadb", "postgres"])
def merged(rows_js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
           sqlite_url: str, request: pytest.FixtureRequest) -> Merged:
    url = sqlite_url if request.param == "sqlite" else request.getfixturevalue(request.param).url
    return Merged(rows_js, checkpoints, spark, url, "error")


@pytest.fixture
def overwriting(rows_js: JetStreamContext, checkpoints: CheckpointStore, spark: SparkSession,
                sqlite_url: str) -> Merged:
    return Merged(rows_js, checkpoints, spark, sqlite_url, "overwrite")


def _assert_reported(merged: Merged, span: Span, holder: int, taker: tuple[str, int]) -> None:
    status = merged.status(span)
    assert status["state"] == "error", status
    incident = status["incident"]
    error = incident["error"]
    assert f"cross-shard unique conflict on {merged.schema}.users unique (name) = ['lucy']" in error, error
    assert f"{taker[0]} key [{taker[1]}]" in error and f"key [{holder}]" in error, error
    assert ORIGIN_ADVICE in error and incident["statement"] == "upsert"


async def test_a_conflict_across_rounds_stops_the_target_and_keeps_the_other_shards_row(
        merged: Merged) -> None:
    await merged.start()
    src = merged.source
    await src.txn("shop_a", "users", [ins(1, "lucy", 30)])
    await src.resolve()
    report = await merged.pipeline.round()
    assert not report.errors, report.errors
    taken = await src.txn("shop_b", "users", [ins(2, "lucy", 40)])
    await src.resolve()
    report = await merged.pipeline.round()
    assert report.errors
    assert merged.rows() == people((1, "lucy", 30))  # shard a's row is still there
    _assert_reported(merged, merged.b, holder=1, taker=(merged.b.name, 2))
    # Shard a's row was written a round earlier: the sink cannot name its shard, and says so.
    assert "another shard (written before this batch)" in merged.status(merged.b)["incident"]["error"]
    cp = await merged.pipeline.checkpoints.get(merged.b)
    assert cp is None or cp.ts < taken  # nothing of b's refused batch is checkpointed


async def test_a_conflict_within_one_round_is_refused_whichever_lands_first(merged: Merged) -> None:
    await merged.start()
    src = merged.source
    await src.txn("shop_a", "users", [ins(1, "lucy", 30), ins(3, "ann", 1)])
    await src.txn("shop_b", "users", [ins(2, "lucy", 40), ins(4, "bob", 2)])
    await src.resolve()
    report = await merged.pipeline.round()
    assert report.errors
    rows = merged.rows()
    assert [r["name"] for r in rows].count("lucy") == 1, rows  # one of them, never neither
    for span in (merged.a, merged.b):
        error = merged.status(span)["incident"]["error"]
        conflict = f"cross-shard unique conflict on {merged.schema}.users unique (name) = ['lucy']"
        assert conflict in error, error
        assert merged.a.name in error and merged.b.name in error, error  # both shards, both in the batch


async def test_the_lucy_reorder_within_one_shard_of_a_merged_target_is_no_conflict(merged: Merged) -> None:
    await merged.start()
    src = merged.source
    await src.txn("shop_a", "users", [ins(1, "lucy", 30)])
    await src.txn("shop_b", "users", [ins(7, "zed", 1)])
    await src.resolve()
    assert not (await merged.pipeline.round()).errors
    # Within shard a: 1 gives "lucy" up, then 2 takes it, in one batch.
    await src.txn("shop_a", "users", [upd((1, "lucy", 30), (1, "lucy2", 30))])
    await src.txn("shop_a", "users", [ins(2, "lucy", 31)])
    last = await src.resolve()
    report = await merged.pipeline.round()
    assert not report.errors, report.errors
    assert merged.rows() == people((1, "lucy2", 30), (2, "lucy", 31), (7, "zed", 1))
    cp = await merged.pipeline.checkpoints.get(merged.a)
    assert cp is not None and cp.ts == last


async def test_overwrite_removes_the_other_shards_row_and_reports_each_one(overwriting: Merged) -> None:
    merged = overwriting
    await merged.start()
    src = merged.source
    await src.txn("shop_a", "users", [ins(1, "lucy", 30)])
    await src.resolve()
    assert not (await merged.pipeline.round()).errors
    await src.txn("shop_b", "users", [ins(2, "lucy", 40)])
    await src.resolve()
    assert not (await merged.pipeline.round()).errors
    assert merged.rows() == people((2, "lucy", 40))
    assert len(merged.pipeline.new_overwrites) == 1
    changefeed, text = merged.pipeline.new_overwrites[0]
    report = json.loads(text)
    assert changefeed == merged.a.changefeed and report["action"] == "overwritten"
    assert (report["target"], report["unique_key"], report["value"]) == (f"{merged.schema}.users", ["name"],
                                                                         ["lucy"])
    assert (report["key"], report["other_key"], report["shard"]) == ([2], [1], merged.b.name)
