"""Creation checks (like DM's precheck): before a changefeed is recorded, the api connects to
every source and the sink with the changefeed's own credentials (secrets resolved here) and
checks what replication will need, so a changefeed that cannot work is refused with the fix
instead of showing "running" with no tables.

- every source: reachable; ROW binlog, FULL row image and FULL row metadata (capture's own
  check, ``services.capture.source.check_source``); the grants replication needs
  (REPLICATION SLAVE, REPLICATION CLIENT, SELECT);
- the sink: reachable and writable;
- every route rule: matches at least one table of the sources;
- a target table that exists already: used as it is when it can hold the source's rows, refused
  with the column and the reason when not (``libs.target_fit``: a missing column, a narrower
  type, a unique key the source's rows, or a merge's shards, would break);
- cascading foreign keys of the tables it replicates (``libs.foreign_keys``): not a failure, a
  warning in the answer, since the binlog never shows the child rows a cascade changes.

Messages name what failed and the fix, never a password."""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import psycopg
import pymysql

from contracts.events.changefeeds import ChangefeedCheckV1, ChangefeedSpec
from libs.codec.table_meta import TableInfo, load_table_info
from libs.dburl import DatabaseUrl, DatabaseUrlError, parse_database_url
from libs.foreign_keys import ForeignKey, cascade_warnings, load_foreign_keys
from libs.mysql_connection import connect as mysql_connect
from libs.routing import Router, RouteRule, RoutingConfigError, TableFilter, TableRef, router_for
from libs.table_rules import rule_column_problems
from libs.target_definitions import read_target
from libs.target_fit import TargetDefinition, fit_problems
from services.capture.source import check_source, server_gtids
from services.sink_worker.sinks.factory import sink_kind
from services.sink_worker.sinks.nats_stream import (
    StreamSinkUrl,
    StreamUrlError,
    parse_stream_url,
)
from services.sink_worker.span.target import KeylessTableError, choose_key

CONNECT_TIMEOUT_S = 3
# Each replication need, and the privilege names that grant it (MariaDB >= 10.5 shows
# REPLICATION CLIENT as BINLOG MONITOR and may show REPLICATION SLAVE as REPLICATION REPLICA).
SOURCE_GRANTS: dict[str, tuple[str, ...]] = {
    "REPLICATION SLAVE": ("REPLICATION SLAVE", "REPLICATION REPLICA"),
    "REPLICATION CLIENT": ("REPLICATION CLIENT", "BINLOG MONITOR"),
    "SELECT": ("SELECT",),
}
_GRANT = re.compile(r"^GRANT (?P<privs>.+?) ON (?P<on>\S+) TO ", re.IGNORECASE)


def _check(check: str, target: str, message: str) -> ChangefeedCheckV1:
    return ChangefeedCheckV1(check=check, target=target, message=message)


def _privileges(grants: Iterable[str], global_only: bool) -> set[str]:
    out: set[str] = set()
    for line in grants:
        m = _GRANT.match(line.strip())
        if m is None or (global_only and m.group("on") != "*.*"):
            continue
        out |= {p.strip().upper() for p in m.group("privs").split(",")}
    return out


def missing_source_grants(grants: Iterable[str]) -> list[str]:
    """The replication needs that ``SHOW GRANTS`` lines do not cover (all global: ON *.*)."""
    held = _privileges(list(grants), global_only=True)
    if "ALL PRIVILEGES" in held or "ALL" in held:
        return []
    return [need for need, names in SOURCE_GRANTS.items() if not held & set(names)]


def missing_mysql_sink_grants(grants: Iterable[str]) -> list[str]:
    held = _privileges(grants, global_only=False)
    if "ALL PRIVILEGES" in held or "ALL" in held:
        return []
    return [p for p in ("CREATE", "INSERT", "UPDATE", "DELETE") if p not in held]


def unmatched_routes(spec: ChangefeedSpec, tables: dict[str, list[tuple[str, str]]]) -> list[str]:
    """Labels of the route rules no table of the listed sources matches."""
    refs = [TableRef(src, d, t) for src, ts in tables.items() for d, t in ts]
    out = []
    for r in spec.routes:
        rule = RouteRule(schema=r.database, table=r.table, target_schema=r.target_schema,
                         target_table=r.target_table, source=r.source, name=r.name)
        if not any(rule.matches(ref) for ref in refs):
            out.append(rule.label)
    return out


def _mysql(url: DatabaseUrl) -> Any:
    return mysql_connect(host=url.host, port=url.port, user=url.user or "root", password=url.password,
                           database=url.database or None, connect_timeout=CONNECT_TIMEOUT_S,
                           read_timeout=10, charset="utf8mb4", autocommit=True)


