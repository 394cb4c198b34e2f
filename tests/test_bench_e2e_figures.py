"""bench_e2e's figures and issue 15's targets (benchmarks/e2e_figures.py), and how the release
report shows a figure a short run could not compute."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import e2e_figures as figs
from benchmarks.output import Figures, figure_text
from benchmarks.run_all import BENCHES, render


def test_pct_is_the_nearest_rank_and_refuses_no_values() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert figs.pct(values, 0.5) == 51.0  # round(0.5 * 99) = 50 -> the 51st
    assert figs.pct(values, 0.99) == 99.0
    assert figs.pct([3.0, 1.0, 2.0], 1.0) == 3.0
    with pytest.raises(ValueError):
        figs.pct([], 0.5)


def test_latency_targets_say_the_number_of_workers() -> None:
    assert figs.latency_targets(1) == figs.LatencyTargets(p50=0.5, p99=1.0)
    assert figs.latency_targets(3) == figs.LatencyTargets(p50=None, p99=1.5)


def test_latency_is_judged_at_the_targets_rate_only() -> None:
    assert figs.latency_target(1.0, 0.9, 5000) == ("< 1 s at 5,000 rows/s", True)
    assert figs.latency_target(1.5, 1.6, 5000) == ("< 1.5 s at 5,000 rows/s", False)
    text, met = figs.latency_target(1.0, 0.2, 2000)
    assert met is None and text == "< 1 s at 5,000 rows/s (not judged at 2,000)"
    assert figs.latency_target(None, 0.2, 5000) == (None, None)


def test_latency_without_transactions_is_not_measured_with_a_reason() -> None:
    got = figs.latency([], [])
    assert got.p50 is None and got.p99 is None and got.max is None
    assert got.reason is not None and "no transaction" in got.reason
    assert "none seen on NATS" in got.nats_text
    some = figs.latency([0.2, 0.4, 0.3], [0.01, 0.03])
    assert (some.p50, some.max, some.reason) == (0.3, 0.4, None)
    assert "p50 10 ms" in some.nats_text and "(2 seen)" in some.nats_text


def test_the_before_window_of_a_short_move_phase_is_not_empty() -> None:
    # 25 s before the move: the first 5 s are left out, as before.
    assert figs.before_move_from(100.0, 25.0) == 105.0
    # 5 s before the move: half of it is left out, not all of it (which gave no "before").
    assert figs.before_move_from(100.0, 5.0) == 102.5


def test_move_spike_is_the_peak_during_minus_the_median_before() -> None:
    spike = figs.move_spike([0.2, 0.3, 0.3, 0.4, 0.5], [0.4, 1.1], [0.6])
    assert spike.reason is None and spike.value == pytest.approx(1.1 - 0.3)
    assert "median 0.30 s, max 0.50 s" in spike.baseline and "max 0.60 s" in spike.baseline


def test_move_spike_with_too_few_before_or_none_during_is_not_measured() -> None:
    few = figs.move_spike([0.2, 0.3], [1.0], [0.5])
    assert few.value is None and few.reason is not None and "2 transaction(s)" in few.reason
    assert "median 0.25 s" in few.baseline  # what there was is still shown
    none = figs.move_spike([0.2] * 5, [], [])
    assert none.value is None and none.reason is not None and "during the move" in none.reason
    assert "other tables during the move: none" in none.baseline


def test_throughput_targets() -> None:
    assert figs.throughput_target(1, 31_000, None) == (">= 30,000 rows/s", True)
    assert figs.throughput_target(1, 29_999, None)[1] is False
    text, met = figs.throughput_target(3, 15_000, 16_000)
    assert met is False and text is not None and "16,000 rows/s" in text
    assert figs.throughput_target(3, 16_000, 16_000)[1] is True
    assert figs.throughput_target(3, 16_000, None) == (None, None)


def test_worker_rss_target_is_one_gib() -> None:
    assert figs.worker_rss_target(1024.0) == ("<= 1 GiB", True)
    assert figs.worker_rss_target(1025.0)[1] is False


def test_a_figure_not_measured_shows_why_in_the_release_report() -> None:
    out = Figures("bench_e2e")
    out.add("end-to-end latency p99, 3 sink-workers", 0.8, "s", target="< 1.5 s", met=True)
    out.not_measured("move-table lag spike", "s", "1 transaction(s) of the table visible before the move",
                     target="< 1 s")
    data = {"started": "2026-11-24T20:00:00+00:00", "load_avg": [1.0, 1.0, 1.0],
            "figures": [vars(f) for f in out.figures]}
    assert figure_text(None, "s", "why") == "not measured (why)"
    assert figure_text(1234.4, "rows/s") == "1,234 rows/s" and figure_text(0.123, "s") == "0.12 s"
    run = {"machine": "test", "versions": "test"}
    history = {"runs": [], "benchmarks": {}}
    page = render(run, history, {b.name: None for b in BENCHES} | {"bench_e2e": data}, None, Path("."))
    spike_rows = [line for line in page.splitlines() if "move-table lag spike" in line]
    # In the targets table and in the benchmark's own table; neither met nor not met.
    assert len(spike_rows) == 2
    why = "not measured (1 transaction(s) of the table visible before the move)"
    assert all(why in r for r in spike_rows)
    assert all(r.endswith("| - |") for r in spike_rows)



def test_the_release_run_measures_both_spark_modes() -> None:
    by_name = {b.name: b for b in BENCHES}
    local, shared = by_name["bench_e2e"], by_name["bench_e2e_shared"]
    assert local.runs == shared.runs == "bench_e2e"
    for bench in (local, shared):
        for opts in (bench.full, bench.quick):
            assert opts[opts.index("--spark") + 1] == ("local" if bench is local else "shared")
    assert "--chart" in local.full and "--chart" not in shared.full  # one fault schedule, one chart
