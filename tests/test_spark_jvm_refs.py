"""A finished job's JVM objects are released without CPython's cyclic collector (real local
SparkSession): py4j proxies are in cycles with their method caches, so with the collector paused
or the proxies frozen (``libs.gc_pause``) each round's datasets and Arrow batches stayed pinned in
the driver's heap until it ran out. ``release_jvm_refs`` breaks the cycles, and ``gc_paused``
runs it before every freeze once a session exists."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from libs import gc_pause
from libs.gc_pause import gc_paused
from libs.spark import release_jvm_refs

pytestmark = pytest.mark.integration


@pytest.fixture
def collector_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


def _finished_job(spark: SparkSession) -> weakref.ref[object]:
    frame = spark.range(5).selectExpr("id * 2 AS twice")
    assert frame.count() == 5
    return weakref.ref(frame._jdf)


def test_a_finished_jobs_proxies_are_freed_without_the_collector(spark: SparkSession,
                                                                  collector_off: None) -> None:
    ref = _finished_job(spark)
    assert ref() is not None  # only its own cycle holds it: without a collection it stays pinned
    assert release_jvm_refs() >= 1
    assert ref() is None
    # The JVM still answers, and a proxy in use keeps working after its cache was emptied.
    live = spark.range(3)
    assert live.count() == 3
    release_jvm_refs()
    assert live.count() == 3
    # A proxy something else holds keeps its method cache: another thread may be reading it.
    assert live._jdf._methods
    held = live._jdf
    release_jvm_refs()
    assert held._methods and "count" in held._methods


def test_the_pause_releases_them_before_it_freezes(spark: SparkSession) -> None:
    assert release_jvm_refs in gc_pause._before_freeze  # registered when the session was built
    every = gc_pause.unfreeze_every_s
    gc_pause.unfreeze_every_s = 3600.0
    try:
        with gc_paused():
            ref = _finished_job(spark)
            assert ref() is not None
        assert ref() is None  # not frozen with the pause's other objects: freed
    finally:
        gc_pause.unfreeze_every_s = every
        gc.unfreeze()