def _unreachable(what: str, url: DatabaseUrl, exc: Exception) -> str:
    # pymysql/psycopg messages name host and user but never the password.
    reason = exc.args[1] if isinstance(exc, pymysql.err.MySQLError) and len(exc.args) > 1 else exc
    return (f"cannot connect to {what} at {url.host}:{url.port} as {url.user or 'root'!r}: {reason}. "
            "Start it or open the network path from the api, or fix the URL's host, user or secret")


# Tables whose columns the checks read per source (two information_schema queries each): a
# changefeed over more is checked on these and says so.
MAX_TABLES_INSPECTED = 2000


def _check_source(source_id: str, url_text: str, tables: dict[str, list[tuple[str, str]]],
                  fks: dict[str, list[ForeignKey]], fk_problems: list[str],
                  selected: TableFilter | None = None,
                  infos: dict[tuple[str, str, str], TableInfo] | None = None) -> list[ChangefeedCheckV1]:
    """``selected``/``infos``: the tables the changefeed replicates get their columns and keys
    read into ``infos`` (key: source, database, table) for the checks that need them."""
    try:
        url = parse_database_url(url_text)
    except DatabaseUrlError as exc:
        return [_check("source_secret", source_id, f"source {source_id}: {exc}")]
    try:
        conn = _mysql(url)
    except (pymysql.err.MySQLError, OSError) as exc:
        return [_check("source_reachable", source_id, f"source {source_id}: "
                       + _unreachable("the source", url, exc))]
    failed: list[ChangefeedCheckV1] = []
    try:
        for kind, message in check_source(conn):
            failed.append(_check(kind, source_id, f"source {source_id}: {message}"))
        if not server_gtids(conn).mariadb:
            fk_problems.append(no_gtid_warning(source_id))
        with conn.cursor() as cur:
            cur.execute("SHOW GRANTS")
            missing = missing_source_grants(str(row[0]) for row in cur.fetchall())
            if missing:
                failed.append(_check(
                    "source_grants", source_id,
                    f"source {source_id}: user {url.user or 'root'!r} lacks {', '.join(missing)}; run "
                    f"GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO "
                    f"'{url.user or 'root'}'@'%'"))
            cur.execute("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES WHERE "
                        "TABLE_TYPE = 'BASE TABLE' AND TABLE_SCHEMA NOT IN "
                        "('mysql', 'information_schema', 'performance_schema', 'sys')"
                        + (" AND TABLE_SCHEMA = %s" if url.database else ""),
                        (url.database,) if url.database else ())
            tables[source_id] = [(str(d), str(t)) for d, t in cur.fetchall()]
        if selected is not None and infos is not None:
            chosen = [(d, t) for d, t in tables[source_id] if selected.selected(d, t)]
            if len(chosen) > MAX_TABLES_INSPECTED:
                fk_problems.append(f"source {source_id}: {len(chosen)} tables; the columns of the first "
                                   f"{MAX_TABLES_INSPECTED} were checked")
            for d, t in chosen[:MAX_TABLES_INSPECTED]:
                info = load_table_info(conn, d, t)
                if info is not None:
                    infos[(source_id, d, t)] = info
        try:
            fks[source_id] = load_foreign_keys(conn, url.database or None)
        except pymysql.err.MySQLError as exc:
            # Only a warning is at stake: never refuse a changefeed because of it.
            fk_problems.append(f"source {source_id}: its foreign keys could not be read ({exc}), so "
                               "cascades the binlog does not show are not named here")
    except pymysql.err.MySQLError as exc:
        failed.append(_check("source_reachable", source_id,
                             f"source {source_id}: the checks' queries failed: {exc}"))
    finally:
        conn.close()
    return failed


async def _jetstream_reachable(url: StreamSinkUrl) -> None:
    nc = await nats.connect(servers=url.servers, user=url.user, password=url.password,
                            connect_timeout=CONNECT_TIMEOUT_S, max_reconnect_attempts=0,
                            allow_reconnect=False)
    try:
        await nc.jetstream().account_info()
    finally:
        await nc.close()


def _check_stream_sink(url_text: str) -> list[ChangefeedCheckV1]:
    try:
        url = parse_stream_url(url_text)
    except StreamUrlError as exc:
        return [_check("sink_secret", "sink", f"sink: {exc}")]
    try:
        asyncio.run(asyncio.wait_for(_jetstream_reachable(url), CONNECT_TIMEOUT_S * 2))
    except Exception as exc:  # nats-py raises many kinds (refused, auth, no JetStream, timeout)
        return [_check("sink_reachable", "sink",
                       f"sink: cannot reach JetStream at {', '.join(url.hosts)} as "
                       f"{url.user or 'no user'!r}: {type(exc).__name__} {exc}. Start nats-server "
                       "with -js, open the network path from the api, or fix the URL's user or secret")]
    return []


