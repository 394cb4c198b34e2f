"""Run every benchmark and write the release report: the "Release report" section at the top
of BENCHMARKS.md (between markers, replaced by each run; the hand-written sections below stay)
and the lag-through-faults chart.

    .venv/bin/python -m benchmarks.run_all                  # everything, ~35 minutes
    .venv/bin/python -m benchmarks.run_all --quick          # small sizes, a few minutes; report to .sluice/
    .venv/bin/python -m benchmarks.run_all --only apply,bench_e2e

Each benchmark runs as its own process with ``--json PATH`` (see ``benchmarks/output.py``);
its output is shown as it runs and kept in ``.sluice/bench-logs/``. The JSON files go to
``benchmarks/results/``. With ``--only``, the other benchmarks' figures come from their last
JSON files there, each shown with its own date. The chart needs matplotlib:
``.venv/bin/pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.output import figure_text, machine  # noqa: E402
from libs.localservers.common import find_binary  # noqa: E402

BEGIN = "<!-- release-report:begin -->"
END = "<!-- release-report:end -->"
CHART = "benchmarks/lag_through_faults.png"


@dataclass(frozen=True)
class Bench:
    name: str
    title: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    module: str = ""
    """``benchmarks.<module>`` (default: ``name``): one benchmark may run twice with other options."""

    @property
    def runs(self) -> str:
        return self.module or self.name


BENCHES = (
    Bench("bench_e2e", "End to end, Spark local in each worker: throughput and latency with 1 and 3 "
          "workers, move-table spike, memory, lag through faults",
          ("--spark", "local", "--chart", "{chart}"),
          ("--spark", "local", "--rows", "20000", "--steady-s", "15", "--before-move-s", "15",
           "--after-move-s", "8", "--fault-gap-s", "10", "--recover-s", "60", "--chart", "{chart}",
           "--dir", ".sluice/bench-quick/e2e")),
    # The same phases with one Spark shared by the workers (a 3-worker figure on 2 cores is not
    # three JVMs' contention); the faults ran above.
    Bench("bench_e2e_shared", "End to end, one shared Spark Connect server for every worker: throughput "
          "and latency with 1 and 3 workers, move-table spike, memory",
          ("--spark", "shared", "--skip-faults", "--dir", ".sluice/bench-e2e-shared"),
          ("--spark", "shared", "--skip-faults", "--rows", "20000", "--steady-s", "15", "--before-move-s",
           "15", "--after-move-s", "8", "--dir", ".sluice/bench-quick/e2e-shared"),
          module="bench_e2e"),
    Bench("apply", "Apply path against multi-row INSERT and LOAD DATA on the same database",
          # The naive row-at-a-time baseline (time-boxed at 120 s) and the cold-worker variant are
          # left to `python -m benchmarks.apply`: they add ~4 minutes and no target.
          ("--rows", "1000000", "--skip", "naive", "--spark", "default", "tuned"),
          ("--rows", "50000", "--skip", "naive", "--spark", "default", "--warmup-rows", "10000")),
    Bench("bench_failover", "Worker and leader failover", ("--rounds", "3"), ("--rounds", "1")),
    Bench("bench_scheduling", "Scheduling at scale (10,000 and 100,000 spans)", (), ("--spans", "1000")),
    Bench("bench_rebuild", "Replication-manager rebuild", (),
          ("--events", "50000", "--spans", "1000", "--snapshot-every", "1000")),
    Bench("bench_rebuild_memory", "Replication-manager rebuild with 100,000 spans from JetStream (chunked "
          "snapshot)", (), ("--spans", "5000", "--skip-full-replay")),
    Bench("bench_shard_ddl", "Shard DDL coordination", (), ("--rounds", "1")),
    Bench("bench_spark_start", "A local Spark driver's start with and without the class archive", (),
          ("--pairs", "1")),
    Bench("bench_system_start", "A whole system's start and stop: CPU of every service beside bare "
          "interpreters", (), ("--repeat", "1")),
    Bench("bench_snapshot", "Initial load against LOAD DATA and COPY", ("--rows", "500000"),
          ("--rows", "50000", "--chunk-rows", "10000")),
    Bench("bench_capture_drain", "Capture drain of a sysbench backlog beside the binlog library's parse-only "
          "rate", (), ("--table-size", "10000", "--seconds", "10")),
    Bench("bench_worker_memory", "A sink-worker's process tree by process and its Spark JVM by part: "
          "after an initial load, after 100k changes, idle (the 1 GiB target)", ("--nmt",),
          ("--tables", "5", "--rows", "2000", "--idle", "65")),
    # 10M changes take over half an hour on a loaded 2-core machine (a 10M-row load, its initial
    # copy, the UPDATE upstream, the streamed apply): the full run measures 1M, the quick 100k;
    # `python -m benchmarks.bench_large_txn --rows 10000000` for the 10M figure.
    Bench("bench_large_txn", "One large transaction (an UPDATE of every row): peak memory of capture and "
          "of the worker's process tree, time against the same UPDATE run on the downstream",
          ("--rows", "1000000"), ("--rows", "100000")),
    Bench("bench_tables", "10,000 real tables in one changefeed, 3 sink-workers: create -> replicating and "
          "initial load done, idle CPU and RSS of every service, changefeed tables through the api and "
          "the CLI, lag under 2,000 rows/s over every table, a worker killed", (),
          ("--tables", "200", "--settle-s", "5", "--idle-s", "10", "--write-s", "10",
           "--kill-timeout-s", "120", "--dir", ".sluice/bench-quick/tables")),
    Bench("bench_oltp", "sysbench against a source: upstream TPS, lag and catch-up into MariaDB and "
          "PostgreSQL beside a native GTID replica", (),
          ("--table-size", "10000", "--write-s", "20", "--rw-s", "10", "--dir", ".sluice/bench-quick/oltp")),
    Bench("bench_syncpoints", "Syncpoints' cost on lag: changefeeds with syncpoint_interval beside one "
          "without, on one worker under the same sysbench load", (),
          ("--load-s", "40", "--feeds", "0/0", "10/2", "--dir", ".sluice/bench-quick/syncpoints")),
)
# Heavy multi-process benchmarks last: a failure there should not cost the quick ones.
RUN_ORDER = ("bench_scheduling", "bench_rebuild", "bench_rebuild_memory", "bench_shard_ddl",
             "bench_spark_start", "bench_system_start", "bench_snapshot", "bench_capture_drain", "apply",
             "bench_failover", "bench_worker_memory",
             "bench_large_txn", "bench_e2e", "bench_e2e_shared", "bench_tables", "bench_oltp",
             "bench_syncpoints")


def _say(text: str) -> None:
    print(f"[run_all {time.strftime('%H:%M:%S')}] {text}", flush=True)


def _has_json_option(module: str) -> bool:
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode == 0 and "--json" in proc.stdout


def _run(bench: Bench, args: list[str], json_path: Path, log_path: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", f"benchmarks.{bench.runs}", "--json", str(json_path), *args]
    shown = " ".join(["python", "-m", f"benchmarks.{bench.runs}", "--json", "PATH", *args]).replace(
        f"{ROOT}/", "")
    _say(f"{bench.name}: {' '.join(cmd[1:])}")
    json_path.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # Its own session: on a timeout the benchmark and every server it started go together.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, bufsize=1)
        assert proc.stdout is not None
        timed_out = False
        deadline = started + timeout
        for line in proc.stdout:
            sys.stdout.write("  " + line)
            log.write(line)
            if time.monotonic() > deadline:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                break
        try:
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    seconds = time.monotonic() - started
    status: dict[str, Any] = {"command": shown, "seconds": round(seconds, 1), "rc": rc, "log": str(log_path)}
    if timed_out:
        status["status"] = f"timed out after {timeout / 60:.0f} min"
    elif json_path.exists():
        status["status"] = "ok" if rc == 0 else f"exit code {rc} (figures written before the failure)"
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        status["status"] = f"failed (exit code {rc}): " + " / ".join(t.strip() for t in tail)[:400]
    _say(f"{bench.name}: {status['status']} in {seconds / 60:.1f} min")
    return status


# ----------------------------------------------------------------------------- report


def fmt_figure(f: dict[str, Any]) -> str:
    """A figure of a benchmark's JSON as the report shows it (not measured: why)."""
    return figure_text(f["value"], f["unit"], f.get("reason"))


