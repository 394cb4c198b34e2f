"""Stage timings from a Spark event log (``benchmarks.apply --profile DIR`` writes one per run).

    .venv/bin/python -m benchmarks.spark_stages DIR/tuned-eventlog/*

Prints every stage in submission order, with its wall time and its tasks' summed run time,
CPU time, (de)serialization and shuffle volumes, and the same summed by the stage's name
(the call site: ``collect at sort_job.py:139``), which tells which job of a round costs what.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def summarize(path: Path) -> None:
    stages: dict[int, dict[str, Any]] = {}
    tasks: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    with open(path) as f:
        for line in f:
            event = json.loads(line)
            kind = event.get("Event")
            if kind == "SparkListenerStageCompleted":
                info = event["Stage Info"]
                stages[info["Stage ID"]] = info
            elif kind == "SparkListenerTaskEnd":
                metrics = event.get("Task Metrics") or {}
                t = tasks[event["Stage ID"]]
                t["tasks"] += 1
                t["run_ms"] += metrics.get("Executor Run Time", 0)
                t["cpu_ms"] += metrics.get("Executor CPU Time", 0) / 1e6
                t["deser_ms"] += metrics.get("Executor Deserialize Time", 0)
                t["result_ser_ms"] += metrics.get("Result Serialization Time", 0)
                t["gc_ms"] += metrics.get("JVM GC Time", 0)
                shuffle_w = metrics.get("Shuffle Write Metrics") or {}
                shuffle_r = metrics.get("Shuffle Read Metrics") or {}
                t["shuffle_w_mb"] += shuffle_w.get("Shuffle Bytes Written", 0) / 2**20
                read = shuffle_r.get("Remote Bytes Read", 0) + shuffle_r.get("Local Bytes Read", 0)
                t["shuffle_r_mb"] += read / 2**20
    by_name: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    print(f"{'stage':>5} {'wall s':>7} {'tasks':>5} {'run s':>7} {'cpu s':>7} {'gc s':>6} {'shufW MB':>8} "
          f"{'shufR MB':>8}  name")
    for sid in sorted(stages, key=lambda s: stages[s].get("Submission Time", 0)):
        info = stages[sid]
        wall = (info.get("Completion Time", 0) - info.get("Submission Time", 0)) / 1000
        t = tasks[sid]
        name = info.get("Stage Name", "?")
        print(f"{sid:>5} {wall:>7.2f} {int(t['tasks']):>5} {t['run_ms'] / 1000:>7.2f} "
              f"{t['cpu_ms'] / 1000:>7.2f} {t['gc_ms'] / 1000:>6.2f} {t['shuffle_w_mb']:>8.1f} "
              f"{t['shuffle_r_mb']:>8.1f}  {name}")
        agg = by_name[name]
        agg["wall"] += wall
        agg["run"] += t["run_ms"] / 1000
        agg["cpu"] += t["cpu_ms"] / 1000
        agg["stages"] += 1
    print()
    for name, agg in sorted(by_name.items(), key=lambda kv: -kv[1]["wall"]):
        print(f"{agg['wall']:>7.2f} s wall {agg['run']:>7.2f} s run {agg['cpu']:>7.2f} s cpu "
              f"{int(agg['stages']):>3} stages  {name}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        path = Path(arg)
        # Spark 4 writes rolling logs: a directory of events_N_* files.
        for file in sorted(path.glob("**/events_*")) if path.is_dir() else [path]:
            summarize(file)
