"""Handing a job's Python data to its tasks: by value through the JVM, or by file in local mode.

``sc.parallelize(groups)`` pickles the groups into a file the JVM reads into its heap, keeps
them there as the partitions of the RDD, serialises each partition into its task and streams it
to a Python worker: every byte of a round crosses the driver's heap two or three times, for
nothing, since the JVM never looks inside. Under a sysbench backlog (32 MiB rounds) that was
most of what filled the old generation between full collections.

When the executors run on the driver's host (``local[...]``), ``partition_rdd`` writes each
partition's data to a file of its own instead and hands Spark only the paths: the Python worker
that runs the partition loads it from the file. On any other master (a standalone cluster,
whose executors may be elsewhere) it is ``parallelize`` as before. Either way the RDD has one
partition per item, holding that item alone.

The files live in a directory of this process (``sluice-handoff-<pid>`` under the temporary
directory) and are removed when the job's ``with`` block ends, however it ends; the directory
goes when the process exits, and that of a process that died (kill -9 in the middle of a job) is
removed by the next process that hands something off.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pyspark import RDD, SparkContext

from libs.process_alive import pid_alive

_PREFIX = "sluice-handoff-"
_lock = threading.Lock()
_dir: Path | None = None


def is_local(sc: SparkContext) -> bool:
    """Whether the executors are this process' JVM (``local``, ``local[N]``, ``local[*]``)."""
    return str(sc.master).startswith("local")


def handoff_dir() -> Path:
    """This process' hand-off directory, made on first use; first the directories of processes
    that are gone are removed."""
    global _dir
    with _lock:
        if _dir is None or not _dir.is_dir():
            base = Path(tempfile.gettempdir())
            for stale in base.glob(_PREFIX + "*"):
                pid = stale.name.removeprefix(_PREFIX)
                if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                    shutil.rmtree(stale, ignore_errors=True)
            _dir = base / f"{_PREFIX}{os.getpid()}"
            _dir.mkdir(mode=0o700, exist_ok=True)
            atexit.register(shutil.rmtree, _dir, True)
        return _dir


def load_item(path: str) -> Any:
    """A partition's item from its file (runs in the Python worker)."""
    with open(path, "rb") as f:
        return pickle.load(f)


@contextlib.contextmanager
def partition_rdd(sc: SparkContext, items: Sequence[Any]) -> Iterator[RDD[Any]]:
    """An RDD whose i-th partition holds ``items[i]`` alone; collect or otherwise finish the job
    inside the block (the files are gone after it)."""
    if not is_local(sc):
        yield sc.parallelize(items, len(items))
        return
    directory = handoff_dir()
    paths: list[str] = []
    try:
        for item in items:
            fd, path = tempfile.mkstemp(dir=directory, suffix=".pkl")
            paths.append(path)
            with os.fdopen(fd, "wb") as f:
                pickle.dump(item, f, protocol=pickle.HIGHEST_PROTOCOL)
        yield sc.parallelize(paths, len(paths)).map(load_item)
    finally:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
