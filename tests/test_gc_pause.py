"""``gc_paused`` (no servers): after the last pause ends the collector is on again, what the
pause allocated is frozen (the next collection does not walk it) and still freed by reference
counting, frozen objects go back to the collector at most every ``unfreeze_every_s``, and a
registered cycle breaker runs before each freeze, so the garbage it frees is never frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from libs import gc_pause
from libs.gc_pause import gc_paused


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def collector_on() -> Iterator[None]:
    was, every = gc.isenabled(), gc_pause.unfreeze_every_s
    gc.enable()
    gc.unfreeze()
    yield
    gc_pause.unfreeze_every_s = every
    gc.unfreeze()
    if not was:
        gc.disable()


def test_what_a_pause_allocated_is_frozen_and_still_freed_by_refcount(collector_on: None) -> None:
    gc_pause.unfreeze_every_s = 3600.0
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the collector stays off until the outer pause ends
            batch = [{"row": [i, str(i)]} for i in range(20_000)]
        assert not gc.isenabled()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(batch)
    assert gc.get_count()[0] < 700  # the young generation does not hold the batch
    probe = _Node()
    ref = weakref.ref(probe)
    with gc_paused():
        pass
    del probe
    assert ref() is None  # frozen, yet freed by its reference count


def test_frozen_cycles_go_back_to_the_collector_after_the_interval(collector_on: None) -> None:
    gc_pause.unfreeze_every_s = 3600.0
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    with gc_paused():
        pass
    del a, b
    gc.collect()
    assert ref() is not None  # a frozen cycle waits
    gc_pause.unfreeze_every_s = 0.0
    with gc_paused():
        pass
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_a_cycle_breaker_runs_before_the_freeze_so_its_garbage_is_not_frozen(collector_on: None) -> None:
    gc_pause.unfreeze_every_s = 3600.0
    proxies: list[_Node] = []

    def break_cycles() -> None:
        for node in proxies:
            node.other = None

    gc_pause.before_freeze(break_cycles)
    gc_pause.before_freeze(break_cycles)  # once, however often registered
    try:
        with gc_paused():
            a = _Node()
            a.other = a  # a proxy in a cycle with itself, as py4j's are
            proxies.append(a)
            ref = weakref.ref(a)
            del a
            assert ref() is not None
            proxies.clear()  # only the cycle holds it now
            proxies.append(ref())  # type: ignore[arg-type]  # the breaker still sees it
        # The breaker ran at the pause's end: the cycle is gone and reference counting freed it
        # once the breaker's own list let go, with no collection and nothing frozen waiting.
        proxies.clear()
        assert ref() is None
        assert gc_pause._before_freeze.count(break_cycles) == 1
    finally:
        gc_pause._before_freeze.remove(break_cycles)
