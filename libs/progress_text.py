"""Initial-load progress for people. The total is the source's row estimate
(information_schema's TABLE_ROWS, off by tens of percent on InnoDB): said as "about", and never
the denominator of a fraction the copy has already passed."""

from __future__ import annotations


def rows_progress(done: int, estimate: int | None) -> str:
    """``1,500 of about 20,000 rows``; past the estimate, ``100,000 rows (the estimate was about
    98,712)``; without one, ``1,500 rows``."""
    if not estimate:
        return f"{done:,} rows"
    if done > estimate:
        return f"{done:,} rows (the estimate was about {estimate:,})"
    return f"{done:,} of about {estimate:,} rows"


def progress_total(done: int, estimate: int | None) -> int | None:
    """A progress bar's total: the estimate while the copy is within it, else none (the bar
    shows a count instead of a fraction above 100%)."""
    return estimate if estimate and done <= estimate else None
