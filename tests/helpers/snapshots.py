"""Domain states large enough to be snapshotted in chunks, and a lease that ends mid-write.

Used by the unit tests of chunked snapshots (in-memory log) and by their integration test on a
real nats-server, so both tell the same story.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from contracts.events.members import MemberJoinedV2
from libs.eventstore import StoredEvent


def noise(rng: random.Random, n: int) -> str:
    """``n`` hex characters (zlib shrinks them to a little over half): a state that stays large."""
    return rng.randbytes(n // 2).hex()


def joined_fold(state: dict[str, Any], stored: StoredEvent) -> dict[str, Any]:
    """Members joined so far with their labels, and how many events were folded."""
    event = stored.event
    members = dict(state.get("members", {}))
    if isinstance(event, MemberJoinedV2):
        members[event.member_id] = dict(event.labels)
    return {"members": members, "folded": int(state.get("folded", 0)) + 1}


def joined(rng: random.Random, i: int, label_bytes: int) -> MemberJoinedV2:
    """A member whose labels carry ``label_bytes`` of noise: the state grows by about that."""
    return MemberJoinedV2(member_id=f"m{i:06d}", incarnation=f"inc{i}",
                          labels={"blob": noise(rng, label_bytes)})


@dataclass
class LeaseUntil:
    """A lease valid for its first ``checks`` validity checks (then the leader has lost it): a
    log checks it before every append and after every snapshot chunk, so ``checks`` picks the
    message after which a snapshot write stops, as a leader killed there would."""

    epoch: int
    checks: int = 1 << 30

    def valid(self) -> bool:
        self.checks -= 1
        return self.checks >= 0
