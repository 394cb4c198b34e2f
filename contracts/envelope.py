"""The envelope every Sluice event travels in."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

from pydantic import BaseModel, ConfigDict, Field


def new_event_id() -> str:
    return uuid4().hex


def utc_now() -> datetime:
    return datetime.now(UTC)


class Envelope(BaseModel):
    """Versioned wrapper: consumers dispatch on ``(type, version)`` and read ``data``."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    type: str = Field(min_length=1, description="Event type, dotted, e.g. 'member.joined'.")
    version: int = Field(ge=1, description="Contract version of `data` for this type.")
    id: str = Field(min_length=1, description="Unique event id; consumers deduplicate on it.")
    time: datetime = Field(description="When the producer created the event (UTC).")
    producer: str = Field(min_length=1, description="Service and instance that produced it.")
    epoch: int = Field(ge=0, description="Leader epoch of the producer; 0 for non-leaders.")
    data: dict[str, Any] = Field(description="The event body, valid against the type's model.")
