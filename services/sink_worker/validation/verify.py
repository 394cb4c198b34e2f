"""Compare a downstream table with the merge of its upstream shards, row for row.

A user feature, not only test code: the demo (``infra/dev.sh demo``, ``infra/demo.py``) ends by
verifying each target with it and shows the result; it is not a ``sluice`` command (an operator
checks a running changefeed with continuous validation, ``libs/validation``). The end-to-end and
process tests use it too. Upstream rows are read with the source's own metadata; the downstream
through the sink (``Sink.fetch_rows``), so each side is decoded by the code that owns it. It
reads whole tables into memory: for the demo's and the tests' sizes, not a production table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libs.checksum import TableDiff, compare_tables
from libs.codec.decode import CanonicalJson, canonical_json
from libs.codec.table_meta import load_table_info
from libs.dburl import parse_database_url
from libs.sql_ident import quote_ident
from services.sink_worker.sinks.base import TargetTable
from services.sink_worker.sinks.factory import open_sink
from services.sink_worker.span.target import choose_key


@dataclass(frozen=True)
class ShardRef:
    source_url: str
    database: str
    table: str


@dataclass
class Verification:
    target: str
    diff: TableDiff
    upstream_digest: str
    downstream_digest: str

    @property
    def ok(self) -> bool:
        return self.diff.ok and self.upstream_digest == self.downstream_digest


def _source_rows(ref: ShardRef) -> tuple[list[dict[str, Any]], Any]:
    import pymysql
    import pymysql.cursors

    from libs.mysql_connection import connect as mysql_connect

    url = parse_database_url(ref.source_url)
    conn = mysql_connect(host=url.host, port=url.port, user=url.user or "root", password=url.password,
                           charset="utf8mb4", autocommit=True)
    try:
        info = load_table_info(conn, ref.database, ref.table)
        if info is None:
            return [], None
        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute("SET time_zone = '+00:00'")
            name = f"{quote_ident('mysql', ref.database)}.{quote_ident('mysql', ref.table)}"
            cur.execute(f"SELECT * FROM {name}")
            rows = [dict(r) for r in cur.fetchall()]
        return rows, info.meta()
    finally:
        conn.close()


def verify_target(shards: Sequence[ShardRef], sink_url: str, target_schema: str, target_table: str,
                  ) -> Verification:
    """Checksum and diff of ``target_schema.target_table`` against the union of ``shards``."""
    return verify_targets(shards, [sink_url], target_schema, target_table)[0]


def verify_targets(shards: Sequence[ShardRef], sink_urls: Sequence[str], target_schema: str,
                   target_table: str) -> list[Verification]:
    """``verify_target`` against each of ``sink_urls``, the upstream read once for all of them."""
    upstream: list[dict[str, Any]] = []
    meta = None
    for ref in shards:
        rows, shard_meta = _source_rows(ref)
        upstream.extend(rows)
        meta = meta or shard_meta
    if meta is None:
        raise LookupError(f"none of the shards of {target_schema}.{target_table} exists upstream")
    key = choose_key(meta, "primary", database=target_schema, table=target_table)
    unique = tuple(tuple(uk) for uk in meta.unique_keys if tuple(uk) != key)
    target = TargetTable(schema=target_schema, name=target_table, meta=meta, key=key, unique_keys=unique)
    columns = list(meta.columns)
    if len(sink_urls) > 1:
        # Each JSON document parsed once, not once per downstream it is compared with.
        docs = [c.name for c in columns if c.kind == "json"]
        for row in upstream:
            for name in docs:
                if row.get(name) is not None:
                    row[name] = CanonicalJson(canonical_json(row[name]))
    results = []
    for sink_url in sink_urls:
        downstream = open_sink(sink_url).fetch_rows(target)
        # One normalisation of each row serves the diff and the checksums.
        diff = compare_tables(upstream, downstream, key, columns=columns)
        results.append(Verification(f"{target_schema}.{target_table}", diff, diff.upstream_digest,
                                    diff.downstream_digest))
    return results
