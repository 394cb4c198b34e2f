"""Member (sink-worker) liveness events, owned by the member service."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contracts.registry import register, upcaster


@register("member.joined", 1)
class MemberJoinedV1(BaseModel):
    """First version: members had no incarnation, so a restart looked like the same process."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    member_id: str = Field(min_length=1)
    address: str = ""


@register("member.joined", 2)
class MemberJoinedV2(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    member_id: str = Field(min_length=1)
    incarnation: str = Field(description="Fresh per process start; '' when the producer predates it.")
    address: str = ""
    labels: dict[str, str] = Field(default_factory=dict)


@upcaster("member.joined", 1)
def _member_joined_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    # v1 producers had no incarnation: '' tells consumers "unknown", which never equals a real one.
    return {**data, "incarnation": "", "labels": {}}


@register("member.draining", 1)
class MemberDrainingV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    member_id: str = Field(min_length=1)
    incarnation: str
    requested_by: str = ""
    reason: str = ""


@register("member.left", 1)
class MemberLeftV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    member_id: str = Field(min_length=1)
    incarnation: str
    reason: str = Field(description="'ttl-expired', 'shutdown' or 'replaced'.")
