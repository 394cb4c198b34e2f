"""Syncpoints: consistent points across the tables of a changefeed (``syncpoint_interval``).

Written by the replication-manager leader to the replication domain stream, one changefeed at a
time, in this order per ts T:

- ``syncpoint.planned``: every span of the changefeed stops at T (the sink-workers read the cap
  from ``SYNCPOINT_BUCKET``, which the leader writes after this event);
- ``syncpoint.reached``: every span applied exactly up to T and the row (changefeed, T, commit
  time) is in the downstream's ``sluice_syncpoint`` table; the spans wait until ``hold_until``;
- ``syncpoint.ended``: the spans go on; ``outcome`` says whether T was released after its hold
  or abandoned before it was reached (with the reason).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from contracts.registry import register


@register("syncpoint.planned", 1)
class SyncpointPlannedV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    changefeed: str = Field(min_length=1)
    ts: int = Field(gt=0, description="The upstream ts every span stops at.")
    planned_at: float = Field(description="Unix seconds (leader's clock).")


@register("syncpoint.reached", 1)
class SyncpointReachedV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    changefeed: str = Field(min_length=1)
    ts: int = Field(gt=0)
    commit_time: str = Field(min_length=1, description="When the downstream row was first written "
                                                       "(UTC, ISO 8601), as the row holds it.")
    hold_until: float = Field(description="Unix seconds (leader's clock) the spans wait until.")


@register("syncpoint.ended", 1)
class SyncpointEndedV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    changefeed: str = Field(min_length=1)
    ts: int = Field(gt=0)
    outcome: Literal["released", "abandoned"]
    reason: str = ""
    ended_at: float = Field(description="Unix seconds (leader's clock).")
