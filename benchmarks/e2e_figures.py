"""bench_e2e's figures from what it recorded, and issue 15's targets for them; no I/O.

A figure that cannot be computed (too few transactions in a window) comes back with a reason
instead of a value, so a short run reports it as not measured rather than failing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

THROUGHPUT_1_WORKER_TARGET = 30_000.0  # rows/s, end to end, one sink-worker
WORKER_RSS_TARGET_MIB = 1024.0  # a sink-worker's process tree, end to end
MIN_BEFORE_MOVE = 5
"""t0 transactions visible before the move request for its "before" median."""
BEFORE_MOVE_SKIP_S = 5.0
"""The start of the load before the move that is not part of "before" (rounds settling)."""


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; ``values`` must not be empty."""
    if not values:
        raise ValueError("no values")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass(frozen=True)
class LatencyTargets:
    p50: float | None  # seconds; None: no target
    p99: float


LATENCY_TARGET_RATE = 5000.0  # rows/s of steady load the latency targets are set at


def latency_targets(workers: int) -> LatencyTargets:
    """Issue 15: one worker p50 < 0.5 s and p99 < 1 s; several workers on this 2-core machine
    p99 < 1.5 s."""
    return LatencyTargets(0.5, 1.0) if workers == 1 else LatencyTargets(None, 1.5)


def latency_target(limit: float | None, value: float, asked_rate: float) -> tuple[str | None, bool | None]:
    """The target's text and whether it is met; a lighter load than the target's is shown
    against it but not judged."""
    if limit is None:
        return None, None
    text = f"< {limit:g} s at {LATENCY_TARGET_RATE:,.0f} rows/s"
    if asked_rate < LATENCY_TARGET_RATE:
        return f"{text} (not judged at {asked_rate:,.0f})", None
    return text, value < limit


@dataclass(frozen=True)
class Latency:
    count: int
    p50: float | None
    p99: float | None
    max: float | None
    nats_count: int
    nats_p50: float | None
    nats_p99: float | None

    @property
    def reason(self) -> str | None:
        return None if self.count else "no transaction of the window became visible downstream"

    @property
    def nats_text(self) -> str:
        if self.nats_p50 is None or self.nats_p99 is None:
            return "source -> capture -> NATS of the same transactions: none seen on NATS"
        return (f"source -> capture -> NATS of the same transactions: p50 {self.nats_p50 * 1000:,.0f} ms, "
                f"p99 {self.nats_p99 * 1000:,.0f} ms ({self.nats_count} seen)")


def latency(latencies: Sequence[float], to_nats: Sequence[float]) -> Latency:
    """Percentiles of commit -> visible downstream and of commit -> on NATS (the baseline)."""
    lat, cap = list(latencies), list(to_nats)
    return Latency(len(lat), pct(lat, 0.5) if lat else None, pct(lat, 0.99) if lat else None,
                   max(lat) if lat else None, len(cap), pct(cap, 0.5) if cap else None,
                   pct(cap, 0.99) if cap else None)


def before_move_from(load_from: float, before_move_s: float) -> float:
    """Where the "before" window of the move starts: after the load's first seconds, and never
    at or past the request even with a short ``--before-move-s``."""
    return load_from + min(BEFORE_MOVE_SKIP_S, before_move_s / 2)


@dataclass(frozen=True)
class Spike:
    value: float | None  # max latency during the move - median before
    reason: str | None
    before_median: float | None
    before_max: float | None
    during_max: float | None
    others_max: float | None

    @property
    def baseline(self) -> str:
        before = ("not measured" if self.before_median is None or self.before_max is None
                  else f"median {self.before_median:.2f} s, max {self.before_max:.2f} s")
        others = "none" if self.others_max is None else f"max {self.others_max:.2f} s"
        return f"the table before the move: {before}; other tables during the move: {others}"


def move_spike(before: Sequence[float], during: Sequence[float], others: Sequence[float],
               min_before: int = MIN_BEFORE_MOVE) -> Spike:
    """The moved table's highest latency from the request until after the hand-over, minus its
    median latency before the request; ``others``: the other tables' latencies meanwhile."""
    median = statistics.median(before) if before else None
    b_max = max(before) if before else None
    d_max = max(during) if during else None
    o_max = max(others) if others else None
    reason = None
    if len(before) < min_before:
        reason = (f"{len(before)} transaction(s) of the table visible before the move, {min_before} "
                  "needed for its median before")
    elif d_max is None:
        reason = "no transaction of the table committed during the move"
    value = None if reason is not None or median is None or d_max is None else d_max - median
    return Spike(value, reason, median, b_max, d_max, o_max)


def throughput_target(workers: int, rate: float, one_worker: float | None) -> tuple[str | None, bool | None]:
    """Issue 15: one worker >= 30,000 rows/s; several workers >= the one-worker figure of the
    same run (same rows)."""
    if workers == 1:
        return f">= {THROUGHPUT_1_WORKER_TARGET:,.0f} rows/s", rate >= THROUGHPUT_1_WORKER_TARGET
    if one_worker is None:
        return None, None
    return f">= the 1-worker figure ({one_worker:,.0f} rows/s, same rows, same run)", rate >= one_worker


def worker_rss_target(peak_mib: float) -> tuple[str, bool]:
    return f"<= {WORKER_RSS_TARGET_MIB / 1024:.0f} GiB", peak_mib <= WORKER_RSS_TARGET_MIB
