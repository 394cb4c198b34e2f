"""Pausing CPython's cyclic garbage collector around allocation-heavy loops.

Decoding a round of row events allocates millions of small containers (dicts, models) that
all stay alive until the round is applied. Every 700 allocations the collector walks the young
generation, and whenever the heap has grown by a quarter it walks all of it; on the apply
benchmark (``benchmarks/apply.py``) that was more than half of the time spent decoding
events, and of decoding and writing rows in the Spark workers. The objects these loops build
are acyclic and alive, so a collection in the middle finds nothing to free; the collector
runs as usual as soon as the loop is done.

Switching the collector back on is not enough: everything the pause allocated that is still
alive (a round's batch, the next round's read-ahead: ~750,000 objects for 48,000 transaction
parts) sits in the young generation, and the first collection after the pause walks all of it,
then the middle generation's walks it again: 2.4-3 s each on a loaded machine (load ~14),
during which the GIL is held, the event loop stands still, heartbeats go unconfirmed and the
sink-worker fences itself (BENCHMARKS.md, "The sink under sysbench"). So the last pause to end
*freezes* what is alive (``gc.freeze``: into the permanent generation, which collections skip;
an O(1) move), then switches the collector on: collections stay cheap, and the frozen objects
are still freed by their reference counts as usual (the round's data is acyclic). Only a
reference cycle that becomes garbage after it was frozen would wait; so at most every
``unfreeze_every_s`` the frozen objects go back into the oldest generation
(``gc.unfreeze``), where the collector's usual rules for long-lived objects apply.

A freeze also keeps whatever *cyclic garbage* is in the young generation at that moment, until
the next unfreeze. That is harmless for plain Python objects, but not for proxies of resources
elsewhere: every py4j proxy of a JVM object whose method was called is in a cycle with its
method cache, so the Spark driver's datasets, RDDs and Arrow batches of a round's jobs stayed
pinned in the JVM for up to ``unfreeze_every_s`` and ran a 512 MiB driver heap out of memory
under a sysbench backlog. Code that owns such proxies registers a breaker (``before_freeze``)
that runs right before each freeze (``libs.spark.release_jvm_refs``).

``gc_paused()`` nests and may be used from several threads at once: the collector is switched
back on only when the last pause ends, and only when it was on before the first one.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False
unfreeze_every_s = 60.0
"""The longest objects stay frozen (see the module docstring)."""
_last_unfreeze = time.monotonic()
_before_freeze: list[Callable[[], object]] = []


def before_freeze(hook: Callable[[], object]) -> None:
    """Run ``hook`` right before each freeze (once per hook, however often registered): it
    breaks reference cycles that hold resources outside this process (see the module
    docstring), so their garbage is freed by reference counting instead of frozen."""
    if hook not in _before_freeze:
        _before_freeze.append(hook)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                _thaw_or_freeze()
                gc.enable()


def _thaw_or_freeze() -> None:
    global _last_unfreeze
    for hook in _before_freeze:
        hook()
    gc.freeze()
    now = time.monotonic()
    if now - _last_unfreeze >= unfreeze_every_s:
        gc.unfreeze()
        _last_unfreeze = now
