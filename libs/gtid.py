"""MariaDB GTID arithmetic: parse and spell GTID lists, follow a binlog's GTID state, and judge
whether another server of the replication topology can continue a stream (pure; no I/O).

A MariaDB GTID is ``domain-server-seq``. The state capture records with every resolved mark is
``gtid_binlog_pos``-style: per replication domain, the last GTID read (``GtidState``). A server
can continue a stream from that state when, for every domain of the state, it holds the very
transaction the state names (its ``gtid_binlog_state`` has that domain and server at that
sequence number or later) and it has no domain the stream never saw. Sequence numbers grow
within a domain (``gtid_strict_mode``, which MariaDB replication topologies run with), so "the
same server at a sequence at least as high" means "this transaction and everything before it".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

_GTID = re.compile(r"^(\d+)-(\d+)-(\d+)$")


class GtidError(ValueError):
    pass


@dataclass(frozen=True, order=True)
class Gtid:
    domain: int
    server: int
    seq: int

    @classmethod
    def parse(cls, text: str) -> Gtid:
        match = _GTID.match(text.strip())
        if match is None:
            raise GtidError(f"not a MariaDB GTID (domain-server-seq): {text!r}")
        return cls(*(int(part) for part in match.groups()))

    def __str__(self) -> str:
        return f"{self.domain}-{self.server}-{self.seq}"


def is_mariadb_gtid(text: str | None) -> bool:
    return text is not None and _GTID.match(text.strip()) is not None


def parse_list(text: str | None) -> list[Gtid]:
    """A comma-separated GTID list (``@@gtid_binlog_pos``, ``@@gtid_binlog_state``); '' is empty."""
    return [Gtid.parse(part) for part in (text or "").split(",") if part.strip()]


@dataclass
class GtidState:
    """Per domain, the last GTID read: the binlog's GTID position after it."""

    last: dict[int, Gtid] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | None) -> GtidState:
        state = cls()
        for gtid in parse_list(text):
            if gtid.domain in state.last:
                raise GtidError(f"domain {gtid.domain} twice in a GTID position: {text!r}")
            state.last[gtid.domain] = gtid
        return state

    def advance(self, gtid: Gtid) -> None:
        self.last[gtid.domain] = gtid

    def text(self) -> str:
        return ",".join(str(self.last[d]) for d in sorted(self.last))

    def copy(self) -> GtidState:
        return GtidState(dict(self.last))

    def __bool__(self) -> bool:
        return bool(self.last)


Verdict = Literal["covers", "lost", "gap"]


@dataclass(frozen=True)
class MoveJudgement:
    verdict: Verdict
    reason: str

    @property
    def ok(self) -> bool:
        return self.verdict == "covers"


def judge_move(mark: GtidState, server_pos: str, server_state: str) -> MoveJudgement:
    """Can a server whose ``@@gtid_binlog_pos`` is ``server_pos`` and ``@@gtid_binlog_state``
    is ``server_state`` continue a stream whose last resolved mark holds ``mark``?

    - ``lost``: the server lacks a transaction the stream already holds (a replica that lagged
      behind the old primary when it was promoted, or a history that diverged there): reading
      it would leave the stream with changes the new source never had.
    - ``gap``: the server has transactions of a domain the stream never saw: capture cannot tell
      which of them the stream's start already covers, so it cannot place them.
    - ``covers``: the server holds everything up to the mark; what it has after it is new.
    """
    if not mark:
        return MoveJudgement("gap", "the stream's last resolved mark records no GTID position, so "
                                    "no other server can be matched to it")
    pos = GtidState.parse(server_pos)
    held: dict[tuple[int, int], int] = {}
    for gtid in parse_list(server_state):
        key = (gtid.domain, gtid.server)
        held[key] = max(held.get(key, -1), gtid.seq)
    lost: list[str] = []
    for domain, want in sorted(mark.last.items()):
        have = held.get((domain, want.server))
        if have is None or have < want.seq:
            newest = pos.last.get(domain)
            lost.append(f"{want} (the server's newest in domain {domain}: "
                        f"{newest if newest is not None else 'none'})")
    if lost:
        return MoveJudgement("lost", "the new server lacks transaction(s) the stream already holds: "
                                     + "; ".join(lost) + ". It is behind the stream (a replica that "
                                     "lagged when it was promoted loses them) or its history differs; "
                                     "moving would publish a history the new source does not have")
    unknown = sorted(d for d in pos.last if d not in mark.last)
    if unknown:
        named = ", ".join(str(pos.last[d]) for d in unknown)
        return MoveJudgement("gap", f"the new server has transactions in GTID domain(s) the stream "
                                    f"never saw ({named}): capture cannot place them before or after "
                                    f"its mark {mark.text()}")
    return MoveJudgement("covers", f"the new server holds everything up to {mark.text()} "
                                   f"(its position: {pos.text() or 'empty'})")


def move_refusal(mark_gtid: str | None, *, xa_prepared: bool, mariadb: bool, server_pos: str,
                 server_state: str) -> str | None:
    """Why a stream whose last resolved mark records ``mark_gtid`` cannot continue on a server
    (None: it can). The api asks before it records a move, and capture again before it reads."""
    if not mariadb:
        return ("the new server is not MariaDB: capture follows MariaDB GTIDs only (a MySQL source "
                "resumes by binlog file and position, so moving it needs a new initial load)")
    if mark_gtid is None:
        return ("the stream's last resolved mark records no GTID position (a MySQL source, or a "
                "mark written before capture recorded them: let capture publish a newer mark on "
                "the old server first)")
    if xa_prepared:
        return ("the stream's last resolved mark passes prepared XA transactions still undecided: "
                "their rows are found again by the old server's binlog position only; decide them "
                "(XA COMMIT / XA ROLLBACK) and let capture publish a newer mark first")
    try:
        judgement = judge_move(GtidState.parse(mark_gtid), server_pos, server_state)
    except GtidError as exc:
        return f"cannot compare GTID positions: {exc}"
    return None if judgement.ok else judgement.reason
