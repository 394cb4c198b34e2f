"""Leadership events: the first event a new leader appends to its domain stream."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from contracts.registry import register


@register("leader.elected", 1)
class LeaderElectedV1(BaseModel):
    """A candidate won the lease; every later append of the domain is fenced behind this one."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    service: str = Field(min_length=1)
    candidate: str = Field(min_length=1, description="Instance id of the new leader.")
    epoch: int = Field(ge=1, description="KV revision at which the lease was won.")


@register("leader.resigned", 1)
class LeaderResignedV1(BaseModel):
    """A leader gave up its lease on purpose (shutdown or operator request)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    service: str = Field(min_length=1)
    candidate: str = Field(min_length=1)
    epoch: int = Field(ge=1)
    reason: str = ""
