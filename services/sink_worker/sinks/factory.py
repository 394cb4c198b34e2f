"""``open_sink(url)``: the sink for a downstream database URL, chosen by its dialect."""

from __future__ import annotations

from typing import Any

from libs.dburl import parse_database_url
from services.sink_worker.sinks.base import Sink
from services.sink_worker.sinks.sql_common import SqlSink


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
