"""Table rules on rows, in Spark: the ``ignore_*_value_expr`` filters and computed columns of
``libs.table_rules`` as Spark SQL expressions over the row images.

Row records of a span with such rules carry three more fields: the row event (``ev``) and its
full before/after images as contract JSON (``bj``, ``aj``: dropped columns included, so a
filter may use a column that never leaves the source; the JSON lives only inside the job).
``evaluate`` parses the images with a schema built from the table's metadata (values cast from
their contract encoding to Spark types), evaluates each expression with Spark's own analyser
and code generation, drops the records an expression ignores and adds ``computed``: the JSON
object of the computed columns' values, which the write merges into the image.

A record's fields stay one struct (``__rec``) while the image's columns are spread out for the
expressions: a table column may be named like a record field (``key``, ``ts``) without either
shadowing the other (the few working columns start with ``__``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    NullType,
    StringType,
    StructField,
    StructType,
)

from contracts.events.rows import ColumnV1, RowImageV2, RowsChangedV2, TableMetaV1
from libs.table_rules import ComputedColumn, TableRules
from services.sink_worker.sinks.nats_stream import ChangeSource

RULE_FIELDS = [
    StructField("ev", StringType(), True),  # the row event: insert | update | delete
    StructField("bj", StringType(), True),  # before image, contract JSON
    StructField("aj", StringType(), True),  # after image, contract JSON
]

_DECIMAL = re.compile(r"decimal\s*\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)", re.IGNORECASE)
_COMPUTED_TYPE = {"string": "string", "int": "bigint", "float": "double"}


def _json_type(column: ColumnV1) -> DataType:
    """How the contract JSON of a column parses: numbers as numbers, the rest as text."""
    if column.kind in ("int", "bit"):
        return LongType()
    if column.kind == "float":
        return DoubleType()
    return StringType()


def _sql_type(column: ColumnV1) -> str | None:
    """The Spark type a column's text becomes for the expressions (None: stays as parsed)."""
    if column.kind == "decimal":
        m = _DECIMAL.search(column.sql_type)
        precision, scale = (int(m.group(1)), int(m.group(2) or 0)) if m else (38, 10)
        return f"decimal({min(precision, 38)},{min(scale, 38)})"
    if column.kind == "date":
        return "date"
    if column.kind in ("datetime", "timestamp"):
        return "timestamp"
    return None


def json_schema(meta: TableMetaV1) -> StructType:
    return StructType([StructField(c.name, _json_type(c), True) for c in meta.columns])


def _typed(struct: str, meta: TableMetaV1) -> list[Column]:
    """The image's columns, by name, in the types the expressions see."""
    out = []
    for c in meta.columns:
        col = F.col(f"{struct}.`{c.name}`")
        target = _sql_type(c)
        out.append((col.cast(target) if target else col).alias(c.name))
    return out


@dataclass(frozen=True)
class SpanRowRules:
    """One span's expressions, with the source metadata its images have (picklable)."""

    meta: TableMetaV1
    rules: TableRules


def _cond(expr: str | None) -> Column:
    # NULL (an expression over NULL values) does not ignore the row: only a true result does.
    return F.coalesce(F.expr(expr).cast("boolean"), F.lit(False)) if expr else F.lit(False)


def _computed(columns: Sequence[ComputedColumn]) -> Column:
    if not columns:
        return F.lit(None).cast("string")
    return F.to_json(F.struct(*[F.expr(c.expr).cast(_COMPUTED_TYPE[c.type]).alias(c.name) for c in columns]))


def evaluate(records: DataFrame, spans: dict[int, SpanRowRules], shard_column: str = "shard") -> DataFrame:
    """``records`` without the rows their span's expressions ignore, plus ``computed`` (the
    computed columns' JSON, on records with a new image; null for spans without any).

    One projection chain over every record, a few steps per span with rules (its images
    parsed only on its own records): no union, so the Python explode feeding ``records`` runs
    once, and Spark pipelines the whole chain into the stage that reads them."""
    fields = [c for c in records.columns if c not in ("ev", "bj", "aj")]
    keep = ["__rec", "__ev", "__bj", "__aj"]
    cur = records.select(F.struct(*[F.col(c) for c in fields]).alias("__rec"), F.col("ev").alias("__ev"),
                         F.col("bj").alias("__bj"), F.col("aj").alias("__aj"),
                         F.lit(False).alias("__ignored"), F.lit(None).cast("string").alias("__computed"))
    ev = F.col("__ev")
    for shard, span in sorted(spans.items()):
        rules, meta = span.rules, span.meta
        exprs = rules.expressions
        schema = json_schema(meta)
        mine = F.col(f"__rec.{shard_column}") == shard
        cur = cur.select(*keep, "__ignored", "__computed",
                         F.when(mine, F.from_json("__bj", schema)).alias("__b0"),
                         F.when(mine, F.from_json("__aj", schema)).alias("__a0"))
        cur = cur.select(*keep, "__ignored", "__computed", F.struct(*_typed("__a0", meta)).alias("__a"),
                         *_typed("__b0", meta))
        on_before = (F.when(ev == "update", _cond(exprs.get("update_old")))
                     .when(ev == "delete", _cond(exprs.get("delete"))).otherwise(F.lit(False)))
        ignored = (F.col("__ignored") | (mine & on_before)).alias("__ignored")
        cur = cur.select(*keep, "__computed", "__a", ignored)
        cur = cur.select(*keep, "__computed", "__ignored", "__a.*")
        on_after = (F.when(ev == "update", _cond(exprs.get("update_new")))
                    .when(ev == "insert", _cond(exprs.get("insert"))).otherwise(F.lit(False)))
        computed = F.when(mine & (ev != "delete"), _computed(rules.computed)).otherwise(F.col("__computed"))
        cur = cur.select(*keep, (F.col("__ignored") | (mine & on_after)).alias("__ignored"),
                         computed.alias("__computed"))
    return cur.where(~F.col("__ignored")).select("__rec.*", F.col("__computed").alias("computed"))


