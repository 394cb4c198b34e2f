"""Syncpoints: one upstream ts T at which every span of a changefeed stops together, so the
downstream holds, for a moment, a state that existed upstream at T (DESIGN.md, "Syncpoints").

The pure parts, tested without NATS:

- ``ChangefeedSyncpoints``: one changefeed's syncpoints folded from the replication stream
  (``syncpoint.planned`` / ``reached`` / ``ended``): the pending one, the last released one;
- ``decide``: what the leader does next for a changefeed (plan a T, write the row once every
  span is exactly at T, release after the hold, abandon one that cannot be reached);
- ``choose_ts`` and ``marks_passed``: where T goes, and the check that no worker could have
  written past it before the cap was out;
- ``capped``: a span's horizon under the cap a sink-worker reads.

The sink-workers read each changefeed's cap from ``SYNCPOINT_BUCKET`` (``SyncpointRecord``),
which only the replication-manager leader writes, after it recorded the event.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel

from contracts.events.syncpoints import SyncpointEndedV1, SyncpointPlannedV1, SyncpointReachedV1
from libs.streams import SYNCPOINT_BUCKET, token
from libs.ts import LOGICAL_BITS, utc_text

LEAD_S = 1.0
"""How far past the newest resolved mark T is chosen: every worker reads the cap before any mark
passes T (the leader checks that after writing the cap, ``marks_passed``)."""

SYNCPOINT_TABLE = "sluice_syncpoint"


def reach_timeout_s(interval_s: float) -> float:
    """How long a planned T may take to be reached before it is abandoned: a span that cannot
    reach it (waiting at a shard DDL, far behind) must not hold the others for long."""
    return max(60.0, 3 * interval_s)


@dataclass(frozen=True)
class Pending:
    ts: int
    planned_at: float
    commit_time: str | None = None
    """Set once reached: when the downstream row was first written."""
    hold_until: float | None = None

    @property
    def reached(self) -> bool:
        return self.commit_time is not None


@dataclass(frozen=True)
class LastSyncpoint:
    ts: int
    commit_time: str
    released_at: float


@dataclass
class ChangefeedSyncpoints:
    """One changefeed's syncpoints as its events add up."""

    pending: Pending | None = None
    last: LastSyncpoint | None = None
    last_planned_at: float = 0.0
    ended_at: float = 0.0
    released: int = 0
    abandoned: int = 0
    last_abandoned: str = ""

    def apply(self, event: BaseModel) -> None:
        if isinstance(event, SyncpointPlannedV1):
            self.pending = Pending(event.ts, event.planned_at)
            self.last_planned_at = event.planned_at
        elif isinstance(event, SyncpointReachedV1):
            if self.pending is not None and self.pending.ts == event.ts:
                self.pending = replace(self.pending, commit_time=event.commit_time,
                                       hold_until=event.hold_until)
        elif isinstance(event, SyncpointEndedV1):
            if self.pending is None or self.pending.ts != event.ts:
                return
            if event.outcome == "released" and self.pending.commit_time is not None:
                self.last = LastSyncpoint(event.ts, self.pending.commit_time, event.ended_at)
                self.released += 1
            else:
                self.abandoned += 1
                self.last_abandoned = event.reason
            self.pending = None
            self.ended_at = event.ended_at

    @property
    def cap(self) -> int | None:
        """The ts the changefeed's spans may not pass now (None: no syncpoint pending)."""
        return self.pending.ts if self.pending is not None else None

    def dump(self) -> dict[str, Any]:
        return {"pending": list(_astuple(self.pending)) if self.pending else None,
                "last": list(_astuple(self.last)) if self.last else None,
                "last_planned_at": self.last_planned_at, "ended_at": self.ended_at,
                "released": self.released, "abandoned": self.abandoned,
                "last_abandoned": self.last_abandoned}

    @classmethod
    def restore(cls, data: Mapping[str, Any]) -> ChangefeedSyncpoints:
        p, last = data.get("pending"), data.get("last")
        return cls(pending=Pending(int(p[0]), float(p[1]), p[2], p[3]) if p else None,
                   last=LastSyncpoint(int(last[0]), str(last[1]), float(last[2])) if last else None,
                   last_planned_at=float(data.get("last_planned_at") or 0.0),
                   ended_at=float(data.get("ended_at") or 0.0), released=int(data.get("released") or 0),
                   abandoned=int(data.get("abandoned") or 0),
                   last_abandoned=str(data.get("last_abandoned") or ""))

    def record(self, changefeed: str) -> SyncpointRecord:
        return SyncpointRecord(changefeed=changefeed, cap_ts=self.cap,
                               holding=self.pending is not None and self.pending.reached,
                               hold_until=self.pending.hold_until if self.pending else None,
                               planned_at=self.pending.planned_at if self.pending else None,
                               last_ts=self.last.ts if self.last else None,
                               last_commit_time=self.last.commit_time if self.last else None,
                               last_released_at=self.last.released_at if self.last else None,
                               released=self.released, abandoned=self.abandoned,
                               last_abandoned=self.last_abandoned)


