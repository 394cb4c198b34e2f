"""The figures a benchmark hands to ``benchmarks.run_all``: with ``--json PATH`` every benchmark
writes, besides what it prints,

    {"benchmark": "<module name>", "started": "<iso time>", "load_avg": [1m, 5m, 15m],
     "figures": [{"measure", "value", "unit", "baseline", "target", "met", "reason"}, ...]}

``baseline`` is a figure measured in the same run to compare with (text, or null), ``target``
the goal (text, or null) and ``met`` whether the value reaches it (null without a target).
A figure the run could not compute has ``value`` null and says why in ``reason`` (its
``met`` is null): the report shows it as not measured instead of the benchmark failing.
The load average is taken when the benchmark starts and again when it ends ("load_avg_end"):
the machine is shared, so a figure means little without it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


@dataclass
class Figure:
    measure: str
    value: float | None
    unit: str
    baseline: str | None = None
    target: str | None = None
    met: bool | None = None
    reason: str | None = None
    """Why ``value`` is None (not measured)."""


@dataclass
class Figures:
    benchmark: str
    started: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    load_avg: list[float] = field(default_factory=lambda: [round(x, 2) for x in os.getloadavg()])
    figures: list[Figure] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the report may show (settings, series); not part of the figures."""

    def add(self, measure: str, value: float, unit: str, baseline: str | None = None,
            target: str | None = None, met: bool | None = None) -> Figure:
        fig = Figure(measure, float(value), unit, baseline, target, met)
        self.figures.append(fig)
        return fig

    def not_measured(self, measure: str, unit: str, reason: str, baseline: str | None = None,
                     target: str | None = None) -> Figure:
        fig = Figure(measure, None, unit, baseline, target, None, reason)
        self.figures.append(fig)
        return fig

    def write(self, path: Path | None) -> None:
        if path is None:
            return
        body = {
            "benchmark": self.benchmark,
            "started": self.started,
            "load_avg": self.load_avg,
            "load_avg_end": [round(x, 2) for x in os.getloadavg()],
            "machine": machine(),
            "figures": [asdict(f) for f in self.figures],
            **self.extra,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        tmp.replace(path)


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the figures as JSON here (see benchmarks/output.py)")


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def figure_text(value: float | None, unit: str, reason: str | None = None) -> str:
    """A figure as the reports show it: ``0.42 s``, ``1,234 rows/s``, or not measured and why."""
    if value is None:
        return f"not measured ({reason})" if reason else "not measured"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:,.0f} {unit}"


def rate(n: float, seconds: float) -> str:
    return f"{n / seconds:,.0f}" if seconds > 0 else "inf"