def analyse(spark: SparkSession, meta: TableMetaV1, rules: TableRules) -> str | None:
    """Why the rules' expressions do not fit the table (Spark's parser and analyser on an empty
    frame of the table's columns: unknown columns, wrong functions, a filter that is not a
    condition), None when they do. Cheap: nothing runs."""
    from pyspark.errors import PySparkException
    from pyspark.sql.utils import AnalysisException, ParseException

    empty = spark.createDataFrame([], json_schema(meta)).select(*_typed_top(meta))
    checks = [(role, expr) for role, expr in rules.expressions.items()]
    checks += [(f"computed column {c.name}", c.expr) for c in rules.computed]
    for role, expr in checks:
        try:
            result = empty.select(F.expr(expr).alias("v")).schema["v"].dataType
        except (ParseException, AnalysisException, PySparkException) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"{_ROLE_FIELD.get(role, role)} {expr!r} does not fit the table: {first}"
        if role in _ROLE_FIELD and not isinstance(result, BooleanType | NullType):
            return (f"{_ROLE_FIELD[role]} {expr!r} is a {result.simpleString()}, not a condition "
                    "(true leaves the row out)")
    return None


_ROLE_FIELD = {"insert": "ignore_insert_value_expr", "update_old": "ignore_update_old_value_expr",
               "update_new": "ignore_update_new_value_expr", "delete": "ignore_delete_value_expr"}


def _typed_top(meta: TableMetaV1) -> list[Column]:
    out = []
    for c in meta.columns:
        target = _sql_type(c)
        col = F.col(f"`{c.name}`")
        out.append((col.cast(target) if target else col).alias(c.name))
    return out


def stream_rows(spark: SparkSession, meta: TableMetaV1, rules: TableRules,
                events: list[ChangeSource]) -> list[ChangeSource]:
    """The NATS sink's view of a span's batch under its table rules: rows of ignored event types
    and rows an expression ignores left out (the expressions evaluated by one Spark job over
    the batch's rows), images without the left-out columns and with the computed ones. Events
    left without rows are dropped."""
    computed: dict[tuple[int, int], str | None] | None = None
    if rules.needs_spark:
        rows = [(0, i, j, image.op, None if image.before is None else json.dumps(image.before),
                 None if image.after is None else json.dumps(image.after))
                for i, e in enumerate(events) if isinstance(e.event, RowsChangedV2)
                for j, image in enumerate(e.event.rows) if not rules.ignores(image.op)]
        schema = StructType([StructField(name, IntegerType(), False) for name in ("shard", "eidx", "idx")]
                            + RULE_FIELDS)
        computed = {}
        if rows:
            frame = spark.createDataFrame(rows, schema)
            for _, eidx, idx, value in evaluate(frame, {0: SpanRowRules(meta, rules)}).collect():
                computed[(eidx, idx)] = value
    out: list[ChangeSource] = []
    for i, e in enumerate(events):
        if not isinstance(e.event, RowsChangedV2):
            out.append(e)
            continue
        ids: list[int] = []
        images: list[RowImageV2] = []
        for j, image in enumerate(e.event.rows):
            if rules.ignores(image.op) or (computed is not None and (i, j) not in computed):
                continue
            extra = json.loads(value) if computed is not None and (value := computed[(i, j)]) else {}
            ids.append(j)
            images.append(RowImageV2(op=image.op, before=_kept(image.before, rules, {}),
                                     after=_kept(image.after, rules, extra)))
        if images:
            out.append(ChangeSource(e.event_id, e.event.model_copy(update={"rows": images}), tuple(ids)))
    return out


def _kept(image: dict[str, Any] | None, rules: TableRules, extra: dict[str, Any]) -> dict[str, Any] | None:
    if image is None:
        return None
    return {**{k: v for k, v in image.items() if rules.kept(k)}, **extra}
