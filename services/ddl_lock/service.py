"""The ddl-lock leader: pessimistic shard DDL locks (``libs.shard_ddl.lock``) as a service.

While leader it:

- replays the ``ddl`` domain stream into a ``LockKeeper`` (every lock event is recorded there, so
  the replayed keeper is the one the previous leader had), then re-sends every operation that
  has no done yet: a worker deduplicates by operation id and answers one for a DDL it passed
  with its done, and the keeper issues exec once per lock instance, so nothing runs twice;
- follows the changefeeds stream and, every ``ddl_lock_discovery_interval_s``, computes each
  target's shard group from the running changefeeds' routes over the spans in the ROWS stream
  (``discover_spans``), without the shards reported dropped; shards that leave a group (table
  dropped, span gone, changefeed paused or deleted) leave the pending lock;
- handles the workers' reports on ``SHARD_DDL_REPORT_SUBJECT`` (Info, done, dropped shard) and
  the operator commands on ``command_subject("ddl")``, one at a time in one loop: the keeper
  computes the events, they are appended (fenced) to the domain stream, then the operations
  go out on ``shard_ddl_ops_subject(changefeed)``;
- re-sends what has been awaited longer than ``ddl_lock_resend_s`` (an operation without done,
  an Info request to a shard whose Info never came).

Only the leader subscribes, so a command without a leader gets "no responders".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from prometheus_client import Gauge, Histogram

from contracts import REGISTRY, ContractError
from contracts.events import shard_ddl as c
from libs.changefeeds import ChangefeedView, discover_spans
from libs.control.follow import DomainFollower
from libs.election import Leadership
from libs.eventstore import DomainLog, StoredEvent
from libs.routing import AmbiguousRouteError, RoutingConfigError, TableRef, Target, router_for
from libs.service import ServiceRuntime
from libs.shard_ddl.convert import done_of, from_contract, ref_of, target_of, to_contract
from libs.shard_ddl.lock import (
    Info,
    InfoRequest,
    LockActionError,
    LockEvent,
    LockKeeper,
    LockKey,
    LockRemoved,
    LockResolved,
    Operation,
    Outcome,
    UnknownGroupError,
)
from libs.shard_ddl.view import lock_view, parse_span, parse_target
from libs.streams import SHARD_DDL_REPORT_SUBJECT, command_subject, shard_ddl_ops_subject

log = logging.getLogger(__name__)

DOMAIN = "ddl"

LOCKS_PENDING = Gauge("sluice_ddl_locks_pending", "Shard DDL locks not resolved yet.")
SHARDS_BLOCKED = Gauge("sluice_ddl_shards_blocked", "Shards stopped at a DDL, waiting for their operation.")
RESOLVE_SECONDS = Histogram("sluice_ddl_lock_resolve_seconds",
                            "Seconds from a lock's first Info to its resolution.",
                            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800))

_LOCK_EVENT_MODELS = (c.GroupChangedV1, c.LockCreatedV1, c.InfoReceivedV1, c.InfoQueuedV1, c.CaughtUpV1,
                      c.OperationIssuedV1, c.DoneReceivedV1, c.ExecFailedV1, c.ShardLeftV1, c.UnlockedV1,
                      c.LockResolvedV1, c.LockRemovedV1)
_RETURNING = (c.InfoReceivedV1, c.InfoQueuedV1, c.CaughtUpV1)


@dataclass
class DdlState:
    """The folded ddl domain: the keeper and the shards reported dropped (left out of groups
    until they send an Info again, i.e. the table was created again)."""

    keeper: LockKeeper = field(default_factory=LockKeeper)
    dropped: dict[tuple[str, TableRef], int] = field(default_factory=dict)
    live: bool = False
    """Replay done: the leader applies lock events to the keeper itself (``handle_*``), so the
    log's fold must not apply them again."""

    def fold(self, stored: StoredEvent) -> DdlState:
        ev = stored.event
        if isinstance(ev, c.ShardDroppedV1):
            self.dropped[(ev.changefeed, ref_of(ev.span))] = ev.position
            return self
        if isinstance(ev, _RETURNING):
            self.dropped.pop((ev.changefeed, ref_of(ev.span)), None)
        if isinstance(ev, _LOCK_EVENT_MODELS) and not self.live:
            event = from_contract(ev)
            self.keeper.apply(event)  # type: ignore[arg-type]
        return self


