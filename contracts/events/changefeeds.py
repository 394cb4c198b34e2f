"""Changefeed definitions: the changefeeds domain stream is their event log."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from contracts.events.rows import SourcePositionV1
from contracts.registry import register

KeyPolicy = Literal["primary", "unique", "all_columns"]


class SourceRefV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    url: str = Field(min_length=1, description="mysql://user:pass@host:port/ of the source.")


class TableFilterV1(BaseModel):
    """Glob patterns over ``database.table``; a table is in when it matches an include and no exclude."""

    model_config = ConfigDict(extra="forbid")
    include: list[str] = Field(default_factory=lambda: ["*.*"])
    exclude: list[str] = Field(default_factory=list)


class ChangefeedSpecV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    sources: list[SourceRefV1] = Field(min_length=1)
    filter: TableFilterV1 = Field(default_factory=TableFilterV1)
    sink_url: str = Field(min_length=1)
    key_policy: KeyPolicy = Field(
        "primary", description="Tables without a primary key are refused unless this says otherwise."
    )
    start: Literal["earliest", "latest"] = "earliest"
    start_position: dict[str, SourcePositionV1] = Field(default_factory=dict)


@register("changefeed.created", 1)
class ChangefeedCreatedV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: ChangefeedSpecV1
    requested_by: str = ""


@register("changefeed.updated", 1)
class ChangefeedUpdatedV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: ChangefeedSpecV1
    requested_by: str = ""


@register("changefeed.state_changed", 1)
class ChangefeedStateChangedV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)
    state: Literal["running", "paused", "deleted"]
    requested_by: str = ""
    reason: str = ""
