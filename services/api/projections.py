"""Projections: follow the control-domain streams, fold them with the control plane's own folds
and keep the read-model tables (``services.api.models``) equal to the folded state.

Each domain has a ``DomainFollower`` (newest snapshot plus the events after it, then every new
event). After a change the domain's rows are rewritten in one transaction, at most every
``FLUSH_INTERVAL_S``: a burst of events costs one write, and a reader never sees half a fold.
On start the tables are dropped and rebuilt by replay, so a read model can never disagree with
the log it came from (even after a contract upcaster changed what old events mean).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from nats.js import JetStreamContext
from sqlalchemy import Engine, delete
from sqlmodel import Session, SQLModel, create_engine, select

from libs.config import Settings
from libs.control.changefeeds_state import ChangefeedView, changefeeds_fold
from libs.control.follow import DomainFollower
from libs.control.members import MembersState, members_fold
from libs.control.replication_state import ReplicationState, replication_fold
from libs.control.schedule_state import ScheduleState, schedule_fold
from libs.eventstore import StoredEvent
from libs.scheduling import Span
from services.api.models import ChangefeedRow, MemberRow, ProjectionPosition, SpanRow
from services.api.schemas import redact_spec

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.05
PROJECTED_DOMAINS = ("changefeeds", "members", "replication", "schedule")


def make_engine(url: str) -> Engine:
    """An engine for the read-model URL (SQLAlchemy syntax; SQLite by default)."""
    if url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///")
        if path and path != ":memory:":
            from pathlib import Path

            Path(path).parent.mkdir(parents=True, exist_ok=True)
        return create_engine(url, connect_args={"check_same_thread": False})
    return create_engine(url, pool_pre_ping=True)


def span_key(span: Span) -> str:
    return span.key


class Projections:
    """The api's read models and the followers that feed them."""

    def __init__(self, js: JetStreamContext, engine: Engine, settings: Settings | None = None,
                 name: str = "api") -> None:
        self.js = js
        self.engine = engine
        self.changefeeds: DomainFollower[ChangefeedView] = DomainFollower(
            js, "changefeeds", changefeeds_fold, ChangefeedView, name=f"{name}_changefeeds",
            settings=settings, on_event=self._on_event("changefeeds"))
        self.members: DomainFollower[MembersState] = DomainFollower(
            js, "members", members_fold, MembersState, restore=MembersState.restore,
            name=f"{name}_members", settings=settings, on_event=self._on_event("members"))
        self.replication: DomainFollower[ReplicationState] = DomainFollower(
            js, "replication", replication_fold, ReplicationState, restore=ReplicationState.restore,
            name=f"{name}_replication", settings=settings, on_event=self._on_event("replication"))
        self.schedule: DomainFollower[ScheduleState] = DomainFollower(
            js, "schedule", schedule_fold, ScheduleState, restore=ScheduleState.restore,
            name=f"{name}_schedule", settings=settings, on_event=self._on_event("schedule"))
        self.followers: dict[str, DomainFollower[Any]] = {
            "changefeeds": self.changefeeds, "members": self.members,
            "replication": self.replication, "schedule": self.schedule}
        self._dirty: set[str] = set()
        self._written: dict[str, list[dict[str, Any]]] = {}
        """Per read-model table, the rows its last write put there (``flush`` skips equal ones)."""
        self._wake = asyncio.Event()
        self.last_event_seq: dict[str, int] = dict.fromkeys(PROJECTED_DOMAINS, 0)
        """Per domain, the stream sequence of the newest event folded (0: none yet)."""
        self.flushed_seq: dict[str, int] = dict.fromkeys(PROJECTED_DOMAINS, 0)
        self.ready = False
        self._flushed = asyncio.Event()

    def _on_event(self, domain: str) -> Callable[[StoredEvent], None]:
        def mark(stored: StoredEvent) -> None:
            self.last_event_seq[domain] = stored.seq
            self._dirty.add(domain)
            self._wake.set()

        return mark

    # -- lifecycle ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop and re-create the read-model tables: they are rebuilt by replay."""
        tables = [SQLModel.metadata.tables[t.__tablename__]
                  for t in (ChangefeedRow, MemberRow, SpanRow, ProjectionPosition)]
        SQLModel.metadata.drop_all(self.engine, tables=tables)
        SQLModel.metadata.create_all(self.engine, tables=tables)
        self._written.clear()

    async def load(self) -> None:
        """Replay every domain (newest snapshot plus the tail) and write the tables once."""
        await asyncio.to_thread(self.reset)
        for domain, follower in self.followers.items():
            await follower.load()
            self.last_event_seq[domain] = follower.next_seq - 1
        self._dirty.update(PROJECTED_DOMAINS)
        await self.flush()
        self.ready = True

    async def run(self, stopping: asyncio.Event) -> None:
        """Follow every domain and keep the tables up to date until ``stopping``."""
        if not self.ready:
            while not stopping.is_set():
                try:
                    await self.load()
                    break
                except Exception:
                    log.warning("building the read models failed; retrying", exc_info=True)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), 1.0)
        tasks = [asyncio.create_task(f.run(stopping), name=f"project-{d}")
                 for d, f in self.followers.items()]
        try:
            while not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                self._wake.clear()
                if self._dirty:
                    try:
                        await self.flush()
                    except Exception:
                        log.warning("writing the read models failed; retrying", exc_info=True)
                    await asyncio.sleep(FLUSH_INTERVAL_S)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def seen_seq(self, domain: str) -> int:
        """The newest sequence of ``domain``'s events subject the follower has processed: folded
        or, when undecodable, dead-lettered (the next append's expected last subject sequence)."""
        follower = self.followers[domain]
        return follower.last_seq_of(follower.subject)

    async def wait_seen(self, domain: str, seq: int, wait_s: float) -> bool:
        """Wait until the follower has processed ``seq`` (its state, not yet the tables)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while self.seen_seq(domain) < seq:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def wait_folded(self, domain: str, seq: int, wait_s: float) -> bool:
        """Wait until ``domain``'s tables include the event at ``seq`` (read your own write)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while self.flushed_seq.get(domain, 0) < seq:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._flushed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flushed.wait(), min(remaining, 0.2))
        return True

    # -- writing ------------------------------------------------------------------------------

    async def flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        if not dirty:
            return
        positions = {d: self.last_event_seq[d] for d in dirty}
        built = self._rows(dirty)
        # Only the tables whose rows changed are rewritten: most events move only a changefeed's
        # checkpoint, and rewriting every span's row for each (several times a second, 10,000 of
        # them at many tables) was most of an idle api's CPU.
        rows = {table: items for table, items in built.items() if self._written.get(table) != items}
        try:
            await asyncio.to_thread(self._write, dirty, rows, positions)
        except Exception:
            self._dirty |= dirty
            raise
        self._written.update(rows)
        for d, seq in positions.items():
            self.flushed_seq[d] = max(self.flushed_seq[d], seq)
        self._flushed.set()

    def _rows(self, dirty: set[str]) -> dict[str, list[dict[str, Any]]]:
        """Rows (column -> value) for each dirty domain, built on the loop (the folds are not
        thread-safe)."""
        out: dict[str, list[dict[str, Any]]] = {}
        if "changefeeds" in dirty or "replication" in dirty:
            view = self.changefeeds.state
            checkpoints = self.replication.state.checkpoints
            out["changefeeds"] = [
                {"id": cf, "state": view.states.get(cf, "running"),
                 "spec_json": json.dumps(redact_spec(spec)),
                 "failed_checks_json": json.dumps([c.model_dump() for c in view.failed_checks.get(cf, [])]),
                 "checkpoint_ts": checkpoints.get(cf, (0, 0))[0],
                 "resolved_ts": checkpoints.get(cf, (0, 0))[1]}
                for cf, spec in sorted(view.specs.items())]
        if "members" in dirty:
            out["members"] = [{"member_id": m, "incarnation": r.incarnation, "address": r.address,
                               "draining": r.draining}
                              for m, r in sorted(self.members.state.members.items())]
        if "replication" in dirty or "schedule" in dirty:
            sets = self.replication.state.sets
            wanted = self.schedule.state.wanted_spans()
            spans: list[dict[str, Any]] = []
            for span in sorted(set(sets) | set(wanted)):
                s = sets.get(span)
                row: dict[str, Any] = {"key": span_key(span), "changefeed": span.changefeed,
                                       "source": span.source, "database": span.database,
                                       "table": span.table, "wanted": span in wanted}
                if s is not None:
                    row.update(state=s.state.value, primary=s.primary, secondary=s.secondary,
                               members_json=json.dumps({m: r.value for m, r in sorted(s.members.items())}),
                               error=s.error.detail if s.error is not None else None,
                               checkpoint_ts=s.checkpoint_ts, resolved_ts=s.resolved_ts)
                spans.append(row)
            out["spans"] = spans
        return out

    def _write(self, dirty: set[str], rows: dict[str, list[dict[str, Any]]],
               positions: dict[str, int]) -> None:
        models: dict[str, type[SQLModel]] = {"changefeeds": ChangefeedRow, "members": MemberRow,
                                             "spans": SpanRow}
        with Session(self.engine) as session:
            for table, items in rows.items():
                model = models[table]
                session.exec(delete(model))
                session.add_all([model(**item) for item in items])
            for domain, seq in positions.items():
                pos = session.get(ProjectionPosition, domain) or ProjectionPosition(domain=domain)
                pos.seq = max(pos.seq, seq)
                pos.events = self.followers[domain].events_folded
                session.add(pos)
            session.commit()

    def dump(self) -> dict[str, list[dict[str, Any]]]:
        """Every read-model row, for comparing two projections of the same streams."""
        out: dict[str, list[dict[str, Any]]] = {}
        with Session(self.engine) as session:
            for name, model, order in (("changefeeds", ChangefeedRow, ChangefeedRow.id),
                                       ("members", MemberRow, MemberRow.member_id),
                                       ("spans", SpanRow, SpanRow.key)):
                out[name] = [r.model_dump() for r in session.exec(select(model).order_by(order))]
        return out
