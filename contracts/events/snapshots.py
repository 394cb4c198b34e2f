"""Snapshots of a domain's state, so a new leader's replay follows live state, not history."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contracts.registry import register


@register("snapshot.taken", 1)
class SnapshotTakenV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    domain: str = Field(min_length=1)
    up_to_seq: int = Field(ge=0, description="Stream sequence of the last event folded into state.")
    state: dict[str, Any]
