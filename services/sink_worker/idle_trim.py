"""Giving memory back once a busy sink-worker turns quiet.

A round's Spark jobs and an initial load's copies grow the driver JVM's heap and the worker's
own allocator pools, and neither gives the memory back by itself while nothing runs: the
serial collector (``libs/spark.py``'s default) resizes the heap only at a full collection,
and an idle JVM collects nothing; glibc keeps freed arena memory, pyarrow's pool its pages.
So a worker that wrote heavily stayed at its busiest size for as long as it was quiet (990 MiB
for the whole tree before the 1M-change UPDATE of ``bench_large_txn``, most of it the JVM's
heap and the initial load's leftovers).

``IdleTrim`` decides when: once Spark was used, after ``after_s`` seconds without a Spark job
started, once per busy spell. ``release_memory`` does it: a full collection in the driver JVM
unless a Spark job is still running, then the Python side (a collection, pyarrow's pool,
glibc's ``malloc_trim``). The JVM's collection runs with the tight heap-free ratios of
``IDLE_HEAP_FREE`` (``MinHeapFreeRatio``/``MaxHeapFreeRatio`` are manageable flags), so the
serial collector returns the free heap at once, and the ratios the JVM had (the busy ones,
``libs.config.DRIVER_MEMORY_OPTIONS``) are put back after it: tight ratios while busy made it
collect fully after every round.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

IDLE_HEAP_FREE = (10, 30)
"""``(MinHeapFreeRatio, MaxHeapFreeRatio)`` of the idle trim's full collection: the old
generation shrinks to its live data plus 30 % (plus at least 10 %)."""


class IdleTrim:
    """When to give memory back: ``after_s`` seconds after the last Spark use, once per busy spell
    (``after_s`` 0: never)."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._used_at: float | None = None

    def used(self, now: float | None = None) -> None:
        """Spark is (about to be) used: a trim is due once it has been quiet long enough."""
        self._used_at = time.monotonic() if now is None else now

    def due(self, now: float | None = None) -> bool:
        if self.after_s <= 0 or self._used_at is None:
            return False
        now = time.monotonic() if now is None else now
        return now - self._used_at >= self.after_s

    def done(self) -> None:
        """Trimmed: nothing more is due until Spark is used again."""
        self._used_at = None


def _malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: freed memory of every malloc arena back to the system."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


@contextlib.contextmanager
def heap_free_ratios(jvm: Any, min_free: int, max_free: int) -> Iterator[None]:
    """The JVM's ``MinHeapFreeRatio``/``MaxHeapFreeRatio`` set to these meanwhile, then back to
    what they were (each change keeps min <= max, which the JVM insists on)."""
    bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    was = (int(bean.getVMOption("MinHeapFreeRatio").getValue()),
           int(bean.getVMOption("MaxHeapFreeRatio").getValue()))

    def put(low: int, high: int) -> None:
        if low <= int(bean.getVMOption("MaxHeapFreeRatio").getValue()):
            bean.setVMOption("MinHeapFreeRatio", str(low))
            bean.setVMOption("MaxHeapFreeRatio", str(high))
        else:
            bean.setVMOption("MaxHeapFreeRatio", str(high))
            bean.setVMOption("MinHeapFreeRatio", str(low))

    put(min_free, max_free)
    try:
        yield
    finally:
        put(*was)


def release_memory(spark: Any | None) -> dict[str, Any]:
    """A full collection in the driver JVM of ``spark`` (a classic session; skipped while one of
    its jobs runs, and for a Spark Connect session, which has no JVM here), then the worker
    process' own free memory back to the system. Returns what it did (for the log)."""
    done: dict[str, Any] = {}
    jvm = getattr(spark, "_jvm", None) if spark is not None else None
    if spark is not None and jvm is not None:
        active = list(spark.sparkContext.statusTracker().getActiveJobsIds())
        if active:
            done["jvm"] = f"skipped: {len(active)} jobs running"
        else:
            t0 = time.monotonic()
            with heap_free_ratios(jvm, *IDLE_HEAP_FREE):
                jvm.java.lang.System.gc()
            done["jvm_gc_s"] = round(time.monotonic() - t0, 3)
    gc.collect()
    try:
        import pyarrow as pa

        pa.default_memory_pool().release_unused()
    except Exception:  # an old pyarrow or a pool without the call: nothing to release there
        log.debug("pyarrow's pool released nothing", exc_info=True)
    done["malloc_trim"] = _malloc_trim()
    return done
