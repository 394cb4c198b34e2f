"""Continuous validation: what a downstream row should be, the status records and the requests.

The sink-worker that runs a span validates it (``services/sink_worker/validation/validator.py``); the api
reads what it records and asks for on-demand compares. Both meet in the ``sluice-validation``
KV bucket:

- ``<span kv_key>``: the span's ``SpanValidation`` JSON, written by the worker running it (the
  next owner reads it back, so reported rows and a compare in progress survive a move);
- ``<changefeed>.request``: the newest ``CompareRequest`` for the changefeed, written by the api.
  A changefeed id is ``[A-Za-z0-9_-]+``, so it is one KV token as it is, and the request key
  (two tokens) never meets a span key (four).

What the downstream should hold is decided here, from the table rules, with the values
normalised as ``libs.checksum`` normalises them for the checksum compare:

- dropped columns are not compared (they never leave the source), nor are computed columns
  (the sink computes them with Spark; the validator does not re-run the expression) or the
  origin column (the sink adds it);
- a row that exists upstream but not downstream is a mismatch unless the rules may have left
  its insert out (``ignore_events: insert`` or an insert expression) or may have ignored an
  update (a key change ignored keeps the old key);
- a row that exists downstream but not upstream is a mismatch unless the rules may have left
  its delete out (``ignore_events: delete`` or a delete expression), or an update;
- values differ only in ``full`` mode and only when the rules leave no update out (an ignored
  update keeps the older image downstream, which is what the rules say it should hold).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from uuid import uuid4

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, Field

from contracts.events.rows import ColumnV1
from libs.checksum import normalize
from libs.nats_client import read_json
from libs.streams import VALIDATION_BUCKET
from libs.table_rules import TableRules

MismatchKind = Literal["missing", "extra", "different"]


# --------------------------------------------------------------------------- what to compare


@dataclass(frozen=True)
class RowPlan:
    """How one table's rows are compared, from its rules and its target's columns."""

    columns: tuple[ColumnV1, ...]
    """The target columns compared (kept source columns; no computed or origin column)."""
    report_missing: bool
    report_extra: bool
    compare_values: bool

    @classmethod
    def of(cls, mode: str, target_columns: Sequence[ColumnV1], rules: TableRules | None,
           skip: Sequence[str] = ()) -> RowPlan:
        computed = {c.name for c in rules.computed} if rules is not None else set()
        columns = tuple(c for c in target_columns if c.name not in computed and c.name not in skip)
        ignores = rules.ignore_events if rules is not None else frozenset()
        exprs = rules.expressions if rules is not None else {}
        updates_left_out = "update" in ignores or "update_old" in exprs or "update_new" in exprs
        return cls(columns=columns,
                   report_missing=not ("insert" in ignores or "insert" in exprs or updates_left_out),
                   report_extra=not ("delete" in ignores or "delete" in exprs or updates_left_out),
                   compare_values=mode == "full" and not updates_left_out)


@dataclass(frozen=True)
class Mismatch:
    kind: MismatchKind
    columns: tuple[str, ...] = ()
    """``different``: the columns that differ."""


def compare_row(plan: RowPlan, upstream: Mapping[str, Any] | None,
                downstream: Mapping[str, Any] | None) -> Mismatch | None:
    """What is wrong with ``downstream`` given ``upstream`` (None: nothing, as the rules say)."""
    if upstream is None and downstream is None:
        return None
    if downstream is None:
        return Mismatch("missing") if plan.report_missing else None
    if upstream is None:
        return Mismatch("extra") if plan.report_extra else None
    if not plan.compare_values:
        return None
    differ = tuple(c.name for c in plan.columns
                   if normalize(upstream.get(c.name), c) != normalize(downstream.get(c.name), c))
    return Mismatch("different", differ) if differ else None


def key_text(columns: Sequence[ColumnV1], values: Sequence[Any]) -> str:
    """One text per key, equal for equal keys whichever driver read them (``normalize``)."""
    return json.dumps([normalize(v, c) for c, v in zip(columns, values, strict=True)],
                      ensure_ascii=False)


# --------------------------------------------------------------------------- records


class ReportedRow(BaseModel):
    key: dict[str, Any] = Field(description="The row's key columns (contract JSON values).")
    kind: MismatchKind = Field(description="missing: upstream only; extra: downstream only; "
                                           "different: both, with other values.")
    columns: list[str] = Field(default_factory=list, description="different: the columns that differ.")
    since: float = Field(description="When it was found (Unix seconds).")


class CompareProgress(BaseModel):
    """An on-demand compare of a whole table, resumable by key range."""

    request_id: str
    state: Literal["running", "done", "failed"] = "running"
    after_key: list[Any] | None = Field(None, description="Contract JSON of the last key compared.")
    rows_checked: int = 0
    rows_estimate: int = 0
    chunks_done: int = 0
    candidates: int = Field(0, description="Rows that differed when read; each is re-checked before "
                                           "it is reported.")
    started_at: float = 0.0
    finished_at: float | None = None
    error: str | None = None


class SpanValidation(BaseModel):
    """One span's validation status (the ``<span kv_key>`` record)."""

    changefeed: str
    span: str
    source: str
    database: str
    table: str
    target: str = ""
    mode: str = "off"
    worker: str = ""
    checkpoint_ts: int = 0
    checked_at: float = 0.0
    rows_checked: int = 0
    pending: int = Field(0, description="Changed rows waiting for their check.")
    rechecking: int = Field(0, description="Rows that differed once, waiting for their re-check at a "
                                           "checkpoint past the read (rows in flight).")
    mismatches: int = 0
    found_total: int = 0
    repaired_total: int = 0
    skipped_total: int = Field(0, description="Changed rows not checked: more than the pending limit.")
    error: str | None = None
    reported: list[ReportedRow] = Field(default_factory=list)
    compare: CompareProgress | None = None


class CompareRequest(BaseModel):
    id: str
    requested_by: str = ""
    requested_at: float = 0.0


def request_key(changefeed: str) -> str:
    return f"{changefeed}.request"


async def bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    try:
        return await js.key_value(VALIDATION_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(bucket=VALIDATION_BUCKET, history=1, replicas=replicas,
                                         description="Sluice validation status and compare requests")


async def span_statuses(kv: KeyValue, changefeed: str) -> list[SpanValidation]:
    """Every status record of ``changefeed``'s spans (keys ``<changefeed>.*.*.*``), by span."""
    watcher = await kv.watch(f"{changefeed}.*.*.*", ignore_deletes=True)
    out: list[SpanValidation] = []
    try:
        async for entry in watcher:
            if entry is None:
                break  # every current value delivered
            try:
                out.append(SpanValidation.model_validate_json(entry.value or b""))
            except ValueError:
                continue  # not a status this version can read: leave it out
    finally:
        await watcher.stop()
    return sorted(out, key=lambda s: s.span)


async def request_compare(js: JetStreamContext, changefeed: str, requested_by: str,
                          replicas: int = 1) -> CompareRequest:
    """Ask the workers of ``changefeed`` to compare every table of it from its first key."""
    request = CompareRequest(id=uuid4().hex[:12], requested_by=requested_by, requested_at=time.time())
    kv = await bucket(js, replicas)
    await kv.put(request_key(changefeed), request.model_dump_json().encode())
    return request


async def read_request(kv: KeyValue, changefeed: str) -> CompareRequest | None:
    raw = await read_json(kv, request_key(changefeed))
    return CompareRequest.model_validate(raw) if raw is not None else None