def _fold(state: DdlState, stored: StoredEvent) -> DdlState:
    return state.fold(stored)


class CommandError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Item:
    kind: str
    payload: Any
    answer: asyncio.Future[bytes] | None = None


class DdlLockService:
    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.nc = runtime.nc
        self.js = runtime.nc.jetstream()
        self.groups: dict[LockKey, frozenset[TableRef]] = {}
        self.running: set[str] = set()
        self.discovered = False
        """The last discovery succeeded: groups and running changefeeds may be acted on (a
        failed one must not look like every shard leaving)."""

    def make_log(self) -> DomainLog[DdlState]:
        return DomainLog(self.js, DOMAIN, producer=self.runtime.producer, fold=_fold,
                         initial=DdlState(LockKeeper(resend_after=self.settings.ddl_lock_resend_s)),
                         settings=self.settings)

    # -- the term ---------------------------------------------------------------------------------

    async def lead(self, leadership: Leadership, domain_log: DomainLog[Any]) -> None:
        state = domain_log.state
        assert isinstance(state, DdlState)
        state.live = True
        keeper = state.keeper
        items: asyncio.Queue[_Item] = asyncio.Queue()
        changefeeds = DomainFollower(self.js, "changefeeds", _changefeeds_fold, ChangefeedView,
                                     name="ddl_changefeeds", settings=self.settings)
        await changefeeds.load()
        stop = asyncio.Event()
        follow = asyncio.create_task(changefeeds.run(stop), name="follow-changefeeds")

        async def on_report(msg: Msg) -> None:
            try:
                event = REGISTRY.decode(msg.data).event
            except ContractError as exc:
                log.warning("bad shard DDL report: %s", exc)
                if msg.reply:
                    with contextlib.suppress(Exception):
                        await msg.respond(f"refused: {exc}".encode())
                return
            answer: asyncio.Future[bytes] | None = None
            if msg.reply:
                answer = asyncio.get_running_loop().create_future()
            items.put_nowait(_Item("report", event, answer))
            if answer is not None and msg.reply:
                with contextlib.suppress(Exception):
                    await msg.respond(await answer)

        async def on_command(msg: Msg) -> None:
            answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            items.put_nowait(_Item("command", msg.data, answer))
            if msg.reply:
                with contextlib.suppress(Exception):
                    await msg.respond(await answer)

        await self._discover(changefeeds.state)
        reports = await self.nc.subscribe(SHARD_DDL_REPORT_SUBJECT, cb=on_report)
        commands = await self.nc.subscribe(command_subject(DOMAIN), cb=on_command)
        log.info("ddl-lock leading", extra={"epoch": leadership.epoch, "locks": len(keeper.locks)})
        # A new leader re-sends what its predecessor may not have: duplicates are harmless.
        await self._send(keeper.pending_operations())
        last_groups = time.monotonic()
        try:
            while True:
                try:
                    item: _Item | None = await asyncio.wait_for(items.get(), timeout=0.5)
                except TimeoutError:
                    item = None
                now = time.time()
                if item is not None:
                    await self._handle(item, state, domain_log, changefeeds.state, now)
                if time.monotonic() - last_groups >= self.settings.ddl_lock_discovery_interval_s:
                    last_groups = time.monotonic()
                    await self._discover(changefeeds.state)
                    await self._apply_groups(state, domain_log, now)
                await self._send(keeper.due_resends(now))
                self._publish_status(keeper)
        finally:
            stop.set()
            follow.cancel()
            with contextlib.suppress(BaseException):
                await follow
            for sub in (reports, commands):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            while not items.empty():
                left = items.get_nowait()
                if left.answer is not None and not left.answer.done():
                    left.answer.set_result(_error(503, "the ddl-lock leader stepped down; try again"))
            self.runtime.status.pop("ddl_locks", None)

    async def _handle(self, item: _Item, state: DdlState, domain_log: DomainLog[Any], view: ChangefeedView,
                      now: float) -> None:
        keeper = state.keeper
        if item.kind == "command":
            assert item.answer is not None
            try:
                reply = await self._command(item.payload, keeper, domain_log, now)
            except CommandError as exc:
                reply = _error(exc.code, str(exc))
            item.answer.set_result(reply)
            return
        event = item.payload
        if isinstance(event, c.ShardInfoV1):
            info = from_contract(event)
            assert isinstance(info, Info)
            key = info.key
            if info.span not in self.groups.get(key, frozenset()):
                await self._discover(view)
            if info.span not in self.groups.get(key, frozenset()):
                # The changefeed or the span is newer than this leader's view: a lock formed now
                # would not wait for shards it does not know. The worker sends the Info again.
                log.info("info from a shard not in a known group yet; waiting for its re-send",
                         extra={"changefeed": info.changefeed, "target": str(info.target),
                                "span": str(info.span)})
                return
            shards = self.groups[key]
            try:
                outcome = keeper.handle_info(info, now, shards)
            except UnknownGroupError:  # pragma: no cover - shards are always passed
                log.exception("info for an unknown group")
                return
            await self._record(outcome, domain_log)
        elif isinstance(event, c.ShardDoneV1):
            done = done_of(event)
            if event.error is not None:
                outcome = keeper.handle_exec_failed(done, event.error, now)
            else:
                outcome = keeper.handle_done(done, now)
            await self._record(outcome, domain_log)
        elif isinstance(event, c.ShardDroppedV1):
            ref = ref_of(event.span)
            if (event.changefeed, ref) not in state.dropped:
                await domain_log.append(event)  # folds into state.dropped
            outcome = keeper.handle_shard_left(event.changefeed, target_of(event.target), ref,
                                               f"table dropped upstream: {event.reason}"[:500], now)
            await self._record(outcome, domain_log)
            if item.answer is not None:
                item.answer.set_result(b"ok")
            return
        else:
            log.warning("unexpected message on the shard DDL report subject: %s", type(event).__name__)
        if item.answer is not None and not item.answer.done():
            item.answer.set_result(b"ok")

    async def _record(self, outcome: Outcome, domain_log: DomainLog[Any]) -> None:
        """Append the keeper's events (fenced: a deposed leader fails here and steps down
        before it sends anything), then send the operations."""
        for event in outcome.events:
            await domain_log.append(to_contract(event))
            self._observe(event)
        await self._send(outcome.operations)

    def _observe(self, event: LockEvent) -> None:
        if isinstance(event, LockResolved):
            RESOLVE_SECONDS.observe(max(0.0, event.at - event.created_at))
            log.info("shard DDL lock resolved", extra={
                "changefeed": event.changefeed, "target": str(event.target), "instance": event.instance,
                "seconds": round(event.at - event.created_at, 3)})
        elif isinstance(event, LockRemoved):
            log.info("shard DDL lock removed", extra={
                "changefeed": event.changefeed, "target": str(event.target), "instance": event.instance,
                "by": event.by, "reason": event.reason})

    async def _send(self, items: list[Operation] | list[Operation | InfoRequest]) -> None:
        for item in items:
            body = REGISTRY.encode(to_contract(item), producer=self.runtime.producer)
            with contextlib.suppress(Exception):
                await self.nc.publish(shard_ddl_ops_subject(item.changefeed), body)

    # -- shard groups -----------------------------------------------------------------------------

    async def _discover(self, view: ChangefeedView) -> None:
        specs = view.running()
        try:
            found = await discover_spans(self.js, specs)
        except Exception:
            log.warning("span discovery failed", exc_info=True)
            self.discovered = False
            return
        if found.rows_stream_missing:
            self.discovered = False
            return
        routers = {}
        for spec in specs:
            try:
                routers[spec.id] = router_for(spec)
            except RoutingConfigError:
                log.error("changefeed %s has an unreadable route rule", spec.id)
        groups: dict[LockKey, set[TableRef]] = {}
        for (cf, src, db, tbl) in found.spans:
            router = routers.get(cf)
            if router is None:
                continue
            try:
                target = router.route(src, db, tbl) or Target(db, tbl)
            except AmbiguousRouteError as exc:
                log.error("%s", exc)
                continue
            groups.setdefault(LockKey(cf, target), set()).add(TableRef(src, db, tbl))
        self.groups = {k: frozenset(v) for k, v in groups.items()}
        self.running = {spec.id for spec in specs}
        self.discovered = True

    async def _apply_groups(self, state: DdlState, domain_log: DomainLog[Any], now: float) -> None:
        keeper = state.keeper
        if not self.discovered:
            return
        known = {*keeper.groups, *keeper.locks}
        for key in sorted(known):
            if key.changefeed not in self.running:
                outcome = keeper.handle_changefeed_stopped(key.changefeed, "changefeed paused or deleted",
                                                           now)
            else:
                shards = {s for s in self.groups.get(key, frozenset())
                          if (key.changefeed, s) not in state.dropped}
                outcome = keeper.handle_group(key.changefeed, key.target, shards, now,
                                              "left the shard group (span gone)")
            await self._record(outcome, domain_log)

    # -- operator commands ------------------------------------------------------------------------

    async def _command(self, raw: bytes, keeper: LockKeeper, domain_log: DomainLog[Any], now: float) -> bytes:
        try:
            req = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise CommandError(422, "the request is not JSON") from None
        if not isinstance(req, dict):
            raise CommandError(422, "the request must be a JSON object")
        action = req.get("action")
        if action == "list":
            locks = [lock_view(lock) for lock in sorted(keeper, key=lambda lk: lk.key)]
            return _ok({"locks": locks})
        if action not in ("show", "unlock", "force_remove"):
            raise CommandError(422, f"unknown action {action!r}: use list, show, unlock or force_remove")
        changefeed = _text(req, "changefeed")
        try:
            target = parse_target(_text(req, "target"))
        except ValueError as exc:
            raise CommandError(422, str(exc)) from None
        lock = keeper.lock(changefeed, target)
        if action == "show":
            if lock is None:
                raise CommandError(404, f"no shard DDL lock for {changefeed}/{target}")
            return _ok({"lock": lock_view(lock)})
        by, reason = _text(req, "requested_by"), _text(req, "reason")
        if lock is None:
            raise CommandError(404, f"no shard DDL lock for {changefeed}/{target}")
        try:
            if action == "unlock":
                mode = req.get("mode")
                if mode not in ("exec", "skip"):
                    raise CommandError(422, "mode must be 'exec' or 'skip'")
                owner_text = req.get("owner")
                if owner_text is not None and not isinstance(owner_text, str):
                    raise CommandError(422, "owner must be a span name or null")
                try:
                    owner = parse_span(changefeed, owner_text) if owner_text else None
                except ValueError as exc:
                    raise CommandError(422, str(exc)) from None
                outcome = keeper.unlock(changefeed, target, mode, by=by, reason=reason, now=now, owner=owner)
            else:
                outcome = keeper.force_remove(changefeed, target, by=by, reason=reason, now=now)
        except LockActionError as exc:
            raise CommandError(409, str(exc)) from None
        log.info("operator %s", action, extra={"changefeed": changefeed, "target": str(target), "by": by,
                                               "reason": reason})
        await self._record(outcome, domain_log)
        after = keeper.lock(changefeed, target)
        return _ok({"lock": lock_view(after) if after is not None else None})

    def _publish_status(self, keeper: LockKeeper) -> None:
        LOCKS_PENDING.set(len(keeper.locks))
        SHARDS_BLOCKED.set(keeper.blocked_shards())
        self.runtime.status["ddl_locks"] = {
            "pending": len(keeper.locks), "shards_blocked": keeper.blocked_shards(),
            "groups": {str(k): len(v) for k, v in sorted(self.groups.items()) if len(v) > 1},
            "locks": [f"{lk.id}: {lk.phase}" for lk in keeper],
        }


def _changefeeds_fold(view: ChangefeedView, stored: StoredEvent) -> ChangefeedView:
    view.apply(stored.event)
    return view


def _text(req: dict[str, Any], name: str) -> str:
    value = req.get(name)
    if not isinstance(value, str) or not value.strip():
        raise CommandError(422, f"{name} is required (a non-empty string)")
    return value


def _ok(body: dict[str, Any]) -> bytes:
    return json.dumps({"ok": True, **body}).encode()


def _error(code: int, message: str) -> bytes:
    return json.dumps({"ok": False, "code": code, "error": message}).encode()


__all__ = ["DdlLockService", "DdlState"]
