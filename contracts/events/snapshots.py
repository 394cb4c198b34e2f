"""Snapshots of a domain's state, so a new leader's replay follows live state, not history.

A small state travels inside the ``snapshot.taken`` message (``state``). A large one does not
fit in one NATS message (max_payload, 1 MiB by default): it is written first as chunk messages
(zlib-compressed JSON, cut by ``libs.chunks``) and ``snapshot.taken`` is written after the last
chunk, naming them (``chunks``). The snapshot exists only once that message exists, so chunks
without it (a leader stopped mid-write) are never read.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contracts.registry import register, upcaster


@register("snapshot.taken", 1)
class SnapshotTakenV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    domain: str = Field(min_length=1)
    up_to_seq: int = Field(ge=0, description="Stream sequence of the last event folded into state.")
    state: dict[str, Any]


class SnapshotChunksV1(BaseModel):
    """Where a chunked snapshot's state is: ``count`` messages on ``subject`` at consecutive
    stream sequences from ``first_seq``, joining to ``size`` bytes with SHA-256 ``digest``."""

    model_config = ConfigDict(extra="forbid")
    subject: str = Field(min_length=1)
    first_seq: int = Field(ge=1)
    count: int = Field(ge=1)
    size: int = Field(ge=0, description="Bytes of the joined (still compressed) payload.")
    digest: str = Field(min_length=64, max_length=64, description="SHA-256 (hex) of the joined payload.")
    encoding: Literal["zlib+json"] = "zlib+json"


@register("snapshot.taken", 2)
class SnapshotTakenV2(BaseModel):
    model_config = ConfigDict(extra="forbid")
    domain: str = Field(min_length=1)
    up_to_seq: int = Field(ge=0, description="Stream sequence of the last event folded into state.")
    state: dict[str, Any] | None = Field(None, description="The state, when it fits in this message.")
    chunks: SnapshotChunksV1 | None = Field(None, description="Else where its chunks are.")

    @model_validator(mode="after")
    def _state_or_chunks(self) -> SnapshotTakenV2:
        if (self.state is None) == (self.chunks is None):
            raise ValueError("a snapshot has either its state or its chunks")
        return self


@upcaster("snapshot.taken", 1)
def _taken_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return dict(data)