def _check_sink(url_text: str) -> list[ChangefeedCheckV1]:
    if sink_kind(url_text).stream:
        return _check_stream_sink(url_text)
    try:
        url = parse_database_url(url_text)
    except DatabaseUrlError as exc:
        return [_check("sink_secret", "sink", f"sink: {exc}")]
    if url.dialect == "sqlite":
        directory = Path(url.path).parent
        if not directory.is_dir() or not os.access(directory, os.W_OK):
            return [_check("sink_writable", "sink",
                           f"sink: directory {directory} does not exist or is not writable; create it "
                           "or give the sink-worker's user write access")]
        return []
    if url.dialect == "mysql":
        try:
            conn = _mysql(url)
        except (pymysql.err.MySQLError, OSError) as exc:
            return [_check("sink_reachable", "sink", "sink: " + _unreachable("the sink", url, exc))]
        try:
            with conn.cursor() as cur:
                cur.execute("SHOW GRANTS")
                missing = missing_mysql_sink_grants(str(row[0]) for row in cur.fetchall())
        finally:
            conn.close()
        if missing:
            return [_check("sink_writable", "sink",
                           f"sink: user {url.user or 'root'!r} lacks {', '.join(missing)}; grant them on "
                           "the target databases")]
        return []
    try:
        pg = psycopg.connect(host=url.host, port=url.port, user=url.user or None,
                             password=url.password or None, dbname=url.database or "postgres",
                             connect_timeout=CONNECT_TIMEOUT_S)
    except psycopg.Error as exc:
        return [_check("sink_reachable", "sink", "sink: " + _unreachable("the sink", url, exc))]
    try:
        row = pg.execute("SELECT has_database_privilege(current_database(), 'CREATE')").fetchone()
    finally:
        pg.close()
    if not row or not row[0]:
        return [_check("sink_writable", "sink",
                       f"sink: user {url.user!r} may not create schemas in {url.database or 'postgres'}; "
                       "GRANT CREATE ON DATABASE to it")]
    return []


@dataclass
class CheckResult:
    failed: list[ChangefeedCheckV1] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """Accepted, but the operator should know (cascading foreign keys)."""


def unreplicable_warnings(spec: ChangefeedSpec, infos: dict[tuple[str, str, str], TableInfo]) -> list[str]:
    """Tables the changefeed selects that it will not replicate as they are: a column type
    capture does not carry (capture stops the table), no key under the changefeed's key_policy
    (the sink-worker stops the table). Accepted, since the rest of the changefeed works and the
    table may be fixed upstream; each shows as stopped with its incident afterwards."""
    out: list[str] = []
    for (source, database, table), info in sorted(infos.items()):
        where = f"{database}.{table} (source {source})"
        bad = info.unsupported()
        if bad:
            out.append(f"{where} will not be replicated: unsupported column type(s) "
                       f"{', '.join(f'{c.name} {c.sql_type}' for c in bad)}")
            continue
        try:
            choose_key(info.meta(), spec.key_policy, database=database, table=table)
        except KeylessTableError as exc:
            out.append(f"{where} will not be replicated: {exc}")
    return out


def table_rule_checks(spec: ChangefeedSpec, infos: dict[tuple[str, str, str], TableInfo]
                      ) -> list[ChangefeedCheckV1]:
    """The table rules against the columns of every table they match: an unknown column in an
    expression, keep_columns or drop_columns, or a key column left out, names the rule."""
    rules = spec.table_rules
    failed: list[ChangefeedCheckV1] = []
    seen: set[str] = set()
    for (source, database, table), info in sorted(infos.items()):
        for message in rule_column_problems(rules, f"source {source}", database, table, info.meta()):
            if message not in seen:
                seen.add(message)
                failed.append(_check("table_rules", message.split(":", 1)[0], message))
    return failed


