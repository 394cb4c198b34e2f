"""The one place a sink URL's kind is read: ``sink_kind(url)`` (what the downstream can do),
``check_sink_url`` (its form, as the api checks it) and ``open_sink(url)`` (the SQL sink for a
database URL, chosen by its dialect). The NATS sink (``nats_stream``) is written by the round's
``StreamWriter``; every other part asks ``sink_kind`` instead of looking at a URL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libs.dburl import parse_database_url
from services.sink_worker.sinks.base import Sink
from services.sink_worker.sinks.nats_stream import is_stream_sink, parse_stream_url
from services.sink_worker.sinks.sql_common import SqlSink


@dataclass(frozen=True)
class SinkKind:
    """What a downstream can do, by its URL."""

    stream: bool
    """A NATS stream: the changes are published (every change, DDL as messages); no rows are
    held, so nothing reads them back (validation), and no table is applied as a whole (a
    foreign-key group's cascades, a table re-copied or dropped at a DDL)."""

    @property
    def holds_rows(self) -> bool:
        return not self.stream


def sink_kind(url: str) -> SinkKind:
    return SinkKind(stream=is_stream_sink(url))


def check_sink_url(url: str) -> None:
    """Check the URL's form without resolving secrets (the api, before a worker runs it);
    ``ValueError`` (``DatabaseUrlError`` is one) says what is wrong."""
    if sink_kind(url).stream:
        parse_stream_url(url, resolve_secrets=False)
    else:
        parse_database_url(url, resolve_secrets=False)


def open_sink(url: str, **options: Any) -> Sink:
    """A sink for ``url`` (mysql://, mariadb://, postgresql://, sqlite:///path).

    Nothing connects yet: sinks connect per call, so the result can be pickled to executors.
    ``options`` go to the sink (``max_attempts``, ``backoff_s``, ``chunk_rows``, ...).
    """
    dialect = parse_database_url(url).dialect
    sink_class: type[SqlSink]
    if dialect == "mysql":
        from services.sink_worker.sinks.mysql import MySQLSink

        sink_class = MySQLSink
    elif dialect == "postgresql":
        from services.sink_worker.sinks.postgres import PostgresSink

        sink_class = PostgresSink
    else:
        from services.sink_worker.sinks.sqlite import SQLiteSink

        sink_class = SQLiteSink
    return sink_class(url, **options)
