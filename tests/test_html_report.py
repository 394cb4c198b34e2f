"""benchmarks/html_report.py builds one self-contained page from benchmark figures and the chart."""

from __future__ import annotations

import base64
import json
import re
import struct
import zlib
from pathlib import Path

from benchmarks.html_report import build, main


def _png() -> bytes:
    """A 1x1 PNG, made here so the fixture needs no image library."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


def _fixture(tmp_path: Path) -> tuple[Path, Path]:
    results = tmp_path / "results"
    results.mkdir()
    common = {"started": "2026-11-23T11:40:00+00:00", "load_avg": [2.0, 4.4, 4.5],
              "load_avg_end": [1.6, 3.3, 4.0], "machine": "2 cores (test), 24 GiB"}
    scheduling = {**common, "benchmark": "bench_scheduling", "figures": [
        {"measure": "10,000 spans scheduled", "value": 0.45, "unit": "s", "baseline": None,
         "target": "< 30 s", "met": True},
        {"measure": "one checkpoint over <10,000> spans", "value": 1.4, "unit": "ms", "baseline": None,
         "target": None, "met": None}]}
    (results / "bench_scheduling.json").write_text(json.dumps(scheduling))
    (results / "apply.json").write_text(json.dumps({**common, "benchmark": "apply", "figures": [
        {"measure": "apply path, 1,000,000 row changes", "value": 27776.4, "unit": "changes/s",
         "baseline": "multi-row INSERT 100,552 rows/s", "target": ">= multi-row INSERT", "met": False}]}))
    (results / "runs.json").write_text(json.dumps({
        "runs": [{"command": ".venv/bin/python -m benchmarks.run_all", "started": "2026-11-23 11:39",
                  "ended": "2026-11-23 11:50", "minutes": 11.9, "load_avg": [5.8, 5.9, 4.9], "quick": False}],
        "benchmarks": {"apply": {"command": "python -m benchmarks.apply --json PATH", "seconds": 164.7,
                                 "status": "ok", "run": "2026-11-23 11:39"},
                       "bench_e2e": {"status": "failed (rc 1)"}}}))
    chart = tmp_path / "lag.png"
    chart.write_bytes(_png())
    return results, chart


def test_report_is_one_self_contained_page_of_the_figures_and_the_chart(tmp_path: Path) -> None:
    results, chart = _fixture(tmp_path)
    page = build(results, chart, tmp_path / "out" / "report.html").read_text()
    # The chart is inside the page, byte for byte; nothing is loaded from anywhere else.
    inline = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert inline and base64.b64decode(inline.group(1)) == chart.read_bytes()
    assert not re.search(r'(src|href)="(?!data:)', page), "every resource is inline"
    # Figures formatted as in BENCHMARKS.md, text escaped, targets marked and counted.
    assert "27,776 changes/s" in page and "0.45 s" in page and "1 ms" in page
    assert "one checkpoint over &lt;10,000&gt; spans" in page and "&lt; 30 s" in page
    assert '<span class="summary met">1 met</span>' in page
    assert '<span class="summary not-met">1 not met</span>' in page
    assert page.count('<td class="met">met</td>') == 2  # in the targets table and its benchmark's
    assert "load average 2.0/4.4/4.5 at the start, 1.6/3.3/4.0 at the end" in page
    assert "No figures (failed (rc 1))." in page  # bench_e2e has a status but no JSON
    assert "2 cores (test), 24 GiB" in page


def test_report_without_a_chart_says_how_to_get_one(tmp_path: Path) -> None:
    results, _ = _fixture(tmp_path)
    out = tmp_path / "r.html"
    assert main(["--results", str(results), "--chart", str(tmp_path / "missing.png"), "--out", str(out)]) == 0
    page = out.read_text()
    assert "No lag chart" in page and "data:image/png" not in page
