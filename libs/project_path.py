"""The project's root on ``PYTHONPATH``: for every process Sluice starts that imports its modules
(the binlog reader's child, Spark's Python workers and daemons), wherever it was started from."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


def pythonpath_with_project(env: Mapping[str, str]) -> str:
    """``env``'s ``PYTHONPATH`` with the project root first (once)."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != PROJECT_ROOT]
    return os.pathsep.join([PROJECT_ROOT, *paths])
