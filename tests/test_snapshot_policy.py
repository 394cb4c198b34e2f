"""A control leader's snapshot policy when a snapshot cannot be written."""

from __future__ import annotations

from typing import Any

import pytest
from nats.errors import MaxPayloadError

from libs.control.snapshots import SnapshotPolicy
from libs.telemetry.metrics import SNAPSHOTS_TOO_LARGE


class _Log:
    """The part of a leader's log the policy uses; its snapshot is too large or fails otherwise."""

    stream = "SLUICE_TEST"
    loaded = None

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.snapshots = 0

    async def snapshot(self, state: dict[str, Any] | None = None) -> int:
        self.snapshots += 1
        if self.error is not None:
            raise self.error
        return self.snapshots


async def test_a_snapshot_past_max_payload_is_counted_and_the_leader_goes_on() -> None:
    policy, log = SnapshotPolicy(every=3), _Log(MaxPayloadError())
    before = SNAPSHOTS_TOO_LARGE.labels(stream=log.stream)._value.get()
    policy.appended(3)
    assert await policy.maybe_snapshot(log) is False  # type: ignore[arg-type]
    assert SNAPSHOTS_TOO_LARGE.labels(stream=log.stream)._value.get() == before + 1
    # Not tried again on the next event: only after another `every` events.
    policy.appended(1)
    assert await policy.maybe_snapshot(log) is False  # type: ignore[arg-type]
    assert log.snapshots == 1
    policy.appended(2)
    log.error = None
    assert await policy.maybe_snapshot(log) is True  # type: ignore[arg-type]
    assert log.snapshots == 2 and not policy.due()


async def test_any_other_snapshot_failure_reaches_the_leader_and_stays_due() -> None:
    policy, log = SnapshotPolicy(every=1), _Log(TimeoutError())
    policy.appended()
    with pytest.raises(TimeoutError):
        await policy.maybe_snapshot(log)  # type: ignore[arg-type]
    assert policy.due()
