"""examples/: the commented changefeed specs are what the api accepts, and the MySQL/MariaDB
user and settings are what capture and the creation checks need."""

from __future__ import annotations

import configparser
import re
import secrets
import tomllib
from pathlib import Path
from typing import Any

import pymysql
import pytest

from contracts.events.changefeeds import ChangefeedSpec
from libs.localservers.mariadb import MariaDB
from libs.routing import TableRef, Target, router_for, validate_spec
from services.api.prechecks import missing_source_grants
from services.api.validation import password_problems, spec_problems
from services.capture.source import check_source
from services.cli.app import spec_from_text

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _spec(name: str) -> ChangefeedSpec:
    text = (EXAMPLES / "changefeeds" / name).read_text()
    assert sum(line.lstrip().startswith("//") for line in text.splitlines()) >= 5, "explain the fields"
    return ChangefeedSpec.model_validate(spec_from_text(text))


def _refs(sources: list[str], databases: list[str], tables: list[str]) -> list[TableRef]:
    return [TableRef(s, d, t) for s in sources for d in databases for t in tables]


def test_every_example_spec_is_one_the_api_accepts() -> None:
    names = sorted(p.name for p in (EXAMPLES / "changefeeds").glob("*.jsonc"))
    assert names == ["nats-sink.jsonc", "one-database-to-postgres.jsonc", "shards-into-mariadb.jsonc"]
    for name in names:
        spec = _spec(name)
        assert spec_problems(spec) == [] and password_problems(spec) == [], name

    one = _spec("one-database-to-postgres.jsonc")
    assert one.sink_url.startswith("postgresql://") and one.initial_load == "snapshot"
    assert validate_spec(one, _refs(["shop"], ["shop"], ["orders", "customers", "tmp_import"])) == []

    merged = _spec("shards-into-mariadb.jsonc")
    assert merged.sink_url.startswith("mysql://") and merged.origin_column and len(merged.sources) == 2
    shards = _refs(["shard-1", "shard-2"], ["shop_a", "shop_b"], ["orders_0", "orders_1", "orders_2"])
    assert validate_spec(merged, shards) == []
    router = router_for(merged)
    assert {router.route(*ref) for ref in shards} == {Target("shop", "orders")}
    assert router.route("shard-1", "shop_a", "customers") is None, "the filter leaves it out"
    one_router = router_for(one)
    assert one_router.route("shop", "shop", "tmp_import") is None
    assert one_router.route("shop", "shop", "orders") == Target("shop", "orders")

    events = _spec("nats-sink.jsonc")
    assert events.sink_url.startswith("nats://") and events.initial_load == "binlog-only"


@pytest.mark.integration
def test_the_example_source_user_and_settings_pass_capture_and_the_creation_checks(mariadb: MariaDB) -> None:
    password = secrets.token_hex(12)
    sql = (EXAMPLES / "mysql" / "source-user.sql").read_text().replace("change-me", password)
    statements = [s.strip() for s in "\n".join(
        line for line in sql.splitlines() if not line.startswith("--")).split(";") if s.strip()]
    admin = mariadb.connect()
    try:
        with admin.cursor() as cur:
            cur.execute("DROP USER IF EXISTS 'sluice'@'%'")
            for statement in statements:
                cur.execute(statement)
        user = pymysql.connect(host="127.0.0.1", port=mariadb.port, user="sluice", password=password)
        try:
            with user.cursor() as cur:
                cur.execute("SHOW GRANTS")
                grants = [row[0] for row in cur.fetchall()]
            assert missing_source_grants(grants) == [], grants
            assert check_source(user) == []
        finally:
            user.close()
        # The option file names the settings this server runs with, the ones capture accepts.
        cnf = configparser.ConfigParser()
        cnf.read_string((EXAMPLES / "mysql" / "source.cnf").read_text())
        wanted = dict(cnf["mysqld"])
        with admin.cursor() as cur:
            for name in ("binlog_format", "binlog_row_image", "binlog_row_metadata"):
                cur.execute(f"SELECT @@GLOBAL.{name}")
                assert str(cur.fetchone()[0]).upper() == wanted[name].upper(), name
            cur.execute("SELECT @@GLOBAL.log_bin")
            assert str(cur.fetchone()[0]) in ("1", "ON") and wanted["log_bin"]
            cur.execute("DROP USER 'sluice'@'%'")
    finally:
        admin.close()


