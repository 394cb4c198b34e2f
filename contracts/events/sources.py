"""The sources registry: each source's URL in one place, read by the changefeeds that name the
source by id and by the capture started with only the source's id. Its events live in the
changefeeds log (``sluice.ctl.changefeeds.events``) so a changefeed's reference to a source and
the source's removal are checked against one sequence."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from contracts.registry import register

SOURCE_ID_PATTERN = r"^[A-Za-z0-9_\-]+$"


@register("source.registered", 1)
class SourceRegisteredV1(BaseModel):
    """A source's URL; its password is a secret reference (``secret:NAME``), never the value."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    id: str = Field(min_length=1, pattern=SOURCE_ID_PATTERN)
    url: str = Field(min_length=1, description="mysql://user:secret:NAME@host:port/ of the source.")
    requested_by: str = ""


@register("source.removed", 1)
class SourceRemovedV1(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    id: str = Field(min_length=1, pattern=SOURCE_ID_PATTERN)
    requested_by: str = ""


@register("source.moved", 1)
class SourceMovedV1(BaseModel):
    """The source now lives on another server of its replication topology (a promoted replica):
    the registry and every changefeed reading it take ``url``. Recorded only after the api found
    that the new server holds every transaction the stream holds (``reason`` says what it saw)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    id: str = Field(min_length=1, pattern=SOURCE_ID_PATTERN)
    url: str = Field(min_length=1, description="mysql://user:secret:NAME@host:port/ of the new server.")
    requested_by: str = ""
    reason: str = Field("", description="What the api checked: the stream's GTID position and the server's.")