def _astuple(value: Pending | LastSyncpoint) -> tuple[Any, ...]:
    if isinstance(value, Pending):
        return (value.ts, value.planned_at, value.commit_time, value.hold_until)
    return (value.ts, value.commit_time, value.released_at)


# ------------------------------------------------------------------ the leader's decision

@dataclass(frozen=True)
class SpanProgress:
    """A span as the leader sees it: its reported checkpoint ts (None: no member replicates it,
    or it is in conflict) and whether an incident stopped it."""

    checkpoint_ts: int | None
    stopped: bool = False


@dataclass(frozen=True)
class Idle:
    reason: str = ""


@dataclass(frozen=True)
class Plan:
    ts: int


@dataclass(frozen=True)
class Reach:
    """Every span is exactly at T: write the downstream row, then record it."""

    ts: int


@dataclass(frozen=True)
class Release:
    ts: int


@dataclass(frozen=True)
class Abandon:
    ts: int
    reason: str


Step = Idle | Plan | Reach | Release | Abandon


def choose_ts(marks: Iterable[int], checkpoints: Iterable[int], lead_s: float = LEAD_S) -> int:
    """T: ``lead_s`` past the newest resolved mark of the changefeed's sources, and past every
    span's checkpoint (checkpoints never go back, so T must be ahead of all of them)."""
    lead = int(lead_s * 1000) << LOGICAL_BITS
    return max(max(marks, default=0) + lead, max(checkpoints, default=0) + 1)


def marks_passed(ts: int, marks: Mapping[str, int | None]) -> str | None:
    """The source whose resolved mark is past ``ts`` (a worker may have written past it), if any."""
    for source, mark in sorted(marks.items()):
        if mark is not None and mark > ts:
            return source
    return None


def decide(sp: ChangefeedSyncpoints, *, interval_s: float | None, hold_s: float, now: float,
           spans: Mapping[str, SpanProgress], marks: Mapping[str, int | None]) -> Step:
    """The next step for one changefeed (``now``: Unix seconds on the leader's clock).

    ``spans``: every span the changefeed wants, by name; ``marks``: its sources' newest
    resolved ts. A pending T is reached when every span's checkpoint is exactly T (a span
    cannot pass a cap it knows, and one past T never learnt of it in time: abandoned)."""
    pending = sp.pending
    if pending is not None and pending.reached:
        assert pending.hold_until is not None
        if interval_s is None or now >= pending.hold_until:
            return Release(pending.ts)
        return Idle(f"holding at {pending.ts} until {pending.hold_until:.3f}")
    if pending is not None:
        if interval_s is None:
            return Abandon(pending.ts, "syncpoints were turned off")
        stopped = sorted(name for name, p in spans.items() if p.stopped)
        if stopped:
            return Abandon(pending.ts, f"span {stopped[0]} is stopped by an incident")
        past = sorted(name for name, p in spans.items()
                      if p.checkpoint_ts is not None and p.checkpoint_ts > pending.ts)
        if past:
            return Abandon(pending.ts, f"span {past[0]} passed {pending.ts} before it read the cap")
        if now - pending.planned_at > reach_timeout_s(interval_s):
            behind = sorted(name for name, p in spans.items() if p.checkpoint_ts != pending.ts)
            return Abandon(pending.ts, f"not reached within {reach_timeout_s(interval_s):g} s "
                                       f"(span {behind[0] if behind else '?'} behind)")
        if spans and all(p.checkpoint_ts == pending.ts for p in spans.values()):
            return Reach(pending.ts)
        return Idle(f"waiting for the spans to reach {pending.ts}")
    if interval_s is None:
        return Idle("syncpoints off")
    due = max(sp.last_planned_at + interval_s, sp.ended_at)
    if now < due:
        return Idle(f"next at {due:.3f}")
    if not spans:
        return Idle("no spans")
    unready = sorted(name for name, p in spans.items() if p.stopped or p.checkpoint_ts is None)
    if unready:
        return Idle(f"span {unready[0]} is stopped or not replicated")
    if not marks or any(m is None for m in marks.values()):
        return Idle("a source has no resolved mark yet")
    return Plan(choose_ts([m for m in marks.values() if m is not None],
                          [p.checkpoint_ts for p in spans.values() if p.checkpoint_ts is not None]))


