"""The members domain: which sink-worker processes are alive, folded from the members stream,
and the member service's liveness logic (heartbeats in, member events out).

A member is a member id plus an incarnation (fresh per process start). A heartbeat from a new
incarnation of a known id means the old process is gone: it is recorded as left ("replaced")
and the new one as joined, so nobody mistakes the restarted process for the old one and its
old tables. Incarnations that left are remembered (a few per id) so a late heartbeat of a
previous life cannot bring it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from contracts.events.leadership import LeaderElectedV1
from contracts.events.members import MemberDrainingV1, MemberJoinedV2, MemberLeftV1
from contracts.events.scheduling import MemberHeartbeatV3
from libs.eventstore import StoredEvent

_RETIRED_PER_MEMBER = 8


@dataclass
class MemberRecord:
    incarnation: str
    address: str = ""
    draining: bool = False


@dataclass
class MembersState:
    members: dict[str, MemberRecord] = field(default_factory=dict)
    retired: dict[str, list[str]] = field(default_factory=dict)
    """member id -> incarnations that left, newest last."""
    epoch: int = 0
    """Epoch of the member-service leader that wrote the newest event."""

    def apply(self, event: BaseModel) -> MembersState:
        if isinstance(event, MemberJoinedV2):
            old = self.members.get(event.member_id)
            if old is not None and old.incarnation != event.incarnation:
                self._retire(event.member_id, old.incarnation)
            self.members[event.member_id] = MemberRecord(event.incarnation, event.address)
        elif isinstance(event, MemberDrainingV1):
            rec = self.members.get(event.member_id)
            if rec is not None and rec.incarnation == event.incarnation:
                rec.draining = True
        elif isinstance(event, MemberLeftV1):
            rec = self.members.get(event.member_id)
            if rec is not None and rec.incarnation == event.incarnation:
                del self.members[event.member_id]
                self._retire(event.member_id, event.incarnation)
        elif isinstance(event, LeaderElectedV1):
            self.epoch = event.epoch
        return self

    def _retire(self, member: str, incarnation: str) -> None:
        gone = self.retired.setdefault(member, [])
        if incarnation not in gone:
            gone.append(incarnation)
            del gone[:-_RETIRED_PER_MEMBER]

    def incarnation(self, member: str) -> str | None:
        rec = self.members.get(member)
        return rec.incarnation if rec is not None else None

    def dump(self) -> dict[str, Any]:
        return {
            "members": {m: [r.incarnation, r.address, r.draining] for m, r in sorted(self.members.items())},
            "retired": {m: list(v) for m, v in sorted(self.retired.items())},
            "epoch": self.epoch,
        }

    @classmethod
    def restore(cls, data: dict[str, Any]) -> MembersState:
        members = {m: MemberRecord(str(v[0]), str(v[1]), bool(v[2]))
                   for m, v in (data.get("members") or {}).items()}
        retired = {m: [str(i) for i in v] for m, v in (data.get("retired") or {}).items()}
        return cls(members, retired, int(data.get("epoch") or 0))


def members_fold(state: MembersState, stored: StoredEvent) -> MembersState:
    return state.apply(stored.event)


class MemberTracker:
    """The member service leader's liveness logic; plain, with the clock passed in.

    ``state`` is the folded members stream; the caller appends the returned events and folds
    them into ``state`` (the domain log does both) before the next call.
    """

    def __init__(self, state: MembersState, ttl_s: float, now: float) -> None:
        self.state = state
        self.ttl_s = ttl_s
        # Replayed members get a full TTL to be heard from: the previous leader's silence
        # tells nothing about them.
        self.last_seen: dict[str, float] = dict.fromkeys(state.members, now)
        self.ignored = 0

    def on_heartbeat(self, hb: MemberHeartbeatV3, now: float) -> list[BaseModel]:
        member, incarnation = hb.member_id, hb.incarnation
        if incarnation in self.state.retired.get(member, ()):
            self.ignored += 1  # a late heartbeat of a process that has left
            return []
        rec = self.state.members.get(member)
        if rec is not None and rec.incarnation == incarnation:
            self.last_seen[member] = now
            if hb.leaving:
                self.last_seen.pop(member, None)
                return [MemberLeftV1(member_id=member, incarnation=incarnation, reason="shutdown")]
            if hb.draining and not rec.draining:
                return [MemberDrainingV1(member_id=member, incarnation=incarnation,
                                         requested_by=f"{member} (SIGTERM)", reason="member shutting down")]
            return []
        if hb.leaving:
            self.ignored += 1  # the goodbye of a process we never saw join
            return []
        out: list[BaseModel] = []
        if rec is not None:
            out.append(MemberLeftV1(member_id=member, incarnation=rec.incarnation, reason="replaced"))
        out.append(MemberJoinedV2(member_id=member, incarnation=incarnation, address=hb.address))
        if hb.draining:
            out.append(MemberDrainingV1(member_id=member, incarnation=incarnation,
                                        requested_by=f"{member} (SIGTERM)", reason="member shutting down"))
        self.last_seen[member] = now
        return out

    def expire(self, now: float) -> list[BaseModel]:
        out: list[BaseModel] = []
        for member, rec in list(self.state.members.items()):
            seen = self.last_seen.setdefault(member, now)
            if now - seen > self.ttl_s:
                out.append(MemberLeftV1(member_id=member, incarnation=rec.incarnation, reason="ttl-expired"))
                del self.last_seen[member]
        return out
