"""Sluice ts (``physical_ms << 18 | logical``) for people and for Prometheus.

A raw ts is about 4.7e17, beyond float64's exact integers: metrics export the physical part as
Unix seconds, and people read a UTC time with how far it is behind the wall clock."""

from __future__ import annotations

import time
from datetime import UTC, datetime

LOGICAL_BITS = 18


def ts_seconds(ts: int) -> float:
    """The ts's commit time as Unix seconds (millisecond precision)."""
    return (ts >> LOGICAL_BITS) / 1000.0


def utc_text(ts: int) -> str:
    """``2026-11-23 22:31:07.120 UTC``."""
    moment = datetime.fromtimestamp(ts_seconds(ts), UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d} UTC"


def duration_text(seconds: float) -> str:
    """``0.8 s``, ``4.5 min``, ``2.0 h``, ``3.1 d``: one unit, one decimal."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def lag_seconds(ts: int, now: float | None = None) -> float:
    """How far a ts is behind the wall clock, in seconds (0 for no ts or one from the future)."""
    if ts <= 0:
        return 0.0
    return max(0.0, (time.time() if now is None else now) - ts_seconds(ts))


def behind_text(ts: int, now: float | None = None) -> str | None:
    """``2026-11-23 22:31:07.120 UTC, 0.8 s behind``; None before any ts (unknown, not 0)."""
    if ts <= 0:
        return None
    return f"{utc_text(ts)}, {duration_text(lag_seconds(ts, now))} behind"


def utc_moment(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)  # naive: UTC


def ts_threshold(start_time: datetime) -> int:
    """The highest ts a transaction committed before ``start_time``'s second has (naive: UTC)."""
    ms = int(utc_moment(start_time).timestamp()) * 1000
    return max(0, (ms << LOGICAL_BITS) - 1)
