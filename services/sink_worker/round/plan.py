"""A span's plan for one round: its routes, target, key, table rules and origin, worked out
once in the driver before anything is written.

``SpanRoutes`` keeps the routes and targets of the span's tables for the round, so the DDL
barriers and the writers read the same target the plan chose instead of routing again.
``RoundPlanner`` plans each span: a table without a usable key (or with table rules Spark's
analyser refuses) cannot be replicated and stops with an incident (``span.machine``, at the
round's end), rows lacking key values are dead-lettered, and the changes of keys an operator
skipped are parked in the dead letters.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import replace

from nats.js import JetStreamContext
from pyspark.sql import SparkSession

from contracts.events.rows import RowImageV2, RowsChangedV2
from libs.eventstore.deadletter import dead_letter
from libs.routing import Router, Target
from libs.scheduling.model import Span
from libs.source_tables import source_foreign_keys
from libs.streams import token
from libs.table_rules import NO_RULES, TableRules, TableRulesError, rules_for
from services.sink_worker.ddl.shard import ShardDdl
from services.sink_worker.fk.table_group import cut_group, source_metas
from services.sink_worker.round.apply_job import TargetPlan, key_json
from services.sink_worker.round.pull import PulledEvent
from services.sink_worker.round.routes import route_tokens
from services.sink_worker.round.row_rules import analyse
from services.sink_worker.round.work import SpanWork
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import sink_kind
from services.sink_worker.span.machine import Refused
from services.sink_worker.span.runtime import SpanRuntime
from services.sink_worker.span.target import KeylessTableError

log = logging.getLogger(__name__)


class RoundPlanner:
    def __init__(self, js: JetStreamContext, rows_stream: str, spark: Callable[[], SparkSession]) -> None:
        self.js = js
        self.rows_stream = rows_stream
        self._spark = spark
        # (table meta JSON, rules) -> why Spark's analyser refuses the rules' expressions, or None.
        self._rules_checked: dict[tuple[str, str], str | None] = {}

    async def plan(self, w: SpanWork) -> None:
        """The span's target and key; stop a keyless table, park rows without key values."""
        last_meta: RowsChangedV2 | None = None
        kept: list[PulledEvent] = []
        barrier = False
        for e in w.fresh:
            if e.dead:
                kept.append(e)  # holds its place in its transaction; never applied
                continue
            if barrier or not isinstance(e.event, RowsChangedV2):
                barrier = True
                kept.append(e)
                continue
            ev = e.event
            if last_meta is None or (ev.database, ev.table, ev.meta) != (
                    last_meta.database, last_meta.table, last_meta.meta):
                # Consecutive events almost always share the table's metadata: route once.
                try:
                    routed = w.routes.target(ev.database, ev.table, ev.meta)
                    w.rules = await self._table_rules(w.rt.config.router, ev)
                except (KeylessTableError, TableRulesError) as exc:
                    self.refuse(w, str(exc))
                    return
                origin = w.routes.origin(ev.database, ev.table)
                key = tuple(c for c in routed.key if origin is None or c != origin[0])
            problem = missing_key_columns(e.event, key)
            if problem is not None:
                await w.rt.reader.dead_letter_event(e, "invalid_data", problem)
                dead = replace(e, dead=True)
                w.pulled.events = [dead if x.stream_seq == e.stream_seq else x for x in w.pulled.events]
                w.rt.dead_lettered += 1
                kept.append(dead)
                continue
            kept.append(e)
            last_meta = e.event
        w.fresh = kept
        if last_meta is not None:
            table = w.routes.target(last_meta.database, last_meta.table, last_meta.meta)
            # Before parking skipped keys: a merged target's key holds the origin column.
            w.origin = w.routes.origin(last_meta.database, last_meta.table)
            if w.rt.skip_reasons:
                await self._park_skipped(w, table.key)
            w.plan = TargetPlan(target_id=target_id(w.rt.config.sink_url, table),
                                sink_url=w.rt.config.sink_url, table=table)
            w.source_meta = last_meta.meta

    async def plan_group(self, w: SpanWork) -> None:
        """A table group's cut (``table_group.cut_group``), the cascading keys among its tables
        and every member's metadata (from its events, else the source's information_schema: a
        cascade reaches children that have no event in the batch)."""
        rt = w.rt
        if not sink_kind(rt.config.sink_url).holds_rows:
            self.refuse(w, "a foreign-key table group is applied with its cascades on SQL "
                            "downstreams only (DESIGN.md, \"Foreign-key cascades\")")
            return
        try:
            fks = await source_foreign_keys(rt.config.source_url, strict=True)
        except Exception as exc:
            reason = f"cannot read the source's foreign keys: {exc!r}"
            rt.source_failed(reason)
            w.head = Refused(reason)
            return
        members = set(rt.span.tables())
        w.group_fks = [fk for fk in fks if fk.cascading
                       and (token(fk.database), token(fk.table)) in members
                       and (token(fk.ref_database), token(fk.ref_table)) in members]
        w.group = cut_group(rt.span.kv_key, w.start.ts, w.horizon, w.fresh)
        for e in w.group.batch:
            assert isinstance(e.event, RowsChangedV2)
            rt.group_metas[(e.event.database, e.event.table)] = e.event.meta
        names = ({(fk.database, fk.table) for fk in w.group_fks}
                 | {(fk.ref_database, fk.ref_table) for fk in w.group_fks})
        missing = sorted(n for n in names if n not in rt.group_metas)
        if missing:
            rt.group_metas.update(await asyncio.to_thread(source_metas, rt.config.source_url, missing))
        router = rt.config.router
        if router is not None and router.table_rules:
            ruled = [f"{d}.{t}" for d, t in sorted(rt.group_metas)
                     if rules_for(router.table_rules, d, t) is not NO_RULES]
            if ruled:
                self.refuse(w, f"table rules on tables of a foreign-key group ({', '.join(ruled)}) "
                                "are not carried out with its cascades")

    async def _table_rules(self, router: Router | None, ev: RowsChangedV2) -> TableRules | None:
        """The table's rules, their expressions checked against its metadata by Spark's
        analyser (once per table shape); ``TableRulesError`` says why they do not fit."""
        if router is None or not router.table_rules:
            return None
        rules = rules_for(router.table_rules, ev.database, ev.table)
        if rules == NO_RULES:
            return None
        if rules.needs_spark:
            cache_key = (ev.meta.model_dump_json(), repr(rules))
            if cache_key not in self._rules_checked:
                problem = await asyncio.to_thread(analyse, self._spark(), ev.meta, rules)
                self._rules_checked[cache_key] = problem
            problem = self._rules_checked[cache_key]
            if problem is not None:
                raise TableRulesError(f"table rules of {ev.database}.{ev.table}: {problem}")
        return rules


    @staticmethod
    def refuse(w: SpanWork, reason: str) -> None:
        """The table cannot be replicated as the changefeed says: the round's end stops it with
        an incident (recorded, logged and counted once, in ``CheckpointAdvance``)."""
        w.head = Refused(reason, unreplicable=True)


    async def _park_skipped(self, w: SpanWork, key: tuple[str, ...]) -> None:
        """Dead-letter (a copy of) each event that holds a skipped key's change, once per key."""
        rt = w.rt
        for skipped, upto in list(rt.skips.items()):
            stopped = rt.skip_reasons.pop(skipped, None)
            if stopped is None:
                continue  # parked already
            reason = (f"skipped by an operator (incident {stopped.id}): {stopped.failure.describe()}")
            for e in w.fresh:
                if e.dead or e.ts > upto or not isinstance(e.event, RowsChangedV2):
                    continue
                if any(skipped in image_keys(image, key, w.origin) for image in e.event.rows):
                    await dead_letter(self.js, e, reason, "skipped", self.rows_stream, seq=e.stream_seq,
                                      ack=False)
                    rt.dead_lettered += 1


