"""The apply job (Spark): a round's batch to the final image per key, written, in one Spark job.

The batch (``sort_job.SortResult``: rows events in order, per span) goes to Spark as one
pyarrow Table (``createDataFrame``), every step running in Python workers over Arrow batches
(``mapInArrow``); a batch of whole units only (below) on a classic session goes as an RDD of
its groups instead, which the JVM carries as opaque bytes, or in local mode only the paths of
files holding them (``groups_to_reports``, ``libs.spark_handoff``).

1. Explode: every row image of every event becomes a record keyed by ``(target, key)``; an
   update that changes the key becomes a delete of the old key followed by an upsert of the new
   one (sub-order 0 then 1), so the old row cannot survive under its old key.
2. Collapse: the last record per ``(target, key)`` by ``(ts, seq, part, row index,
   sub-order)``: the image the source had at the end of the batch.
3. Write: each partition writes its final images through the sink (``Sink.apply_partition``:
   delete by key, all deletes before any upsert; upsert that first removes rows holding the
   same unique-key values under another key), a transaction per target over one connection per
   downstream for the whole partition. No lock spans partitions: the batch ends at a
   consistent point of the source, so its final images satisfy every unique key together,
   and keys the downstream compares as equal are in one partition, so the order in which
   partitions land does not matter (the TDSQL "lucy" case needs no lock here). The driver
   sums the counts each partition returns.

Where the records of a key meet (``plan_partitions``): a target's spans (its upstream shards
too) are one unit. Units of at most ``SPLIT_EVENTS`` events, or of at most a partition's fair
share of the batch, are packed into as many groups as partitions, and each group goes to Spark
as *one row* (its events' fields as arrays; one element of the RDD): a row is never cut, so
whatever partition Spark (or a Spark Connect server) puts it in holds its units whole, and
explode, collapse and write run in one Python pass with no shuffle; the images never leave the
Python worker. A bigger unit goes as one row per event, its events explode in
parallel, and its records are hash-partitioned by ``(target, bucket)`` (``key_buckets``: keys
a downstream collation may compare as equal share a bucket) so its write is spread over
several partitions: the one shuffle of the job, of records, not bodies. Both paths are one
plan, and one ``collect`` runs it.

Values stay in their contract JSON encoding until the write decodes them
(``values.RowDecoder``), so Spark never has to know a column's type; a record crossing to the
JVM carries its image as JSON text.
"""

from __future__ import annotations

import contextlib
import json
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from contracts import REGISTRY
from contracts.events.rows import RowsChangedV2
from libs.spark import is_connect_session
from libs.spark_handoff import partition_rdd
from libs.table_rules import TableRules
from services.sink_worker.incidents.poison import RowFailure, Statement
from services.sink_worker.metrics import STAGE_SECONDS
from services.sink_worker.round.key_buckets import key_bucket
from services.sink_worker.round.large_values import LargeValues, holds_ref
from services.sink_worker.round.sort_job import BatchEvent
from services.sink_worker.sinks.base import Change, Delete, PartitionResult, TargetTable, Upsert
from services.sink_worker.sinks.error_class import ErrorClass
from services.sink_worker.sinks.unique_guard import DELETED, ConflictGuard, UniqueConflictPolicy

if TYPE_CHECKING:
    import pyarrow as pa

    from services.sink_worker.round.row_rules import SpanRowRules

RECORD_SCHEMA = StructType([
    # The target's index in the round's list of targets: an int is cheaper than its id string
    # to shuffle, hash and sort for every row change.
    StructField("target", IntegerType(), False),
    StructField("key", StringType(), False),
    StructField("ts", LongType(), False),
    StructField("seq", LongType(), False),
    StructField("part", IntegerType(), False),
    StructField("idx", IntegerType(), False),
    StructField("sub", IntegerType(), False),
    StructField("op", StringType(), False),  # "upsert" | "delete"
    # The contract's JSON values (a dict in the worker's process, JSON text in Spark).
    StructField("image", StringType(), True),
    # The partition: ``key_buckets.key_bucket``, equal for keys the downstream may see as equal.
    StructField("bucket", IntegerType(), False),
    # The span's index in the round's sorted span keys: which shard wrote a final image
    # (``sinks.unique_guard`` tells a lucy reorder from a cross-shard conflict by it).
    StructField("shard", IntegerType(), False),
])


@dataclass(frozen=True)
class TargetPlan:
    """Where one span's rows go: the sink and the target table (with the key to use)."""

    target_id: str
    sink_url: str
    table: TargetTable


@dataclass
class TargetCounts:
    deleted: int = 0
    upserted: int = 0
    conflicts_removed: int = 0


@dataclass
class ApplyResult:
    per_target: dict[str, TargetCounts] = field(default_factory=dict)
    partitions: int = 0
    overwritten: dict[str, list[str]] = field(default_factory=dict)
    """Per target, the cross-shard conflicts removed under policy ``overwrite`` (JSON reports)."""
    failures: dict[str, RowFailure] = field(default_factory=dict)
    """Targets a downstream refused for good (``poison``): one refused change each. The rest
    of such a target's batch may be written or not; it is not checkpointed."""

    @property
    def written(self) -> int:
        return sum(c.deleted + c.upserted for c in self.per_target.values())


_KEY_ENCODE = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


def key_json(image: dict[str, Any], key: tuple[str, ...]) -> str:
    # The contract's JSON value of each key column: one canonical text per key value. Integer
    # keys (most of them) are spelled directly: exactly what the encoder writes, at a fifth
    # of the cost, and this runs for every row change.
    if len(key) == 1:
        value = image[key[0]]
        if type(value) is int:
            return f"[{value}]"
        return _KEY_ENCODE([value])
    values = [image[c] for c in key]
    if set(map(type, values)) == _INT_ONLY:
        return "[" + ",".join(map(str, values)) + "]"
    return _KEY_ENCODE(values)


