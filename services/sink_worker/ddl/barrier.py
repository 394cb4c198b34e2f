"""What happens at a DDL barrier: a span's batch stops at its first DDL, and the DDL is carried
out (or waited for) before anything after it is written.

- At the head of a span (in the driver, before the round's write): a sharded span's DDL goes
  through shard DDL coordination (``shard_ddl``); a single-shard span's DDL that re-copies its
  table or renamed it away (``ddl_plan``) is carried out here.
- After a batch is written (``after_batch``, in the write's thread): the DDL the batch stopped
  at is applied to the target, or blocks the span (shards), or refuses it (no usable key
  after it), or fails it (``table_errors``).
- The NATS sink publishes the DDL as a message instead (``stream_barrier`` decides whether).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pymysql

from contracts.events.rows import DdlExecutedV1, TableMetaV1
from libs.routing import Router
from libs.table_rules import TableRulesError, rules_for
from services.sink_worker import metrics as m
from services.sink_worker.ddl.plan import ddl_action, dropped_columns
from services.sink_worker.ddl.policy import (
    PolicyDecision,
    decide,
    recopy_drops,
    removes_columns,
    stop_reason,
)
from services.sink_worker.ddl.shard import ShardDdl, execute_on_target, rewritten
from services.sink_worker.ddl.target_schemas import TargetSchemas
from services.sink_worker.incidents.table_errors import ddl_failed
from services.sink_worker.round.pull import PulledEvent
from services.sink_worker.round.sort_job import SpanCut
from services.sink_worker.round.work import SpanWork
from services.sink_worker.sinks.base import Sink, TargetTable
from services.sink_worker.sinks.factory import open_sink, sink_kind
from services.sink_worker.sinks.sql_common import SqlSink
from services.sink_worker.snapshot.initial_load import InitialLoads, SnapshotRequest
from services.sink_worker.span.machine import (
    CarriedOut,
    HeadFailed,
    Recopying,
    Refused,
    SpanOutcome,
    SpanState,
    WaitsAtHead,
)
from services.sink_worker.span.target import KeylessTableError

log = logging.getLogger(__name__)


class DdlBarrier:
    def __init__(self, schemas: TargetSchemas, initial_loads: InitialLoads | None) -> None:
        self.schemas = schemas
        self.initial_loads = initial_loads
        self.shard_ddl: ShardDdl | None = None
        """Shard DDL coordination; without it a sharded target's DDL blocks its spans."""

    async def at_head(self, w: SpanWork) -> None:
        """A planned span whose next event is a DDL the driver carries out (or waits for)."""
        if w.refused:
            return
        if self.shard_ddl is not None and w.rt.shards > 1:
            await self._shard_ddl_at_head(w)
        elif w.rt.shards <= 1 and sink_kind(w.rt.config.sink_url).holds_rows:
            await self._schema_ddl_at_head(w)

    async def _shard_ddl_at_head(self, w: SpanWork) -> None:
        """A sharded span whose next event is a DDL: handled here in the driver, without a
        Spark job (``services.sink_worker.ddl.shard``). Rows before a DDL are applied first by
        the normal round, which stops the span just below the DDL."""
        assert self.shard_ddl is not None
        head = next((e for e in w.fresh if not e.dead), None)
        if head is None or not isinstance(head.event, DdlExecutedV1):
            return
        ddl = head.event
        if head.ts > w.horizon:
            w.fresh = []  # not complete yet: the checkpoint follows the horizon, below the DDL
            return
        span = w.rt.span
        action = ddl_action(ddl)
        decision = self.decide(w, head)
        if decision.do == "stop":
            w.fresh = []
            w.head = Refused(stop_reason(ddl.statement, head.ts), unreplicable=True)
            return
        if decision.do == "skip" and action not in ("drop", "truncate"):
            # Nothing reaches the merged target, so the shards need not agree first.
            w.fresh = []
            m.DDL_APPLIED.labels(span.changefeed, "ignored").inc()
            log.info("DDL not applied: schema_change_policy", extra={
                "span": span.name, "policy": w.rt.config.schema_change_policy, "ts": head.ts})
            w.head = CarriedOut(SpanCut(span.kv_key, limit_ts=head.ts, batch_events=0, batch_max_ts=None,
                                        ddl_ts=head.ts, ddl_id=head.event_id))
            return
        target = self.shard_ddl.lock_target(span)
        if target is None:
            target = w.routes.tokens()
        w.fresh = []
        if action == "drop":
            # One shard's table is gone; the merged target keeps the other shards' rows.
            if not await self.shard_ddl.dropped(span, target, head.stream_seq, ddl.statement):
                w.head = WaitsAtHead("shard dropped upstream; waiting for the ddl-lock leader to record it")
                return
        elif action == "truncate":
            log.warning("TRUNCATE of one shard of a merged target is not replicated (the target "
                        "holds other shards' rows)", extra={"span": span.name, "statement": ddl.statement})
        else:
            ddls = (rewritten(ddl.statement, ddl.database, ddl.table, target),)
            op = await self.shard_ddl.at_ddl(span, target, ddls, head.stream_seq)
            if op is None:
                w.head = WaitsAtHead(f"DDL at ts {head.ts} on a target with {w.rt.shards} upstream "
                                     "shards waits for its shard DDL operation")
                return
            if op.kind == "exec" and not self.shard_ddl.already_carried(op):
                try:
                    await asyncio.to_thread(self._exec_shard_ddl, w, ddl, op.ddls, decision)
                except Exception as exc:
                    m.ROUND_ERRORS.labels("ddl").inc()
                    log.exception("shard DDL exec failed",
                                  extra={"span": span.name, "statement": ddl.statement})
                    await self.shard_ddl.carried_out(op, error=repr(exc))
                    w.head = WaitsAtHead(f"shard DDL exec failed (retried): {exc!r}")
                    return
            await self.shard_ddl.carried_out(op)
            if ddl.meta_after is None:
                # Every span of the group, not only the owner: the lock has resolved, so each
                # one's next rows carry the shape after the DDL, and a span that skipped it must
                # not wait, failing, for the owner's next rows to bring the target's columns (the
                # owner may be stopped at the group's next DDL, which waits for this span).
                self.schemas.reconcile_next(span.kv_key)
            log.info("shard DDL carried out", extra={"span": span.name, "kind": op.kind, "ts": head.ts,
                                                     "statement": ddl.statement})
        w.head = CarriedOut(SpanCut(span.kv_key, limit_ts=head.ts, batch_events=0, batch_max_ts=None,
                                    ddl_ts=head.ts, ddl_id=head.event_id))

    async def _schema_ddl_at_head(self, w: SpanWork) -> None:
        """A single-shard span whose next event is a DDL that re-copies its table or renamed it
        away (``ddl_plan``): carried out here in the driver. The rows before the DDL were
        applied by the normal round, which stopped the span just below it.

        - ``leave``: the name's target is dropped and the span moves past the DDL.
        - ``recopy``: the initial-load machinery copies the table into an emptied target; the
          progress is recorded under the DDL's stream sequence, so a worker that takes the span
          over (crash, move) finds the same DDL at the head and runs the same copy again, from
          the start (``InitialLoads._prepare``: the source's shape may have moved on). Once it
          is done, the checkpoint moves to the copy's low watermark (at or past the DDL) and
          the span streams on from there, as after an initial load.
        """
        head = next((e for e in w.fresh if not e.dead), None)
        if head is None or not isinstance(head.event, DdlExecutedV1) or head.ts > w.horizon:
            return
        ddl = head.event
        action = ddl_action(ddl)
        if action not in ("recopy", "leave") or self.decide(w, head).do != "apply":
            return  # after the batch (``after_batch``), as the policy says
        rt, span = w.rt, w.rt.span
        url = rt.config.sink_url
        routed = w.routes.route(ddl.database, ddl.table)
        self.schemas.forget(url, routed.schema, routed.table)
        w.fresh = []

        def failed(reason: str) -> None:
            failure = ddl_failed(span, ddl.statement, head.ts, head.stream_seq, reason, rt.ddl_error)
            w.head = HeadFailed(failure)

        if action == "leave":
            table = TargetTable(schema=routed.schema, name=routed.table,
                                meta=TableMetaV1(columns=[], primary_key=[]), key=())
            try:
                await asyncio.to_thread(lambda: open_sink(url).drop_table(table))
            except Exception as exc:
                m.ROUND_ERRORS.labels("ddl").inc()
                failed(f"dropping the target of a table renamed away failed: {type(exc).__name__}: {exc}")
                return
            m.DDL_APPLIED.labels(span.changefeed, action).inc()
            log.info("table renamed away upstream: its target is dropped",
                     extra={"span": span.name, "ts": head.ts, "statement": ddl.statement})
            w.head = CarriedOut(SpanCut(span.kv_key, limit_ts=head.ts, batch_events=0, batch_max_ts=None,
                                        ddl_ts=head.ts, ddl_id=head.event_id))
            return
        if self.initial_loads is None or not rt.config.source_url:
            failed("the DDL changes existing rows upstream, so the table must be copied again, but "
                   "this worker has no initial-load runner or no source URL for it")
            return
        drops = recopy_drops(ddl)
        request = SnapshotRequest(span, rt.config.source_url, url, rt.config.key_policy, "snapshot",
                                  rt.shards, rt.config.router, recopy_of=head.stream_seq,
                                  case_insensitive=rt.config.case_insensitive,
                                  recopy_drops=drops,
                                  keep_target=rt.config.schema_change_policy == "lenient")
        decision, start = await self.initial_loads.decide(request)
        if decision == "unreplicable":
            # The re-copy cannot copy the table as the changefeed says: stopped at the DDL.
            w.head = Refused(self.initial_loads.unreplicable.pop(span, "the re-copy was refused"),
                             unreplicable=True)
            return
        if decision == "copying" or start is None:
            if rt.state is not SpanState.SNAPSHOT:
                log.info("DDL changes existing rows: copying the table again",
                         extra={"span": span.name, "ts": head.ts, "statement": ddl.statement})
            w.head = Recopying()
            return
        try:
            restored = await asyncio.to_thread(_restore_kept, url, routed.schema, routed.table)
        except Exception as exc:
            m.ROUND_ERRORS.labels("ddl").inc()
            failed("putting back the target's own columns after the re-copy failed: "
                   f"{type(exc).__name__}: {exc}")
            return
        if restored:
            log.info("re-copy: the target's own columns have their values back",
                     extra={"span": span.name, "rows": restored})
        resume_ts = max(head.ts, start.ts)
        m.DDL_APPLIED.labels(span.changefeed, action).inc()
        log.info("re-copy after DDL done; streaming on from its low watermark",
                 extra={"span": span.name, "ddl_ts": head.ts, "low_watermark_ts": start.ts})
        w.head = CarriedOut(SpanCut(span.kv_key, limit_ts=resume_ts, batch_events=0, batch_max_ts=None,
                                    ddl_ts=resume_ts, ddl_id=head.event_id), request.progress_key)

    def _exec_shard_ddl(self, w: SpanWork, ddl: DdlExecutedV1, statements: tuple[str, ...],
                        decision: PolicyDecision) -> None:
        """The owner brings the target to the shard's schema after the DDL
        (``shard_ddl.execute_on_target``: idempotent, a re-run counts as done)."""
        drop = dropped_columns(ddl.statement)
        if decision.keep_columns and (decision.renamed or removes_columns(ddl.statement)):
            statements = ()  # lenient: the text would drop; the reconcile keeps and adds
        if ddl.meta_after is None:
            # Capture read this DDL behind a later one of the table, so it sent no shape (never
            # a later one). A MySQL-family target still runs the statements (indexes, defaults);
            # the columns follow the span's next batch, whose rows carry their own shape.
            target = open_sink(w.rt.config.sink_url).statement_target()
            if target is not None:
                for sql in statements:
                    try:
                        target.execute_ddl(sql)
                    except pymysql.err.MySQLError as exc:
                        log.warning("shard DDL without table metadata failed on the target; its "
                                    "columns follow the next batch", extra={
                                        "span": w.rt.span.name, "statement": sql, "error": repr(exc)})
            log.info("shard DDL without table metadata: the target follows the next batch's rows",
                     extra={"span": w.rt.span.name, "statement": ddl.statement})
            return
        url = w.rt.config.sink_url
        table = w.routes.target(ddl.database, ddl.table, ddl.meta_after)
        self.schemas.forget(url, table.schema, table.name)
        sink = open_sink(url)
        already = execute_on_target(sink, table, statements, drop)
        if decision.renamed:
            fill_renamed(sink, table, decision.renamed)
        if already:
            log.info("shard DDL was already applied on the target: counted as done",
                     extra={"span": w.rt.span.name, "statements": already})
        self.schemas.brought_to(url, table)
        m.DDL_APPLIED.labels(w.rt.span.changefeed, "reconcile").inc()

    def after_batch(self, sink: Sink, sink_url: str, w: SpanWork, cut: SpanCut, outcome: SpanOutcome,
                    abort: threading.Event) -> None:
        """The DDL a written batch stopped at, on a SQL sink (in the write's thread)."""
        if cut.ddl_id is None:
            return
        ddl = next(e for e in w.fresh if e.event_id == cut.ddl_id)
        if abort.is_set():
            return  # the round is being abandoned: nothing more is written
        if not self.keys_pass(w, ddl, outcome):
            return
        assert isinstance(ddl.event, DdlExecutedV1)
        if w.rt.shards > 1:
            outcome.blocked = shards_wait(ddl.ts, w.rt.shards)
            return
        decision = self.policy_gate(w, ddl, outcome)
        if decision is None:
            return
        if decision.do == "apply" and decision.action in ("recopy", "leave"):
            return  # carried out at the head of the span next round (_schema_ddl_at_head)
        try:
            self.apply_ddl(sink, sink_url, w, ddl.event, decision)
            outcome.ddl_applied = True
        except (KeylessTableError, TableRulesError) as exc:
            outcome.refused = str(exc)
        except Exception as exc:
            m.ROUND_ERRORS.labels("ddl").inc()
            log.debug("DDL failed", exc_info=True, extra={"span": w.rt.span.name})
            outcome.ddl_failure = ddl_failed(w.rt.span, ddl.event.statement, ddl.ts, ddl.stream_seq,
                                             f"{type(exc).__name__}: {exc}", w.rt.ddl_error)
            outcome.error = outcome.ddl_failure.message()

    @staticmethod
    def keys_pass(w: SpanWork, ddl: PulledEvent, outcome: SpanOutcome) -> bool:
        """Whether the span goes on to carry out the DDL it stopped at: not when it changes the
        span's foreign-key group (``fk_barrier``: the span stays before it, blocked); a parent's
        ``foreign_keys.changed`` it passes is done (nothing to apply)."""
        if w.fk_wait is not None and w.fk_wait[0] == ddl.event_id:
            outcome.blocked = w.fk_wait[1]
            return False
        if not isinstance(ddl.event, DdlExecutedV1):
            outcome.ddl_applied = True
            return False
        return True

    def group_ddl(self, sink: Sink, sink_url: str, w: SpanWork, ddl: PulledEvent,
                  outcome: SpanOutcome) -> None:
        """The DDL a table group's written batch stopped at (``table_group``)."""
        if not self.keys_pass(w, ddl, outcome):
            return
        assert isinstance(ddl.event, DdlExecutedV1)
        decision = self.policy_gate(w, ddl, outcome)
        if decision is None:
            return
        if decision.do == "apply" and decision.action in ("recopy", "leave"):
            outcome.blocked = (f"DDL at ts {ddl.ts} ({ddl.event.statement!r}) would re-copy a table "
                               "of a foreign-key group, which is not built yet")
            return
        self.apply_ddl(sink, sink_url, w, ddl.event, decision)
        metas = w.rt.group_metas
        metas.pop((ddl.event.database, ddl.event.table), None)
        if ddl.event.meta_after is not None:
            metas[(ddl.event.database, ddl.event.table)] = ddl.event.meta_after
        outcome.ddl_applied = True

    @staticmethod
    def stream_barrier(w: SpanWork, cut: SpanCut, outcome: SpanOutcome) -> PulledEvent | None:
        """NATS sink: the DDL the batch stopped at when it is to be published after the batch
        (None: no DDL, a sharded target's DDL that blocks the span, or one the rules leave out)."""
        if cut.ddl_id is None:
            return None
        ddl = next(e for e in w.fresh if e.event_id == cut.ddl_id)
        if not isinstance(ddl.event, DdlExecutedV1):
            outcome.ddl_ignored = True  # a parent's foreign-key change: nothing to publish
            return None
        if w.rt.shards > 1:
            outcome.blocked = shards_wait(cut.ddl_ts, w.rt.shards)
            return None
        if ddl_ignored(w, ddl):
            outcome.ddl_ignored = True
            return None
        return ddl

    @staticmethod
    def decide(w: SpanWork, e: PulledEvent) -> PolicyDecision:
        """What the DDL ``e`` becomes under the changefeed's ``schema_change_policy``."""
        assert isinstance(e.event, DdlExecutedV1)
        policy = w.rt.config.schema_change_policy
        released = policy == "stop" and w.rt.ddl_released(e.ts, e.stream_seq)
        return decide(policy, ddl_action(e.event), e.event.statement, released=released,
                      has_meta=e.event.meta_after is not None)

    def policy_gate(self, w: SpanWork, e: PulledEvent, outcome: SpanOutcome) -> PolicyDecision | None:
        """The policy's decision on the DDL a batch stopped at; None when the policy already
        settled it: ``skip`` moves past it untouched, ``stop`` stops the table below it with an
        incident (``SpanMachine.written``: a refusal)."""
        assert isinstance(e.event, DdlExecutedV1)
        decision = self.decide(w, e)
        if decision.do == "stop":
            outcome.refused = stop_reason(e.event.statement, e.ts)
            return None
        if decision.do == "skip":
            m.DDL_APPLIED.labels(w.rt.span.changefeed, "ignored").inc()
            log.info("DDL not applied: schema_change_policy", extra={
                "span": w.rt.span.name, "policy": w.rt.config.schema_change_policy,
                "action": decision.action, "ts": e.ts})
            outcome.ddl_applied = True
            return None
        return decision

    def apply_ddl(self, sink: Sink, sink_url: str, w: SpanWork, ddl: DdlExecutedV1,
                  decision: PolicyDecision | None = None) -> None:
        action = ddl_action(ddl) if decision is None else decision.action
        if rules_ignore_ddl(w.rt.config.router, ddl, action):
            m.DDL_APPLIED.labels(w.rt.span.changefeed, "ignored").inc()
            log.info("DDL left out by the changefeed's table rules",
                     extra={"span": w.rt.span.name, "action": action, "ts": ddl.ts})
            return
        routed = w.routes.route(ddl.database, ddl.table)
        if action == "reconcile":
            assert ddl.meta_after is not None
            table = w.routes.target(ddl.database, ddl.table, ddl.meta_after)
            self.schemas.forget(sink_url, routed.schema, routed.table)
            sink.ensure_table(table)
            sink.reconcile_schema(table, dropped_columns(ddl.statement))
            if decision is not None and decision.renamed:
                fill_renamed(sink, table, decision.renamed)
            self.schemas.brought_to(sink_url, table)
        elif action in ("drop", "truncate"):
            # Only the name matters to drop/truncate; the metadata may be gone with the table.
            meta = ddl.meta_after or TableMetaV1(columns=[], primary_key=[])
            table = TargetTable(schema=routed.schema, name=routed.table, meta=meta, key=())
            self.schemas.forget(sink_url, routed.schema, routed.table)
            if action == "drop":
                sink.drop_table(table)
            else:
                sink.truncate_table(table)
        else:
            # The span's next batch brings the target's columns to its rows' metadata; the
            # columns this DDL drops go then (the target's own columns stay).
            self.schemas.drop_next(sink_url, routed.schema, routed.table, dropped_columns(ddl.statement))
            log.warning("DDL without table metadata: the target follows the next batch's rows",
                        extra={"span": w.rt.span.name, "statement": ddl.statement})
        m.DDL_APPLIED.labels(w.rt.span.changefeed, action).inc()
        log.info("DDL applied", extra={"span": w.rt.span.name, "action": action, "ts": ddl.ts,
                                       "statement": ddl.statement})


