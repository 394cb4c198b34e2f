"""What the NATS sink republishes for event-stream consumers (``format=sluice``).

One message per row change, in the changefeed's merged order for its span:
``(ts, seq, part)`` of the source, then the row's index inside its message. Nothing is
collapsed to the last image: a consumer sees every insert, update and delete. Values keep the
row-change contract's JSON encoding (``contracts/events/rows.py``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contracts.events.rows import RowOp
from contracts.registry import register


@register("sink.row_changed", 1)
class SinkRowChangedV1(BaseModel):
    """One row change of a changefeed, as the NATS sink publishes it."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    changefeed: str = Field(min_length=1)
    source: str = Field(min_length=1, description="Source id the change was captured from.")
    database: str = Field(min_length=1, description="Upstream database (shard).")
    table: str = Field(min_length=1, description="Upstream table (shard).")
    target_schema: str | None = Field(None, description="Target schema (database) after routing.")
    target_table: str = Field(min_length=1, description="Target table after routing.")
    ts: int = Field(ge=0, description="Commit ts of the transaction: physical_ms << 18 | logical.")
    seq: int = Field(ge=0, description="Order of the captured message within the source's stream.")
    part: int = Field(0, ge=0)
    row: int = Field(ge=0, description="Index of the row inside the captured message.")
    op: RowOp
    key: list[str] = Field(description="Key columns the sink identifies the row by.")
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    event_id: str = Field(min_length=1, description="Id of the captured rows.changed event.")
