"""The apply job (Spark): a sorted batch to the final image per key, written in parallel.

1. Explode: every row image of every event becomes a record keyed by ``(target, key)``; an
   update that changes the key becomes a delete of the old key followed by an upsert of the new
   one (sub-order 0 then 1), so the old row cannot survive under its old key.
2. Collapse: repartition by a hash of ``(target, bucket)`` (``key_buckets``: keys a downstream
   collation may compare as equal share a bucket), then a window over ``(target, key)``
   ordered by ``(ts, seq, part, row index, sub-order)`` keeps only the last record per key: the
   image the source had at the end of the batch. The window needs exactly the clustering the
   repartition made, so this is one shuffle, not two.
3. Write: every partition writes its final images through the sink (``Sink.apply_partition``:
   delete by key, all deletes before any upsert; upsert that first removes rows holding the
   same unique-key values under another key). No lock spans partitions: the batch ends at a
   consistent point of the source, so its final images satisfy every unique key together,
   and keys the downstream compares as equal are in one partition, so the order in which
   partitions land does not matter (the TDSQL "lucy" case needs no lock here). The driver
   sums the counts each partition returns.

Values stay in their contract JSON encoding until the partition decodes them
(``values.RowDecoder``), so Spark never has to know a column's type. Between the explode and
the write an image travels pickled (a dict of those JSON values; it never leaves this job):
half the cost of JSON text in the Python workers and plain bytes to the JVM, for every row
change of a round.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame, Row, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType

from contracts import REGISTRY
from contracts.events.rows import RowsChangedV1
from libs.table_rules import TableRules
from services.sink_worker.key_buckets import key_bucket
from services.sink_worker.large_values import LargeValues, holds_ref
from services.sink_worker.poison import RowFailure, Statement
from services.sink_worker.sinks.base import Change, Delete, PartitionResult, TargetTable, Upsert
from services.sink_worker.sinks.error_class import ErrorClass
from services.sink_worker.sinks.unique_guard import DELETED, ConflictGuard, UniqueConflictPolicy

if TYPE_CHECKING:
    from services.sink_worker.row_rules import SpanRowRules

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
    StructField("image", BinaryType(), True),  # pickled dict of the contract's JSON values
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
    if all(type(v) is int for v in values):
        return "[" + ",".join(map(str, values)) + "]"
    return _KEY_ENCODE(values)


def _bucket(image: dict[str, Any], key: tuple[str, ...]) -> int:
    if len(key) == 1:
        value = image[key[0]]
        if type(value) is int:
            return value & 0x7FFFFFFF  # no text to fold: the value itself spreads the keys
        return key_bucket([value])
    return key_bucket([image[c] for c in key])


def _pack(image: dict[str, Any]) -> bytes:
    return pickle.dumps(image, protocol=pickle.HIGHEST_PROTOCOL)


SpanTargets = dict[str, tuple[int, tuple[str, ...], tuple[str, str] | None]]
"""span key -> (target index, key columns, origin column name and value or None)"""

Skips = dict[str, dict[str, int]]
"""span key -> {key JSON: ts}: that key's changes up to ts are left out (an operator's skip)."""


_LATEST: dict[str, int] = {}


def event_rows(body: bytes | str) -> list[dict[str, Any]]:
    """The row images of one rows event, as plain dicts (``RowImageV1`` fields).

    The driver validated every event of the batch when it pulled it (``pull.decode_for_span``),
    so a body in the newest contract version is only parsed here, not validated again (that
    was most of this job's Python time); an older version goes through the registry's
    upcasters like everywhere else.
    """
    obj = json.loads(body)
    type_, version = obj["type"], obj["version"]
    if version == _latest(type_):
        return list(obj["data"]["rows"])
    event = REGISTRY.decode(body).event
    assert isinstance(event, RowsChangedV1)
    return [image.model_dump(mode="json") for image in event.rows]


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


def explode_event(span_targets: SpanTargets, span: str, ts: int, seq: int, part: int,
                  body: bytes, skips: Skips | None = None, shard: int = 0,
                  rules: SpanRules | None = None, extended: bool = False) -> Iterator[tuple[Any, ...]]:
    """One rows event to its row records (see ``RECORD_SCHEMA``), without skipped keys and the
    row events its table rules ignore by type, its images without the columns they leave out;
    ``extended`` adds ``row_rules.RULE_FIELDS`` to every record (null for spans without
    expressions)."""
    skipped = (skips or {}).get(span)
    if skipped:
        for record in explode_event(span_targets, span, ts, seq, part, body, shard=shard, rules=rules,
                                    extended=extended):
            upto = skipped.get(record[1])
            if upto is None or ts > upto:
                yield record
        return
    target, key, origin = span_targets[span]
    span_rules = (rules or {}).get(span)
    extra: tuple[Any, ...] = (None, None, None)
    for idx, image in enumerate(event_rows(body)):
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
            record = (target, key_json(after, key), ts, seq, part, idx, 0, "upsert", _pack(after),
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
            record = (target, new, ts, seq, part, idx, 1, "upsert", _pack(after), _bucket(after, key), shard)
            yield (*record, *extra) if extended else record


def _latest(type_: str) -> int:
    latest = _LATEST.get(type_)
    if latest is None:
        latest = _LATEST[type_] = REGISTRY.latest_version(type_)
    return latest


_EXPLODE_INPUT = ("span", "ts", "seq", "part", "body")


def explode_partition(span_targets: SpanTargets, skips: Skips | None, rules: SpanRules | None,
                      extended: bool, rows: Iterator[Row]) -> Iterator[tuple[Any, ...]]:
    """``explode_event`` over a partition (rows of ``_EXPLODE_INPUT``, unpacked by position:
    cheaper than Row's lookups by name), without the garbage collector (``libs.gc_pause``)."""
    from libs.gc_pause import gc_paused

    shard_of = shard_indexes(span_targets)
    with gc_paused():
        for span, ts, seq, part, body in rows:
            yield from explode_event(span_targets, span, ts, seq, part, body, skips, shard_of[span],
                                     rules, extended)


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


Deferred = list[tuple[str, bytes, int, str | None]]
"""Upserts a partition leaves to the driver (images holding large-value references):
``(key JSON, pickled image, shard, computed columns' JSON or None)``."""

PartitionReport = tuple[str, int, int, int, str | None, list[str], Deferred]


def _decode_key(table: TargetTable, text: str) -> tuple[Any, ...]:
    from services.sink_worker.values import decode_value

    columns = {c.name: c for c in table.meta.columns}
    return tuple(decode_value(columns[c].kind, columns[c].sql_type, v)
                 for c, v in zip(table.key, json.loads(text), strict=True))


def _guard(plan: TargetPlan, spec: GuardPlan | None) -> ConflictGuard | None:
    if spec is None:
        return None
    return ConflictGuard(spec.policy, {_decode_key(plan.table, k): v for k, v in spec.owners.items()},
                         spec.shard_names, spec.target)


def _write(sink: Any, plan: TargetPlan, changes: list[Change], keys: list[str],
           guard: ConflictGuard | None) -> PartitionResult | RowFailure:
    """Write one target's changes; the refused change when the downstream refuses for good."""
    try:
        result: PartitionResult = sink.apply_partition(plan.table, changes, guard)
        return result
    except Exception as exc:
        refused = _refusal(sink, plan.table, changes, keys, exc, guard)
        if refused is None:
            raise
        return refused


def write_partition(plans: list[TargetPlan], guards: dict[int, GuardPlan], defer_large: bool,
                    rows: Iterator[Row]) -> Iterator[PartitionReport]:
    """Runs on an executor: decode one partition's final images and write them per target.

    A target the downstream refuses for good (``sinks.error_class``) does not fail the
    partition: its refused change is found (``poison.locate_poison``) and reported in the
    fifth field, and the partition goes on with the other targets. With ``defer_large``, an
    upsert whose image holds a large-value reference (``large_values``) is not written here:
    it is handed back to the driver in the last field."""
    # Imported here: executors need them, the driver's import of this module does not.
    from libs.gc_pause import gc_paused
    from services.sink_worker.sinks.factory import open_sink
    from services.sink_worker.values import RowDecoder

    with gc_paused():
        decoders = [RowDecoder(plan.table.meta) for plan in plans]
        changes: list[list[Change]] = [[] for _ in plans]
        keys: list[list[str]] = [[] for _ in plans]
        deferred: list[Deferred] = [[] for _ in plans]
        # Positional fields (see final_images): Row lookups by name cost more than the rest.
        for target, key_json_, op, image, shard, computed in rows:
            table = plans[target].table
            if op == "upsert":
                values = pickle.loads(image)
                if defer_large and holds_ref(values):
                    deferred[target].append((key_json_, image, shard, computed))
                    continue
                if computed is not None:
                    values.update(json.loads(computed))
                decoded = decoders[target](values)
                key = tuple(decoded[c] for c in table.key)
                changes[target].append(Upsert(key=key, row=decoded, shard=shard))
            else:
                changes[target].append(Delete(key=_decode_key(table, key_json_)))
            keys[target].append(key_json_)
        sinks: dict[str, Any] = {}
        for index, (plan, target_changes, target_keys) in enumerate(zip(plans, changes, keys, strict=True)):
            if not target_changes:
                if deferred[index]:
                    yield (plan.target_id, 0, 0, 0, None, [], deferred[index])
                continue
            sink = sinks.get(plan.sink_url)
            if sink is None:
                sink = sinks[plan.sink_url] = open_sink(plan.sink_url)
            result = _write(sink, plan, target_changes, target_keys, _guard(plan, guards.get(index)))
            if isinstance(result, RowFailure):
                # Refused for good: the target stops, so its large upserts are not written either.
                yield (plan.target_id, 0, 0, 0, result.to_json(), [], [])
                continue
            yield (plan.target_id, result.deleted, result.upserted, result.conflicts_removed, None,
                   result.overwritten, deferred[index])


def write_deferred(plans: list[TargetPlan], guards: dict[int, GuardPlan], large: LargeValues,
                   deferred: dict[str, Deferred], result: ApplyResult) -> None:
    """Runs on the driver, after every partition: the upserts the partitions left because their
    images hold large-value references, one row per statement, each with its values put back
    just before it is decoded and written (so one decoded large row is held at a time). Keys
    the downstream compares as equal are in one partition, whose deletes are written by now."""
    from services.sink_worker.sinks.factory import open_sink
    from services.sink_worker.values import RowDecoder

    index = {plan.target_id: i for i, plan in enumerate(plans)}
    for target_id, rows in deferred.items():
        if target_id in result.failures:
            continue  # the target is stopped: nothing more of its batch is written
        plan = plans[index[target_id]]
        sink = open_sink(plan.sink_url)
        decoder = RowDecoder(plan.table.meta)
        guard = _guard(plan, guards.get(index[target_id]))
        counts = result.per_target.setdefault(target_id, TargetCounts())
        for key_json_, image, shard, computed in rows:
            values = large.resolve(pickle.loads(image))
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
    from services.sink_worker.poison import describe_error, locate_poison
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


def final_images(spark: SparkSession, batch: DataFrame, span_targets: SpanTargets,
                 partitions: int, skips: Skips | None = None, rules: SpanRules | None = None,
                 row_rules: dict[str, SpanRowRules] | None = None) -> DataFrame:
    """The last record per (target, key) of the batch: ``target, key, op, image, shard,
    computed`` (as in ``RECORD_SCHEMA``; ``computed``: the computed columns' JSON or null), in
    ``partitions`` partitions by a hash of (target, bucket): keys the downstream may compare as
    equal share a partition (``key_buckets``), whose write deletes before it upserts.

    ``rules``: spans' table rules (events ignored by type, columns left out); ``row_rules``:
    spans whose rules have expressions, evaluated by ``row_rules.evaluate`` before the collapse,
    so an ignored change never becomes a key's final image."""
    extended = bool(row_rules)
    # explode_partition yields RECORD_SCHEMA tuples by construction: no per-row type check.
    explode = partial(explode_partition, span_targets, skips, rules, extended)
    exploded = batch.select(*_EXPLODE_INPUT).rdd.mapPartitions(explode)
    if row_rules:
        from services.sink_worker.row_rules import RULE_FIELDS, evaluate

        shard_of = shard_indexes(span_targets)
        records = spark.createDataFrame(exploded, StructType([*RECORD_SCHEMA.fields, *RULE_FIELDS]),
                                        verifySchema=False)
        records = evaluate(records, {shard_of[span]: r for span, r in row_rules.items()})
    else:
        records = spark.createDataFrame(exploded, RECORD_SCHEMA, verifySchema=False).withColumn(
            "computed", F.lit(None).cast("string"))
    # Hash-partitioned by (target, bucket) first: a key has one bucket, so the window over
    # (target, bucket, key) is the window over (target, key), and its clustering is satisfied
    # by that partitioning: Spark adds no second shuffle, and the write runs on these
    # partitions as they are.
    order = Window.partitionBy("target", "bucket", "key").orderBy(
        F.desc("ts"), F.desc("seq"), F.desc("part"), F.desc("idx"), F.desc("sub"))
    return (records.repartition(partitions, "target", "bucket")
            .withColumn("_rn", F.row_number().over(order)).where(F.col("_rn") == 1)
            .select("target", "key", "op", "image", "shard", "computed"))


def run_apply(spark: SparkSession, batch: DataFrame, span_plans: dict[str, TargetPlan],
              partitions: int, origins: dict[str, tuple[str, str]] | None = None,
              skips: Skips | None = None, guarded: dict[str, UniqueConflictPolicy] | None = None,
              span_names: dict[str, str] | None = None, large: LargeValues | None = None,
              rules: SpanRules | None = None, row_rules: dict[str, SpanRowRules] | None = None
              ) -> ApplyResult:
    """Collapse ``batch`` (rows events of the sort job) and write it; ``span_plans`` maps each
    span key in the batch to its target, ``origins`` a span key to the origin column name and
    value its rows gain (shard routing with an origin column), ``skips`` the keys an operator
    skipped, ``guarded`` the merged targets (by id) whose unique keys need ``unique_guard`` and
    their policy, ``span_names`` the names its reports use, ``large`` the round's large values
    (``large_values``: the batch's bodies hold references to them), ``rules`` and
    ``row_rules`` the spans' table rules (see ``final_images``)."""
    # Shards of one target share its plan (and its index): their rows collapse together.
    plans = list({plan.target_id: plan for plan in span_plans.values()}.values())
    index = {plan.target_id: i for i, plan in enumerate(plans)}
    span_targets: SpanTargets = {span: (index[plan.target_id], plan.table.key, (origins or {}).get(span))
                                 for span, plan in span_plans.items()}
    final = final_images(spark, batch, span_targets, partitions, skips, rules, row_rules)
    guards: dict[int, GuardPlan] = {}
    if guarded:
        # Who wrote each key's final image, for the guarded targets only: one more pass over
        # the (cached) final images, so the write of every partition knows every owner.
        final = final.cache()
        names = [(span_names or {}).get(span, span) for span in sorted(span_targets)]
        for plan in plans:
            if plan.target_id in guarded:
                table = plan.table
                guards[index[plan.target_id]] = GuardPlan(
                    guarded[plan.target_id], {}, names,
                    f"{table.schema}.{table.name}" if table.schema else table.name)
        for target, key, op, shard in (final.where(F.col("target").isin(list(guards)))
                                       .select("target", "key", "op", "shard").collect()):
            guards[target].owners[key] = DELETED if op == "delete" else shard
    defer = large is not None and len(large) > 0
    try:
        counts = final.rdd.mapPartitions(partial(write_partition, plans, guards, defer)).collect()
    finally:
        if guarded:
            final.unpersist()
    result = ApplyResult(partitions=partitions)
    deferred: dict[str, Deferred] = {}
    for target_id, deleted, upserted, conflicts, failure, overwritten, later in counts:
        if later:
            deferred.setdefault(target_id, []).extend(later)
        if overwritten:
            result.overwritten.setdefault(target_id, []).extend(overwritten)
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
