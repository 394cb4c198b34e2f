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
  the operator commands (``shard_ddl.command``) on ``command_subject("ddl")``, one at a time in
  one loop: the keeper computes the events, they are appended (fenced) to the domain stream,
  then the operations go out on ``shard_ddl_ops_subject(changefeed)``;
- re-sends what has been awaited longer than ``ddl_lock_resend_s`` (an operation without done,
  an Info request to a shard whose Info never came).

Only the leader subscribes, so a command without a leader gets "no responders".
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from prometheus_client import Gauge, Histogram
from pydantic import BaseModel, ValidationError

from contracts import REGISTRY, ContractError
from contracts.events import shard_ddl as c
from contracts.events.changefeeds import ChangefeedSpec
from libs.changefeeds import Discovered, discover_spans
from libs.config import Settings
from libs.control.changefeeds_state import ChangefeedView, changefeeds_fold
from libs.control.ddl_state import DdlState, ddl_fold
from libs.election import Leadership
from libs.eventstore import DomainLog, LeaderLog
from libs.leader_service import Entry, Followed, LeaderLoop
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

class CommandError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


Input = c.DdlCommandV1 | BaseModel
"""An operator command, or a worker's report (``ShardInfoV1``, ``ShardDoneV1``, ``ShardDroppedV1``)."""