def _restore_kept(url: str, schema: str | None, name: str) -> int:
    """After a re-copy that kept its target (``initial_load.empty_for_recopy``): the values of
    the target's columns the source lacks, saved before it was emptied, go back."""
    sink = open_sink(url)
    if not isinstance(sink, SqlSink):
        return 0
    return sink.restore_columns(TargetTable(schema=schema, name=name,
                                            meta=TableMetaV1(columns=[], primary_key=[]), key=()))


def shards_wait(ts: int | None, shards: int) -> str:
    return f"DDL at ts {ts} on a target with {shards} upstream shards waits for shard DDL coordination"


_IGNORABLE_DDL = {"drop": "drop table", "truncate": "truncate"}


def rules_ignore_ddl(router: Router | None, ddl: DdlExecutedV1, action: str) -> bool:
    """A TRUNCATE or DROP TABLE the table's rules leave out (``ignore_events``)."""
    kind = _IGNORABLE_DDL.get(action)
    if kind is None or router is None or not router.table_rules:
        return False
    try:
        return rules_for(router.table_rules, ddl.database, ddl.table).ignores(kind)
    except TableRulesError:
        return False


def ddl_ignored(w: SpanWork, e: PulledEvent) -> bool:
    return isinstance(e.event, DdlExecutedV1) and rules_ignore_ddl(w.rt.config.router, e.event,
                                                                     ddl_action(e.event))


def fill_renamed(sink: Sink, table: TargetTable, renamed: tuple[tuple[str, str], ...]) -> None:
    """lenient: the renamed columns' new columns take the old ones' values (kept beside them)."""
    if not isinstance(sink, SqlSink):
        raise TypeError("a column rename under schema_change_policy = lenient needs a SQL sink, "
                        f"not {sink!r}")
    sink.fill_renamed(table, renamed)
