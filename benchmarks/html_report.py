"""One self-contained HTML page of the benchmark figures and the lag-through-faults chart, for
people who would rather look than read BENCHMARKS.md's tables.

    .venv/bin/python -m benchmarks.html_report                 # -> .sluice/benchmarks.html
    .venv/bin/python -m benchmarks.html_report --out report.html --results DIR --chart PNG

It reads what ``benchmarks.run_all`` (``just bench``) leaves: the figures of each benchmark
(``benchmarks/results/<name>.json``, see ``benchmarks/output.py``), the run history
(``runs.json``) and the chart (``benchmarks/lag_through_faults.png``). The chart is inlined as a
``data:`` URI and the styles are in the page, so the file can be mailed or opened offline. Needs
nothing beyond the standard library (no matplotlib: the chart is already drawn).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run_all import BENCHES, CHART, fmt_figure  # noqa: E402

DEFAULT_OUT = ROOT / ".sluice" / "benchmarks.html"

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222;
       padding: 0 1em; }
h1 { margin-bottom: .2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
.meta { color: #555; } .meta li { margin: .15em 0; }
table { border-collapse: collapse; width: 100%; margin: .8em 0; }
th, td { border: 1px solid #ddd; padding: .35em .6em; vertical-align: top; text-align: left; }
th { background: #f4f4f4; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
.met { background: #e3f5e1; color: #1d6b1a; font-weight: 600; }
.not-met { background: #fde4e1; color: #a1260d; font-weight: 600; }
.summary { display: inline-block; padding: .3em .8em; border-radius: 1em; margin-right: .5em; }
img.chart { max-width: 100%; border: 1px solid #ddd; }
code { background: #f4f4f4; padding: 0 .25em; }
"""


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _met_cell(met: bool | None) -> str:
    if met is None:
        return "<td>-</td>"
    return '<td class="met">met</td>' if met else '<td class="not-met">not met</td>'


def _text(value: str | None) -> str:
    return escape(value) if value else "-"


def _loads(data: dict[str, Any]) -> str:
    fmt = lambda xs: "/".join(f"{x:.1f}" for x in xs) or "?"  # noqa: E731
    return (f"load average {fmt(data.get('load_avg') or [])} at the start, "
            f"{fmt(data.get('load_avg_end') or [])} at the end (1/5/15 min)")


def _chart(path: Path | None) -> str:
    if path is None or not path.is_file():
        return "<p>No lag chart: run <code>just bench</code> (bench_e2e draws it).</p>"
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<img class="chart" alt="Lag through faults" src="data:image/png;base64,{data}">'
            "<p>Lag over time through the fault schedule (red: the faults; grey: the killed process "
            "started again).</p>")


def render(results: dict[str, dict[str, Any] | None], history: dict[str, Any] | None,
           chart: Path | None, generated: datetime | None = None) -> str:
    """The page for the figures of each benchmark (``None``: no figures), the run history of
    run_all and the chart's PNG file."""
    generated = generated or datetime.now(UTC)
    history = history or {}
    statuses: dict[str, Any] = history.get("benchmarks") or {}
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           "<title>Sluice benchmark report</title>", f"<style>{_STYLE}</style></head><body>",
           "<h1>Sluice benchmark report</h1>", '<ul class="meta">',
           f"<li>generated {generated:%Y-%m-%d %H:%M} UTC from the figures of "
           "<code>python -m benchmarks.run_all</code> (<code>just bench</code>)</li>"]
    for run in history.get("runs") or []:
        command, started, ended = (escape(str(run.get(k, ""))) for k in ("command", "started", "ended"))
        out.append(f"<li>run <code>{command}</code>: {started} to {ended} UTC, load average at its start "
                   + "/".join(f"{x:.1f}" for x in run.get("load_avg") or [])
                   + (" <strong>(quick smoke run: reduced sizes)</strong>" if run.get("quick") else "")
                   + "</li>")
    machine = next((d.get("machine") for d in results.values() if d and d.get("machine")), None)
    if machine:
        out.append(f"<li>machine: {escape(machine)}</li>")
    out.append("</ul>")

    targets = [(b.name, f) for b in BENCHES
               for f in ((results.get(b.name) or {}).get("figures") or []) if f.get("target")]
    met = sum(1 for _, f in targets if f.get("met"))
    not_met = sum(1 for _, f in targets if f.get("met") is False)  # a figure not measured is neither
    out += ["<h2>Targets</h2>",
            f'<p><span class="summary met">{met} met</span>'
            f'<span class="summary not-met">{not_met} not met</span></p>',
            "<table><tr><th>benchmark</th><th>measure</th><th>figure</th><th>target</th><th></th></tr>"]
    for name, f in targets:
        out.append(f"<tr><td>{escape(name)}</td><td>{_text(f['measure'])}</td>"
                   f"<td class=\"num\">{escape(fmt_figure(f))}</td>"
                   f"<td>{_text(f.get('target'))}</td>{_met_cell(f.get('met'))}</tr>")
    out.append("</table>")

    out += ["<h2>Lag through faults</h2>", _chart(chart)]

    for bench in BENCHES:
        data = results.get(bench.name)
        status = statuses.get(bench.name) or {}
        out.append(f"<h2>{escape(bench.title)} (<code>{escape(bench.name)}</code>)</h2>")
        if status.get("command"):
            command, state, run_of = (escape(str(status.get(k, "?"))) for k in ("command", "status", "run"))
            minutes = float(status.get("seconds", 0)) / 60
            out.append(f"<p><code>{command}</code>: {state}, {minutes:.1f} min (run of {run_of})</p>")
        if data is None:
            out.append(f"<p>No figures ({escape(str(status.get('status', 'not run')))}).</p>")
            continue
        out.append(f"<p>Started {escape(str(data.get('started', '?')))}; {_loads(data)}.</p>")
        out.append("<table><tr><th>measure</th><th>figure</th><th>baseline (same run)</th>"
                   "<th>target</th><th></th></tr>")
        for f in data.get("figures") or []:
            out.append(f"<tr><td>{_text(f['measure'])}</td>"
                       f"<td class=\"num\">{escape(fmt_figure(f))}</td>"
                       f"<td>{_text(f.get('baseline'))}</td><td>{_text(f.get('target'))}</td>"
                       f"{_met_cell(f.get('met'))}</tr>")
        out.append("</table>")
        if "downstream_equals_upstream" in data:
            same = "yes" if data["downstream_equals_upstream"] else "<strong>no</strong>"
            out.append(f"<p>Downstream equal to upstream at the end (row count and CRC32 sum per "
                       f"table): {same}.</p>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def build(results_dir: Path, chart: Path | None, out: Path) -> Path:
    results = {b.name: _load_json(results_dir / f"{b.name}.json") for b in BENCHES}
    history = _load_json(results_dir / "runs.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, history, chart))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results",
                        help="Directory of the benchmarks' JSON figures and runs.json.")
    parser.add_argument("--chart", type=Path, default=ROOT / CHART, help="The lag chart (PNG).")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="The HTML file to write.")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        parser.error(f"no benchmark results in {args.results}: run `just bench` first")
    print(build(args.results, args.chart, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
