"""How the local Spark driver's JVM flags are put together (``libs.spark.driver_java_options``),
and when a quiet sink-worker gives memory back (``services.sink_worker.idle_trim``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pyspark import StorageLevel
from pyspark.sql import SparkSession

from libs.config import DRIVER_MEMORY_OPTIONS, Settings
from libs.spark import driver_java_options
from services.sink_worker.__main__ import DEFAULT_MALLOC, MALLOC_REEXEC, reexec_args
from services.sink_worker.idle_trim import IdleTrim, release_memory


def test_the_memory_bounds_come_first_and_the_operators_flags_after_them() -> None:
    flags = driver_java_options(Settings(spark_driver_java_options="-XX:TieredStopAtLevel=1 -Xms256m"), None)
    assert flags == f"{DRIVER_MEMORY_OPTIONS} -XX:TieredStopAtLevel=1 -Xms256m"
    # The JVM takes the last of a repeated flag: the operator's -Xms wins over the bounds' one.
    assert flags.split().index("-Xms256m") > flags.split().index("-Xms32m")


def test_the_class_archive_comes_last() -> None:
    archive = Path("/venv/sluice-spark-classes.jsa")
    flags = driver_java_options(Settings(), archive).split()
    assert flags[-1] == f"-XX:SharedArchiveFile={archive}"
    assert flags[:-1] == DRIVER_MEMORY_OPTIONS.split()


def test_a_collector_the_operator_chooses_replaces_the_serial_one() -> None:
    own = "-XX:+UseG1GC -XX:G1PeriodicGCInterval=5000"
    flags = driver_java_options(Settings(spark_driver_java_options=own), None).split()
    assert "-XX:+UseG1GC" in flags and "-XX:+UseSerialGC" not in flags
    # The other bounds stay.
    assert "-XX:MaxHeapFreeRatio=70" in flags and "-XX:ReservedCodeCacheSize=64m" in flags
    # Turning a collector off is not choosing one.
    kept = driver_java_options(Settings(spark_driver_java_options="-XX:-UseG1GC"), None).split()
    assert "-XX:+UseSerialGC" in kept


def test_empty_bounds_leave_the_jvm_its_defaults() -> None:
    assert driver_java_options(Settings(spark_driver_memory_options=""), None) == ""
    assert driver_java_options(Settings(spark_driver_memory_options="", spark_driver_java_options="-Xss1m"),
                               None) == "-Xss1m"


def test_the_defaults_bound_a_worker_under_its_memory_target() -> None:
    settings = Settings()
    assert settings.spark_driver_memory == "512m"
    assert "-XX:+UseSerialGC" in settings.spark_driver_memory_options.split()


def test_a_trim_is_due_once_per_quiet_spell_after_spark_was_used() -> None:
    trim = IdleTrim(10.0)
    assert not trim.due(100.0)  # Spark never used: nothing to give back
    trim.used(100.0)
    assert not trim.due(109.9)
    assert trim.due(110.0)
    trim.done()
    assert not trim.due(500.0)  # given back already; quiet since
    trim.used(600.0)
    trim.used(605.0)  # used again meanwhile: the quiet spell starts over
    assert not trim.due(614.0)
    assert trim.due(615.0)


def test_zero_never_trims() -> None:
    trim = IdleTrim(0.0)
    trim.used(1.0)
    assert not trim.due(1e9)


def test_release_memory_without_a_jvm_trims_this_process_only() -> None:
    done = release_memory(None)
    assert "jvm_gc_s" not in done and "jvm" not in done
    assert isinstance(done["malloc_trim"], bool)


@pytest.mark.integration
def test_a_quiet_driver_gives_its_free_heap_back(spark: SparkSession) -> None:
    """The suite's driver runs with the default bounds: a job's data grows its heap, and the trim's
    full collection gives the free part back (with the idle ratios the trim sets for it, the
    serial collector shrinks the old generation to MaxHeapFreeRatio's share, in one step, and
    sizes the young one from it); the busy ratios are back afterwards."""
    jvm = spark.sparkContext._jvm  # type: ignore[attr-defined]
    args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert "-XX:MaxHeapFreeRatio=70" in args and "-XX:-ShrinkHeapInSteps" in args, args
    bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    runtime = jvm.java.lang.Runtime.getRuntime()
    # The suite's session has run other modules' jobs before this one: the heap is measured
    # from where a trim leaves it now, not from a size it had when the session was new.
    assert "jvm_gc_s" in release_memory(spark)
    before = runtime.totalMemory()
    # A round's batch in the driver's heap, then garbage: a cached frame, unpersisted.
    frame = spark.range(2_000_000).selectExpr("id", "repeat(cast(id as string), 10) AS s")
    frame = frame.persist(StorageLevel.MEMORY_ONLY)
    assert frame.count() == 2_000_000
    grown = runtime.totalMemory()
    assert grown - before > 64 * 1024 * 1024, (before, grown)
    frame.unpersist(blocking=True)
    done = release_memory(spark)
    assert "jvm_gc_s" in done, done
    total = runtime.totalMemory()
    assert total - before < (grown - before) / 2, (before, grown, total)
    assert [bean.getVMOption(f).getValue() for f in ("MinHeapFreeRatio", "MaxHeapFreeRatio")] == ["40", "70"]


def test_the_worker_reexecutes_itself_on_the_c_allocator_once() -> None:
    argv = ["/venv/bin/python", "-m", "services.sink_worker"]
    command = reexec_args({"PATH": "/bin"}, argv, "/venv/bin/python", "malloc")
    assert command is not None
    new_argv, env = command
    assert new_argv == argv
    assert env["PYTHONMALLOC"] == "malloc" and env[MALLOC_REEXEC] == "1" and env["PATH"] == "/bin"
    # The new process has it: no second exec. An operator's own choice stands; empty opts out.
    assert reexec_args(env, argv, "/venv/bin/python", "malloc") is None
    assert reexec_args({"PYTHONMALLOC": "pymalloc_debug"}, argv, "/venv/bin/python", "malloc") is None
    assert reexec_args({}, argv, "/venv/bin/python", "") is None
    # main() reads the setting before pydantic is imported: the same default as Settings.
    assert Settings().sink_python_malloc == DEFAULT_MALLOC
    # The console script re-executes as itself.
    script = ["/venv/bin/python", "/venv/bin/sluice-sink-worker"]
    assert reexec_args({}, script, "/venv/bin/python", "malloc")[0] == script  # type: ignore[index]


def test_sparks_python_processes_go_back_to_pymalloc(monkeypatch: pytest.MonkeyPatch) -> None:
    from libs.spark import _prepare_environment

    # _prepare_environment sets more than this (PYTHONPATH, PYSPARK_PYTHON): on a copy.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setenv("PYTHONMALLOC", "malloc")
    monkeypatch.setenv(MALLOC_REEXEC, "1")
    _prepare_environment()
    assert "PYTHONMALLOC" not in os.environ and MALLOC_REEXEC not in os.environ
    # An operator's PYTHONMALLOC (no re-exec marker) reaches Spark's workers unchanged.
    monkeypatch.setenv("PYTHONMALLOC", "malloc")
    _prepare_environment()
    assert os.environ["PYTHONMALLOC"] == "malloc"
