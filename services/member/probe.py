"""The member leader's probe of silent members: a killed worker is left in about a second.

A worker answers ``member_probe_subject(member, incarnation)`` while its NATS connection is up.
NATS answers "no responders" at once when no connection holds that subscription, which after
``kill -9`` is immediate (the kernel closes the socket). A slow or SIGSTOPped worker keeps its
connection: the probe times out and only the TTL replaces it.

A member found gone (two "no responders" ``confirm_gap_s`` apart: the first can race a new
incarnation's subscribe) is declared left ``fence_s + margin_s`` after the last heartbeat the
leader received from it. The worker's own fence ends its writes ``fence_s`` after it *sent* its
newest heartbeat the server confirmed, and the server passes every heartbeat it accepted on to
the leader's subscription at once, so the leader received that heartbeat after it was sent:
declared left >= fence deadline + ``margin_s``. That rests on the leader not having lost a
heartbeat: for a member whose last heartbeat is older than the leader's own last reconnect
(messages may have been lost meanwhile), the clock starts at the first "no responders" instead
(the worker confirms nothing on a connection it lost, and "no responders" means that connection
is gone, so everything it could rely on was sent before).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from contracts.events.members import MemberLeftV1
from libs.control.members import MembersState

DEFAULT_MARGIN_S = 0.3
"""Covers a write the fence check let start just before the deadline until the worker's watchdog
cancels its Spark jobs, and clock rate differences between hosts."""


@dataclass
class _Gone:
    incarnation: str
    first: float
    last: float


@dataclass
class MemberProbes:
    heartbeat_interval_s: float
    fence_s: float
    margin_s: float = DEFAULT_MARGIN_S
    confirm_gap_s: float = 0.2
    _gone: dict[str, _Gone] = field(default_factory=dict)
    _asked: dict[str, float] = field(default_factory=dict)

    @property
    def silent_after_s(self) -> float:
        """A member this long without a heartbeat is probed (two heartbeats missed)."""
        return 2 * self.heartbeat_interval_s

    def to_probe(self, state: MembersState, last_seen: Mapping[str, float],
                 now: float) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for member, rec in sorted(state.members.items()):
            seen = last_seen.get(member)
            if seen is None or now - seen < self.silent_after_s:
                continue
            if now - self._asked.get(member, float("-inf")) < self.confirm_gap_s:
                continue
            self._asked[member] = now
            out.append((member, rec.incarnation))
        return out

    def no_responders(self, member: str, incarnation: str, now: float) -> None:
        gone = self._gone.get(member)
        if gone is None or gone.incarnation != incarnation:
            self._gone[member] = _Gone(incarnation, now, now)
        else:
            gone.last = now

    def answered(self, member: str, incarnation: str) -> None:
        gone = self._gone.get(member)
        if gone is not None and gone.incarnation == incarnation:
            del self._gone[member]

    def heard(self, member: str) -> None:
        """A heartbeat arrived: whatever the probes said is old news."""
        self._gone.pop(member, None)
        self._asked.pop(member, None)

    def due(self, state: MembersState, last_seen: Mapping[str, float], now: float,
            reconnected_at: float | None = None) -> list[MemberLeftV1]:
        """Members to declare left now. ``reconnected_at``: the leader's own last reconnect."""
        out: list[MemberLeftV1] = []
        for member, gone in list(self._gone.items()):
            rec = state.members.get(member)
            if rec is None or rec.incarnation != gone.incarnation:
                del self._gone[member]
                continue
            if gone.last - gone.first < self.confirm_gap_s:
                continue
            since = last_seen.get(member, gone.first)
            if reconnected_at is not None and since <= reconnected_at:
                since = max(since, gone.first)
            if now >= since + self.fence_s + self.margin_s:
                out.append(MemberLeftV1(member_id=member, incarnation=gone.incarnation,
                                        reason="no-responders"))
                del self._gone[member]
                self._asked.pop(member, None)
        return out