def missing_key_columns(event: RowsChangedV2, key: tuple[str, ...]) -> str | None:
    for i, row in enumerate(event.rows):
        for image in (row.before, row.after):
            if image is not None:
                missing = [c for c in key if c not in image]
                if missing:
                    return f"row {i} ({row.op}) lacks key columns {missing}"
    return None


def image_keys(image: RowImageV2, key: tuple[str, ...], origin: tuple[str, str] | None) -> list[str]:
    """The key JSON (as the apply job spells it, origin column included) of a row change's images."""
    out = []
    for values in (image.before, image.after):
        if values is None:
            continue
        full = {origin[0]: origin[1], **values} if origin is not None else values
        if all(c in full for c in key):
            out.append(key_json(full, key))
    return out


def count_shards(spans: dict[Span, SpanRuntime], shard_ddl: ShardDdl | None) -> None:
    """Each span's shard count: the group the coordinator knows across every worker, else
    the spans of this worker routed to the same target."""
    targets: dict[tuple[str, Target], int] = {}
    routed = {}
    for span, rt in spans.items():
        # Routing every span again each round was most of an idle round at a thousand spans:
        # kept while the span's router is the same object (set_spans keeps an equal config).
        cached = rt.routed
        if cached is None or cached[0] is not rt.config.router:
            cached = rt.routed = (rt.config.router, route_tokens(span, rt.config.router))
        routed[span] = (span.changefeed, cached[1])
        targets[routed[span]] = targets.get(routed[span], 0) + 1
    for span, rt in spans.items():
        local = targets[routed[span]]
        if shard_ddl is None:
            rt.shards = local
            continue
        known = shard_ddl.group_size(span)
        # Group unknown (discovery failed): count it as sharded, so a DDL waits for the
        # ddl-lock (which resolves a group of one at once) instead of being applied alone.
        rt.shards = max(known, local) if known is not None else max(local, 2)


def target_id(sink_url: str, table: TargetTable) -> str:
    """Identifies a target table across spans (shards of one target collapse together) without
    carrying the sink URL, which may hold a password, into Spark's data."""
    digest = hashlib.sha256(sink_url.encode()).hexdigest()[:12]
    return f"{digest}:{table.schema or ''}.{table.name}"
