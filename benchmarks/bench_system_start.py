"""A whole system's start and stop: the CPU every service spends from its process start to
healthy, and the CPU of the whole start-to-stop, beside the floor of a process-per-service design
measured in the same run (as many bare Python interpreters as there are services).

Every process test, the demo and an operator's restart pay this. The system is the tests' usual
one (``libs/localservers`` LocalSystem): nats-server, two MariaDB sources with a capture each,
two replicas of member, scheduler, replication-manager and ddl-lock, one sink-worker (its Spark
driver starts at its first round, so it is not in these figures: ``bench_spark_start``), the api,
a SQLite downstream.

Run: ``.venv/bin/python -m benchmarks.bench_system_start [--repeat 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from libs.localservers.system import LocalSystem


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _one_system() -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="sluice-bench-start-") as tmp:
        system = LocalSystem(Path(tmp), sources=2, downstream="sqlite", workers=1)
        cpu0 = _children_cpu()
        system.start_infra()
        try:
            t0 = time.monotonic()
            system.start_services()
            system.wait_healthy()
            healthy_s = time.monotonic() - t0
            per_service = {name: _process_cpu(p.proc.pid) for name, p in system.processes.items()
                           if p.proc is not None}
        finally:
            system.stop()
        return {"healthy_s": healthy_s, "services_cpu_s": sum(per_service.values()),
                "start_stop_cpu_s": _children_cpu() - cpu0, "per_service": per_service}


def _floor(processes: int) -> float:
    """CPU of starting and ending ``processes`` bare interpreters (``python -c pass``)."""
    cpu0 = _children_cpu()
    for _ in range(processes):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    return _children_cpu() - cpu0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    runs = [_one_system() for _ in range(args.repeat)]
    services = len(runs[0]["per_service"])  # type: ignore[arg-type]
    floor = _floor(services)
    by_service: dict[str, list[float]] = {}
    for run in runs:
        for name, cpu in run["per_service"].items():  # type: ignore[attr-defined]
            by_service.setdefault(name.rsplit("-", 1)[0] if name[-1].isdigit() else name, []).append(cpu)
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    result = {
        "services": services,
        "healthy_s": statistics.median(float(r["healthy_s"]) for r in runs),  # type: ignore[arg-type]
        "services_cpu_s": statistics.median(float(r["services_cpu_s"]) for r in runs),  # type: ignore[arg-type]
        "start_stop_cpu_s": statistics.median(float(r["start_stop_cpu_s"]) for r in runs),  # type: ignore[arg-type]
        "floor_cpu_s": floor,
        "per_service_cpu_s": {k: statistics.median(v) for k, v in sorted(by_service.items())},
        "load": load,
    }
    print(f"system start (median of {args.repeat}, load {load}): {services} services healthy in "
          f"{result['healthy_s']:.1f} s; their CPU to healthy {result['services_cpu_s']:.1f} s; "
          f"start to stop, every process {result['start_stop_cpu_s']:.1f} s of CPU")
    print(f"baseline (same run): {services} bare interpreters start and exit in {floor:.2f} s of CPU")
    for name, cpu in result["per_service_cpu_s"].items():  # type: ignore[attr-defined]
        print(f"  {name:24s} {cpu:5.2f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
