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
