"""The sink-worker's round pacing without servers: adaptive round sizes and the idle wait."""

from __future__ import annotations

import asyncio

import pytest

from services.sink_worker.round.overlap import settle
from services.sink_worker.round.size import RoundSize
from services.sink_worker.round.wakeup import Pause, pause_after, subscription_changes


def test_a_new_span_starts_at_an_equal_share_of_the_ceiling() -> None:
    size = RoundSize(floor=10, ceiling=1000, byte_budget=10**9)
    assert size.limits(["a", "b", "c", "d"]) == {"a": 250, "b": 250, "c": 250, "d": 250}
    # Never below the floor, as long as the ceiling holds for the round.
    assert RoundSize(floor=100, ceiling=1000, byte_budget=10**9).limits(["a", "b"]) == {"a": 500, "b": 500}


def test_a_behind_span_doubles_up_to_the_ceiling_and_shrinks_to_the_floor_when_caught_up() -> None:
    size = RoundSize(floor=10, ceiling=1000, byte_budget=10**9)
    limit = size.limits(["a"])["a"]
    assert limit == 1000
    size = RoundSize(floor=10, ceiling=1000, byte_budget=10**9)
    size.limits(["a", "b", "c", "d"])  # a starts at 250
    seen = []
    for _ in range(4):
        limit = size.wanted("a")
        size.observe("a", limit, events=limit, event_bytes=limit * 100, behind=True)
        seen.append(size.wanted("a"))
    assert seen == [500, 1000, 1000, 1000]
    for _ in range(10):
        size.observe("a", size.wanted("a"), events=0, event_bytes=0, behind=False)
    assert size.wanted("a") == 10
    # Between half and all of it: it stays.
    size.observe("a", 10, events=7, event_bytes=700, behind=False)
    assert size.wanted("a") == 10


def test_counted_events_past_the_allowance_make_a_span_behind() -> None:
    size = RoundSize(floor=10, ceiling=1000, byte_budget=10**9)
    size.limits(["a", "b"])
    size.observe("a", 500, events=3, event_bytes=300, behind=True)  # ghosts: a few big events
    assert size.wanted("a") == 1000


def test_the_round_never_exceeds_the_ceiling_but_a_behind_span_takes_the_idle_ones_share() -> None:
    size = RoundSize(floor=10, ceiling=1000, byte_budget=10**9)
    spans = ["busy", "idle1", "idle2", "idle3"]
    for _ in range(8):
        limits = size.limits(spans)
        assert sum(limits.values()) <= 1000
        size.observe("busy", limits["busy"], events=limits["busy"], event_bytes=limits["busy"] * 10,
                     behind=True)
        for idle in spans[1:]:
            size.observe(idle, limits[idle], events=0, event_bytes=0, behind=False)
    limits = size.limits(spans)
    assert sum(limits.values()) <= 1000
    assert limits["busy"] > 900 and all(limits[s] < 20 for s in spans[1:])


def test_the_byte_budget_bounds_a_round_of_large_events() -> None:
    size = RoundSize(floor=1, ceiling=1000, byte_budget=1_000_000)
    size.limits(["big", "small"])
    size.observe("big", 500, events=10, event_bytes=10 * 100_000, behind=True)  # 100 kB each
    size.observe("small", 500, events=500, event_bytes=500 * 100, behind=True)
    limits = size.limits(["big", "small"])
    expected_bytes = limits["big"] * 100_000 + limits["small"] * 100
    assert expected_bytes <= 1_000_000
    assert limits["big"] >= 1 and limits["small"] >= 1


def test_spans_that_left_are_forgotten() -> None:
    size = RoundSize(floor=10, ceiling=1000, byte_budget=10**9)
    size.limits(["a", "b"])
    size.observe("a", 500, events=500, event_bytes=500, behind=True)
    assert size.limits(["b"]) == {"b": 500}
    assert size.limits(["a", "b"])["a"] == 500  # back as new: an equal share again


def test_a_ceiling_below_the_floor_wins() -> None:
    size = RoundSize(floor=100, ceiling=1, byte_budget=10**9)
    assert size.limits(["a", "b"]) == {"a": 1, "b": 1}
    with pytest.raises(ValueError):
        RoundSize(floor=0, ceiling=10, byte_budget=1)


def test_the_wait_after_a_round() -> None:
    assert pause_after(worked=True, errors=False, failures=0, interval_s=0.5) == Pause(0.0, on_signal=True)
    assert pause_after(worked=False, errors=False, failures=0, interval_s=0.5) == Pause(0.5, on_signal=True)
    # Failures back off, and a new mark does not cut the backoff short.
    assert pause_after(worked=False, errors=True, failures=1, interval_s=0.5) == Pause(2.0, on_signal=False)
    assert pause_after(worked=True, errors=True, failures=9, interval_s=0.5) == Pause(30.0, on_signal=False)


def test_subscription_changes() -> None:
    assert subscription_changes({"a", "b"}, ["b", "c"]) == ({"c"}, {"a"})
    assert subscription_changes([], []) == (set(), set())


async def test_settle_waits_for_every_step_before_it_raises() -> None:
    finished: list[str] = []
    failed = asyncio.Event()

    async def fails() -> None:
        failed.set()
        raise RuntimeError("store failed")

    async def slow() -> None:
        await failed.wait()  # still in flight when the other one fails
        await asyncio.sleep(0)
        finished.append("slow")

    with pytest.raises(RuntimeError, match="store failed"):
        await settle([fails(), slow()])
    assert finished == ["slow"]
