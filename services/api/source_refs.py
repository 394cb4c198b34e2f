"""A changefeed's sources as the api takes them: by id only (the URL comes from the sources
registry, libs/sources.py) or with their URL, resolved to the spec the changefeeds log records."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

from contracts.events.changefeeds import ChangefeedSpec
from contracts.events.sources import SOURCE_ID_PATTERN
from libs.sources import resolve_sources
from services.api.context import ApiContext, projections_of


class SourceRefIn(BaseModel):
    """A changefeed's source: by id only (its URL comes from the sources registry) or with its URL."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, pattern=SOURCE_ID_PATTERN)
    url: str | None = Field(None, min_length=1, description=(
        "Leave out to use the URL registered with `sluice source add` (POST /api/v1/sources)."))


class ChangefeedSpecIn(ChangefeedSpec):
    """A changefeed spec as the api takes it: sources may be given by id only."""

    sources: list[SourceRefIn] = Field(min_length=1)  # type: ignore[assignment]


def resolve_spec(ctx: ApiContext, spec: ChangefeedSpecIn) -> ChangefeedSpec:
    """The spec the changefeeds log records: every source with its URL (422 for an unknown id)."""
    view = projections_of(ctx).changefeeds.state
    refs, problems = resolve_sources(view, [(s.id, s.url) for s in spec.sources])
    if problems:
        raise RequestValidationError([{"loc": ["body", "sources", p.index, "url"], "msg": p.message,
                                       "type": "value_error"} for p in problems])
    body = {name: getattr(spec, name) for name in ChangefeedSpec.model_fields}
    return ChangefeedSpec.model_validate({**body, "sources": refs})
