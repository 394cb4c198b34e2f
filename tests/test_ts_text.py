"""Sluice ts for people and for Prometheus (libs/ts.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from libs.ts import behind_text, duration_text, lag_seconds, ts_seconds, utc_text


def _ts(moment: datetime, logical: int = 7) -> int:
    return (int(moment.timestamp() * 1000) << 18) | logical


def test_a_ts_reads_as_a_utc_time_and_how_far_behind() -> None:
    moment = datetime(2026, 11, 23, 22, 31, 7, 120000, tzinfo=UTC)
    ts = _ts(moment)
    assert ts > 2**53, "a raw ts is beyond float64's exact integers: why metrics export seconds"
    assert ts_seconds(ts) == moment.timestamp()
    assert utc_text(ts) == "2026-11-23 22:31:07.120 UTC"
    now = moment.timestamp() + 0.8
    assert behind_text(ts, now) == "2026-11-23 22:31:07.120 UTC, 0.8 s behind"
    assert behind_text(0, now) is None
    assert lag_seconds(ts, moment.timestamp() - 5) == 0.0, "a ts from the future is not behind"


def test_durations_keep_one_unit_people_read() -> None:
    assert [duration_text(s) for s in (0, 0.84, 119.9, 120, 5400, 7200, 172800)] == [
        "0.0 s", "0.8 s", "119.9 s", "2.0 min", "90.0 min", "2.0 h", "2.0 d"]


def test_waiting_for_says_why_a_span_does_not_stream_yet() -> None:
    from services.api.schemas import waiting_for

    now = 1_000.0
    warming = {"member": "w1", "phase": "spark", "since": now - 12.34,
               "waiting_for": "Spark warming up (JVM start and first plans, once per worker)"}
    assert waiting_for("prepare", ("w1", None), warming, None, now) == (
        "Spark warming up (JVM start and first plans, once per worker) on w1, 12.3 s")
    # Another member's record (an earlier prepare of a moved span) says nothing about this one.
    assert waiting_for("prepare", ("w2",), warming, None, now) == "its worker to start preparing it"
    assert waiting_for("absent", (), None, None, now).startswith("the scheduler to place it on a worker")
    copying = {"state": "copying", "rows_copied": 1500, "rows_estimate": 20000}
    assert waiting_for("replicating", ("w1",), None, copying, now) == (
        "initial load copying: 1,500 of about 20,000 rows copied")
    # The estimate is information_schema's: a copy past it is never shown as more than all.
    past = {"state": "copying", "rows_copied": 100_000, "rows_estimate": 98_712}
    assert waiting_for("replicating", ("w1",), None, past, now) == (
        "initial load copying: 100,000 rows (the estimate was about 98,712) copied")
    assert waiting_for("replicating", ("w1",), warming, {"state": "done"}, now) is None


def test_a_progress_bar_never_passes_its_total() -> None:
    from libs.progress_text import progress_total, rows_progress

    assert rows_progress(1500, None) == "1,500 rows"
    assert progress_total(500, 1000) == 1000 and progress_total(1200, 1000) is None
    assert progress_total(5, 0) is None


def test_cli_tables_never_cut_a_value_at_80_columns() -> None:
    import io

    from rich.console import Console

    from services.cli.render import table

    columns = ["source", "database", "table", "state", "primary", "secondary", "checkpoint", "snapshot",
               "waiting for", "incident"]
    row = ["src1", "shop_database_long_name", "orders_table_with_a_long_name", "replicating",
           "sink-worker-1", "sink-worker-2", "2026-11-27 06:52:08.100 UTC, 33.4 s behind",
           "copying 500 of about 1,000 rows", "initial load copying: 500 of about 1,000 rows copied", None]

    def render(**options: object) -> str:
        out = io.StringIO()
        table("tables", columns, [row], out=Console(file=out, width=80, color_system=None, **options))
        return out.getvalue()

    for text in (render(force_terminal=True), render()):  # an 80-column terminal; a pipe
        assert "…" not in text
        assert all(str(v) in text for v in row if v is not None), text
        assert all(c in text for c in columns), text
    # On the terminal nothing is wider than it; a short table stays a table there.
    assert max(len(line) for line in render(force_terminal=True).splitlines()) <= 80
    out = io.StringIO()
    table("members", ["member", "tables"], [["w1", 3]],
          out=Console(file=out, width=80, force_terminal=True, color_system=None))
    assert "┃ member ┃" in out.getvalue()
