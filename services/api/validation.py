"""Checks a changefeed spec must pass beyond its contract model: URLs that parse, source ids
used once, routing rules that compile and cannot disagree about a table's target, table rules
whose patterns compile and whose expressions parse.

Each problem is a FastAPI-style field error (``loc``, ``msg``, ``type``) so a client sees
which field to fix, exactly like the model's own validation errors."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from contracts.events.changefeeds import ChangefeedSpec, current_spec
from libs.dburl import DatabaseUrlError, parse_database_url
from libs.routing import OriginColumn, Router, RouteRule, RoutingConfigError, TableFilter
from libs.secret_refs import binding_problem, is_reference, literal_password, reference_name
from libs.table_rules import rule_problems
from services.api.schemas import REDACTED
from services.sink_worker.sinks.factory import check_sink_url, sink_kind
from services.sink_worker.sinks.nats_stream import parse_stream_url, server_host_port


def _error(loc: list[str | int], msg: str) -> dict[str, Any]:
    return {"loc": ["body", *loc], "msg": msg, "type": "value_error"}


def _literal_password(what: str) -> str:
    return (f"the {what} URL holds a password; passwords are never stored in a changefeed. Put it "
            "in a named secret (file $SLUICE_SECRETS_DIR/NAME or environment variable "
            "SLUICE_SECRET_NAME of the api, capture and sink-worker) and write "
            "user:secret:NAME@host in the URL instead")


def password_problems(spec: ChangefeedSpec) -> list[dict[str, Any]]:
    """URLs holding a literal password (a secret reference or the api's ``***`` is fine)."""
    errors: list[dict[str, Any]] = []
    if literal_password(spec.sink_url) and urlsplit(spec.sink_url).password != REDACTED:
        errors.append(_error(["sink_url"], _literal_password("sink")))
    for i, source in enumerate(spec.sources):
        if literal_password(source.url) and urlsplit(source.url).password != REDACTED:
            errors.append(_error(["sources", i, "url"], _literal_password("source")))
    return errors


def url_binding_problem(url: str) -> str | None:
    """Why ``url``'s secret may not be sent to its host(s) (libs.secret_refs bindings), checked
    before anything connects; None without a secret reference or an unparseable URL (refused
    for its form elsewhere)."""
    try:
        if sink_kind(url).stream:
            stream = parse_stream_url(url, resolve_secrets=False)
            password, destinations = stream.password or "", [server_host_port(h) for h in stream.hosts]
        else:
            db = parse_database_url(url, resolve_secrets=False)
            password, destinations = db.password, [(db.host, db.port)]
        if not is_reference(password):
            return None
        return binding_problem(reference_name(password), destinations)
    except ValueError:  # the URL's form, or a malformed name: spec_problems says which
        return None


def binding_problems(spec: ChangefeedSpec) -> list[dict[str, Any]]:
    """URLs sending a secret to a host it is not bound to: refused before the creation checks
    connect anywhere, so a changefeed cannot carry a stored secret to a host of its choosing."""
    errors: list[dict[str, Any]] = []
    problem = url_binding_problem(spec.sink_url)
    if problem:
        errors.append(_error(["sink_url"], f"sink URL refused: {problem}"))
    for i, source in enumerate(spec.sources):
        problem = url_binding_problem(source.url)
        if problem:
            errors.append(_error(["sources", i, "url"], f"source URL refused: {problem}"))
    return errors


def spec_problems(spec: ChangefeedSpec) -> list[dict[str, Any]]:
    try:
        spec.model_dump_json()
    except ValueError as exc:  # lone surrogates and the like cannot be stored as JSON text
        return [_error([], f"the spec holds text that is not valid Unicode: {exc}")]
    errors: list[dict[str, Any]] = []
    try:
        check_sink_url(spec.sink_url)
    except (DatabaseUrlError, ValueError) as exc:
        errors.append(_error(["sink_url"], f"sink URL refused: {exc}"))
    else:
        policy = current_spec(spec).schema_change_policy
        if policy != "evolve" and not sink_kind(spec.sink_url).holds_rows:
            errors.append(_error(["schema_change_policy"], (
                f"schema_change_policy {policy!r} applies to SQL downstreams; "
                "a NATS sink publishes every DDL for its consumers to decide (use evolve)")))
    if current_spec(spec).large_txn_split_rows is not None and sink_kind(spec.sink_url).stream:
        errors.append(_error(["large_txn_split_rows"], "a NATS stream downstream publishes every "
                                                       "transaction as it is; large_txn_split_rows "
                                                       "applies to SQL downstreams"))
    if current_spec(spec).syncpoint_interval is not None and sink_kind(spec.sink_url).stream:
        errors.append(_error(["syncpoint_interval"], "syncpoints are written to a sluice_syncpoint "
                                                     "table: they need a SQL downstream, not a NATS stream"))
    seen: set[str] = set()
    for i, source in enumerate(spec.sources):
        if source.id in seen:
            errors.append(_error(["sources", i, "id"], f"source id {source.id!r} is listed twice"))
        seen.add(source.id)
        try:
            url = parse_database_url(source.url, resolve_secrets=False)
        except (DatabaseUrlError, ValueError) as exc:
            errors.append(_error(["sources", i, "url"], f"source URL refused: {exc}"))
            continue
        if url.dialect != "mysql":
            errors.append(_error(["sources", i, "url"],
                                 "a source must be MySQL/MariaDB (mysql:// or mariadb://), "
                                 f"not {url.dialect}"))
    table_filter: TableFilter | None = None
    try:
        table_filter = TableFilter.from_contract(spec.filter)
    except RoutingConfigError as exc:
        errors.append(_error(["filter"], str(exc)))
    rules: list[RouteRule] = []
    for i, r in enumerate(spec.routes):
        try:
            rules.append(RouteRule(schema=r.database, table=r.table, target_schema=r.target_schema,
                                   target_table=r.target_table, source=r.source, name=r.name))
        except RoutingConfigError as exc:
            errors.append(_error(["routes", i], str(exc)))
    origin: OriginColumn | None = None
    if spec.origin_column is not None:
        try:
            origin = OriginColumn(spec.origin_column)
        except RoutingConfigError as exc:
            errors.append(_error(["origin_column"], str(exc)))
    if len(rules) == len(spec.routes):
        for problem in Router(rules, table_filter, origin).validate():
            errors.append(_error(["routes"], f"{problem.kind}: {problem.message}"))
    # Table rules (v4): patterns that compile, expressions that parse (``libs.table_rules``).
    for text in rule_problems(current_spec(spec).table_rules, spec.initial_load):
        errors.append(_error(["table_rules"], text))
    # Continuous validation (v5) reads the downstream's rows: a NATS sink has none.
    if current_spec(spec).validation.mode != "off" and not sink_kind(spec.sink_url).holds_rows:
        errors.append(_error(["validation", "mode"], "validation compares downstream rows; a NATS sink "
                                                     "holds none (set mode to off)"))
    for source_id in spec.start_position:
        if source_id not in seen:
            errors.append(_error(["start_position", source_id],
                                 f"start position for {source_id!r}, which is not a source "
                                 "of this changefeed"))
    return errors
