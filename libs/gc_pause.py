"""Pausing CPython's cyclic garbage collector around allocation-heavy loops.

Decoding a round of row events allocates millions of small containers (dicts, models) that
all stay alive until the round is applied. Every 700 allocations the collector walks the young
generation, and whenever the heap has grown by a quarter it walks all of it; on the apply
benchmark (``benchmarks/apply.py``) that was more than half of the time spent decoding
events, and of decoding and writing rows in the Spark workers. The objects these loops build
are acyclic and alive, so a collection in the middle finds nothing to free; the collector
runs as usual as soon as the loop is done.

``gc_paused()`` nests and may be used from several threads at once: the collector is switched
back on only when the last pause ends, and only when it was on before the first one.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


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
                gc.enable()