def hold_until(now: float, hold_s: float) -> float:
    return now + hold_s


# ------------------------------------------------------------------ the workers' view

def capped(horizon: int, cap: int | None, checkpoint_ts: int) -> int:
    """A span's horizon under its changefeed's cap: never past a pending T. A span already past
    T (it could not know of it in time) stays where it is until the leader abandons T."""
    if cap is None or horizon <= cap:
        return horizon
    return max(cap, checkpoint_ts)


class SyncpointRecord(BaseModel):
    """What ``SYNCPOINT_BUCKET`` holds per changefeed (key: the changefeed's token): the cap the
    workers obey, and what the api shows."""

    changefeed: str
    cap_ts: int | None = None
    holding: bool = False
    hold_until: float | None = None
    planned_at: float | None = None
    last_ts: int | None = None
    last_commit_time: str | None = None
    last_released_at: float | None = None
    released: int = 0
    abandoned: int = 0
    last_abandoned: str = ""

    def view(self) -> dict[str, Any]:
        """For people: ts also as UTC text."""
        out = self.model_dump()
        out["cap_time"] = utc_text(self.cap_ts) if self.cap_ts else None
        out["last_time"] = utc_text(self.last_ts) if self.last_ts else None
        return out


async def syncpoint_bucket(js: JetStreamContext, replicas: int = 1, *,
                           create: bool = True) -> KeyValue | None:
    try:
        return await js.key_value(SYNCPOINT_BUCKET)
    except BucketNotFoundError:
        if not create:
            return None
        return await js.create_key_value(bucket=SYNCPOINT_BUCKET, history=1, replicas=replicas,
                                         description="Sluice syncpoints: each changefeed's cap and last one")


async def read_record(kv: KeyValue, changefeed: str) -> SyncpointRecord | None:
    try:
        entry = await kv.get(token(changefeed))
    except (KeyNotFoundError, KeyDeletedError):
        return None
    if not entry.value:
        return None
    return SyncpointRecord.model_validate_json(entry.value)


@dataclass
class SyncpointCaps:
    """A sink-worker's reading of the caps, once per round and changefeed, *after* the resolved
    marks (so a mark it acts on is older than the cap it read: ``marks_passed``)."""

    js: JetStreamContext
    _kv: KeyValue | None = None
    caps: dict[str, int | None] = field(default_factory=dict)

    async def read(self, changefeeds: Iterable[str]) -> dict[str, int | None]:
        wanted = sorted(set(changefeeds))
        if not wanted:
            self.caps = {}
            return {}  # no changefeed here has syncpoints: no NATS request per round
        if self._kv is None:
            self._kv = await syncpoint_bucket(self.js, create=False)
        out: dict[str, int | None] = {}
        for cf in wanted:
            record = await read_record(self._kv, cf) if self._kv is not None else None
            out[cf] = record.cap_ts if record is not None else None
        self.caps = out
        return out


def record_json(record: SyncpointRecord) -> bytes:
    return json.dumps(record.model_dump(), separators=(",", ":")).encode()
