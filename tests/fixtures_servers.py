"""Database and Spark fixtures (a pytest plugin, registered in tests/conftest.py).

Each server is private (own port, own temp data dir, own socket, no system option files) and is
started only when a test asks for it:

- ``mariadb``: one MariaDB for the session, ROW binlog with full images, server_id 1. Tests share
  it, so each test uses its own database names.
- ``mariadb_factory``: more MariaDB servers for one test (shards, crash tests); each gets a new
  server_id; all are stopped when the test ends.
- ``postgres`` / ``postgres_factory``: the same for PostgreSQL.
- ``spark``: the process' SparkSession (``libs.spark.get_spark``) with local[2], no UI and
  2 shuffle partitions; stopped at the end of the session.
  Its JVM gets ``SPARK_TEST_JAVA_OPTIONS`` (tests/helpers/worker_env.py), as the tests'
  sink-worker processes do.

Binlog readers in tests need server ids that no server uses: ``replica_server_id`` hands out a
fresh one per test (from 9000 up).
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from libs.config import Settings
from libs.localservers.mariadb import MariaDB
from libs.localservers.postgres import PostgreSQL
from libs.spark import get_spark, stop_spark
from tests.helpers.worker_env import SPARK_TEST_JAVA_OPTIONS

_server_ids = itertools.count(2)  # 1 is the session server's
_replica_ids = itertools.count(9000)


@pytest.fixture(scope="session")
def mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MariaDB]:
    server = MariaDB(data_dir=tmp_path_factory.mktemp("mariadb"), server_id=1).start()
    yield server
    server.cleanup()


@pytest.fixture
def mariadb_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., MariaDB]]:
    started: list[MariaDB] = []

    def make(**kwargs: Any) -> MariaDB:
        kwargs.setdefault("server_id", next(_server_ids))
        server = MariaDB(data_dir=tmp_path_factory.mktemp("mariadb"), **kwargs)
        started.append(server)
        return server.start()

    yield make
    for server in started:
        server.cleanup()


@pytest.fixture
def replica_server_id() -> int:
    """A server_id no MariaDB here uses, for a BinLogStreamReader."""
    return next(_replica_ids)


def _pg_dir() -> Path:
    # Not under pytest's tmp_path: its 0700 base dir is closed to the unprivileged user
    # PostgreSQL runs as when the tests run as root.
    return Path(tempfile.mkdtemp(prefix="sluice-pg-"))


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgreSQL]:
    server = PostgreSQL(data_dir=_pg_dir())
    try:
        yield server.start()
    finally:
        server.cleanup(remove_data=True)


@pytest.fixture
def postgres_factory() -> Iterator[Callable[..., PostgreSQL]]:
    started: list[PostgreSQL] = []

    def make(**kwargs: Any) -> PostgreSQL:
        server = PostgreSQL(data_dir=_pg_dir(), **kwargs)
        started.append(server)
        return server.start()

    yield make
    for server in started:
        server.cleanup(remove_data=True)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    settings = Settings(
        spark_master="local[2]",
        spark_shuffle_partitions=2,
        spark_driver_memory="1g",
        spark_driver_java_options=SPARK_TEST_JAVA_OPTIONS,
    )
    session = get_spark(settings)
    yield session
    stop_spark()
