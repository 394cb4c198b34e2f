"""Promises about the repository itself: settings documented, lint and types clean, CI wiring."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from libs.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_is_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [f"SLUICE_{name.upper()}" for name in Settings.model_fields
               if f"`SLUICE_{name.upper()}`" not in readme]
    assert not missing, f"settings missing from README.md: {missing}"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash infra/dev.sh test" in readme
    commands = [line for line in ci.splitlines()
                if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert commands == ["exec bash infra/dev.sh test"], commands


def test_ruff_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