def decode_command(raw: bytes) -> c.DdlCommandV1:
    """A ``shard_ddl.command`` in its envelope, or the bare command object (what clients sent
    before the command was a registered contract). ``CommandError`` 422 with the reason for
    anything else: not JSON, an unknown type or version, a malformed command."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CommandError(422, "the request is not JSON") from None
    if not isinstance(obj, dict):
        raise CommandError(422, "the request must be a JSON object")
    try:
        if "type" in obj and "data" in obj:
            event = REGISTRY.decode(raw).event
            if not isinstance(event, c.DdlCommandV1):
                raise CommandError(422, f"{obj.get('type')} is not a ddl-lock command (shard_ddl.command)")
            return event
        return c.DdlCommandV1.model_validate(obj)
    except ContractError as exc:
        raise CommandError(422, str(exc)) from None
    except ValidationError as exc:
        raise CommandError(422, f"invalid shard_ddl.command: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err.get("loc", ())) or "command"
    return f"{where}: {err.get('msg', 'invalid')}"


def _stepped_down(_item: Input) -> bytes:
    return _error(503, "the ddl-lock leader stepped down; try again")


class DdlLockService:
    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.nc = runtime.nc
        self.js = runtime.nc.jetstream()

    def make_log(self) -> DomainLog[DdlState]:
        return DomainLog(self.js, DOMAIN, producer=self.runtime.producer, fold=ddl_fold,
                         initial=DdlState(LockKeeper(resend_after=self.settings.ddl_lock_resend_s)),
                         settings=self.settings)

    # -- the term ---------------------------------------------------------------------------------

    async def lead(self, leadership: Leadership, domain_log: DomainLog[Any]) -> None:
        async with LeaderLoop[Input, bytes](self.runtime, status_key="ddl_locks",
                                            refuse=_stepped_down) as loop:
            changefeeds = loop.follow("changefeeds", changefeeds_fold, ChangefeedView,
                                      name="ddl_changefeeds")
            await loop.load()
            handlers = DdlLockHandlers(domain_log, self.settings, changefeeds, send=self._publish,
                                       discover=lambda specs: discover_spans(self.js, specs),
                                       publish_status=loop.publish_status, producer=self.runtime.producer)

            async def on_report(msg: Msg) -> None:
                try:
                    event = REGISTRY.decode(msg.data).event
                except ContractError as exc:
                    log.warning("bad shard DDL report: %s", exc)
                    if msg.reply:
                        with contextlib.suppress(Exception):
                            await msg.respond(f"refused: {exc}".encode())
                    return
                if not msg.reply:
                    loop.inbox.put(event)
                    return
                answer = await loop.inbox.ask(event)
                with contextlib.suppress(Exception):
                    await msg.respond(answer)

            async def on_command(msg: Msg) -> None:
                try:
                    command = decode_command(msg.data)
                except CommandError as exc:
                    answer = _error(exc.code, str(exc))
                else:
                    answer = await loop.inbox.ask(command)
                if msg.reply:
                    with contextlib.suppress(Exception):
                        await msg.respond(answer)

            await handlers.discover_groups()
            await loop.subscribe(SHARD_DDL_REPORT_SUBJECT, on_report)
            await loop.subscribe(command_subject(DOMAIN), on_command)
            log.info("ddl-lock leading", extra={"epoch": leadership.epoch,
                                                "locks": len(handlers.keeper.locks)})
            # A new leader re-sends what its predecessor may not have: duplicates are harmless.
            await handlers.send(handlers.keeper.pending_operations())
            await loop.run(handlers.handle, handlers.tick, lambda: 0.5)

    async def _publish(self, subject: str, body: bytes) -> None:
        await self.nc.publish(subject, body)


Send = Callable[[str, bytes], Awaitable[None]]
Discover = Callable[[list[ChangefeedSpec]], Awaitable[Discovered]]


class DdlLockHandlers:
    """One term's handlers: reports and operator commands go to the ``LockKeeper`` (the core);
    its events are appended (fenced) to the ddl log, then its operations published."""

    def __init__(self, domain_log: LeaderLog, settings: Settings, changefeeds: Followed[ChangefeedView],
                 *, send: Send, discover: Discover, publish_status: Callable[[dict[str, Any]], None],
                 producer: str) -> None:
        state = domain_log.state
        assert isinstance(state, DdlState)
        state.live = True
        self.state = state
        self.keeper = state.keeper
        self.domain_log = domain_log
        self.settings = settings
        self.changefeeds = changefeeds
        self._publish = send
        self._discover_spans = discover
        self.publish_status = publish_status
        self.producer = producer
        self.groups: dict[LockKey, frozenset[TableRef]] = {}
        self.running: set[str] = set()
        self.discovered = False
        """The last discovery succeeded: groups and running changefeeds may be acted on (a
        failed one must not look like every shard leaving)."""
        self.last_groups = time.monotonic()

    async def handle(self, entry: Entry[Input, bytes]) -> None:
        await self._handle(entry, time.time())

    async def tick(self) -> None:
        now = time.time()
        if time.monotonic() - self.last_groups >= self.settings.ddl_lock_discovery_interval_s:
            self.last_groups = time.monotonic()
            await self.discover_groups()
            await self._apply_groups(now)
        await self.send(self.keeper.due_resends(now))
        self._publish_status()

    async def _handle(self, entry: Entry[Input, bytes], now: float) -> None:
        keeper, state = self.keeper, self.state
        if isinstance(entry.item, c.DdlCommandV1):
            try:
                reply = await self._command(entry.item, now)
            except CommandError as exc:
                reply = _error(exc.code, str(exc))
            entry.reply(reply)
            return
        event = entry.item
        if isinstance(event, c.ShardInfoV1):
            info = from_contract(event)
            assert isinstance(info, Info)
            key = info.key
            if info.span not in self.groups.get(key, frozenset()):
                await self.discover_groups()
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
            await self._record(outcome)
        elif isinstance(event, c.ShardDoneV1):
            done = done_of(event)
            if event.error is not None:
                outcome = keeper.handle_exec_failed(done, event.error, now)
            else:
                outcome = keeper.handle_done(done, now)
            await self._record(outcome)
        elif isinstance(event, c.ShardDroppedV1):
            ref = ref_of(event.span)
            if (event.changefeed, ref) not in state.dropped:
                await self.domain_log.append(event)  # folds into state.dropped
            outcome = keeper.handle_shard_left(event.changefeed, target_of(event.target), ref,
                                               f"table dropped upstream: {event.reason}"[:500], now)
            await self._record(outcome)
            entry.reply(b"ok")
            return
        else:
            log.warning("unexpected message on the shard DDL report subject: %s", type(event).__name__)
        entry.reply(b"ok")

    async def _record(self, outcome: Outcome) -> None:
        """Append the keeper's events (fenced: a deposed leader fails here and steps down
        before it sends anything), then send the operations."""
        for event in outcome.events:
            await self.domain_log.append(to_contract(event))
            self._observe(event)
        await self.send(outcome.operations)

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

    async def send(self, items: list[Operation] | list[Operation | InfoRequest]) -> None:
        for item in items:
            body = REGISTRY.encode(to_contract(item), producer=self.producer)
            with contextlib.suppress(Exception):
                await self._publish(shard_ddl_ops_subject(item.changefeed), body)

    # -- shard groups -----------------------------------------------------------------------------

    async def discover_groups(self) -> None:
        specs = self.changefeeds.state.running()
        try:
            found = await self._discover_spans(specs)
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

    async def _apply_groups(self, now: float) -> None:
        keeper, state = self.keeper, self.state
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
            await self._record(outcome)

    # -- operator commands ------------------------------------------------------------------------

    async def _command(self, cmd: c.DdlCommandV1, now: float) -> bytes:
        keeper = self.keeper
        action = cmd.action
        if action == "list":
            locks = [lock_view(lock) for lock in sorted(keeper, key=lambda lk: lk.key)]
            return _ok({"locks": locks})
        changefeed = _text(cmd.changefeed, "changefeed")
        try:
            target = parse_target(_text(cmd.target, "target"))
        except ValueError as exc:
            raise CommandError(422, str(exc)) from None
        lock = keeper.lock(changefeed, target)
        if action == "show":
            if lock is None:
                raise CommandError(404, f"no shard DDL lock for {changefeed}/{target}")
            return _ok({"lock": lock_view(lock)})
        by, reason = _text(cmd.requested_by, "requested_by"), _text(cmd.reason, "reason")
        if lock is None:
            raise CommandError(404, f"no shard DDL lock for {changefeed}/{target}")
        try:
            if action == "unlock":
                if cmd.mode is None:
                    raise CommandError(422, "mode must be 'exec' or 'skip'")
                try:
                    owner = parse_span(changefeed, cmd.owner) if cmd.owner else None
                except ValueError as exc:
                    raise CommandError(422, str(exc)) from None
                outcome = keeper.unlock(changefeed, target, cmd.mode, by=by, reason=reason, now=now,
                                        owner=owner)
            else:
                outcome = keeper.force_remove(changefeed, target, by=by, reason=reason, now=now)
        except LockActionError as exc:
            raise CommandError(409, str(exc)) from None
        log.info("operator %s", action, extra={"changefeed": changefeed, "target": str(target), "by": by,
                                               "reason": reason})
        await self._record(outcome)
        after = keeper.lock(changefeed, target)
        return _ok({"lock": lock_view(after) if after is not None else None})

    def _publish_status(self) -> None:
        keeper = self.keeper
        LOCKS_PENDING.set(len(keeper.locks))
        SHARDS_BLOCKED.set(keeper.blocked_shards())
        self.publish_status({
            "pending": len(keeper.locks), "shards_blocked": keeper.blocked_shards(),
            "groups": {str(k): len(v) for k, v in sorted(self.groups.items()) if len(v) > 1},
            "locks": [f"{lk.id}: {lk.phase}" for lk in keeper],
        })


def _text(value: str | None, name: str) -> str:
    if value is None or not value.strip():
        raise CommandError(422, f"{name} is required (a non-empty string)")
    return value


def _ok(body: dict[str, Any]) -> bytes:
    return json.dumps({"ok": True, **body}).encode()


def _error(code: int, message: str) -> bytes:
    return json.dumps({"ok": False, "code": code, "error": message}).encode()


__all__ = ["DdlLockHandlers", "DdlLockService", "decode_command"]
