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
- ``json``: the JSON document as text (MariaDB: exactly as stored); ``bit``: integer.

``NULL`` is JSON ``null`` for every kind. A value that has no faithful encoding (a zero date
``0000-00-00``, a spatial column) is never sent: capture rejects the table instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contracts.registry import register, upcaster

ColumnKind = Literal["int", "float", "decimal", "string", "set", "bytes", "date", "datetime",
                     "timestamp", "time", "json", "bit"]
RowOp = Literal["insert", "update", "delete"]


class ColumnV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    kind: ColumnKind
    sql_type: str = Field(description="The source's column type, e.g. 'decimal(12,2)', for DDL.")
    nullable: bool = True


class RowImageV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    op: RowOp
    before: dict[str, Any] | None = Field(None, description="Full image before (update, delete).")
    after: dict[str, Any] | None = Field(None, description="Full image after (insert, update).")


class TableMetaV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    columns: list[ColumnV1]
    primary_key: list[str] = Field(description="Primary-key columns; empty when the table has none.")
    unique_keys: list[list[str]] = Field(default_factory=list, description="Other unique keys.")


class SourcePositionV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    binlog_file: str
    binlog_pos: int = Field(ge=0, description="End position of the event in the binlog file.")
    gtid: str | None = None


@register("rows.changed", 1)
class RowsChangedV1(BaseModel):
    """Rows of one table changed by one transaction (or part of it, ``part`` counts from 0)."""

    model_config = ConfigDict(extra="forbid")
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

    model_config = ConfigDict(extra="forbid")
    op: RowOp
    before: dict[str, Any] | None = Field(None, description="Full image before (update, delete).")
    after: dict[str, Any] | None = Field(None, description="Full image after (insert, update).")
    ordinal: int | None = Field(None, ge=0, description="Binlog order of the row within its "
                                "transaction, across all tables; null when unknown (upcast from v1).")


@register("rows.changed", 2)
class RowsChangedV2(BaseModel):
    """Rows of one table changed by one transaction (or part of it, ``part`` counts from 0);
    as v1, and each row carries its ordinal within the transaction."""

    model_config = ConfigDict(extra="forbid")
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
class DdlExecutedV1(BaseModel):
    """A schema change of one table, in stream order with its rows."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field(min_length=1)
    database: str = Field(min_length=1)
    table: str = Field(min_length=1)
    ts: int = Field(ge=0)
    seq: int = Field(ge=0)
    statement: str = Field(min_length=1)
    position: SourcePositionV1
    meta_after: TableMetaV1 | None = Field(None, description="Table metadata after the change.")


@register("foreign_keys.changed", 1)
class ForeignKeysChangedV1(BaseModel):
    """A schema change of another table (``by_database``.``by_table``) names this table after
    REFERENCES: the cascading foreign keys this table is the parent of may change here. On this
    table's DDL subject, at the statement's ts, so every span reading this table meets it in
    stream order; it changes nothing in this table's schema."""

    model_config = ConfigDict(extra="forbid")
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

    model_config = ConfigDict(extra="forbid")
    source: str = Field(min_length=1)
    ts: int = Field(ge=0)
    position: SourcePositionV1


@register("capture.rejected", 1)
class CaptureRejectedV1(BaseModel):
    """Capture met something it will not replicate silently: the operator must act."""

    model_config = ConfigDict(extra="forbid")
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

    model_config = ConfigDict(extra="forbid")
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
