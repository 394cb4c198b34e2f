"""Row-change, DDL and resolved-ts contracts published by capture on the ROWS stream.

Values travel as JSON with one encoding per column kind (see ``ColumnV1.kind``) so every sink
decodes them the same way:

- ``int``: JSON integer (unsigned BIGINT included, up to 2**64-1); ``float``: JSON number;
  ``decimal``: string (exact digits, the column's scale, never an exponent);
- ``string`` (char, varchar, text, enum): JSON string; ``set``: JSON string, comma separated,
  as MySQL itself spells it (definition order; the empty set is ``""``);
- ``bytes`` (binary, varbinary, blob): base64 string;
- ``date``: ``YYYY-MM-DD``; ``datetime`` and ``timestamp``: ISO 8601 without zone,
  ``YYYY-MM-DDTHH:MM:SS.ffffff`` (always six fractional digits; timestamps are UTC);
  ``time``: ``[-]HH:MM:SS.ffffff`` (hours may exceed 24);
- ``json``: the JSON document as text (MariaDB: exactly as stored); ``bit``: integer;
- ``geometry`` (POINT ... GEOMETRYCOLLECTION): base64 of MariaDB's internal format, the SRID
  as 4 bytes little-endian then the WKB; a column's declared SRID is in its ``sql_type``
  (``point srid 4326``).

``NULL`` is JSON ``null`` for every kind. A value that has no faithful encoding (a zero date
``0000-00-00``, an INET6 column) is never sent: capture rejects the table instead.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contracts.registry import register, upcaster

ColumnKind = Literal["int", "float", "decimal", "string", "set", "bytes", "date", "datetime",
                     "timestamp", "time", "json", "bit", "geometry"]
"""``geometry`` came with rows.changed v4 and ddl.executed v3 (``_BeforeGeometry``)."""
RowOp = Literal["insert", "update", "delete"]


class ColumnV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    name: str = Field(min_length=1)
    kind: ColumnKind
    sql_type: str = Field(description="The source's column type, e.g. 'decimal(12,2)', for DDL.")
    nullable: bool = True


class RowImageV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    op: RowOp
    before: dict[str, Any] | None = Field(None, description="Full image before (update, delete).")
    after: dict[str, Any] | None = Field(None, description="Full image after (insert, update).")


class TableMetaV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    columns: list[ColumnV1]
    primary_key: list[str] = Field(description="Primary-key columns; empty when the table has none.")
    unique_keys: list[list[str]] = Field(default_factory=list, description="Other unique keys.")


class IndexPartV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    column: str = Field(min_length=1)
    prefix: int | None = Field(None, ge=1, description="Length of a prefix index part (characters "
                               "of a text column, bytes of a binary one); null: the whole column.")
    descending: bool = False


class IndexV1(BaseModel):
    """A secondary index of the source table (the primary key is ``TableMetaV1.primary_key``)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    name: str = Field(min_length=1)
    unique: bool = False
    kind: Literal["btree", "hash", "fulltext", "spatial"] = "btree"
    parts: list[IndexPartV1] = Field(min_length=1)
    comment: str = ""


class ColumnShapeV1(BaseModel):
    """What the source declares about a column beyond its kind and nullability."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    name: str = Field(min_length=1)
    default: str | None = Field(None, description="The default: a literal's value (unquoted text; "
                                "bits as their integer) or an expression's SQL as the source spells "
                                "it; null: no default (or DEFAULT NULL).")
    default_expression: bool = False
    charset: str | None = None
    collation: str | None = None
    comment: str = ""
    auto_increment: bool = False


class TableShapeV1(BaseModel):
    """The source table's definition as far as a downstream may rebuild it: per column default,
    charset, collation, comment and AUTO_INCREMENT; the secondary and unique indexes; the
    table's own charset, collation and comment. Read from information_schema only where it holds
    at the event's binlog position (as the rest of the metadata)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    columns: list[ColumnShapeV1] = Field(default_factory=list)
    indexes: list[IndexV1] = Field(default_factory=list)
    charset: str | None = None
    collation: str | None = None
    comment: str = ""


