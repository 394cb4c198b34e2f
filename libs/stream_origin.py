"""Where a source's stream begins: the point capture first read the source from.

Capture pins a new source's start with a first resolved mark at the source's current (or
earliest) binlog position; nothing the source committed before that point is in the stream.
Every later mark carries that origin in a header (marks are rolled up: only the newest is kept),
so a reader asked to start earlier than the stream begins (a changefeed's ``start_position`` or
``start_time``) can refuse instead of silently starting later.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from contracts.events.rows import SourcePositionV1
from libs.streams import ROWS_STREAM, resolved_subject
from libs.ts import ts_threshold, utc_moment, utc_text

STREAM_ORIGIN_HEADER = "Sluice-Stream-Origin"


@dataclass(frozen=True)
class StreamOrigin:
    binlog_file: str
    binlog_pos: int
    ts: int
    """The first mark's ts: the wall clock when capture pinned the start (ms << LOGICAL_BITS)."""

    def header(self) -> str:
        return json.dumps({"binlog_file": self.binlog_file, "binlog_pos": self.binlog_pos, "ts": self.ts},
                          separators=(",", ":"))

    @classmethod
    def parse(cls, value: str) -> StreamOrigin:
        """Raises ValueError on anything but a header ``header()`` wrote."""
        try:
            raw = json.loads(value)
            origin = cls(str(raw["binlog_file"]), int(raw["binlog_pos"]), int(raw["ts"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"bad {STREAM_ORIGIN_HEADER} header {value!r}: {exc}") from None
        if not origin.binlog_file or origin.binlog_pos < 0 or origin.ts < 0:
            raise ValueError(f"bad {STREAM_ORIGIN_HEADER} header {value!r}")
        return origin

    def position_key(self) -> tuple[int, str, int]:
        return binlog_order(self.binlog_file, self.binlog_pos)


def binlog_order(binlog_file: str, binlog_pos: int) -> tuple[int, str, int]:
    """Binlog positions in binlog order: the file's numeric suffix, then the offset."""
    match = re.search(r"(\d+)$", binlog_file)
    return (int(match.group(1)) if match else -1, binlog_file, binlog_pos)


async def stream_origin(js: JetStreamContext, source: str,
                        rows_stream: str = ROWS_STREAM) -> StreamOrigin | None:
    """Where capture began ``source``'s stream, from its newest mark; None when there is no mark
    yet or it was written by a capture that did not record it (nothing to check against)."""
    try:
        raw = await js.get_last_msg(rows_stream, resolved_subject(source))
    except NotFoundError:
        return None
    value = (raw.headers or {}).get(STREAM_ORIGIN_HEADER)
    if not value:
        return None
    try:
        return StreamOrigin.parse(value)
    except ValueError:
        return None  # not ours to judge: capture refuses such a mark when it restarts


def uncovered(origin: StreamOrigin | None, *, position: SourcePositionV1 | None = None,
              start_time: datetime | None = None) -> str | None:
    """Why a start point cannot be served from the stream (None: it can): it lies before the
    point capture began the source from, so changes right after it were never captured."""
    if origin is None:
        return None
    began = (f"capture began reading source at binlog {origin.binlog_file}:{origin.binlog_pos} "
             f"({utc_text(origin.ts)})")
    fix = ("; nothing committed before that is in the stream: create the changefeed with "
           "initial_load 'snapshot', or with a start point at or after where capture began")
    if position is not None and (binlog_order(position.binlog_file, position.binlog_pos)
                                 < origin.position_key()):
        return (f"the changefeed's start position {position.binlog_file}:{position.binlog_pos} is "
                f"before the source's stream begins: {began}{fix}")
    if start_time is not None and ts_threshold(start_time) + 1 < origin.ts:
        return (f"the changefeed's start time {utc_moment(start_time).isoformat()} is before the source's "
                f"stream begins: {began}{fix}")
    return None
