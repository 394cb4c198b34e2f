"""The one SparkSession of a process, built from Settings.

``get_spark()`` returns the same session on every call in a process (Spark allows one active
SparkContext per JVM, and starting one costs seconds); ``stop_spark()`` ends it so a later
``get_spark()`` starts a fresh one. The settings of the first call win; later calls with other
settings get the running session.

One setting, ``spark_master`` (``SLUICE_SPARK_MASTER``), says where the jobs run:

- ``local[*]`` (the default; ``local[N]``): driver and executors inside this process' JVM,
  bound to 127.0.0.1 (a machine with no network still works), without the web UI;
- ``spark://host:7077``: a Spark standalone cluster (master and workers started with
  pyspark's own ``spark-class`` launcher or ``sbin`` scripts); executors reach this driver at
  ``spark_driver_host``;
- ``sc://host:15002``: a Spark Connect server, which runs the jobs in its own cluster; this
  process starts no JVM at all. It needs ``pyspark[connect]`` (a dependency of the worker
  extra) and gives no ``sparkContext``: the data path uses DataFrames and ``mapInArrow`` only.

Python workers run the interpreter of this venv (``PYSPARK_PYTHON``; on a cluster the same path
must exist on every worker host, as it does with one image everywhere) and import this
project's modules (``libs``, ``services``): they get the project root on ``PYTHONPATH`` from
here (local mode and cluster executors alike); a Spark Connect server needs both in its own
environment when it is started, or the project installed (``pip install .``).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from libs.config import Settings, get_settings
from libs.gc_pause import before_freeze
from libs.project_path import PROJECT_ROOT, pythonpath_with_project
from libs.spark_class_archive import archive_for

_lock = threading.Lock()
_session: SparkSession | None = None

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _prepare_environment() -> None:
    """Environment the JVM and the Python workers inherit; set before the JVM starts."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # A sink-worker runs on the C allocator for its idle trim (services/sink_worker/__main__.py);
    # Spark's Python workers end when idle, so they keep pymalloc, faster for their small objects.
    if os.environ.pop("SLUICE_INTERNAL_MALLOC_REEXEC", None):
        os.environ.pop("PYTHONMALLOC", None)
    # PySpark marks a process that built a Spark Connect session with these, and every process
    # it starts inherits them; a classic session asked for by SLUICE_SPARK_MASTER would then be
    # refused as a Connect session without a URL (CONNECT_URL_NOT_SET).
    for inherited in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", "SPARK_REMOTE"):
        os.environ.pop(inherited, None)
    # Python workers must run the interpreter of this venv, not whatever `python3` is on PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = pythonpath_with_project(os.environ)


def is_connect(master: str) -> bool:
    """Whether a ``spark_master`` names a Spark Connect server."""
    return master.startswith("sc://")


def is_connect_session(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect session: no ``sparkContext``, so no RDDs."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def _build(settings: Settings) -> SparkSession:
    if is_connect(settings.spark_master):
        session = SparkSession.builder.remote(settings.spark_master).getOrCreate()
        # Runtime settings are per session on a Connect server: without these, its own defaults
        # (the host's time zone, its shuffle partitions) would decide what a local session does not.
        session.conf.set("spark.sql.session.timeZone", "UTC")
        session.conf.set("spark.sql.shuffle.partitions", str(settings.spark_shuffle_partitions))
        return session
    _prepare_environment()
    builder = (
        SparkSession.builder.master(settings.spark_master)
        .appName(f"sluice-{settings.instance_id}")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(settings.spark_shuffle_partitions))
        .config("spark.driver.memory", settings.spark_driver_memory)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.host", settings.spark_driver_host)
        # Loopback unless a cluster's executors must reach the driver from other hosts.
        .config("spark.driver.bindAddress", "127.0.0.1" if settings.spark_driver_host in _LOOPBACK
                else "0.0.0.0")
        # No Hive metastore (metastore_db/, derby.log) in the working directory.
        .config("spark.sql.catalogImplementation", "in-memory")
        .config("spark.python.worker.reuse", "true")
        .config("spark.pyspark.python", sys.executable)
    )
    if not settings.spark_master.startswith("local"):
        # A cluster's executors start their Python workers with this environment.
        builder = builder.config("spark.executorEnv.PYTHONPATH", PROJECT_ROOT)
    archive = archive_for(settings.spark_class_archive) if settings.spark_master.startswith("local") else None
    java_options = driver_java_options(settings, archive)
    if java_options:
        # Passed to spark-submit, which starts the local driver's JVM with them.
        builder = builder.config("spark.driver.extraJavaOptions", java_options)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    # Spark starts one Python daemon (and its pool of workers) per distinct environment of a
    # job's Python functions, and its SQL runners (mapInArrow: the rounds) add this variable
    # where its RDD runners (the initial load's copy) do not: with it in the context's
    # environment both share one daemon and one pool instead of keeping two (measured: a
    # second daemon of 46 MiB idle, and two more workers of ~150-220 MiB while both ran).
    session.sparkContext.environment["SPARK_SIMPLIFIED_TRACEBACK"] = "1"
    return session


