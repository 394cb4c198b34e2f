"""The local Spark driver's class archive (libs/spark_class_archive.py): which archive a setting
names, when a built one is stale, and that the suite's own driver maps the venv's archive."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs import spark_class_archive
from libs.spark_class_archive import archive_for, is_current, venv_archive


def test_the_setting_names_an_archive_only_when_it_is_there(tmp_path: Path) -> None:
    built = tmp_path / "classes.jsa"
    assert archive_for("none") is None
    assert archive_for("") is None
    assert archive_for(str(built)) is None  # not built: the driver starts without one
    built.write_bytes(b"archive")
    assert archive_for(str(built)) == built
    assert archive_for("auto") == (venv_archive() if venv_archive().is_file() else None)


def test_an_archive_of_another_jdk_or_pyspark_is_not_current(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    archive = tmp_path / "classes.jsa"
    stamp = tmp_path / "classes.jsa.stamp"
    monkeypatch.setattr(spark_class_archive, "build_stamp", lambda: "jdk 17\npyspark 4.3.0\n")
    assert not is_current(archive)
    archive.write_bytes(b"archive")
    assert not is_current(archive)  # no stamp: built by hand or half way
    stamp.write_text("jdk 17\npyspark 4.3.0\n")
    assert is_current(archive)
    stamp.write_text("jdk 21\npyspark 4.3.0\n")
    assert not is_current(archive)