@pytest.mark.integration
def test_the_compose_sources_replication_user_is_created_from_its_secret(mariadb: MariaDB,
                                                                          tmp_path: Path) -> None:
    """infra/mariadb/sluice-user.sh, as the MariaDB image's entrypoint sources it (its
    ``docker_process_sql`` reads SQL on stdin): the user capture logs in as in compose, with the
    secret's password (quotes and backslashes included) and the replication grants."""
    import subprocess

    password = "pw'with\\quote-" + secrets.token_hex(6)
    (tmp_path / "source_password").write_text(password)
    script = EXAMPLES.parent / "infra" / "mariadb" / "sluice-user.sh"
    stub = f'docker_process_sql() {{ cat > "{tmp_path}/init.sql"; }}; . "{script}"'
    done = subprocess.run(["/bin/sh", "-ec", stub],
                          env={"SLUICE_SOURCE_PASSWORD_FILE": str(tmp_path / "source_password"),
                               "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    statements = [s.strip() for s in (tmp_path / "init.sql").read_text().split(";\n") if s.strip()]
    admin = mariadb.connect()
    try:
        with admin.cursor() as cur:
            cur.execute("DROP USER IF EXISTS 'sluice'@'%'")
            for statement in statements:
                cur.execute(statement)
        user = pymysql.connect(host="127.0.0.1", port=mariadb.port, user="sluice", password=password)
        try:
            with user.cursor() as cur:
                cur.execute("SHOW GRANTS")
                assert missing_source_grants([row[0] for row in cur.fetchall()]) == []
        finally:
            user.close()
        with admin.cursor() as cur:
            cur.execute("DROP USER 'sluice'@'%'")
    finally:
        admin.close()


def test_the_first_hour_walkthrough_names_real_commands_and_files() -> None:
    from typer.main import get_command

    from services.cli.app import app

    readme = (EXAMPLES.parent / "README.md").read_text()
    first_screen = readme[:1500]
    assert "bash infra/dev.sh demo" in first_screen and "bash infra/dev.sh test" in first_screen
    assert "(#the-first-hour)" in first_screen
    section = readme.split("## The first hour", 1)[1].split("\n## ", 1)[0]
    for link in re.findall(r"\]\((examples/[^)]+)\)", section):
        assert (EXAMPLES.parent / link).is_file(), link
    scripts = set(tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text())["project"]["scripts"])
    for script in ("sluice-capture", "sluice-sink-worker", "sluice-api", "sluice-member",
                   "sluice-scheduler", "sluice-replication-manager", "sluice-ddl-lock"):
        assert script in scripts and script.split("-", 1)[1].split("-")[0] in section, script
    cli: Any = get_command(app)
    used = re.findall(r"\bsluice ([a-z-]+)(?: ([a-z-]+))?", section)
    assert len(used) >= 5, used
    for word, sub in used:
        assert word in cli.commands, word
        command = cli.commands[word]
        if hasattr(command, "commands"):
            assert sub in command.commands, (word, sub)


def test_the_demo_answers_help_before_anything_is_installed(tmp_path: Path) -> None:
    """`bash infra/dev.sh demo --help` prints the options at once: demo.py answers --help before
    importing the project (here with an interpreter that has none of its dependencies), and
    dev.sh runs it before `setup` (which installs Java, MariaDB, PostgreSQL and the venv)."""
    import subprocess
    import sys

    root = EXAMPLES.parent
    bare = tmp_path / "bare-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=60)
    done = subprocess.run([str(bare / "bin" / "python"), "-I", str(root / "infra" / "demo.py"), "--help"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "--seconds" in done.stdout and "--nats-sync-interval" in done.stdout
    dev_sh = (root / "infra" / "dev.sh").read_text()
    demo = dev_sh[dev_sh.index("  demo)"):]
    assert demo.index("-h|--help)") < demo.index("    setup\n"), demo


def test_the_demo_says_where_its_servers_listen_and_as_whom(tmp_path: Path) -> None:
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("sluice_demo", EXAMPLES.parent / "infra" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    system = demo.LocalSystem(base_dir=tmp_path, sources=2)
    system.source_dbs = [SimpleNamespace(port=40001), SimpleNamespace(port=40002)]
    lines = demo.server_lines(system)
    assert lines[0].startswith("source src1: MariaDB 127.0.0.1:40001, user root")
    assert "shop_a, shop_b" in lines[0] and "mysql -h 127.0.0.1 -P 40002 -u root" in lines[1]
    assert lines[2].startswith(f"downstream: SQLite {tmp_path / 'downstream.db'}")