class TableMetaV2(TableMetaV1):
    """``TableMetaV1`` and, when capture knows it at the event's position, the table's shape."""

    shape: TableShapeV1 | None = Field(None, description="The source's definition beyond the "
                                       "columns' kinds; null when not known at the position.")


def meta_with(shape: TableShapeV1 | None, **fields: Any) -> TableMetaV1:
    """Table metadata of ``fields``, a ``TableMetaV2`` when there is a shape to carry (else the
    plain v1, so metadata without a shape compares equal to what it always was)."""
    return TableMetaV2(**fields, shape=shape) if shape is not None else TableMetaV1(**fields)


def shape_of(meta: TableMetaV1) -> TableShapeV1 | None:
    """The table shape ``meta`` carries, None for metadata without one."""
    return meta.shape if isinstance(meta, TableMetaV2) else None


class _BeforeGeometry(BaseModel):
    """The versions registered before the ``geometry`` kind (rows.changed v1-v3, ddl.executed
    v1-v2) keep their meaning: a message of theirs with a geometry column is invalid, as a reader
    of that version finds it, and their JSON Schemas list the kinds they always had. The versions
    after set ``carries_geometry``."""

    carries_geometry: ClassVar[bool] = False

    @model_validator(mode="after")
    def _kinds_of_this_version(self) -> Self:
        if not self.carries_geometry:
            for meta in (getattr(self, "meta", None), getattr(self, "meta_after", None)):
                if meta is not None and any(c.kind == "geometry" for c in meta.columns):
                    raise ValueError("a column of kind 'geometry' needs rows.changed v4 / ddl.executed v3")
        return self

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        schema = super().model_json_schema(*args, **kwargs)
        if not cls.carries_geometry:
            kind = schema.get("$defs", {}).get("ColumnV1", {}).get("properties", {}).get("kind", {})
            kind["enum"] = [k for k in kind.get("enum", []) if k != "geometry"]
        return schema


class SourcePositionV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    binlog_file: str
    binlog_pos: int = Field(ge=0, description="End position of the event in the binlog file.")
    gtid: str | None = None


@register("rows.changed", 1)
class RowsChangedV1(_BeforeGeometry):
    """Rows of one table changed by one transaction (or part of it, ``part`` counts from 0)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    source: str = Field(min_length=1)
    database: str = Field(min_length=1)
    table: str = Field(min_length=1)
    ts: int = Field(ge=0, description="Commit ts of the transaction: physical_ms << 18 | logical.")
    seq: int = Field(ge=0, description="Order of this message within the source's stream.")
    part: int = Field(0, ge=0)
    last_part: bool = Field(True, description="False while more messages of this txn/table follow.")
    position: SourcePositionV1
    meta: TableMetaV1
    rows: list[RowImageV1] = Field(min_length=1)


class RowImageV2(BaseModel):
    """A row image with its place in the transaction.

    ``ordinal`` counts the transaction's rows in binlog order across all its tables, from 0:
    capture publishes one message per (transaction, table), and a consumer that must replay
    several tables of one transaction in source order (a foreign-key table group) merges them by
    it. ``None`` for rows upcast from v1, whose order across tables is unknown.
    """

    model_config = ConfigDict(extra="forbid", defer_build=True)
    op: RowOp
    before: dict[str, Any] | None = Field(None, description="Full image before (update, delete).")
    after: dict[str, Any] | None = Field(None, description="Full image after (insert, update).")
    ordinal: int | None = Field(None, ge=0, description="Binlog order of the row within its "
                                "transaction, across all tables; null when unknown (upcast from v1).")


@register("rows.changed", 2)
class RowsChangedV2(_BeforeGeometry):
    """Rows of one table changed by one transaction (or part of it, ``part`` counts from 0);
    as v1, and each row carries its ordinal within the transaction."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    source: str = Field(min_length=1)
    database: str = Field(min_length=1)
    table: str = Field(min_length=1)
    ts: int = Field(ge=0, description="Commit ts of the transaction: physical_ms << 18 | logical.")
    seq: int = Field(ge=0, description="Order of this message within the source's stream.")
    part: int = Field(0, ge=0)
    last_part: bool = Field(True, description="False while more messages of this txn/table follow.")
    position: SourcePositionV1
    meta: TableMetaV1
    rows: list[RowImageV2] = Field(min_length=1)


