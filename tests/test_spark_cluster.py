"""The data path's jobs on a real Spark standalone cluster (a master and 2 workers from
pyspark's own launcher) and on a Spark Connect server leave the downstream the workload's
plain-Python replay gives (the data-path tests check local Spark against the same kind of
replay).

The workload (``tests.spark_workload``) runs in a process of its own per Spark: a classic
session is one per process. One module-scoped cluster, a few dozen rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from libs.localservers.mariadb import MariaDB
from libs.localservers.spark_cluster import SparkConnect, SparkStandalone
from tests.spark_workload import expected

pytestmark = pytest.mark.integration

_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkStandalone]:
    # 1g a worker: an executor asks for spark.executor.memory (1g by default) and would wait
    # forever on a smaller worker.
    standalone = SparkStandalone(tmp_path_factory.mktemp("spark-standalone"), workers=2, cores=1, memory="1g")
    try:
        yield standalone.start()
    finally:
        standalone.stop()


@pytest.fixture(scope="module")
def connect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkConnect]:
    server = SparkConnect(tmp_path_factory.mktemp("spark-connect"), master="local[2]")
    try:
        yield server.start()
    finally:
        server.stop()


def _run(master: str, db: Path, logs: str = "") -> dict[str, list[dict[str, Any]]]:
    done = subprocess.run([sys.executable, "-m", "tests.spark_workload", master, f"sqlite:///{db}"],
                          cwd=_ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (f"the workload on {master} failed:\n{done.stderr[-4000:]}\n{logs}")
    result: dict[str, list[dict[str, Any]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_standalone_cluster_writes_the_replayed_downstream(cluster: SparkStandalone,
                                                             tmp_path: Path) -> None:
    assert _run(cluster.url, tmp_path / "cluster.db", cluster.logs()) == expected()
    # The jobs ran on the cluster: the master saw the workload's application finish.
    apps = cluster.status().get("completedapps", [])
    assert any(app["name"].startswith("sluice-") for app in apps), cluster.status()


def test_a_spark_connect_server_writes_the_replayed_downstream(connect: SparkConnect, tmp_path: Path) -> None:
    assert _run(connect.url, tmp_path / "connect.db", connect.logs()) == expected()


def _connect_check(check: str, *args: str, logs: str = "") -> dict[str, Any]:
    """One check of ``tests.helpers.spark_connect_checks`` in a child process: this pytest
    worker may hold a classic session from an earlier module, beside which PySpark refuses a
    Connect one."""
    done = subprocess.run([sys.executable, "-m", "tests.helpers.spark_connect_checks", check, *args],
                          cwd=_ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"the {check} check failed:\n{done.stderr[-4000:]}\n{logs}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_an_initial_load_copies_over_spark_connect(connect: SparkConnect, mariadb: MariaDB,
                                                    tmp_path: Path) -> None:
    """The copy's jobs (``CopyPool``) run over Spark Connect, which has no ``sparkContext``:
    there they are ``spark.range`` + ``mapInArrow``."""
    import sqlite3

    db = "snap_connect"
    mariadb.execute(f"DROP DATABASE IF EXISTS {db}", f"CREATE DATABASE {db}",
                    f"CREATE TABLE {db}.t (id INT PRIMARY KEY, v VARCHAR(16))",
                    f"INSERT INTO {db}.t SELECT seq, CONCAT('v', seq) FROM {db}.seq_1_to_3000")
    result = _connect_check("copy", connect.url, mariadb.url, db, f"sqlite:///{tmp_path / 'copy.db'}",
                            logs=connect.logs())
    assert len(result["chunks"]) == 3
    assert result["counts"] == {str(c): 1000 for c in result["chunks"]}
    with sqlite3.connect(tmp_path / "copy.db") as down:
        assert down.execute('SELECT COUNT(*), SUM(id), MAX(v) FROM "t"').fetchone() == (3000, 4501500, "v999")


def test_a_connect_session_gets_this_process_runtime_settings(connect: SparkConnect) -> None:
    """A Connect server's own defaults (its host's time zone, its shuffle partitions) must not
    decide what a local session would: the session sets them itself."""
    assert _connect_check("settings", connect.url, logs=connect.logs()) == {
        "timeZone": "UTC", "shufflePartitions": "7"}
