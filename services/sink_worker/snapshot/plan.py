"""Initial load, the pure part: splitting a table into primary-key chunks, the SQL condition of
a chunk, and the progress record a snapshot keeps in the ``sluice-snapshots`` bucket.

A chunk is a half-open key range ``lower < key <= upper`` (``None``: unbounded on that side),
compared as a tuple over the key columns, so composite keys split like single ones. The first
chunk has no lower bound and the last no upper bound: together they cover every key, also keys
inserted after the plan was made. Chunk ids are their index in the plan; the plan is stored
with the progress, so a resumed snapshot (another worker, after a crash) copies exactly the
chunks the first run did not finish.

Key values travel in the progress record in the contract's JSON encoding (``contracts/events/
rows.py``), the same as row images, so any key type (decimal, datetime, bytes) survives.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

SnapshotState = Literal["pending", "copying", "done", "failed"]

KeyValues = tuple[Any, ...]


@dataclass(frozen=True)
class Chunk:
    id: int
    lower: KeyValues | None
    """Exclusive lower bound (None: from the first key)."""
    upper: KeyValues | None
    """Inclusive upper bound (None: to the last key, including keys added later)."""


def chunks_from_boundaries(boundaries: Sequence[KeyValues]) -> list[Chunk]:
    """Chunks ``(-inf, b0], (b0, b1], ..., (bn, +inf)`` from boundaries increasing in the
    source's own key order (not checked here: a case-insensitive collation orders strings
    differently from Python)."""
    bounds: list[KeyValues | None] = [None, *boundaries, None]
    return [Chunk(i, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def even_int_boundaries(low: int, high: int, rows: int, chunk_rows: int) -> list[KeyValues]:
    """Boundaries that split the integer key range ``[low, high]`` into chunks of about
    ``chunk_rows`` rows, assuming ``rows`` rows spread evenly over it."""
    if high < low or rows <= chunk_rows:
        return []
    chunks = math.ceil(rows / max(1, chunk_rows))
    step = max(1, math.ceil((high - low + 1) / chunks))
    return [(b,) for b in range(low + step - 1, high, step)]


def evenly_spread(low: int, high: int, rows: int, *, max_sparseness: float = 2.0) -> bool:
    """True when ``rows`` integer keys between ``low`` and ``high`` are dense enough for an even
    split of the range to give chunks of similar size (auto-increment keys with few gaps).
    Sparse keys (gaps, hashes) would give empty and huge chunks: they are split by walking the
    key index instead."""
    if rows <= 0:
        return False
    return (high - low + 1) <= max_sparseness * rows


def key_after(cols: Sequence[str], quote: Callable[[str], str], values: KeyValues,
           params: list[Any]) -> str:
    """``key > values`` as a tuple comparison spelled out (``a > x OR (a = x AND b > y)``): an
    index range every MySQL/MariaDB version uses, unlike a row constructor comparison."""
    ors = []
    for i in range(len(cols)):
        ands = []
        for j in range(i):
            ands.append(f"{quote(cols[j])} = %s")
            params.append(values[j])
        ands.append(f"{quote(cols[i])} > %s")
        params.append(values[i])
        ors.append("(" + " AND ".join(ands) + ")")
    return "(" + " OR ".join(ors) + ")"


def range_condition(cols: Sequence[str], chunk: Chunk,
                    quote: Callable[[str], str]) -> tuple[str, list[Any]]:
    """The WHERE condition of ``chunk`` over the key ``cols`` (``%s`` parameters), or ``"1=1"``."""
    params: list[Any] = []
    parts = []
    if chunk.lower is not None:
        parts.append(key_after(cols, quote, chunk.lower, params))
    if chunk.upper is not None:
        parts.append("NOT " + key_after(cols, quote, chunk.upper, params))
    return (" AND ".join(parts) or "1=1"), params


@dataclass
class SnapshotProgress:
    """One span's initial-load progress (the value in the snapshots bucket; the api reads it).

    ``low_watermark_*``: the source's newest resolved mark before the first chunk was read;
    streaming starts there. ``high_watermark_*``: the newest mark once the last chunk was
    read; the target equals the source at a point of its history once the span's checkpoint
    passes ``high_watermark_ts``.
    """

    changefeed: str
    source: str
    database: str
    table: str
    mode: str = "snapshot"
    state: SnapshotState = "pending"
    rows_copied: int = 0
    rows_estimate: int = 0
    chunks_done: int = 0
    chunks_total: int = 0
    low_watermark_ts: int | None = None
    low_watermark_seq: int | None = None
    high_watermark_ts: int | None = None
    high_watermark_seq: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    key: list[str] = field(default_factory=list)
    chunks: list[list[Any]] = field(default_factory=list)
    """The plan: ``[lower, upper]`` per chunk id, each a list of JSON key values or None."""
    done: list[int] = field(default_factory=list)
    """Ids of the chunks copied in full."""
    resumed_chunks: int = 0
    """Chunks already done when the current run started (a resumed snapshot)."""
    runs: int = 0
    worker: str = ""
    rows_per_s: float = 0.0
    """Copy speed of the current (or last) run: its rows over its time so far."""
    eta_s: float | None = None
    """Seconds the current run still needs at that speed (None: no speed yet); 0 once done."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> SnapshotProgress:
        obj = json.loads(raw)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in obj.items() if k in known})

    def set_plan(self, key: Sequence[str], chunks: Sequence[Chunk],
                 encode: Callable[[KeyValues], list[Any]]) -> None:
        self.key = list(key)
        self.chunks = [[None if c.lower is None else encode(c.lower),
                        None if c.upper is None else encode(c.upper)] for c in chunks]
        self.chunks_total = len(chunks)
        self.done = []
        self.chunks_done = 0

    def plan(self, decode: Callable[[list[Any]], KeyValues]) -> list[Chunk]:
        return [Chunk(i, None if lo is None else decode(lo), None if hi is None else decode(hi))
                for i, (lo, hi) in enumerate(self.chunks)]

    def pending(self, decode: Callable[[list[Any]], KeyValues]) -> list[Chunk]:
        finished = set(self.done)
        return [c for c in self.plan(decode) if c.id not in finished]

    def finish_chunk(self, chunk_id: int, rows: int) -> None:
        if chunk_id not in self.done:
            self.done.append(chunk_id)
            self.rows_copied += rows
        self.chunks_done = len(self.done)

    def measure(self, run_started_at: float, rows_at_run_start: int, now: float) -> None:
        """Speed and time left of the run that started at ``run_started_at`` (wall clock) with
        ``rows_at_run_start`` rows already copied. Rows left: the estimate's rest, or the
        chunks left at the run's average chunk size when that is more (the estimate is the
        source's statistics, often low)."""
        elapsed = now - run_started_at
        copied = self.rows_copied - rows_at_run_start
        self.rows_per_s = copied / elapsed if elapsed > 0 and copied > 0 else 0.0
        if self.state == "done":
            self.eta_s = 0.0
            return
        left = max(0, self.rows_estimate - self.rows_copied)
        if self.chunks_done:
            per_chunk = self.rows_copied / self.chunks_done
            left = max(left, round((self.chunks_total - self.chunks_done) * per_chunk))
        self.eta_s = left / self.rows_per_s if self.rows_per_s > 0 else None

    @property
    def planned(self) -> bool:
        return self.chunks_total > 0 and len(self.chunks) == self.chunks_total
