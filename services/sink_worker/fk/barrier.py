"""Whether a span may pass a change of the foreign-key graph (DESIGN.md, "Foreign-key cascades").

A span's tables are one table group, or one table each, by the cascading keys discovery last
read (``libs.changefeeds._group_spans``, cached for seconds). A DDL that may change those keys
(``libs.foreign_keys.ddl_may_change_keys``, from its text) reaches every span that reads a table
it touches in stream order: on the altered table's DDL subject, and on each parent's as
``foreign_keys.changed`` (capture). The span's batch stops before it like before any DDL; here it
is decided whether the span passes it: it does when the keys, read after the span met the
barrier (so they show the statement), still make exactly this span of its tables. Otherwise
the span stays just before the barrier, blocked, until discovery forms the spans again; the new
span starts from the lowest checkpoint of the spans that held its tables
(``span_start.SpanStarts.inherit``) and replays the barrier, which it then passes.

Nothing is read for spans without such a barrier in their batch: the common round costs nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from contracts.events.rows import DdlExecutedV1, ForeignKeysChangedV1
from libs.foreign_keys import ddl_may_change_keys, regrouped
from libs.source_tables import source_foreign_keys
from services.sink_worker.round.pull import PulledEvent
from services.sink_worker.round.work import SpanWork
from services.sink_worker.sinks.factory import sink_kind

log = logging.getLogger(__name__)


def changes_keys(e: PulledEvent) -> bool:
    """A barrier whose statement may change the foreign-key graph."""
    if isinstance(e.event, ForeignKeysChangedV1):
        return True
    return isinstance(e.event, DdlExecutedV1) and ddl_may_change_keys(e.event.statement)


class ForeignKeyBarrier:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._met: dict[str, tuple[str, float]] = {}
        """Span kv key -> (event id, when this process first met it) of its key barrier."""

    async def check(self, w: SpanWork) -> None:
        """Sets ``w.fk_wait`` when the span's first barrier changes its foreign-key group."""
        rt = w.rt
        if w.refused or not sink_kind(rt.config.sink_url).holds_rows or not rt.config.source_url:
            return  # cascades are carried out on SQL downstreams only; a stream gets no group
        head = next((e for e in w.fresh if e.is_ddl and e.ts <= w.horizon), None)
        if head is None or not changes_keys(head):
            self._met.pop(rt.span.kv_key, None)
            return
        met = self._met.get(rt.span.kv_key)
        if met is None or met[0] != head.event_id:
            met = self._met[rt.span.kv_key] = (head.event_id, self._clock())
        try:
            fks = await source_foreign_keys(rt.config.source_url, read_after=met[1])
        except Exception as exc:
            w.fk_wait = (head.event_id, f"cannot read the source's foreign keys after the DDL at ts "
                                        f"{head.ts}: {exc!r}")
            return
        router = rt.config.router
        selected = router.filter.selected if router is not None else (lambda _d, _t: True)
        now = regrouped(rt.span.tables(), [fk for fk in fks if fk.cascading], selected)
        if now is None:
            return
        assert isinstance(head.event, DdlExecutedV1 | ForeignKeysChangedV1)
        w.fk_wait = (head.event_id, (
            f"the DDL at ts {head.ts} ({head.event.statement[:200]!r}) changes the foreign-key "
            f"groups of its tables (now {', '.join(f'{d}.{t}' for d, t in now)}): waiting for "
            "their spans to be formed again"))
        log.info("span stops at a foreign-key change until its group is formed again",
                 extra={"span": rt.span.name, "ts": head.ts, "tables": [f"{d}.{t}" for d, t in now]})