# A v1 message does not say where its rows sat among the other tables' rows of the transaction:
# the ordinal stays unknown and consumers keep v1's order (publish order, then row order).
@upcaster("rows.changed", 1)
def _rows_changed_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "rows": [{**row, "ordinal": None} for row in data["rows"]]}


@register("ddl.executed", 1)
class DdlExecutedV1(_BeforeGeometry):
    """A schema change of one table, in stream order with its rows."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    source: str = Field(min_length=1)
    database: str = Field(min_length=1)
    table: str = Field(min_length=1)
    ts: int = Field(ge=0)
    seq: int = Field(ge=0)
    statement: str = Field(min_length=1)
    position: SourcePositionV1
    meta_after: TableMetaV1 | None = Field(None, description="Table metadata after the change.")


@register("rows.changed", 3)
class RowsChangedV3(RowsChangedV2):
    """As v2; the metadata may carry the table's shape (``TableMetaV2.shape``)."""

    meta: TableMetaV2


# v2's metadata is v3's without a shape: the body carries over as it is.
@upcaster("rows.changed", 2)
def _rows_changed_v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    return dict(data)


class RowsPartV1(BaseModel):
    """One more transaction (or part of one) of the table in a ``rows.changed`` v4 message: its
    own event id, commit ts, seq, part and binlog position, exactly as a message of its own
    (v3) would have carried them, and its rows (the message's ``meta`` describes them)."""

    model_config = ConfigDict(extra="forbid")
    event_id: str = Field(min_length=1, description="This part's event id: the envelope id it "
                          "would have as a message of its own; consumers deduplicate by it.")
    ts: int = Field(ge=0, description="Commit ts of the transaction: physical_ms << 18 | logical.")
    seq: int = Field(ge=0, description="Order of this part within the source's stream.")
    part: int = Field(0, ge=0)
    last_part: bool = Field(True, description="False while more parts of this txn/table follow.")
    position: SourcePositionV1
    rows: list[RowImageV2] = Field(min_length=1)


@register("rows.changed", 4)
class RowsChangedV4(RowsChangedV3):
    """As v3, and ``more``: the table's next transactions in the same message, each with its
    boundary kept (its own event id, ts, seq, part, position), in stream order.

    The top-level ``ts``/``seq``/``part``/``last_part``/``position``/``rows`` are the first
    transaction part's; ``event_id`` is its id when the message carries more than one (the
    envelope's id then names the message, not a transaction), None when it is the envelope's
    (a message of one part, which is exactly a v3 message). A consumer treats each part as the
    v3 message it would have been: deduplicate by its id, order by ``(ts, seq, part)``.

    A column may be of kind ``geometry`` (spatial types: MariaDB's internal format, base64);
    v3 never carried one (capture refused spatial tables then).
    """

    carries_geometry: ClassVar[bool] = True
    event_id: str | None = Field(None, min_length=1, description="The first part's event id "
                                 "when the message carries ``more``; null: the envelope's id.")
    more: list[RowsPartV1] = Field(default_factory=list, description="The table's next "
                                   "transaction parts, in stream order; empty in a message of one.")

    @model_validator(mode="after")
    def _parts_in_order(self) -> RowsChangedV4:
        if self.more:
            if self.event_id is None:
                raise ValueError("a message with more parts names its first part (event_id)")
            ts, seq = self.ts, self.seq
            for part in self.more:
                if part.seq <= seq or part.ts < ts:
                    raise ValueError("parts out of stream order (ts, seq)")
                ts, seq = part.ts, part.seq
        return self


