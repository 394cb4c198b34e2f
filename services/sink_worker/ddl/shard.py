"""The worker side of shard DDL coordination (``libs.shard_ddl.lock`` describes the protocol).

A span whose target has several shards (its shard group, from the changefeed's routes over the
spans in the ROWS stream) does not apply a DDL by itself. The pipeline stops it just before the
DDL, and this module:

- sends the span's ``Info`` to the ddl-lock leader (``SHARD_DDL_REPORT_SUBJECT``), again every
  ``shard_ddl_info_resend_s`` while no operation came and at once when the leader asks;
- keeps the operations the leader broadcasts for the changefeed (``shard_ddl_ops_subject``);
  the pipeline carries out the one for the position its span is stopped at (exec: bring the
  target to the DDL; skip: nothing) and ``carried`` reports the done;
- answers an operation it carried out already, or one for a DDL its span has passed (a done
  that was lost, a leader that changed), with the done again and nothing else;
- reports a shard whose table was dropped upstream (request/reply: the span stays at the drop
  until the leader has recorded it, so the group cannot wait for that shard forever).

Spans are named by their subject tokens (``lock_ref``) here and in the ddl-lock, which computes
the groups from the same discovery.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import pymysql
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel

from contracts import REGISTRY, ContractError
from contracts.events.changefeeds import ChangefeedSpec
from contracts.events.shard_ddl import ShardDroppedV1, ShardInfoRequestV1, ShardOperationV1
from libs.changefeeds import discover_spans
from libs.routing import AmbiguousRouteError, RoutingConfigError, TableRef, Target, router_for
from libs.scheduling.model import Span
from libs.shard_ddl.convert import (
    done_contract,
    from_contract,
    ref_of,
    shard_ref,
    target_ref,
    to_contract,
)
from libs.shard_ddl.lock import Done, Info, Operation
from libs.shard_ddl.rerun import (
    ColumnDef,
    DDLRewriteError,
    RerunVerdict,
    TableShape,
    check_applied,
    rewrite_for_target,
)
from libs.streams import ROWS_STREAM, SHARD_DDL_OPS_SUBJECTS, SHARD_DDL_REPORT_SUBJECT
from services.sink_worker.ddl.plan import dropped_columns
from services.sink_worker.sinks.base import Sink, TargetTable

log = logging.getLogger(__name__)

SpanKey = tuple[str, TableRef]
Passed = Callable[[str, TableRef], int | None]
"""(changefeed, shard) -> the stream sequence its span has applied up to, when this worker runs it."""

_CARRIED_KEPT = 4096


def lock_ref(span: Span) -> TableRef:
    return TableRef(span.source, span.database, span.table)


def rewritten(statement: str, database: str, table: str, target: Target) -> str:
    """The DDL as the target sees it (compared across shards by the lock); the original text
    when the rewriter cannot read it (the lock still compares it, canonicalised)."""
    try:
        return rewrite_for_target(statement, schema=database, table=table, target_schema=target.schema,
                                  target_table=target.table)
    except DDLRewriteError:
        return statement


def execute_on_target(sink: Sink, table: TargetTable, statements: Sequence[str],
                      drop: Sequence[str] | None = None) -> list[str]:
    """The owner's exec: bring the target to ``table`` (the shard's metadata after the DDL).

    MySQL/MariaDB targets run the DDL text rewritten to the target first, so what the metadata
    does not show (indexes, defaults, comments) reaches the target too; a statement that fails
    is checked with re-run detection against the target as it is, and "already applied" (a
    crash between executing and reporting done) counts as done, "unknown" fails the exec for an
    operator to look at. Every sink then reconciles the columns to the metadata, which is
    idempotent, dropping only the columns the DDL drops (``drop``; default: those the
    statements drop), so the target's own columns stay. Returns what was recognised as already
    applied."""
    already: list[str] = []
    target = sink.statement_target()
    if target is not None:
        for sql in statements:
            try:
                target.execute_ddl(sql)
            except pymysql.err.MySQLError as exc:
                columns, indexes = target.table_shape(table)
                shape = TableShape([ColumnDef(n, t, null) for n, t, null in columns], indexes)
                check = check_applied(sql, shape)
                if check.verdict != RerunVerdict.ALREADY_APPLIED:
                    raise RuntimeError(f"{exc!r}; re-run check: {check.verdict} ({check.reason})") from exc
                already.append(sql)
    if drop is None:
        drop = [c for sql in statements for c in dropped_columns(sql)]
    sink.ensure_table(table)
    sink.reconcile_schema(table, drop)
    return already


class ShardDdl:
    def __init__(self, nc: Client, *, producer: str,
                 specs: Callable[[], list[ChangefeedSpec]] = list,
                 info_resend_s: float = 5.0, discovery_interval_s: float = 2.0,
                 rows_stream: str = ROWS_STREAM) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.producer = producer
        self.specs = specs
        self.info_resend_s = info_resend_s
        self.discovery_interval_s = discovery_interval_s
        self.rows_stream = rows_stream
        self.passed: Passed = lambda _cf, _ref: None
        self.ops: dict[SpanKey, Operation] = {}
        self.sent: dict[SpanKey, tuple[Info, float]] = {}
        self.requested: set[SpanKey] = set()
        self.carried: OrderedDict[str, Done] = OrderedDict()
        self.groups: dict[tuple[str, Target], frozenset[TableRef]] = {}
        self.targets: dict[SpanKey, Target] = {}
        self.groups_at: float | None = None
        self._sub: Subscription | None = None
        self.infos_sent = 0

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(SHARD_DDL_OPS_SUBJECTS, cb=self._on_message)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                log.debug("unsubscribe failed", exc_info=True)
            self._sub = None

    # -- shard groups -----------------------------------------------------------------------------

    async def refresh_if_due(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and self.groups_at is not None and now - self.groups_at < self.discovery_interval_s:
            return
        specs = self.specs()
        found = await discover_spans(self.js, specs, self.rows_stream)
        groups: dict[tuple[str, Target], set[TableRef]] = {}
        targets: dict[SpanKey, Target] = {}
        routers = {}
        for spec in specs:
            try:
                routers[spec.id] = router_for(spec)
            except RoutingConfigError:
                log.error("changefeed %s has an unreadable route rule", spec.id, exc_info=True)
        for (cf, src, db, tbl) in found.spans:
            router = routers.get(cf)
            if router is None:
                continue
            try:
                target = router.route(src, db, tbl) or Target(db, tbl)
            except AmbiguousRouteError:
                log.error("ambiguous route", exc_info=True)
                continue
            ref = TableRef(src, db, tbl)
            targets[(cf, ref)] = target
            groups.setdefault((cf, target), set()).add(ref)
        self.groups = {k: frozenset(v) for k, v in groups.items()}
        self.targets = targets
        self.groups_at = now

    def group_size(self, span: Span) -> int | None:
        """How many shards the span's target has; None before the first discovery."""
        if self.groups_at is None:
            return None
        target = self.targets.get((span.changefeed, lock_ref(span)))
        if target is None:
            return None
        return len(self.groups.get((span.changefeed, target), ()))

    def lock_target(self, span: Span) -> Target | None:
        return self.targets.get((span.changefeed, lock_ref(span)))

    # -- the protocol -----------------------------------------------------------------------------

    async def at_ddl(self, span: Span, target: Target, ddls: tuple[str, ...],
                     position: int) -> Operation | None:
        """The span is stopped before the DDL at ``position``: its operation once it came, else
        None (the Info is sent, or re-sent when due)."""
        ref = lock_ref(span)
        key = (span.changefeed, ref)
        op = self.ops.get(key)
        if op is not None and op.position == position:
            return op
        now = time.monotonic()
        last = self.sent.get(key)
        if (last is None or last[0].position != position or now - last[1] >= self.info_resend_s
                or key in self.requested):
            info = Info(span.changefeed, target, ref, ddls, position)
            await self._publish(to_contract(info))
            self.sent[key] = (info, now)
            self.requested.discard(key)
            self.infos_sent += 1
            log.info("shard DDL info sent", extra={"span": span.name, "position": position,
                                                   "target": str(target)})
        return None

    async def carried_out(self, op: Operation, error: str | None = None) -> None:
        """Report the operation's done (``error``: the exec failed; it stays to be retried)."""
        await self._publish(done_contract(op.done(), error))
        if error is not None:
            return
        key = (op.changefeed, op.span)
        self.carried[op.id] = op.done()
        while len(self.carried) > _CARRIED_KEPT:
            self.carried.popitem(last=False)
        if self.ops.get(key) == op:
            del self.ops[key]
        self.sent.pop(key, None)

    def already_carried(self, op: Operation) -> bool:
        return op.id in self.carried

    async def dropped(self, span: Span, target: Target, position: int, reason: str) -> bool:
        """Tell the leader the shard's table is gone; True once it recorded that."""
        msg = ShardDroppedV1(changefeed=span.changefeed, target=target_ref(target),
                             span=shard_ref(lock_ref(span)), position=position, reason=reason)
        try:
            answer = await self.nc.request(SHARD_DDL_REPORT_SUBJECT,
                                           REGISTRY.encode(msg, producer=self.producer), timeout=2.0)
        except Exception as exc:
            log.warning("no ddl-lock leader recorded the dropped shard yet: %r", exc,
                        extra={"span": span.name})
            return False
        return answer.data == b"ok"

    async def _publish(self, model: BaseModel) -> None:
        await self.nc.publish(SHARD_DDL_REPORT_SUBJECT, REGISTRY.encode(model, producer=self.producer))

    async def _on_message(self, msg: Msg) -> None:
        try:
            event = REGISTRY.decode(msg.data).event
        except ContractError as exc:
            log.warning("undecodable shard DDL message: %s", exc)
            return
        if isinstance(event, ShardInfoRequestV1):
            self.requested.add((event.changefeed, ref_of(event.span)))
            return
        if not isinstance(event, ShardOperationV1):
            return
        op = from_contract(event)
        assert isinstance(op, Operation)
        key = (op.changefeed, op.span)
        if op.id in self.carried:
            await self._publish(done_contract(op.done()))  # our done was lost
            waiting = self.sent.get(key)
            if waiting is not None and waiting[0].position == op.position:
                # The span met that DDL again (its checkpoint was rewound): let it pass; an
                # exec is not run again (``already_carried``).
                self.ops[key] = op
            return
        passed = self.passed(op.changefeed, op.span)
        if passed is not None and passed >= op.position:
            await self._publish(done_contract(op.done()))  # a DDL this span is past already
            return
        current = self.ops.get(key)
        if current is None or current.position <= op.position:
            self.ops[key] = op

    def blocked(self) -> int:
        return len(self.sent)


__all__ = ["ShardDdl", "execute_on_target", "lock_ref", "rewritten"]
