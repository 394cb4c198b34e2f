"""/api/v1/sources: the sources registry (register, remove; GET /sources in routes/cluster.py
lists registered sources beside those changefeeds read). Changefeeds naming a source by id only
are resolved in services/api/source_refs.py.

Registry commands go through the changefeeds log like changefeed commands (``_command``: fenced
on what the read model folded), so a source cannot be removed while a changefeed that reads it
is being created."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

from contracts.events.sources import SOURCE_ID_PATTERN
from libs.dburl import parse_database_url
from libs.secret_refs import literal_password
from libs.sources import readers, record_source, record_source_moved, record_source_removed
from services.api.auth import require_write
from services.api.context import ApiContext, get_ctx, js_of, projections_of
from services.api.prechecks import source_checks
from services.api.routes.changefeeds import _command
from services.api.schemas import Accepted, redact_url
from services.api.source_move import MoveRefused, judge, last_mark
from services.api.validation import url_binding_problem

router = APIRouter(prefix="/sources", tags=["sources"])


class SourceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=128, pattern=SOURCE_ID_PATTERN)
    url: str = Field(min_length=1, max_length=2048, description=(
        "mysql://user:secret:NAME@host:port/ of the source: the password as a named secret, "
        "resolved by each service that connects."))


def _url_problems(url: str) -> list[dict[str, Any]]:
    def error(msg: str) -> list[dict[str, Any]]:
        return [{"loc": ["body", "url"], "msg": msg, "type": "value_error"}]

    if literal_password(url):
        return error("the URL holds a password; the registry never stores one. Put it in a named "
                     "secret (file $SLUICE_SECRETS_DIR/NAME or environment variable "
                     "SLUICE_SECRET_NAME of the api, capture and sink-worker) and write "
                     "user:secret:NAME@host in the URL instead")
    try:
        parsed = parse_database_url(url, resolve_secrets=False)
    except ValueError as exc:  # DatabaseUrlError, or urlsplit's own (an unclosed "[" host)
        return error(f"source URL refused: {exc}")
    if parsed.dialect != "mysql":
        return error(f"a source is MySQL or MariaDB (mysql://...), not {parsed.dialect}")
    return []


_ADD_RESPONSES: dict[int | str, dict[str, Any]] = {
    409: {"description": "The id is registered, or read by a changefeed, with another URL"},
    422: {"description": "Invalid id or URL"}}


def _refuse_bad_url(url: str) -> None:
    """422 for a source URL the api would not record (malformed, or bound to a secret it cannot use)."""
    problems = _url_problems(url)
    binding = None if problems else url_binding_problem(url)
    if binding:
        problems = [{"loc": ["body", "url"], "msg": f"source URL refused: {binding}", "type": "value_error"}]
    if problems:
        raise RequestValidationError(problems)


@router.post("", status_code=202, response_model=Accepted, dependencies=[Depends(require_write)],
             responses=_ADD_RESPONSES)
async def add_source(source: SourceIn, ctx: ApiContext = Depends(get_ctx),
                     skip_checks: bool = Query(False, description=(
                         "Register it even when its connection or binlog checks fail."))) -> Accepted:
    """Register a source's URL once; changefeeds then name it by id and its capture needs only
    SLUICE_SOURCE_ID. Registering the same URL again changes nothing. Before it is recorded, the
    api connects with the URL's own credentials and runs the source checks of changefeed
    creation (reachable, ROW/FULL/FULL binlog, replication grants): 422 with each fix."""
    _refuse_bad_url(source.url)
    view = projections_of(ctx).changefeeds
    follow = f"/api/v1/sources/{source.id}"
    if view.state.sources.get(source.id) == source.url:
        return Accepted(detail=f"source {source.id!r} is registered with this URL already", follow=follow)
    warnings: list[str] = []
    failed = await source_checks(source.id, source.url, warnings)
    if failed and not skip_checks:
        raise RequestValidationError([
            {"loc": ["checks", f.check, f.target], "msg": f.message, "type": f"precheck.{f.check}"}
            for f in failed])

    def check() -> None:
        registered = view.state.sources.get(source.id)
        if registered is not None and registered != source.url:
            raise HTTPException(409, f"source {source.id!r} is registered with {redact_url(registered)}: "
                                     "remove it first (no changefeed may read it then)")
        other = {cf: url for cf, url in readers(view.state, source.id).items() if url != source.url}
        if other:
            raise HTTPException(409, f"changefeed(s) {', '.join(sorted(other))} read source "
                                     f"{source.id!r} from another URL")

    seq = await _command(ctx, check, lambda expected: record_source(
        js_of(ctx), source.id, source.url, ctx.requested_by, expected_last_subject_seq=expected))
    return Accepted(detail=f"source {source.id!r} registered", seq=seq, follow=follow,
                    events=f"/api/v1/events?since=changefeeds:{seq - 1}", warnings=warnings)


@router.delete("/{source_id}", status_code=202, response_model=Accepted,
               dependencies=[Depends(require_write)],
               responses={404: {"description": "Not registered"},
                          409: {"description": "A changefeed reads it"}})
async def remove_source(source_id: str, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    view = projections_of(ctx).changefeeds

    def check() -> None:
        if source_id not in view.state.sources:
            raise HTTPException(404, f"source {source_id!r} is not registered")
        using = readers(view.state, source_id)
        if using:
            raise HTTPException(409, f"changefeed(s) {', '.join(using)} read source {source_id!r}: "
                                     "update or delete them first")

    seq = await _command(ctx, check, lambda expected: record_source_removed(
        js_of(ctx), source_id, ctx.requested_by, expected_last_subject_seq=expected))
    return Accepted(detail=f"source {source_id!r} removed from the registry", seq=seq,
                    follow="/api/v1/sources", events=f"/api/v1/events?since=changefeeds:{seq - 1}")


class SourceUrlIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(min_length=1, max_length=2048, description=(
        "mysql://user:secret:NAME@host:port/ of the server the source moves to (a promoted "
        "replica of its replication topology)."))


_MOVE_RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {"description": "Not registered"},
    409: {"description": "The new server cannot continue the stream (lost transactions, a gap, "
                         "no GTID position); the detail says which"},
    422: {"description": "Invalid URL, or the new server fails the source checks"}}


@router.put("/{source_id}/url", status_code=202, response_model=Accepted,
            dependencies=[Depends(require_write)], responses=_MOVE_RESPONSES)
async def set_source_url(source_id: str, body: SourceUrlIn, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    """Move a source to another server of its replication topology (after a failover). The api
    compares the GTID position of the stream's last resolved mark with the new server's: the
    move is recorded only when the new server holds every transaction the stream holds and no
    GTID domain the stream never saw, so nothing is skipped or published twice. The registry
    and every changefeed reading the source then take the new URL, and its capture continues
    there by GTID (it judges the server again before it reads)."""
    _refuse_bad_url(body.url)
    view = projections_of(ctx).changefeeds
    follow = f"/api/v1/sources/{source_id}"
    registered = view.state.sources.get(source_id)
    if registered is None:
        raise HTTPException(404, f"source {source_id!r} is not registered")
    if registered == body.url:
        return Accepted(detail=f"source {source_id!r} is registered with this URL already", follow=follow)
    failed = await source_checks(source_id, body.url)
    if failed:
        raise RequestValidationError([
            {"loc": ["checks", f.check, f.target], "msg": f.message, "type": f"precheck.{f.check}"}
            for f in failed])
    try:
        reason = await judge(body.url, await last_mark(js_of(ctx), source_id))
    except MoveRefused as exc:
        raise HTTPException(409, f"source {source_id!r} not moved to {redact_url(body.url)}: {exc}") from None

    def check() -> None:
        if view.state.sources.get(source_id) != registered:
            raise HTTPException(409, f"source {source_id!r} changed while the move was checked: try again")

    seq = await _command(ctx, check, lambda expected: record_source_moved(
        js_of(ctx), source_id, body.url, ctx.requested_by, reason=reason,
        expected_last_subject_seq=expected))
    return Accepted(detail=f"source {source_id!r} moved to {redact_url(body.url)}: {reason}", seq=seq,
                    follow=follow, events=f"/api/v1/events?since=changefeeds:{seq - 1}",
                    warnings=[] if readers(view.state, source_id) else
                    [f"no changefeed reads source {source_id!r}"])
