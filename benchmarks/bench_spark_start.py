"""A local Spark driver's start with and without the class archive (libs/spark_class_archive.py):
wall time and the JVM's CPU from process start to the end of a first small job (a session as the
sink-worker builds it, through ``libs.spark.get_spark``), in pairs run back to back in fresh
processes, so both sides of a pair see the same machine.

Run: ``.venv/bin/python -m benchmarks.bench_spark_start [--pairs 3]`` (the archive must be built:
``infra/dev.sh setup`` builds the venv's, or pass ``--archive PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from libs.spark_class_archive import archive_for

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, os, sys, time
t0 = time.monotonic()
from libs.config import Settings
from libs.spark import get_spark
s = get_spark(Settings(spark_master="local[2]", spark_shuffle_partitions=2, spark_driver_memory="1g",
                       spark_driver_java_options="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
                       spark_class_archive=sys.argv[1]))
t1 = time.monotonic()
df = s.createDataFrame([(i % 7, str(i)) for i in range(1000)], "k int, v string")
df.groupBy("k").count().collect()
t2 = time.monotonic()
pid = s._jvm.java.lang.ProcessHandle.current().pid()
fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
print(json.dumps({"session_s": t1 - t0, "first_job_s": t2 - t0, "jvm_cpu_s": cpu}))
"""


def _one(archive: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _CHILD, archive], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=True)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    return {k: float(v) for k, v in json.loads(line).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--archive", default="auto", help="the archive to map (default: the venv's)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    archive = archive_for(args.archive)
    if archive is None:
        print("no class archive to measure: run `python -m libs.spark_class_archive` first", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, float]]] = {"archive": [], "none": []}
    for i in range(args.pairs):
        # Alternate which side goes first, so a load trend does not favour one.
        order = ("archive", "none") if i % 2 == 0 else ("none", "archive")
        for side in order:
            runs[side].append(_one(str(archive) if side == "archive" else "none"))
    load_after = os.getloadavg()
    out: dict[str, Any] = {"pairs": args.pairs, "load_before": load_before, "load_after": load_after}
    print(f"load average (1/5/15) {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f} -> "
          f"{load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}; {args.pairs} pairs; local[2], "
          f"C1 JIT, serial GC; first job: 1,000 rows grouped")
    for side, label in (("none", "without the archive (baseline)"), ("archive", f"with {archive.name}")):
        figures = {k: statistics.median(r[k] for r in runs[side]) for k in runs[side][0]}
        out[side] = {"median": figures, "runs": runs[side]}
        print(f"{label:40s} session {figures['session_s']:5.1f} s   to the end of the first job "
              f"{figures['first_job_s']:5.1f} s   JVM CPU {figures['jvm_cpu_s']:5.1f} s   (medians)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
