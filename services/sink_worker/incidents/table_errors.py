"""A table stopped at a DDL its downstream cannot take: the hook that makes it visible.

The span stays at the DDL (its checkpoint below it, so nothing after it is applied and the
DDL is never skipped), its state is ``error`` with the statement and the reason in the
worker's ``/healthz`` span status, ``sluice_sink_ddl_failures_total`` counts it and the log
says it once per new failure. Every round tries the DDL again, so a downstream fixed by an
operator lets the span go on by itself. Per-table operator actions (skip/retry/resume) belong
to the per-table error state of apply errors; ``DdlFailure`` is what that state records for
a DDL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from libs.scheduling.model import Span
from services.sink_worker import metrics as m

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DdlFailure:
    statement: str
    reason: str
    ts: int
    stream_seq: int

    def message(self) -> str:
        return f"DDL at ts {self.ts} cannot be applied downstream: {self.reason}"

    def as_status(self) -> dict[str, Any]:
        return {"statement": self.statement, "reason": self.reason, "ts": self.ts,
                "stream_seq": self.stream_seq}


def ddl_failed(span: Span, statement: str, ts: int, stream_seq: int, reason: str,
               previous: DdlFailure | None = None) -> DdlFailure:
    """Record that ``span`` cannot apply its DDL; logged and counted once per new failure."""
    failure = DdlFailure(statement=statement, reason=reason, ts=ts, stream_seq=stream_seq)
    if failure != previous:
        m.DDL_FAILURES.labels(span.changefeed).inc()
        log.error("DDL cannot be applied downstream; the table stops at it: %s", reason,
                  extra={"span": span.name, "statement": statement[:500], "ts": ts})
    return failure