_INT_ONLY = {int}


def _key_bucket(image: dict[str, Any], key: tuple[str, ...]) -> int:
    if len(key) == 1:
        value = image[key[0]]
        if type(value) is int:
            return value & 0x7FFFFFFF  # no text to fold: the value itself spreads the keys
        return key_bucket([value])
    return key_bucket([image[c] for c in key])


SpanTargets = dict[str, tuple[int, tuple[str, ...], tuple[str, str] | None]]
"""span key -> (target index, key columns, origin column name and value or None)"""

Skips = dict[str, dict[str, int]]
"""span key -> {key JSON: ts}: that key's changes up to ts are left out (an operator's skip)."""


_LATEST: dict[str, int] = {}
# Older versions whose rows this job reads as they are: rows.changed v2 only added the row's
# ordinal, which the Spark path does not use (its order is (ts, seq, part, row)), so a v1 body
# still in the stream after an upgrade keeps the fast path; v3 only added the table's shape to
# the metadata, so a v2 body has v3's rows too; v4 only added ``event_id`` and ``more`` (several
# transactions a message), and capture still writes a message of one part as v3, so v3 is most
# of what a source of many small tables sends (it went through the registry here, 40 % of this
# job's Python time under bench_tables' writes, since v4 came).
_PARSE_ONLY = frozenset({("rows.changed", 1), ("rows.changed", 2), ("rows.changed", 3)})


def event_rows(body: bytes | str) -> list[dict[str, Any]]:
    """The row images of one rows event, as plain dicts (``RowImageV2`` fields).

    The driver validated every event of the batch when it pulled it (``pull.decode_for_span``),
    so a body in the newest contract version is only parsed here, not validated again (that
    was most of this job's Python time); an older version goes through the registry's
    upcasters like everywhere else.
    """
    obj = _parse(body)
    type_, version = obj["type"], obj["version"]
    if version == _latest(type_) or (type_, version) in _PARSE_ONLY:
        if obj["data"].get("more"):
            # A message of several transactions comes with the parts the batch takes from it
            # (``event_images``): whole, only its first part would be applied.
            raise ValueError("rows.changed message of several transactions given whole")
        return list(obj["data"]["rows"])
    event = REGISTRY.decode(body).event
    assert isinstance(event, RowsChangedV2)
    return [image.model_dump(mode="json") for image in event.rows]


def event_images(ts: int, seq: int, part: int, body: bytes,
                 picks: Sequence[int]) -> Iterator[tuple[int, int, int, list[dict[str, Any]]]]:
    """``(ts, seq, part, row images)`` of each event a batch event holds (``sort_job.BatchEvent``):
    the body itself at ``(ts, seq, part)`` without ``picks``, else each picked part of the
    message, at the place the message gives it. The message is parsed once for all its parts."""
    if not picks:
        yield ts, seq, part, event_rows(body)
        return
    obj = _parse(body)
    if obj["version"] == _latest(obj["type"]):
        data = obj["data"]
    else:  # a later contract version than this job's fast path knows: through the registry
        data = REGISTRY.decode(body).event.model_dump(mode="json")
    more = data.get("more") or []
    for i in picks:
        p = data if i == 0 else more[i - 1]
        yield p["ts"], p["seq"], p.get("part", 0), list(p["rows"])


def _parse(body: bytes | str) -> dict[str, Any]:
    # orjson parses a body in less than half of json's time, and this runs for every event;
    # what it refuses and json takes (NaN, a lone surrogate, an integer past 64 bits) still
    # parses as before.
    try:
        parsed: dict[str, Any] = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = json.loads(body)
    return parsed


SpanRules = dict[str, TableRules]
"""span key -> its table rules (``libs.table_rules``), for spans that have any."""


def rule_fields(rules: TableRules | None, op: str, before: dict[str, Any] | None,
                after: dict[str, Any] | None) -> tuple[str | None, str | None, str | None]:
    """``row_rules.RULE_FIELDS`` of a row: the event and its full images for the expressions."""
    if rules is None or not rules.needs_spark:
        return (None, None, None)
    return (op, None if before is None else json.dumps(before), None if after is None else json.dumps(after))


def _kept(image: dict[str, Any] | None, rules: TableRules) -> dict[str, Any] | None:
    if image is None:
        return None
    return {k: v for k, v in image.items() if rules.kept(k)}


def _no_bucket(image: dict[str, Any], key: tuple[str, ...]) -> int:
    return 0


def explode_event(span_targets: SpanTargets, span: str, ts: int, seq: int, part: int,
                  body: bytes, picks: Sequence[int] = (), skips: Skips | None = None, shard: int = 0,
                  rules: SpanRules | None = None, extended: bool = False,
                  buckets: bool = True) -> Iterator[tuple[Any, ...]]:
    """One batch event (``event_images``) to its row records (see ``RECORD_SCHEMA``), without
    skipped keys and the row events its table rules ignore by type, its images without the
    columns they leave out; ``extended`` adds ``row_rules.RULE_FIELDS`` to every record (null
    for spans without expressions). Without ``buckets`` every record's bucket is 0: records
    that are never shuffled (a whole unit in its partition) need none."""
    for ts_, seq_, part_, images in event_images(ts, seq, part, body, picks):
        yield from _explode_images(span_targets, span, ts_, seq_, part_, images, skips, shard, rules,
                                   extended, buckets)


