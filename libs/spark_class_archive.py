"""A class-data-sharing archive for the local Spark driver's JVM: ``python -m libs.spark_class_archive``.

A local Spark driver loads some 10,000 classes from pyspark's jars before its first job; on a
2-core machine that is most of a sink-worker's start (10-20 s of JVM CPU), paid again by every
worker start, restart and failover. A dynamic CDS archive (JDK 13+, ``-XX:ArchiveClassesAtExit``)
holds those classes already parsed and verified; a JVM started with ``-XX:SharedArchiveFile``
maps it instead. Measured on this project's test machine (2 cores, local[2], a first job of a
few rows): 10.1-10.7 s of JVM CPU to a session and its first job with the archive, 16.9-20.0 s
without.

The archive belongs to one JDK and one set of jars, so it lives in the venv beside them
(``<venv>/sluice-spark-classes.jsa``, with a stamp of the java and pyspark versions it was built
from) and ``infra/dev.sh setup`` builds it once per venv. ``Settings.spark_class_archive`` says
which archive a driver maps: ``auto`` (the default) the venv's when it is there, ``none`` none, or
a path. A JVM that finds the archive built for another JDK or class path prints a warning and
runs without it (``-Xshare:auto``): never a failure, only the old start time.

Building it runs a throwaway local session through the kinds of job the sink-worker runs (rows
from Python, Arrow in and out, a shuffle, a sort) and lets its JVM write the archive when it
exits; the file is written under a temporary name and renamed, so a reader never maps half of one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from libs.project_path import pythonpath_with_project

ARCHIVE_NAME = "sluice-spark-classes.jsa"


def venv_archive() -> Path:
    """Where this venv's archive lives."""
    return Path(sys.prefix) / ARCHIVE_NAME


def _stamp_path(archive: Path) -> Path:
    return archive.with_name(archive.name + ".stamp")


def _java_version() -> str:
    java = Path(os.environ["JAVA_HOME"]) / "bin" / "java" if os.environ.get("JAVA_HOME") else "java"
    done = subprocess.run([str(java), "-version"], capture_output=True, text=True, check=True)
    return (done.stderr or done.stdout).strip()


def build_stamp() -> str:
    """What an archive depends on: the JDK and pyspark's jars (their version)."""
    import pyspark

    return f"{_java_version()}\npyspark {pyspark.__version__}\n"


def archive_for(setting: str) -> Path | None:
    """The archive ``Settings.spark_class_archive`` names, if it is there to map."""
    if setting == "none" or not setting:
        return None
    path = venv_archive() if setting == "auto" else Path(setting)
    return path if path.is_file() else None


def is_current(archive: Path) -> bool:
    stamp = _stamp_path(archive)
    return archive.is_file() and stamp.is_file() and stamp.read_text() == build_stamp()


def _exercise(dump_to: Path) -> None:
    """Runs in a child process: a session whose JVM writes ``dump_to`` when it exits."""
    import pyarrow as pa
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = pythonpath_with_project(os.environ)
    session = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.catalogImplementation", "in-memory")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.extraJavaOptions", f"-XX:ArchiveClassesAtExit={dump_to}")
        .getOrCreate()
    )
    rows = session.createDataFrame([(i, f"v{i}", i * 1.5) for i in range(200)], "k long, v string, f double")

    def passthrough(batches):  # type: ignore[no-untyped-def]
        for batch in batches:
            yield pa.RecordBatch.from_pydict({"k": batch.column("k"), "v": batch.column("v")})

    mapped = rows.mapInArrow(passthrough, "k long, v string")
    mapped.groupBy("v").count().orderBy("v").collect()
    rows.orderBy(rows.f.desc()).limit(5).toArrow()
    jvm = getattr(session.sparkContext._gateway, "proc", None)
    session.stop()
    # The JVM writes the archive on its way out: it leaves when its stdin closes. Wait for it,
    # so the builder renames a whole file.
    if jvm is not None and jvm.stdin is not None:
        jvm.stdin.close()
        jvm.wait(timeout=600)


def build(archive: Path, timeout_s: float = 900.0) -> bool:
    """Build ``archive`` (replacing one of another JDK or pyspark); False when this JDK cannot."""
    tmp = archive.with_name(f"{archive.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "libs.spark_class_archive", "--exercise", str(tmp)],
                       check=True, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       cwd=Path(__file__).resolve().parent.parent)
        if not tmp.is_file() or tmp.stat().st_size == 0:
            return False
        os.replace(tmp, archive)
        _stamp_path(archive).write_text(build_stamp())
        return True
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return False
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("path", nargs="?", type=Path, help=f"the archive (default: <venv>/{ARCHIVE_NAME})")
    parser.add_argument("--exercise", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing when the archive is there and built for this JDK and pyspark")
    args = parser.parse_args(argv)
    if args.exercise is not None:
        _exercise(args.exercise)
        return 0
    archive: Path = args.path or venv_archive()
    if args.if_missing and is_current(archive):
        return 0
    if build(archive):
        print(f"Spark class archive: {archive} ({archive.stat().st_size // (1024 * 1024)} MiB)")
        return 0
    print("Spark class archive: not built (this JDK cannot write one); drivers start without it",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
