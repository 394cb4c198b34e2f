"""A span's routes for one round: each table's route, target and origin value worked out once,
so the plan, the DDL barriers and the writers read the same target instead of routing again."""

from __future__ import annotations

from dataclasses import replace

from contracts.events.rows import TableMetaV1
from libs.routing import Router, Target
from libs.scheduling.model import Span
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.span.runtime import SpanConfig
from services.sink_worker.span.target import route_of, shard_ref, target_for


class SpanRoutes:
    """The routes of one span's tables for one round (the changefeed's router does not change
    within a round): each table's route, target and origin value is worked out once."""

    def __init__(self, span: Span, config: SpanConfig) -> None:
        self.span = span
        self.config = config
        self._routes: dict[tuple[str, str], Target] = {}
        self._targets: list[tuple[str, str, TableMetaV1, TargetTable]] = []
        self._origins: dict[tuple[str, str], tuple[str, str] | None] = {}

    def route(self, database: str, table: str) -> Target:
        """Where the table's rows land (``span.route_of``)."""
        found = self._routes.get((database, table))
        if found is None:
            found = self._routes[(database, table)] = route_of(self.span, database, table,
                                                               self.config.router)
        return found

    def target(self, database: str, table: str, meta: TableMetaV1) -> TargetTable:
        """The table's target with this metadata (``span.target_for``): raises
        ``KeylessTableError`` when the key policy allows no key."""
        for d, t, known, target in self._targets:
            if (d, t) == (database, table) and (known is meta or known == meta):
                return target
        target = target_for(self.span, database, table, meta, self.config.key_policy, self.config.router,
                            case_insensitive=self.config.case_insensitive)
        policy = self.config.schema_change_policy
        if policy in ("lenient", "ignore"):
            target = replace(target, keep_columns=policy == "lenient", leave_out_columns=policy == "ignore")
        self._targets.append((database, table, meta, target))
        return target

    def origin(self, database: str, table: str) -> tuple[str, str] | None:
        """The origin column's name and this span's value, when the table's rows carry one."""
        if (database, table) not in self._origins:
            self._origins[(database, table)] = origin_of(self.span, self.config.router, database, table)
        return self._origins[(database, table)]

    def tokens(self) -> Target:
        """The span's target by its subject tokens (``route_tokens``)."""
        return route_tokens(self.span, self.config.router)


def origin_of(span: Span, router: Router | None, database: str, table: str) -> tuple[str, str] | None:
    if router is None:
        return None
    ref = shard_ref(span, database, table)
    origin = router.origin_for(ref)
    return (origin.name, origin.value(ref)) if origin is not None else None


def route_tokens(span: Span, router: Router | None) -> Target:
    """The span's target by its subject tokens (how spans are discovered and shard groups
    formed, in this worker and in the ddl-lock alike)."""
    try:
        return route_of(span, span.database, span.table, router)
    except ValueError:  # ambiguous routes: refused at creation, counted on its own here
        return Target(span.database, span.table)
