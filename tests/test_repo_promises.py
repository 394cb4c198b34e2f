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


def test_compose_runs_every_service_against_jaeger() -> None:
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"nats", "mariadb", "postgres", "jaeger"} <= set(services)
    modules = {p.name for p in (ROOT / "services").iterdir() if (p / "__main__.py").exists()}
    started = set()
    for spec in services.values():
        command = spec.get("command") or []
        text = " ".join(command) if isinstance(command, list) else str(command)
        for module in modules:
            script = "sluice-" + module.replace("_", "-")
            if f"services.{module}" in text or script in command or text == script:
                started.add(module)
                env = spec.get("environment") or {}
                env_text = str(env)
                assert "OTEL_EXPORTER_OTLP_ENDPOINT" in env_text, spec
                assert "SLUICE_NATS_URL" in env_text, spec
                assert "healthcheck" in spec, spec
    assert started == modules, f"services without a compose entry: {sorted(modules - started)}"