def _explode_images(span_targets: SpanTargets, span: str, ts: int, seq: int, part: int,
                    images: list[dict[str, Any]], skips: Skips | None, shard: int,
                    rules: SpanRules | None, extended: bool, buckets: bool) -> Iterator[tuple[Any, ...]]:
    skipped = (skips or {}).get(span)
    if skipped:
        for record in _explode_images(span_targets, span, ts, seq, part, images, None, shard, rules,
                                      extended, buckets):
            upto = skipped.get(record[1])
            if upto is None or ts > upto:
                yield record
        return
    target, key, origin = span_targets[span]
    _bucket = _key_bucket if buckets else _no_bucket
    span_rules = (rules or {}).get(span)
    extra: tuple[Any, ...] = (None, None, None)
    for idx, image in enumerate(images):
        op, before, after = image["op"], image.get("before"), image.get("after")
        if span_rules is not None:
            if span_rules.ignores(op):
                continue
            extra = rule_fields(span_rules, op, before, after)
            before, after = _kept(before, span_rules), _kept(after, span_rules)
        if origin is not None:
            # Both images: a delete or key change must find this shard's row downstream.
            name, value = origin
            before = {name: value, **before} if before is not None else None
            after = {name: value, **after} if after is not None else None
        if op == "insert":
            assert after is not None
            record = (target, key_json(after, key), ts, seq, part, idx, 0, "upsert", after,
                      _bucket(after, key), shard)
            yield (*record, *extra) if extended else record
        elif op == "delete":
            assert before is not None
            record = (target, key_json(before, key), ts, seq, part, idx, 0, "delete", None,
                      _bucket(before, key), shard)
            yield (*record, *extra) if extended else record
        else:
            assert before is not None and after is not None
            old, new = key_json(before, key), key_json(after, key)
            if old != new:
                record = (target, old, ts, seq, part, idx, 0, "delete", None, _bucket(before, key), shard)
                yield (*record, *extra) if extended else record
            record = (target, new, ts, seq, part, idx, 1, "upsert", after, _bucket(after, key), shard)
            yield (*record, *extra) if extended else record


def _latest(type_: str) -> int:
    latest = _LATEST.get(type_)
    if latest is None:
        latest = _LATEST[type_] = REGISTRY.latest_version(type_)
    return latest


def shard_indexes(span_targets: SpanTargets) -> dict[str, int]:
    """Each span's index in the round (the ``shard`` of its records)."""
    return {span: i for i, span in enumerate(sorted(span_targets))}


@dataclass(frozen=True)
class GuardPlan:
    """A merged target without an origin column whose unique keys are guarded (``unique_guard``)."""

    policy: UniqueConflictPolicy
    owners: dict[str, int]
    """Key JSON -> the span index of the key's final image in the batch (``DELETED``: a delete)."""
    shard_names: list[str]
    target: str


Deferred = list[tuple[str, dict[str, Any], int, str | None]]
"""Upserts a partition leaves to the driver (images holding large-value references):
``(key JSON, image, shard, computed columns' JSON or None)``."""

PartitionReport = tuple[str, int, int, int, str | None, list[str], Deferred]
"""``(target id, deleted, upserted, conflicts removed, refusal JSON or None, overwrite
reports, deferred upserts)``"""


def _decode_key(table: TargetTable, text: str) -> tuple[Any, ...]:
    return _key_decoder(table)(text)