def parts_of(event: RowsChangedV2, envelope_id: str) -> list[tuple[str, RowsChangedV2]]:
    """Each transaction part a rows event carries, as ``(event id, event of that part alone)``:
    the event itself for a message of one part (any version), one event per part of a v4
    message with ``more`` (sharing the message's metadata, no copy of the rows)."""
    if not isinstance(event, RowsChangedV4) or not event.more:
        return [(envelope_id, event)]
    first = event.event_id or envelope_id
    out: list[tuple[str, RowsChangedV2]] = [(first, event.model_copy(update={"event_id": None, "more": []}))]
    for part in event.more:
        out.append((part.event_id, event.model_copy(update={
            "ts": part.ts, "seq": part.seq, "part": part.part, "last_part": part.last_part,
            "position": part.position, "rows": part.rows, "event_id": None, "more": []})))
    return out


# A v3 message is a v4 message of one part: the body carries over as it is.
@upcaster("rows.changed", 3)
def _rows_changed_v3_to_v4(data: dict[str, Any]) -> dict[str, Any]:
    return dict(data)


@register("ddl.executed", 2)
class DdlExecutedV2(DdlExecutedV1):
    """As v1; ``meta_after`` may carry the table's shape right after the change."""

    meta_after: TableMetaV2 | None = Field(None, description="Table metadata after the change.")


@upcaster("ddl.executed", 1)
def _ddl_executed_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return dict(data)


@register("ddl.executed", 3)
class DdlExecutedV3(DdlExecutedV2):
    """As v2; a column of ``meta_after`` may be of kind ``geometry``."""

    carries_geometry: ClassVar[bool] = True


@upcaster("ddl.executed", 2)
def _ddl_executed_v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    return dict(data)


@register("foreign_keys.changed", 1)
class ForeignKeysChangedV1(BaseModel):
    """A schema change of another table (``by_database``.``by_table``) names this table after
    REFERENCES: the cascading foreign keys this table is the parent of may change here. On this
    table's DDL subject, at the statement's ts, so every span reading this table meets it in
    stream order; it changes nothing in this table's schema."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    source: str = Field(min_length=1)
    database: str = Field(min_length=1)
    table: str = Field(min_length=1)
    ts: int = Field(ge=0)
    seq: int = Field(ge=0)
    statement: str = Field(min_length=1)
    position: SourcePositionV1
    by_database: str = Field(min_length=1)
    by_table: str = Field(min_length=1)


@register("resolved.advanced", 1)
class ResolvedAdvancedV1(BaseModel):
    """Every change of ``source`` with ts <= ``ts`` has been published."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    source: str = Field(min_length=1)
    ts: int = Field(ge=0)
    position: SourcePositionV1


@register("capture.rejected", 1)
class CaptureRejectedV1(BaseModel):
    """Capture met something it will not replicate silently: the operator must act."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    source: str = Field(min_length=1)
    kind: Literal["no_primary_key", "unsupported_type", "binlog_not_row", "binlog_not_full_image"]
    database: str = ""
    table: str = ""
    message: str = Field(min_length=1)
    position: SourcePositionV1 | None = None


CaptureRejectKind = Literal["no_primary_key", "unsupported_type", "binlog_not_row", "binlog_not_full_image",
                            "binlog_purged"]


@register("capture.rejected", 2)
class CaptureRejectedV2(BaseModel):
    """As v1, with ``binlog_purged``: the source no longer holds the binlog capture must read
    next (MySQL error 1236), so it cannot go on without losing changes."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    source: str = Field(min_length=1)
    kind: CaptureRejectKind
    database: str = ""
    table: str = ""
    message: str = Field(min_length=1)
    position: SourcePositionV1 | None = None


# v1's kinds are all v2 kinds: the body carries over as it is.
@upcaster("capture.rejected", 1)
def _capture_rejected_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return dict(data)