def _met(met: bool | None) -> str:
    return "-" if met is None else ("**met**" if met else "**not met**")


def _cell(text: str | None) -> str:
    return "-" if not text else text.replace("|", "\\|").replace("\n", " ")


def _load(data: dict[str, Any]) -> str:
    start = data.get("load_avg") or []
    end = data.get("load_avg_end") or []
    fmt = lambda xs: "/".join(f"{x:.1f}" for x in xs)  # noqa: E731
    return f"{fmt(start)} at the start, {fmt(end)} at the end (1/5/15 min)"


def _versions() -> str:
    parts = [f"Python {sys.version.split()[0]}"]
    try:
        from importlib.metadata import version

        parts.append(f"PySpark {version('pyspark')}")
    except Exception:
        pass
    for label, cmd in (("Java", ["java", "-version"]), ("MariaDB", ["mariadbd", "--version"]),
                       ("nats-server", ["nats-server", "--version"])):
        try:
            exe = find_binary(cmd[0], ("/usr/sbin", "/usr/local/sbin"))
        except Exception:  # not installed: the benchmarks that need it fail on their own
            continue
        try:
            out = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        text = (out.stdout + out.stderr).strip().splitlines()
        if text:
            found = re.search(r"\d+\.\d+\.\d+", text[0] if label != "MariaDB" else " ".join(text))
            parts.append(f"{label} {found.group(0) if found else text[0][:40]}")
    return ", ".join(parts)