def _key_values(key: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """A decoded row's key values, as a tuple."""
    if len(key) == 1:
        name = key[0]
        return lambda row: (row[name],)
    return operator.itemgetter(*key)


def _key_decoder(table: TargetTable) -> Callable[[str], tuple[Any, ...]]:
    """Key JSON (``key_json``) to the key's decoded values, the columns looked up once."""
    from libs.codec.decode import decode_value

    columns = {c.name: c for c in table.meta.columns}
    kinds = [(columns[c].kind, columns[c].sql_type) for c in table.key]

    def decode(text: str) -> tuple[Any, ...]:
        values = json.loads(text)
        if len(values) == 1 and type(values[0]) is int and kinds[0][0] == "int":
            return (values[0],)
        return tuple(decode_value(kind, sql_type, v)
                     for (kind, sql_type), v in zip(kinds, values, strict=True))

    return decode


def _guard(plan: TargetPlan, spec: GuardPlan | None) -> ConflictGuard | None:
    if spec is None:
        return None
    return ConflictGuard(spec.policy, {_decode_key(plan.table, k): v for k, v in spec.owners.items()},
                         spec.shard_names, spec.target)


def _write(sink: Any, plan: TargetPlan, changes: list[Change], keys: list[str],
           guard: ConflictGuard | None, *, keep: bool = False) -> PartitionResult | RowFailure:
    """Write one target's changes; the refused change when the downstream refuses for good.
    ``keep``: the sink's connection stays open for the next write (``Sink.apply_partition``)."""
    try:
        result: PartitionResult = sink.apply_partition(plan.table, changes, guard, keep=keep)
        return result
    except Exception as exc:
        refused = _refusal(sink, plan.table, changes, keys, exc, guard)
        if refused is None:
            raise
        return refused


def write_deferred(plans: list[TargetPlan], guards: dict[int, GuardPlan], large: LargeValues,
                   deferred: dict[str, Deferred], result: ApplyResult) -> None:
    """Runs on the driver, after every partition: the upserts the partitions left because their
    images hold large-value references, one row per statement, each with its values put back
    just before it is decoded and written (so one decoded large row is held at a time). Keys
    the downstream compares as equal are in one partition, whose deletes are written by now."""
    from libs.codec.decode import RowDecoder
    from services.sink_worker.sinks.factory import open_sink

    index = {plan.target_id: i for i, plan in enumerate(plans)}
    for target_id, rows in deferred.items():
        if target_id in result.failures:
            continue  # the target is stopped: nothing more of its batch is written
        plan = plans[index[target_id]]
        sink = open_sink(plan.sink_url)
        decoder = RowDecoder(plan.table.meta, leave_out=plan.table.leave_out_columns)
        guard = _guard(plan, guards.get(index[target_id]))
        counts = result.per_target.setdefault(target_id, TargetCounts())
        for key_json_, image, shard, computed in rows:
            values = large.resolve(image)
            if computed is not None:
                values.update(json.loads(computed))
            decoded = decoder(values)
            upsert = Upsert(key=tuple(decoded[c] for c in plan.table.key), row=decoded, shard=shard)
            del decoded
            written = _write(sink, plan, [upsert], [key_json_], guard)
            del upsert
            if isinstance(written, RowFailure):
                result.failures[target_id] = written
                break
            counts.upserted += written.upserted
            counts.conflicts_removed += written.conflicts_removed
            if written.overwritten:
                result.overwritten.setdefault(target_id, []).extend(written.overwritten)


def _refusal(sink: Any, table: TargetTable, changes: list[Change], keys: list[str],
             exc: BaseException, guard: ConflictGuard | None = None) -> RowFailure | PartitionResult | None:
    """The refused change of a failed write, None when the failure is transient, or the result
    of a guarded target's second attempt that succeeded."""
    from services.sink_worker.incidents.poison import describe_error, locate_poison
    from services.sink_worker.sinks.error_class import classify

    def kind(e: BaseException) -> ErrorClass:
        return classify(getattr(sink, "dialect", ""), e)

    if kind(exc) != "permanent":
        return None
    if guard is not None:
        # A guarded target's partitions race for a unique value: the loser's plain INSERT fails
        # until the winner commits. Once more as a whole, now that it has.
        try:
            result: PartitionResult = sink.apply_partition(table, changes, guard)
            return result
        except Exception as again:
            if kind(again) != "permanent":
                raise
            exc = again
    # Sorted as the sink writes them, so each bisected half locks rows in the same order.
    index, error = locate_poison(lambda part: sink.apply_partition(table, part, guard), changes, kind, exc)
    message, code = describe_error(error)
    if index is None:
        return RowFailure("batch", None, table.key, message, code)
    statement: Statement = "upsert" if isinstance(changes[index], Upsert) else "delete"
    return RowFailure(statement, keys[index], table.key, message, code)


EVENT_SCHEMA = StructType([
    StructField("span", StringType(), False),
    StructField("ts", LongType(), False),
    StructField("seq", LongType(), False),
    StructField("part", IntegerType(), False),
    StructField("body", BinaryType(), False),
    StructField("picks", ArrayType(IntegerType(), False), False),
])
"""A batch event as Spark gets it (``sort_job.BatchEvent``), one per row: a chunk of a split unit."""

GROUP_SCHEMA = StructType([StructField(f.name, ArrayType(f.dataType, False), False)
                           for f in EVENT_SCHEMA.fields])
"""Whole units as one row: the fields of their events as arrays. A row is never cut, so its
units stay together in whatever partition Spark (or a Spark Connect server) puts it."""

FINAL_SCHEMA = StructType([
    StructField("target", IntegerType(), False),
    StructField("key", StringType(), False),
    StructField("op", StringType(), False),
    StructField("image", StringType(), True),
    StructField("shard", IntegerType(), False),
    StructField("computed", StringType(), True),
])
"""A key's final image (``computed``: the computed columns' JSON, null without any)."""

REPORT_SCHEMA = StructType([
    StructField("target_id", StringType(), False),
    StructField("deleted", LongType(), False),
    StructField("upserted", LongType(), False),
    StructField("conflicts", LongType(), False),
    StructField("failure", StringType(), True),
    StructField("overwritten", StringType(), False),  # JSON list of reports
    StructField("deferred", StringType(), False),  # JSON list of ``Deferred`` entries
])

SPLIT_EVENTS = 2000
"""A unit (a target's spans) with more events than this in a round explodes in chunks and has
its write spread over several partitions by key hash (one shuffle of its records); smaller
units are a partition each, with no shuffle."""

_OUT_ROWS = 8192  # rows per Arrow batch a Python worker hands back


@dataclass(frozen=True)
class ApplyPlan:
    """What every partition of the job needs (shipped with the job, so picklable)."""

    span_targets: SpanTargets
    plans: list[TargetPlan]
    skips: Skips | None = None
    rules: SpanRules | None = None
    extended: bool = False
    """Records carry ``row_rules.RULE_FIELDS`` (some span has expressions)."""
    guards: dict[int, GuardPlan] = field(default_factory=dict)
    defer_large: bool = False
    local_owners: bool = False
    """Guarded targets are whole in their partition: the owners come from its own collapse."""


def _arrow() -> Any:
    import pyarrow as pa

    return pa


def _spark_to_arrow(schema: StructType) -> pa.Schema:
    pa = _arrow()
    types = {"string": pa.string(), "bigint": pa.int64(), "int": pa.int32(), "binary": pa.binary()}

    def arrow_type(t: Any) -> Any:
        if isinstance(t, ArrayType):
            return pa.list_(pa.field("element", arrow_type(t.elementType), nullable=t.containsNull))
        return types[t.simpleString()]

    return pa.schema([pa.field(f.name, arrow_type(f.dataType), nullable=f.nullable) for f in schema.fields])


def _batches(schema: StructType, rows: Iterable[Sequence[Any]]) -> Iterator[pa.RecordBatch]:
    """``rows`` (tuples in ``schema``'s field order) as Arrow batches of ``_OUT_ROWS`` rows."""
    pa = _arrow()
    arrow_schema = _spark_to_arrow(schema)
    chunk: list[Sequence[Any]] = []

    def flush() -> Any:
        columns: list[Sequence[Any]] = list(zip(*chunk, strict=True)) if chunk else [[] for _ in arrow_schema]
        return pa.RecordBatch.from_arrays([pa.array(col, type=f.type) for col, f in zip(columns, arrow_schema,
                                                                                        strict=True)],
                                          schema=arrow_schema)

    for row in rows:
        chunk.append(row)
        if len(chunk) >= _OUT_ROWS:
            yield flush()
            chunk = []
    if chunk:
        yield flush()


def _rows(batches: Iterable[pa.RecordBatch]) -> Iterator[tuple[Any, ...]]:
    """The rows of Arrow batches as tuples, column by column (no per-row dict)."""
    for batch in batches:
        yield from zip(*(column.to_pylist() for column in batch.columns), strict=True)


def _grouped_rows(batches: Iterable[pa.RecordBatch]) -> Iterator[tuple[Any, ...]]:
    """The events of ``GROUP_SCHEMA`` rows, in order."""
    for group in _rows(batches):
        yield from zip(*group, strict=True)


def explode_events(plan: ApplyPlan, events: Iterable[Sequence[Any]],
                   buckets: bool = True) -> Iterator[tuple[Any, ...]]:
    """``explode_event`` over batch events ``(span, ts, seq, part, body, picks)``."""
    shard_of = shard_indexes(plan.span_targets)
    for span, ts, seq, part, body, picks in events:
        yield from explode_event(plan.span_targets, span, ts, seq, part, body, picks, plan.skips,
                                 shard_of[span], plan.rules, plan.extended, buckets)


def collapse(records: Iterable[Sequence[Any]]) -> Iterator[tuple[Any, ...]]:
    """The last record per ``(target, key)`` by ``(ts, seq, part, idx, sub)``, as a final image
    ``(target, key, op, image, shard, computed)``; ``records`` in ``RECORD_SCHEMA`` order, with
    ``computed`` as a twelfth field when there is one."""
    last: dict[tuple[int, str], Sequence[Any]] = {}
    get = last.get
    for r in records:
        k = (r[0], r[1])
        seen = get(k)
        if seen is None or tuple(r[2:7]) > tuple(seen[2:7]):
            last[k] = r
    for r in last.values():
        yield (r[0], r[1], r[7], r[8], r[10], r[11] if len(r) > 11 else None)


def explode_collapse(plan: ApplyPlan, events: Iterable[Sequence[Any]]) -> Iterator[tuple[Any, ...]]:
    """``collapse(explode_events(plan, events))`` in one loop, for records that are never
    shuffled: no record tuple, generator step or bucket per row change, only the order and
    the final image of each key. Spans with skips, table rules or an origin column take
    ``explode_event`` (as do all of a plan with expressions, whose records Spark evaluates)."""
    if plan.extended:
        yield from collapse(explode_events(plan, events, buckets=False))
        return
    shard_of = shard_indexes(plan.span_targets)
    skips, rules = plan.skips or {}, plan.rules or {}
    last: dict[tuple[int, str], tuple[tuple[int, int, int, int, int], str, Any, int]] = {}
    get = last.get
    for span, ts0, seq0, part0, body, picks in events:
        target, key, origin = plan.span_targets[span]
        shard = shard_of[span]
        if origin is not None or skips.get(span) or span in rules:
            for r in explode_event(plan.span_targets, span, ts0, seq0, part0, body, picks, plan.skips,
                                   shard, plan.rules, buckets=False):
                k = (r[0], r[1])
                order = (r[2], r[3], r[4], r[5], r[6])
                seen = get(k)
                if seen is None or order > seen[0]:
                    last[k] = (order, r[7], r[8], r[10])
            continue
        for ts, seq, part, images in event_images(ts0, seq0, part0, body, picks):
            _collapse_images(last, target, key, shard, ts, seq, part, images)
    for (target, key_text), (_, op, image, shard) in last.items():
        yield (target, key_text, op, image, shard, None)


def _collapse_images(last: dict[tuple[int, str], tuple[tuple[int, int, int, int, int], str, Any, int]],
                     target: int, key: tuple[str, ...], shard: int, ts: int, seq: int, part: int,
                     images: list[dict[str, Any]]) -> None:
    """``explode_collapse``'s inner loop over one event's images, into ``last``."""
    get = last.get
    for idx, image in enumerate(images):
        op = image["op"]
        if op == "insert":
            after = image["after"]
            k = (target, key_json(after, key))
            order = (ts, seq, part, idx, 0)
            seen = get(k)
            if seen is None or order > seen[0]:
                last[k] = (order, "upsert", after, shard)
        elif op == "delete":
            k = (target, key_json(image["before"], key))
            order = (ts, seq, part, idx, 0)
            seen = get(k)
            if seen is None or order > seen[0]:
                last[k] = (order, "delete", None, shard)
        else:
            after = image["after"]
            old, new = key_json(image["before"], key), key_json(after, key)
            if old != new:
                k = (target, old)
                order = (ts, seq, part, idx, 0)
                seen = get(k)
                if seen is None or order > seen[0]:
                    last[k] = (order, "delete", None, shard)
            k = (target, new)
            order = (ts, seq, part, idx, 1)
            seen = get(k)
            if seen is None or order > seen[0]:
                last[k] = (order, "upsert", after, shard)


def write_finals(plan: ApplyPlan, finals: Iterable[Sequence[Any]]) -> Iterator[PartitionReport]:
    """Runs on an executor: decode final images and write them per target.

    A target the downstream refuses for good (``sinks.error_class``) does not fail the
    partition: its refused change is found (``poison.locate_poison``) and reported in the
    fifth field, and the partition goes on with the other targets. With ``defer_large``, an
    upsert whose image holds a large-value reference (``large_values``) is not written here:
    it is handed back to the driver in the last field. With ``local_owners``, a guarded
    target's owners are the partition's own final images (the target is whole here)."""
    # Imported here: executors need them, the driver's import of this module does not.
    from libs.codec.decode import RowDecoder
    from services.sink_worker.sinks.factory import open_sink

    plans = plan.plans
    decoders = [RowDecoder(p.table.meta, leave_out=p.table.leave_out_columns) for p in plans]
    key_decoders = [_key_decoder(p.table) for p in plans]
    key_of = [_key_values(p.table.key) for p in plans]
    changes: list[list[Change]] = [[] for _ in plans]
    keys: list[list[str]] = [[] for _ in plans]
    deferred: list[Deferred] = [[] for _ in plans]
    owners: dict[int, dict[str, int]] = {}
    for target, key_json_, op, image, shard, computed in finals:
        if plan.local_owners and target in plan.guards:
            owners.setdefault(target, {})[key_json_] = DELETED if op == "delete" else shard
        if op == "upsert":
            values = json.loads(image) if isinstance(image, str) else image
            if plan.defer_large and holds_ref(values):
                deferred[target].append((key_json_, values, shard, computed))
                continue
            if computed is not None:
                values = {**values, **json.loads(computed)}
            decoded = decoders[target](values)
            changes[target].append(Upsert(key=key_of[target](decoded), row=decoded, shard=shard))
        else:
            changes[target].append(Delete(key=key_decoders[target](key_json_)))
        keys[target].append(key_json_)
    # One connection per downstream for the partition's targets, one transaction each (a
    # partition of a round over hundreds of small tables opened a connection per table).
    sinks: dict[str, Any] = {}
    try:
        for index, (target_plan, target_changes, target_keys) in enumerate(
                zip(plans, changes, keys, strict=True)):
            if not target_changes:
                if deferred[index]:
                    yield (target_plan.target_id, 0, 0, 0, None, [], deferred[index])
                continue
            sink = sinks.get(target_plan.sink_url)
            if sink is None:
                sink = sinks[target_plan.sink_url] = open_sink(target_plan.sink_url)
            spec = plan.guards.get(index)
            if spec is not None and plan.local_owners:
                spec = GuardPlan(spec.policy, owners.get(index, {}), spec.shard_names, spec.target)
            result = _write(sink, target_plan, target_changes, target_keys, _guard(target_plan, spec),
                            keep=True)
            if isinstance(result, RowFailure):
                # Refused for good: the target stops, so its large upserts are not written either.
                yield (target_plan.target_id, 0, 0, 0, result.to_json(), [], [])
                continue
            yield (target_plan.target_id, result.deleted, result.upserted, result.conflicts_removed, None,
                   result.overwritten, deferred[index])
    finally:
        for sink in sinks.values():
            sink.close()


def _report_rows(reports: Iterable[PartitionReport]) -> Iterator[tuple[Any, ...]]:
    for target_id, deleted, upserted, conflicts, failure, overwritten, later in reports:
        yield (target_id, deleted, upserted, conflicts, failure, json.dumps(overwritten), json.dumps(later))


def _record_rows(records: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    for r in records:
        yield (*r[:8], None if r[8] is None else json.dumps(r[8]), *r[9:])


def _final_rows(finals: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    for target, key, op, image, shard, computed in finals:
        yield (target, key, op, image if image is None or isinstance(image, str) else json.dumps(image),
               shard, computed)


def _gc_paused(stage: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    from libs.gc_pause import gc_paused

    with gc_paused():
        yield from stage


# The functions mapInArrow runs (the plan bound with functools.partial).

def events_to_reports(plan: ApplyPlan, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Rows of whole units (``GROUP_SCHEMA``): explode, collapse and write in one pass."""
    finals = explode_collapse(plan, _grouped_rows(batches))
    return _gc_paused(_batches(REPORT_SCHEMA, _report_rows(write_finals(plan, finals))))


def groups_to_reports(plan: ApplyPlan, groups: Iterable[list[BatchEvent]]) -> Iterator[tuple[Any, ...]]:
    """Whole units as plain Python lists (an RDD partition of ``parallelize``): explode, collapse
    and write in one pass, as ``events_to_reports`` does from Arrow; report rows as tuples."""
    from libs.gc_pause import gc_paused

    with gc_paused():
        for group in groups:
            yield from _report_rows(write_finals(plan, explode_collapse(plan, group)))


def events_to_records(plan: ApplyPlan, grouped: bool,
                      batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    events = _grouped_rows(batches) if grouped else _rows(batches)
    return _gc_paused(_batches(record_schema(plan.extended), _record_rows(explode_events(plan, events))))


def records_to_finals(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    return _gc_paused(_batches(FINAL_SCHEMA, _final_rows(collapse(_rows(batches)))))


def records_to_reports(plan: ApplyPlan, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    finals = collapse(_rows(batches))
    return _gc_paused(_batches(REPORT_SCHEMA, _report_rows(write_finals(plan, finals))))


def finals_to_reports(plan: ApplyPlan, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    return _gc_paused(_batches(REPORT_SCHEMA, _report_rows(write_finals(plan, _rows(batches)))))


def record_schema(extended: bool) -> StructType:
    if not extended:
        return RECORD_SCHEMA
    from services.sink_worker.round.row_rules import RULE_FIELDS

    return StructType([*RECORD_SCHEMA.fields, *RULE_FIELDS])


@dataclass(frozen=True)
class PartitionPlan:
    local: list[list[BatchEvent]]
    """Whole units, packed into at most as many groups as partitions: no shuffle."""
    split: list[BatchEvent]
    """The big units' events, one row each: exploded in parallel, then shuffled by key hash."""


def plan_partitions(events: Sequence[BatchEvent], span_targets: SpanTargets, partitions: int,
                    split_events: int = SPLIT_EVENTS) -> PartitionPlan:
    """Which events go to which partition (see the module docstring)."""
    units: dict[int, list[BatchEvent]] = {}
    for e in events:
        units.setdefault(span_targets[e[0]][0], []).append(e)
    # A unit's size in events: a message of several parts counts each part it holds. A unit is
    # split only when it is big and more than a partition's fair share of the batch: units that
    # fill the partitions between them (a round of many busy tables) are parallel already, and
    # splitting them only added the job's one shuffle, of every row change, through the JVM.
    sizes = {target: sum(len(e[5]) or 1 for e in u) for target, u in units.items()}
    share = sum(sizes.values()) / max(1, partitions)
    split = {t for t, n in sizes.items() if n > split_events and n > share}
    small = [u for t, u in units.items() if t not in split]
    big = [e for t, u in units.items() if t in split for e in u]
    # The small units packed into at most ``partitions`` partitions of about equal bytes,
    # largest first, each into the lightest partition so far.
    bins: list[list[BatchEvent]] = [[] for _ in range(min(partitions, len(small)))]
    weights = [0] * len(bins)
    for unit in sorted(small, key=lambda u: -sum(len(e[4]) for e in u)):
        i = weights.index(min(weights))
        bins[i].extend(unit)
        weights[i] += sum(len(e[4]) + 32 for e in unit)
    return PartitionPlan(local=[b for b in bins if b], split=big)


def _events_frame(spark: SparkSession, events: Sequence[BatchEvent]) -> DataFrame:
    """One row per event (``EVENT_SCHEMA``), as one Arrow table."""
    pa = _arrow()
    schema = _spark_to_arrow(EVENT_SCHEMA)
    columns = [pa.array(col, type=f.type) for col, f in zip(zip(*events, strict=True), schema, strict=True)]
    return spark.createDataFrame(pa.Table.from_arrays(columns, schema=schema), EVENT_SCHEMA)


def _groups_frame(spark: SparkSession, groups: list[list[BatchEvent]]) -> DataFrame:
    """One row per group of whole units (``GROUP_SCHEMA``), as one Arrow table."""
    pa = _arrow()
    schema = _spark_to_arrow(GROUP_SCHEMA)
    per_field: list[list[list[Any]]] = [[] for _ in EVENT_SCHEMA.fields]
    for group in groups:
        for i, col in enumerate(zip(*group, strict=True)):
            per_field[i].append(list(col))
    arrays = [pa.array(values, type=f.type) for values, f in zip(per_field, schema, strict=True)]
    return spark.createDataFrame(pa.Table.from_arrays(arrays, schema=schema), GROUP_SCHEMA)


def _records(spark: SparkSession, plan: ApplyPlan, parts: PartitionPlan, partitions: int,
             row_rules: dict[str, SpanRowRules] | None) -> DataFrame:
    """The records of the batch, those of the small units in the partitions they came in,
    those of the big units hash-partitioned by (target, bucket); with ``computed``."""
    schema = record_schema(plan.extended)
    frames = []
    if parts.local:
        frames.append(_groups_frame(spark, parts.local).mapInArrow(partial(events_to_records, plan, True),
                                                                   schema))
    if parts.split:
        frames.append(_events_frame(spark, parts.split)
                      .mapInArrow(partial(events_to_records, plan, False), schema)
                      .repartition(partitions, "target", "bucket"))
    records = frames[0] if len(frames) == 1 else frames[0].union(frames[1])
    if row_rules:
        from services.sink_worker.round.row_rules import evaluate

        shard_of = shard_indexes(plan.span_targets)
        # Projections and a filter: they keep the partitions as they are.
        return evaluate(records, {shard_of[span]: r for span, r in row_rules.items()})
    return records.withColumn("computed", F.lit(None).cast("string"))


def apply_frame(spark: SparkSession, plan: ApplyPlan, parts: PartitionPlan, partitions: int,
                row_rules: dict[str, SpanRowRules] | None = None) -> DataFrame:
    """The job's plan (``REPORT_SCHEMA``), for a batch with no guarded target split over
    partitions (``run_apply`` handles those)."""
    if not row_rules:
        frames = []
        if parts.local:
            frames.append(_groups_frame(spark, parts.local).mapInArrow(partial(events_to_reports, plan),
                                                                       REPORT_SCHEMA))
        if parts.split:
            split = PartitionPlan(local=[], split=parts.split)
            frames.append(_records(spark, plan, split, partitions, None)
                          .mapInArrow(partial(records_to_reports, plan), REPORT_SCHEMA))
        return frames[0] if len(frames) == 1 else frames[0].union(frames[1])
    return (_records(spark, plan, parts, partitions, row_rules)
            .mapInArrow(partial(records_to_reports, plan), REPORT_SCHEMA))


def final_images(spark: SparkSession, events: Sequence[BatchEvent], span_targets: SpanTargets,
                 partitions: int, skips: Skips | None = None, rules: SpanRules | None = None,
                 row_rules: dict[str, SpanRowRules] | None = None,
                 split_events: int = SPLIT_EVENTS) -> DataFrame:
    """The last record per (target, key) of the batch (``FINAL_SCHEMA``): keys the downstream
    may compare as equal share a partition (``key_buckets``), whose write deletes before it
    upserts. ``rules``: spans' table rules (events ignored by type, columns left out);
    ``row_rules``: spans whose rules have expressions, evaluated by ``row_rules.evaluate``
    before the collapse, so an ignored change never becomes a key's final image."""
    plan = ApplyPlan(span_targets=span_targets, plans=[], skips=skips, rules=rules, extended=bool(row_rules))
    parts = plan_partitions(events, span_targets, partitions, split_events)
    return _records(spark, plan, parts, partitions, row_rules).mapInArrow(records_to_finals, FINAL_SCHEMA)


def _timed_collect(job: Callable[[], Any]) -> list[Any]:
    """``job()``'s plan (a DataFrame or an RDD, its data handed to Spark) collected, the two
    steps timed as the round's ``frame`` and ``job`` stages."""
    t0 = time.monotonic()
    planned = job()
    t1 = time.monotonic()
    out: list[Any] = planned.collect()
    STAGE_SECONDS.labels("frame").observe(t1 - t0)
    STAGE_SECONDS.labels("job").observe(time.monotonic() - t1)
    return out


def run_apply(spark: SparkSession, batch: Sequence[BatchEvent], span_plans: dict[str, TargetPlan],
              partitions: int, origins: dict[str, tuple[str, str]] | None = None,
              skips: Skips | None = None, guarded: dict[str, UniqueConflictPolicy] | None = None,
              span_names: dict[str, str] | None = None, large: LargeValues | None = None,
              rules: SpanRules | None = None, row_rules: dict[str, SpanRowRules] | None = None,
              split_events: int = SPLIT_EVENTS) -> ApplyResult:
    """Collapse ``batch`` (rows events of the round's cut, ``SortResult.batch``) and write it;
    ``span_plans`` maps each span key in the batch to its target, ``origins`` a span key to the
    origin column name and value its rows gain (shard routing with an origin column),
    ``skips`` the keys an operator skipped, ``guarded`` the merged targets (by id) whose unique
    keys need ``unique_guard`` and their policy, ``span_names`` the names its reports use,
    ``large`` the round's large values (``large_values``: the batch's bodies hold references to
    them), ``rules`` and ``row_rules`` the spans' table rules (see ``final_images``)."""
    # Shards of one target share its plan (and its index): their rows collapse together.
    plans = list({plan.target_id: plan for plan in span_plans.values()}.values())
    index = {plan.target_id: i for i, plan in enumerate(plans)}
    span_targets: SpanTargets = {span: (index[plan.target_id], plan.table.key, (origins or {}).get(span))
                                 for span, plan in span_plans.items()}
    result = ApplyResult(partitions=partitions)
    if not batch:
        return result
    names = [(span_names or {}).get(span, span) for span in sorted(span_targets)]
    guards: dict[int, GuardPlan] = {}
    for target_plan in plans:
        if target_plan.target_id in (guarded or {}):
            table = target_plan.table
            guards[index[target_plan.target_id]] = GuardPlan(
                (guarded or {})[target_plan.target_id], {}, names,
                f"{table.schema}.{table.name}" if table.schema else table.name)
    parts = plan_partitions(batch, span_targets, partitions, split_events)
    defer = large is not None and len(large) > 0
    plan = ApplyPlan(span_targets=span_targets, plans=plans, skips=skips, rules=rules,
                     extended=bool(row_rules), guards=guards, defer_large=defer, local_owners=True)
    split_targets = {span_targets[e[0]][0] for e in parts.split}
    reports: list[Any]
    if not parts.split and not row_rules and not is_connect_session(spark):
        # Only whole units: on a classic session an RDD of the groups, which the JVM carries as
        # opaque pickled bytes, where a DataFrame (``apply_frame``) has it convert every event
        # from Arrow to Spark's rows and back to Arrow on its way to the Python worker.
        # In local mode the groups reach the tasks by file, not through the JVM's heap at all
        # (``libs.spark_handoff``).
        with contextlib.ExitStack() as files:
            reports = _timed_collect(
                lambda: files.enter_context(partition_rdd(spark.sparkContext, parts.local))
                .mapPartitions(partial(groups_to_reports, plan)))
    elif not (guards.keys() & split_targets):
        reports = _timed_collect(lambda: apply_frame(spark, plan, parts, partitions, row_rules))
    else:
        # A guarded target split over partitions: every partition's write must know the owner
        # of every key of it, so the final images are made (and kept) first, the owners
        # collected, then written: two jobs, only in such a round.
        final = _records(spark, plan, parts, partitions, row_rules).mapInArrow(records_to_finals,
                                                                               FINAL_SCHEMA).cache()
        try:
            for target, key, op, shard in (final.where(F.col("target").isin(list(guards)))
                                           .select("target", "key", "op", "shard").collect()):
                guards[target].owners[key] = DELETED if op == "delete" else shard
            plan = ApplyPlan(span_targets=span_targets, plans=plans, skips=skips, rules=rules,
                             extended=bool(row_rules), guards=guards, defer_large=defer)
            reports = final.mapInArrow(partial(finals_to_reports, plan), REPORT_SCHEMA).collect()
        finally:
            final.unpersist()
    deferred: dict[str, Deferred] = {}
    for target_id, deleted, upserted, conflicts, failure, overwritten, later in reports:
        for key_json_, image, shard, computed in json.loads(later):
            deferred.setdefault(target_id, []).append((key_json_, image, shard, computed))
        if overwritten_list := json.loads(overwritten):
            result.overwritten.setdefault(target_id, []).extend(overwritten_list)
        if failure is not None:
            result.failures.setdefault(target_id, RowFailure.from_json(failure))
        c = result.per_target.setdefault(target_id, TargetCounts())
        c.deleted += deleted
        c.upserted += upserted
        c.conflicts_removed += conflicts
    if deferred:
        assert large is not None
        write_deferred(plans, guards, large, deferred, result)
    return result
