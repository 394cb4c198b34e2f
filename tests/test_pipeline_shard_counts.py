"""A span's shard count (how many upstream tables feed its target; above one, its DDL goes
through the ddl-lock) is counted again whenever the spans, their configs or the shard groups
change, and only then: an idle round over thousands of spans does not count them again. No
server: the pipeline's span bookkeeping only."""

from __future__ import annotations

from typing import Any

from libs.routing import Router, RouteRule
from libs.scheduling.model import Span
from services.sink_worker.round.pipeline import Pipeline
from services.sink_worker.span.runtime import SpanConfig

MERGED = Router([RouteRule(schema="shop_*", table="items", target_schema="all", target_table="items")])


def _span(shard: str) -> Span:
    return Span.of("cf", "src", f"shop_{shard}", "items")


class _Checkpoints:
    def forget(self, span: Span) -> None:
        pass


def _pipeline() -> Pipeline:
    # The bookkeeping under test opens nothing: no stream, no stored checkpoint, no Spark.
    none: Any = None
    store: Any = _Checkpoints()
    return Pipeline(none, store, lambda: none)


class _Groups:
    """A ShardDdl's answer about groups: ``size`` shards for every span, as of ``groups_at``."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.groups_at: float | None = 1.0
        self.asked = 0

    def group_size(self, span: Span) -> int | None:
        self.asked += 1
        return self.size


async def test_shards_are_counted_again_when_the_spans_or_groups_change_and_not_otherwise() -> None:
    p = _pipeline()
    merged, alone = SpanConfig(sink_url="sqlite://", router=MERGED), SpanConfig(sink_url="sqlite://")
    a, b = _span("a"), _span("b")
    await p.set_spans({a: merged, b: merged})
    assert (p.spans[a].shards, p.spans[b].shards) == (2, 2)
    await p.stop_span(b)
    await p.set_spans({a: merged})
    assert p.spans[a].shards == 1  # its fellow shard left this worker
    await p.set_spans({a: alone, b: alone})
    assert (p.spans[a].shards, p.spans[b].shards) == (1, 1)  # a new config: each its own target

    groups = _Groups(3)
    p.attach_shard_ddl(groups)  # type: ignore[arg-type]
    await p.set_spans({a: alone, b: alone})
    assert p.spans[a].shards == 3  # the groups across every worker
    asked = groups.asked
    for _ in range(5):
        await p.set_spans({a: alone, b: alone})  # an idle round's set_spans: nothing changed
    assert groups.asked == asked and p.spans[a].shards == 3
    groups.size, groups.groups_at = 4, 2.0  # discovered again
    p._count_shards()
    assert p.spans[a].shards == p.spans[b].shards == 4
    p.spans[a].shards = 0  # counted again only on a change, so a stale count would show here
    await p.set_spans({a: alone, b: alone})
    assert p.spans[a].shards == 0
