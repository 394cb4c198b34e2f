"""Promises about the repository itself: settings documented, lint and types clean, CI wiring."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
    assert {"nats-1", "mariadb-1", "postgres", "jaeger"} <= set(services)
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


def _compose() -> dict[str, Any]:
    import yaml

    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def _sluice_services(services: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """compose name -> (sluice service, spec) of every container that runs a Sluice service."""
    out = {}
    for name, spec in services.items():
        command = spec.get("command") or []
        if command and str(command[0]).startswith("sluice-"):
            out[name] = (str(command[0]).removeprefix("sluice-"), spec)
    return out


def _host_port(mapping: Any) -> str:
    """The host port of a ``[bind:]host:container`` mapping (the bind may be ``${VAR:-ip}``)."""
    return str(mapping).rsplit(":", 2)[-2]


_BIND = "${SLUICE_BIND:-127.0.0.1}:"


def test_compose_holds_no_password_and_takes_them_from_env_file() -> None:
    import re

    text = (ROOT / "docker-compose.yml").read_text()
    services = _compose()["services"]
    for name, spec in services.items():
        for key, value in (spec.get("environment") or {}).items():
            if re.search(r"PASSWORD|TOKEN|SECRET", key) and not key.endswith("_FILE") \
                    and key not in ("SLUICE_SECRETS_DIR", "SLUICE_SECRETS_HOSTS"):
                assert str(value).startswith("${") and ":?" in str(value), (name, key, value)
            if "://" in str(value) and "@" in str(value):
                password = str(value).split("://", 1)[1].split("@", 1)[0].partition(":")[2]
                assert not password or password.startswith("secret:"), (name, key)
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", text))
    used |= {s["environment"] for s in _compose()["secrets"].values()}
    example = (ROOT / ".env.example").read_text()
    assert all(re.search(rf"^#? ?{v}=", example, re.MULTILINE) for v in used), (used, example)
    # Copied as it is, .env.example gives no two secrets one value, and no NATS role a password
    # (each gets its own from `python -m libs.nats_auth env`).
    given = dict(re.findall(r"^([A-Z0-9_]+)=(.*)$", example, re.MULTILINE))
    assert not [k for k in given if k.startswith("SLUICE_NATS_PW_")], given
    assert len(set(given.values())) == len(given), given
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert "sluice" not in " ".join(re.findall(r"PASSWORD\w*: *(\S+)", text))


def test_compose_ports_bind_to_localhost_unless_the_operator_opts_in() -> None:
    services = _compose()["services"]
    for name, spec in services.items():
        for mapping in spec.get("ports", []):
            assert str(mapping).startswith(_BIND), (name, mapping)
    # Anyone reaching a Spark master can run code on the cluster.
    assert not services["spark-master"].get("ports")


def test_compose_images_are_pinned() -> None:
    import re

    for name, spec in _compose()["services"].items():
        image = str(spec["image"])
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", (name, image)
        # A release (15.10, 2.10.22-alpine), not a moving major (15, 10.11) or latest.
        assert re.search(r"\d+\.\d+", tag), f"{name}: {image} is not pinned to a release"


def test_compose_grafana_has_no_anonymous_access_and_health_uses_readyz() -> None:
    services = _compose()["services"]
    grafana = services["grafana"]["environment"]
    assert str(grafana["GF_AUTH_ANONYMOUS_ENABLED"]).lower() == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in grafana
    assert grafana["GF_SECURITY_ADMIN_PASSWORD__FILE"].startswith("/run/secrets/")
    for name, (_, spec) in _sluice_services(services).items():
        assert "/readyz" in " ".join(spec["healthcheck"]["test"]), name
        if name.startswith("api-"):
            assert str(spec["environment"]["SLUICE_API_TOKEN"]).startswith("${SLUICE_API_TOKEN:?")


def test_compose_stack_is_complete_and_consistent() -> None:
    from libs.dburl import parse_database_url
    from libs.secret_refs import binding_problem, is_reference, reference_name
    from libs.service import DEFAULT_PORTS

    services = _compose()["services"]
    settings = {f"SLUICE_{n.upper()}" for n in Settings.model_fields}
    nats_nodes = [f"nats-{i}" for i in (1, 2, 3)]
    # NATS: a 3-node JetStream cluster, every node routed to every other as user "route", whose
    # password the routes' listener requires (compose's $$ is a literal $ for the shell).
    for node in nats_nodes:
        spec = services[node]
        assert spec["image"].startswith("nats:") and "healthcheck" in spec
        command = " ".join(spec["command"])
        assert "exec nats-server -c /tmp/nats-node.conf -js -sd /data" in command, node
        assert "name: sluice" in command, node
        assert 'authorization { user: route, password: "$$SLUICE_NATS_PW_ROUTE" }' in command, node
        assert all(f"nats://route:$$SLUICE_NATS_PW_ROUTE@{n}:6222" in command for n in nats_nodes), node
    # Two MariaDB sources with a ROW binlog of full images, distinct server ids.
    server_ids = set()
    for db in ("mariadb-1", "mariadb-2"):
        command = services[db]["command"]
        for flag in ("--log-bin=binlog", "--binlog-format=ROW", "--binlog-row-image=FULL",
                     "--binlog-row-metadata=FULL"):
            assert flag in command, (db, flag)
        server_ids.add(next(c for c in command if c.startswith("--server-id=")))
    assert len(server_ids) == 2
    assert services["postgres"]["image"].startswith("postgres:")
    assert {_host_port(p) for p in services["jaeger"]["ports"]} >= {"4318", "16686"}
    # Spark standalone: master on 7077 and a worker registered with it.
    assert "org.apache.spark.deploy.master.Master" in services["spark-master"]["command"]
    assert "7077" in services["spark-master"]["command"]
    for worker in ("spark-worker", "spark-worker-2"):
        worker_cmd = services[worker]["command"]
        assert "org.apache.spark.deploy.worker.Worker" in worker_cmd
        assert "spark://spark-master:7077" in worker_cmd
    # Spark Connect on the same cluster, not published (the sc:// choice of SLUICE_SPARK_MASTER).
    connect_cmd = " ".join(services["spark-connect"]["command"])
    assert "org.apache.spark.sql.connect.service.SparkConnectServer" in connect_cmd
    assert "--master spark://spark-master:7077" in connect_cmd and "binding.port=15002" in connect_cmd
    assert not services["spark-connect"].get("ports")
    # Grafana with the provisioned dashboard; Prometheus with its config.
    mounts = " ".join(services["grafana"]["volumes"])
    assert "./infra/grafana/provisioning:/etc/grafana/provisioning" in mounts
    assert "./infra/grafana/dashboards:/var/lib/grafana/dashboards" in mounts
    prometheus_mounts = " ".join(services["prometheus"]["volumes"])
    assert "./infra/prometheus.yml:/etc/prometheus/prometheus.yml" in prometheus_mounts

    sluice = _sluice_services(services)
    replicas: dict[str, int] = {}
    for name, (service, spec) in sluice.items():
        replicas[service] = replicas.get(service, 0) + 1
        env = {k: str(v) for k, v in spec["environment"].items()}
        assert spec["image"].startswith("sluice:") and spec["build"]["dockerfile"] == "infra/Dockerfile", name
        assert env["SLUICE_NATS_URL"].split(",") == [f"nats://{n}:4222" for n in nats_nodes], name
        assert env["SLUICE_STREAM_REPLICAS"] == "3", name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
        assert env["SLUICE_INSTANCE_ID"] == name, name
        unknown = {k for k in env if k.startswith("SLUICE_")} - settings
        assert not unknown, f"{name}: settings that do not exist: {unknown}"
        port = DEFAULT_PORTS[service]
        assert env["SLUICE_HTTP_PORT"] == str(port), name
        assert f"127.0.0.1:{port}/readyz" in " ".join(spec["healthcheck"]["test"]), name
        assert set(spec["depends_on"]) >= set(nats_nodes), name
        if service == "sink-worker":
            assert env["SLUICE_SPARK_MASTER"] == "spark://spark-master:7077", name
            assert env["SLUICE_SPARK_DRIVER_HOST"] == spec["hostname"] == name
            assert env["SLUICE_DOWNSTREAM_URL"].startswith(
                "postgresql://sluice:secret:postgres_password@postgres:5432/")
        if service == "capture":
            source = env["SLUICE_SOURCE_URL"]
            assert any(f"@{db}:3306/" in source for db in ("mariadb-1", "mariadb-2")), name
        # Every secret a service's URL names is bound to that URL's host (else it resolves nowhere).
        for key in ("SLUICE_SOURCE_URL", "SLUICE_DOWNSTREAM_URL"):
            if key in env:
                url = parse_database_url(env[key], resolve_secrets=False)
                if is_reference(url.password):
                    assert binding_problem(reference_name(url.password), [(url.host, url.port)],
                                           environ=env) is None, (name, key)
    assert replicas == {"capture": 2, "member": 2, "scheduler": 2, "replication-manager": 2,
                        "ddl-lock": 2, "api": 2, "sink-worker": 3}
    assert {s["environment"]["SLUICE_SOURCE_ID"] for n, (svc, s) in sluice.items() if svc == "capture"} == {
        "src1", "src2"}
    # Prometheus scrapes exactly the Sluice containers, on their ports.
    import yaml

    prometheus = yaml.safe_load((ROOT / "infra" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] if job["job_name"] != "prometheus"
               for cfg in job["static_configs"] for t in cfg["targets"]}
    assert targets == {f"{name}:{DEFAULT_PORTS[svc]}" for name, (svc, _) in sluice.items()}
    # No host port is published twice.
    published = [_host_port(p) for spec in services.values() for p in spec.get("ports", [])]
    assert len(published) == len(set(published)), published


def test_docker_compose_config_validates() -> None:
    import shutil

    candidates = [["docker", "compose"], ["docker-compose"]]
    for cli in candidates:
        if shutil.which(cli[0]) is None:
            continue
        probe = subprocess.run([*cli, "version"], capture_output=True, text=True)
        if probe.returncode != 0:
            continue
        out = subprocess.run([*cli, "--env-file", str(ROOT / ".env.example"),
                              "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
                             capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        return
    pytest.skip("no Docker Compose client on this machine (docker compose / docker-compose)")


def test_no_process_is_started_with_a_url_or_secret_on_its_command_line() -> None:
    """A command line is every local user's to read (ps, /proc/<pid>/cmdline): a URL (which may
    hold a password), a token or a JSON spec goes to a child process through its environment
    or stdin instead."""
    import ast

    found = []
    for root in ("benchmarks", "infra", "libs", "services"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"
                        and node.args):
                    continue
                argv = ast.unparse(node.args[0]).lower()
                if any(word in argv for word in ("url", "password", "secret", "token", "json.dumps")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {argv[:100]}")
    assert found == [], found


def test_compose_nats_node_config_is_what_nats_server_accepts(tmp_path: Path) -> None:
    """The compose nodes' start script, run here with this machine's nats-server (``-t``: check
    the config and exit): the config it writes is valid, includes the generated users, and is
    the only place the route password is written, 0600."""
    import os
    import stat

    from libs.localservers.common import find_binary
    from libs.nats_auth import compose_roles, password_variable

    script = _compose()["services"]["nats-1"]["command"][0].replace("$$", "$")
    (tmp_path / "etc" / "nats").mkdir(parents=True)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "etc" / "nats" / "auth.conf").write_text((ROOT / "infra/nats/auth.conf").read_text())
    conf = tmp_path / "tmp" / "nats-node.conf"
    script = (script.replace("/tmp/nats-node.conf", str(conf)).replace("-sd /data", f"-sd {tmp_path / 'js'}")
              .replace("exec nats-server", f"exec {find_binary('nats-server')} -t"))
    env = {**os.environ, "HOSTNAME": "nats-1", "SLUICE_NATS_SYNC_INTERVAL": "always",
           "SLUICE_NATS_PW_ROUTE": "route-pw-5d1c",
           **{password_variable(r): f"pw-{i}" for i, r in enumerate(compose_roles(["src1", "src2"]))}}
    done = subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is valid" in done.stdout + done.stderr
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    text = conf.read_text()
    assert text.count("route-pw-5d1c") == 4 and "server_name: nats-1" in text


def test_the_readme_says_what_continuous_validation_cannot_find() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Continuous validation"):readme.index("## Operator API and CLI")]
    assert "extra rows downstream in a merged target without an origin" in " ".join(section.split())