def run_checks_blocking(spec: ChangefeedSpec) -> CheckResult:
    tables: dict[str, list[tuple[str, str]]] = {}
    fks: dict[str, list[ForeignKey]] = {}
    fk_problems: list[str] = []
    failed: list[ChangefeedCheckV1] = []
    infos: dict[tuple[str, str, str], TableInfo] = {}
    try:
        selected: TableFilter | None = TableFilter.from_contract(spec.filter)
    except RoutingConfigError:
        selected = None  # the spec validation refuses it with the reason
    for source in spec.sources:
        failed += _check_source(source.id, source.url, tables, fks, fk_problems, selected, infos)
    failed += table_rule_checks(spec, infos)
    failed += _check_sink(spec.sink_url)
    # A route about a source that could not be listed is not judged: its failure says why.
    if tables and len(tables) == len(spec.sources):
        for label in unmatched_routes(spec, tables):
            failed.append(_check("route_matches_nothing", label,
                                 f"route {label} matches no table of the sources; fix its "
                                 "source/database/table patterns or create the tables first"))
    try:
        router = router_for(spec)
    except RoutingConfigError:
        return CheckResult(failed, fk_problems)  # the spec validation refuses it with the reason
    failed += target_fit_checks(spec, infos, router)
    cascades = cascade_warnings(router, fks, tables, stream_sink=sink_kind(spec.sink_url).stream)
    warnings = fk_problems + filter_warnings(spec, tables) + unreplicable_warnings(spec, infos)
    return CheckResult(failed, warnings + [w.message for w in cascades])


def target_fit_checks(spec: ChangefeedSpec, infos: dict[tuple[str, str, str], TableInfo],
                      router: Router) -> list[ChangefeedCheckV1]:
    """Each target that exists already and cannot hold its source tables' rows, with the column
    and the reason (``libs.target_fit``). A target that cannot be read is left to the sink's
    own check (reachable, writable)."""
    if sink_kind(spec.sink_url).stream:
        return []
    try:
        url = parse_database_url(spec.sink_url)
    except DatabaseUrlError:
        return []  # the sink check says why
    failed: list[ChangefeedCheckV1] = []
    seen: set[str] = set()
    read: dict[tuple[str, str], TargetDefinition | None] = {}
    for (source, database, table), info in sorted(infos.items()):
        if info.unsupported():
            continue
        try:
            target = router.route(source, database, table)
            if target is None:
                continue
            meta = router.rewrite_meta_for(info.meta(), TableRef(source, database, table))
            key = choose_key(meta, spec.key_policy, database=database, table=table)
        except (RoutingConfigError, KeylessTableError, ValueError):
            continue  # reported by the routing, table rules or unreplicable checks
        where = (target.schema, target.table)
        if where not in read:
            try:
                read[where] = read_target(url, target.schema, target.table)
            except (pymysql.err.MySQLError, psycopg.Error, sqlite3.Error, OSError):
                read[where] = None
        existing = read[where]
        if existing is None:
            continue
        for problem in fit_problems(meta, key, existing, url.dialect):
            message = (f"target {target.schema}.{target.table} exists and cannot hold the rows of "
                       f"{database}.{table} (source {source}): {problem}; alter or drop the target, "
                       "or route the table elsewhere")
            if message not in seen:
                seen.add(message)
                failed.append(_check("target_fit", f"{target.schema}.{target.table}", message))
    return failed


def filter_warnings(spec: ChangefeedSpec, tables: dict[str, list[tuple[str, str]]]) -> list[str]:
    """A filter that selects no table of the sources: accepted (the tables may come later), but
    a changefeed that replicates nothing should not look like one that works. Judged only when
    every source was listed."""
    if len(tables) != len(spec.sources):
        return []
    try:
        flt = TableFilter.from_contract(spec.filter)
    except RoutingConfigError:
        return []
    if any(flt.selected(d, t) for listed in tables.values() for d, t in listed):
        return []
    return [f"the filter (include {list(flt.include)}, exclude {list(flt.exclude)}) selects no table "
            "of the sources: nothing is replicated until a table it selects is created"]


def no_gtid_warning(source_id: str) -> str:
    return (f"source {source_id}: not a MariaDB server, so capture follows no GTIDs here (MySQL GTID "
            "sets are not supported yet): it resumes by binlog file and position only, and after a "
            "failover to another server (`sluice source set-url`) a new initial load is needed")


def source_checks_blocking(source_id: str, url: str,
                           warnings: list[str] | None = None) -> list[ChangefeedCheckV1]:
    """A source's own creation checks (reachable, ROW/FULL/FULL binlog, replication grants):
    what ``sluice source add`` is refused for, the same as a changefeed naming it; what is only
    worth a warning (no GTIDs to fail over with) goes to ``warnings``."""
    return _check_source(source_id, url, {}, {}, warnings if warnings is not None else [])


async def source_checks(source_id: str, url: str,
                        warnings: list[str] | None = None) -> list[ChangefeedCheckV1]:
    return await asyncio.to_thread(source_checks_blocking, source_id, url, warnings)


async def run_checks(spec: ChangefeedSpec) -> CheckResult:
    """The checks off the event loop (the drivers block)."""
    return await asyncio.to_thread(run_checks_blocking, spec)
