"""Every SQL sink the tests run against, and a target table for each."""

from __future__ import annotations

import itertools
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from contracts.events.rows import TableMetaV1
from services.sink_worker.sinks.base import Sink, TargetTable
from services.sink_worker.sinks.factory import open_sink

SINKS = ["mariadb", "postgres", "sqlite"]


_names = itertools.count()


@dataclass
class Target:
    """One downstream for one test: a sink plus a private database/schema."""

    kind: str
    sink: Sink
    schema: str | None
    server: Any = None

    def table(self, name: str, meta: TableMetaV1, key: tuple[str, ...] | None = None,
              unique_keys: tuple[tuple[str, ...], ...] | None = None, create: bool = True) -> TargetTable:
        table = TargetTable(
            schema=self.schema, name=name, meta=meta,
            key=key or tuple(meta.primary_key),
            unique_keys=unique_keys if unique_keys is not None else tuple(tuple(u) for u in meta.unique_keys),
        )
        if create:
            self.sink.ensure_table(table)
        return table


def _unique_name(request: pytest.FixtureRequest) -> str:
    base = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:30]
    return f"sk{next(_names)}_{base}"


def make_target(request: pytest.FixtureRequest, kind: str, tmp_path: Path, **options: Any) -> Target:
    name = _unique_name(request)
    if kind == "mariadb":
        server = request.getfixturevalue("mariadb")
        url, schema = server.url, name
    elif kind == "postgres":
        server = request.getfixturevalue("postgres")
        # The deadlock test wants this session to detect deadlocks quickly (superuser setting).
        url, schema = server.url + "?options=-c%20deadlock_timeout%3D200ms", name
    else:
        server = None
        url, schema = f"sqlite:///{tmp_path / (name + '.db')}", None
    sink = pickle.loads(pickle.dumps(open_sink(url, **options)))
    return Target(kind, sink, schema, server)
