"""A job's partitions handed to its Python tasks by file in local mode (``libs.spark_handoff``),
with a real local SparkSession: each partition gets its own item, whole and in order, the files
are gone after the job (also after a failed one), and a dead process' directory is cleared."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from libs import spark_handoff
from libs.spark_handoff import handoff_dir, is_local, partition_rdd


def _describe(items: Iterator[Any]) -> Iterator[tuple[int, int, bytes]]:
    for group in items:
        yield len(group), sum(len(e[1]) for e in group), group[-1][1][-8:]


def _boom(items: Iterator[Any]) -> Iterator[int]:
    for _ in items:
        raise ValueError("the task failed")
    yield 0


@pytest.mark.integration
def test_each_partition_gets_its_item_by_file_and_the_files_go(spark: SparkSession) -> None:
    assert is_local(spark.sparkContext)
    groups = [[(f"span{i}", os.urandom(1000 + j), [j]) for j in range(50 * (i + 1))] for i in range(3)]
    with partition_rdd(spark.sparkContext, groups) as rdd:
        assert rdd.getNumPartitions() == 3
        files = list(handoff_dir().iterdir())
        assert len(files) == 3
        got = rdd.mapPartitions(_describe).collect()
    assert got == [(len(g), sum(len(e[1]) for e in g), g[-1][1][-8:]) for g in groups]
    assert not list(handoff_dir().iterdir())

    with pytest.raises(Exception, match="the task failed"):
        with partition_rdd(spark.sparkContext, groups) as rdd:
            rdd.mapPartitions(_boom).collect()
    assert not list(handoff_dir().iterdir())


class _Context:
    def __init__(self, master: str) -> None:
        self.master = master


@pytest.mark.parametrize(("master", "local"), [("local[*]", True), ("local[2]", True), ("local", True),
                                               ("spark://127.0.0.1:7077", False)])
def test_only_a_local_master_hands_off_by_file(master: str, local: bool) -> None:
    assert is_local(_Context(master)) is local  # type: ignore[arg-type]


def test_a_dead_process_directory_is_cleared_and_a_live_ones_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(spark_handoff.tempfile, "tempdir", None)
    monkeypatch.setattr(spark_handoff, "_dir", None)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / f"sluice-handoff-{int(dead.stdout)}"
    stale.mkdir()
    (stale / "left.pkl").write_bytes(b"x")
    live = tmp_path / f"sluice-handoff-{os.getppid()}"
    live.mkdir()
    other = tmp_path / "sluice-handoff-notapid"
    other.mkdir()
    mine = handoff_dir()
    assert mine == tmp_path / f"sluice-handoff-{os.getpid()}" and mine.is_dir()
    assert oct(mine.stat().st_mode & 0o777) == "0o700"
    assert not stale.exists() and live.is_dir() and other.is_dir()


def test_a_process_directory_goes_when_it_exits(tmp_path: Path) -> None:
    made = subprocess.run(
        [sys.executable, "-c", "from libs.spark_handoff import handoff_dir; print(handoff_dir())"],
        capture_output=True, text=True, check=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    directory = Path(made.stdout.strip())
    assert directory.parent == tmp_path and directory.name.startswith("sluice-handoff-")
    assert not directory.exists()