def render(run: dict[str, Any], history: dict[str, Any], results: dict[str, dict[str, Any] | None],
           chart: Path | None, report_dir: Path) -> str:
    lines = [BEGIN, "## Release report", "",
             "Generated by `.venv/bin/python -m benchmarks.run_all` (also `just bench`); a re-run "
             "replaces this section, the hand-written sections below it stay. Every figure is shown "
             "beside its baseline, measured in the same run on the same machine, and its target. The "
             "machine is shared with other test runs: the load average of each benchmark is given "
             "with it.", ""]
    for r in history["runs"]:
        lines.append(f"- run `{r['command']}`: {r['started']} to {r['ended']} UTC ({r['minutes']:.0f} min), "
                     "load average at its start " + "/".join(f"{x:.1f}" for x in r["load_avg"])
                     + (" -- **quick (smoke) run: reduced sizes**" if r.get("quick") else ""))
    lines += [f"- machine: {run['machine']}", f"- software: {run['versions']}", ""]
    statuses = history["benchmarks"]
    with_target = []
    for bench in BENCHES:
        data = results.get(bench.name)
        if data is not None:
            for f in data["figures"]:
                if f.get("target"):
                    with_target.append((bench.name, f))
    lines += ["### Targets", "", "| benchmark | measure | figure | target | |", "|---|---|---:|---|---|"]
    for name, f in with_target:
        lines.append(f"| {name} | {_cell(f['measure'])} | {fmt_figure(f)} | "
                     f"{_cell(f['target'])} | {_met(f['met'])} |")
    if results.get("bench_failover") is None:
        # The failover targets stay in the table while their benchmark gives no figures.
        for measure, target in (("worker failover: a killed worker's spans replicating elsewhere", "< 5 s"),
                                ("replication-manager leader failover to the first checkpoint advance",
                                 "< 3 s")):
            lines.append(f"| bench_failover | {measure} | no figures | {target} | - |")
    missing = [b.name for b in BENCHES if results.get(b.name) is None]
    if missing:
        lines.append("")
        lines.append("No figures from: " + ", ".join(
            f"`{m}` ({statuses.get(m, {}).get('status', 'not run')})" for m in missing) + ".")
    lines.append("")
    for bench in BENCHES:
        data = results.get(bench.name)
        st = statuses.get(bench.name, {})
        lines.append(f"### {bench.title} (`{bench.name}`)")
        lines.append("")
        if st.get("command"):
            lines += [f"`{st['command']}` -- {st.get('status', '')}, {st.get('seconds', 0) / 60:.1f} min "
                      f"(run of {st.get('run', '?')})", ""]
        if data is None:
            lines += [f"No figures ({st.get('status', 'not run')}).", ""]
            continue
        lines.append(f"Started {data['started']}; load average {_load(data)}.")
        lines.append("")
        lines += ["| measure | figure | baseline (same run) | target | |", "|---|---:|---|---|---|"]
        for f in data["figures"]:
            lines.append(f"| {_cell(f['measure'])} | {fmt_figure(f)} | "
                         f"{_cell(f.get('baseline'))} | {_cell(f.get('target'))} | {_met(f.get('met'))} |")
        if bench.runs == "bench_e2e":
            if "downstream_equals_upstream" in data:
                lines += ["", "Downstream equal to upstream at the end (row count and CRC32 sum per table): "
                          + ("yes" if data["downstream_equals_upstream"] else "**no**") + "."]
            if "{chart}" in bench.full and chart is not None and chart.exists():
                rel = os.path.relpath(chart, report_dir)
                lines += ["", f"![Lag through faults]({rel})", "",
                          "Lag over time through the fault schedule (red: the faults; grey: the killed "
                          "process started again). Checkpoint lag moves in steps: the changefeed checkpoint "
                          "is recorded at most once a second and a source commit ts has the binlog's "
                          "one-second resolution; the end-to-end lag is the age of the oldest committed "
                          "transaction not yet seen downstream by a poll every 50 ms."]
        lines.append("")
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_report(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + section + "\n" + tail
    else:
        lines = text.splitlines(keepends=True)
        at = next((i + 1 for i, line in enumerate(lines) if line.startswith("# ")), 0)
        text = "".join(lines[:at]) + "\n" + section + "\n" + "".join(lines[at:]).lstrip("\n")
    path.write_text(text)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (a smoke run of a few minutes); writes to .sluice/bench-quick/")
    parser.add_argument("--only", default="", help="comma-separated benchmark names: " +
                        ", ".join(b.name for b in BENCHES))
    parser.add_argument("--report", type=Path, default=None, help="default BENCHMARKS.md (quick: .sluice/)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write the report again from the last figures")
    parser.add_argument("--timeout-min", type=float, default=None,
                        help="per benchmark (default 45, quick 15)")
    args = parser.parse_args(argv)

    names = [b.name for b in BENCHES]
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in only if n not in names]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {names}")
    selected = [] if args.report_only else [n for n in RUN_ORDER if not only or n in only]

    if "bench_e2e" in selected and importlib.util.find_spec("matplotlib") is None:
        print("The lag chart needs matplotlib, which is not installed. Install the benchmark extra:\n"
              "    .venv/bin/pip install -e '.[bench]'", file=sys.stderr)
        return 2

    if args.quick:
        base = ROOT / ".sluice" / "bench-quick"
        results_dir, report, chart = base / "results", args.report or base / "BENCHMARKS.md", base / "lag.png"
    else:
        results_dir = ROOT / "benchmarks" / "results"
        report, chart = args.report or ROOT / "BENCHMARKS.md", ROOT / CHART
    logs = ROOT / ".sluice" / "bench-logs"
    timeout = (args.timeout_min or (15 if args.quick else 45)) * 60
    command = ".venv/bin/python -m benchmarks.run_all" + (" --quick" if args.quick else "") + (
        f" --only {','.join(only)}" if only else "")
    run: dict[str, Any] = {"command": command, "quick": args.quick,
                           "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
                           "load_avg": list(os.getloadavg()), "machine": machine(),
                           "versions": _versions(), "status": {}}
    t0 = time.monotonic()
    by_name = {b.name: b for b in BENCHES}
    for name in selected:
        bench = by_name[name]
        opts = [o.replace("{chart}", str(chart)) for o in (bench.quick if args.quick else bench.full)]
        json_path = results_dir / f"{name}.json"
        if not _has_json_option(bench.runs):
            json_path.unlink(missing_ok=True)
            run["status"][name] = {"status": "no figures: the benchmark has no --json option yet"}
            _say(f"{name}: no --json option, skipped")
            continue
        run["status"][name] = _run(bench, opts, json_path, logs / f"{name}.log", timeout)
    run["ended"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    run["minutes"] = (time.monotonic() - t0) / 60

    # What every benchmark's figures came from, across runs: a run with --only (or
    # --report-only) keeps the other benchmarks' last figures and says which run made them.
    history_path = results_dir / "runs.json"
    history: dict[str, Any] = {"runs": [], "benchmarks": {}}
    if history_path.exists() and (only or args.report_only):
        history = json.loads(history_path.read_text())
    if selected:
        this = {k: run[k] for k in ("command", "started", "ended", "minutes", "load_avg", "quick")}
        history["runs"].append(this)
        for name in selected:
            history["benchmarks"][name] = {**run["status"][name], "run": run["started"]}
    results_dir.mkdir(parents=True, exist_ok=True)
    history_path.write_text(json.dumps(history, indent=2) + "\n")
    results: dict[str, dict[str, Any] | None] = {}
    for bench in BENCHES:
        path = results_dir / f"{bench.name}.json"
        results[bench.name] = json.loads(path.read_text()) if path.exists() else None
    report.parent.mkdir(parents=True, exist_ok=True)
    write_report(report, render(run, history, results, chart, report.parent))
    _say(f"report written to {report} ({run['minutes']:.0f} min)")
    failed = [n for n in selected if run["status"][n].get("status") != "ok"
              and not run["status"][n].get("status", "").startswith("no figures")]
    if failed:
        _say(f"not ok: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
