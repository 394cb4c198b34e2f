"""What this process last brought each target table's schema to, so a round does not alter a
target again for every batch.

Forgotten whenever the target may have changed behind it (a DDL, a failed apply): the next batch
checks the target's schema again instead of trusting this memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.sink_worker.ddl.policy import as_target_has
from services.sink_worker.sinks.base import Sink, TargetTable
from services.sink_worker.sinks.sql_common import SqlSink

log = logging.getLogger(__name__)


class TargetSchemas:
    def __init__(self) -> None:
        # (sink url, schema, table) -> meta JSON the target was last brought to by this process.
        self._known: dict[tuple[str, str | None, str], str] = {}
        # Spans (kv keys) whose next batch brings a shard-merged target's columns to its rows:
        # their shard DDL came without metadata (capture read it behind a later DDL).
        self._reconcile_next: set[str] = set()
        # (sink url, schema, table) -> the target's column names (``fixed``: never altered).
        self._columns: dict[tuple[str, str | None, str], list[str]] = {}
        # (sink url, schema, table) -> columns a DDL without metadata dropped: the next
        # reconcile drops them (``drop_next``).
        self._drops: dict[tuple[str, str | None, str], set[str]] = {}

    def ensure(self, sink: Sink, sink_url: str, table: TargetTable, *, reconcile: bool) -> None:
        """Create the target from the source schema when missing, and bring its columns to the
        batch's metadata (idempotent; skipped while this process knows it is done).

        Reconciling to the batch's metadata makes a replay from an older checkpoint converge:
        the target goes back to the schema those rows were written with, and the DDL after
        them moves it forward again. Only columns a DDL dropped are dropped (``drop_next``):
        the others a target has beyond the metadata are its own (an operator's extra columns),
        used as they are. Targets fed by several shards only get created here:
        shards may be at different schema versions, and reconciling to each in turn would
        flip columns back and forth (their DDL goes through the ddl-lock).
        """
        cache_key = (sink_url, table.schema, table.name)
        meta_json = table.meta.model_dump_json()
        if cache_key in self._known and (self._known[cache_key] == meta_json or not reconcile):
            return
        if reconcile:
            # Creates the table when it is missing too: one connection, not two, for each table
            # a round meets first (a thousand of them after a start, each a new connection).
            sink.reconcile_schema(table, sorted(self._drops.get(cache_key, ())))
            self._drops.pop(cache_key, None)
        else:
            sink.ensure_table(table)
        self._known[cache_key] = meta_json

    def settle(self, sink: Sink, sink_url: str, tables: Sequence[TargetTable]) -> None:
        """Before a round's ``ensure`` of ``tables``: those this process does not know yet that
        the sink finds settled in bulk (``Sink.settled_schemas``) are known from now on, so
        their ``ensure`` does nothing. Worth it from two tables on (one connection either way);
        a target with columns to drop is left to its own reconcile. A failed check only leaves
        every table to its own ``ensure``."""
        unknown: dict[tuple[str, str | None, str], tuple[TargetTable, str]] = {}
        for t in tables:
            key, meta_json = (sink_url, t.schema, t.name), t.meta.model_dump_json()
            if key not in self._drops and self._known.get(key) != meta_json:
                unknown[key] = (t, meta_json)
        if len(unknown) < 2:
            return
        try:
            settled = sink.settled_schemas([t for t, _ in unknown.values()])
        except Exception:
            log.warning("checking the targets' schemas in bulk failed; each is checked on its own",
                        exc_info=True)
            return
        for key, (t, meta_json) in unknown.items():
            if (t.schema, t.name) in settled:
                self._known[key] = meta_json

    def fixed(self, sink: SqlSink, sink_url: str, table: TargetTable) -> TargetTable:
        """``schema_change_policy = ignore``: create the target when missing, never alter it, and
        return ``table`` as the target's columns hold it (``ddl.policy.as_target_has``)."""
        cache_key = (sink_url, table.schema, table.name)
        names = self._columns.get(cache_key)
        if names is None:
            sink.ensure_table(table)
            names = self._columns[cache_key] = sink.target_columns(table) or []
        return as_target_has(table, names)

    def drop_next(self, sink_url: str, schema: str | None, name: str, columns: Sequence[str]) -> None:
        """A DDL without metadata (capture read it behind a later DDL) dropped ``columns``: the
        target's next reconcile (its next batch) drops them. Kept in memory only: after a
        restart they stay, as the target has them, until an operator drops them (a NOT NULL
        one without a default then fails the table's writes, visibly)."""
        if columns:
            self._drops.setdefault((sink_url, schema, name), set()).update(columns)
        self.forget(sink_url, schema, name)

    def forget(self, sink_url: str, schema: str | None, name: str) -> None:
        self._known.pop((sink_url, schema, name), None)
        self._columns.pop((sink_url, schema, name), None)

    def brought_to(self, sink_url: str, table: TargetTable) -> None:
        """The target now has ``table``'s schema (a DDL carried out on it)."""
        self._known[(sink_url, table.schema, table.name)] = table.meta.model_dump_json()

    def reconcile_next(self, span_key: str) -> None:
        """The span's next batch reconciles its (shard-merged) target to the batch's metadata:
        every shard has passed the DDL by then (the lock resolved), so no column flips back."""
        self._reconcile_next.add(span_key)

    def take_reconcile(self, span_key: str) -> bool:
        if span_key in self._reconcile_next:
            self._reconcile_next.discard(span_key)
            return True
        return False

    def clear(self) -> None:
        self._known.clear()
        self._columns.clear()