_SELECTS_GC = re.compile(r"-XX:\+Use\w*GC\b")


def driver_java_options(settings: Settings, archive: Path | None) -> str:
    """The local driver JVM's flags: the memory bounds (``spark_driver_memory_options``), then
    the operator's own (``spark_driver_java_options``), then the class archive.

    The operator's come after the bounds so that a flag given there wins (the JVM takes the last
    of a repeated ``-XX`` flag or ``-Xms``); a collector chosen there replaces the bounds' one,
    since a JVM given two refuses to start."""
    bounds = settings.spark_driver_memory_options.split()
    own = settings.spark_driver_java_options.split()
    if any(_SELECTS_GC.fullmatch(flag) for flag in own):
        bounds = [flag for flag in bounds if not _SELECTS_GC.fullmatch(flag)]
    flags = [*bounds, *own]
    if archive is not None:
        flags.append(f"-XX:SharedArchiveFile={archive}")
    return " ".join(flags)


def get_spark(settings: Settings | None = None) -> SparkSession:
    """The process' SparkSession, started on first use."""
    global _session
    with _lock:
        if _session is None:
            _session = _build(settings or get_settings())
            before_freeze(release_jvm_refs)
        return _session


def release_jvm_refs() -> int:
    """Break the reference cycle of every live py4j proxy (its cached method objects point back
    at it); returns how many it broke.

    py4j frees a JVM object once Python frees its proxy, but a proxy whose method was called is
    in a cycle, so only CPython's cyclic collector frees it: while the collector is paused or
    the proxy is frozen (``libs.gc_pause``), every finished job's datasets and the Arrow batches
    it read stay pinned in the driver's heap. Emptying the method cache of a proxy held by
    nothing but that cache lets reference counting free it, which releases its JVM object at
    once. A proxy anything else holds keeps its cache: py4j fills and reads it without a lock
    (``JavaObject.__getattr__`` stores a method, then looks it up again), so emptying the cache
    of one in use by another thread could fail that thread's call. Runs before every freeze
    (``gc_pause.before_freeze``, registered when the session is built)."""
    from py4j.finalizer import ThreadSafeFinalizer

    with ThreadSafeFinalizer.lock:
        refs = list(ThreadSafeFinalizer.finalizers.values())
    broken = 0
    for ref in refs:
        proxy = ref()
        methods = getattr(proxy, "_methods", None)
        # Referenced by this frame's ``proxy``, getrefcount's argument and each cached method's
        # ``container``: nothing else, so no thread can be using it.
        if methods and sys.getrefcount(proxy) - 2 == len(methods):
            methods.clear()
            broken += 1
        del proxy
    return broken


def stop_spark() -> None:
    """Stop the process' SparkSession (if any); the next get_spark() starts a new one."""
    global _session
    with _lock:
        if _session is not None:
            _session.stop()
            _session = None


def spark_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the py4j gateway to the JVM cannot be reached."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__name__ == "Py4JNetworkError":
            return True
        if isinstance(cur, ConnectionRefusedError) and cur.__traceback__ is not None and any(
                "py4j" in frame.f_code.co_filename for frame, _ in _walk_tb(cur.__traceback__)):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _walk_tb(tb: Any) -> Iterator[tuple[Any, int]]:
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
