"""Secret references in URLs: where they resolve from, what a missing one says, and that the
redacted forms keep a reference (a name) but never a password."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from libs.dburl import DatabaseUrlError, parse_database_url
from libs.localservers.mariadb import MariaDB
from libs.localservers.nats_server import NatsServer
from libs.localservers.service_process import ServiceProcess
from libs.secret_refs import SecretError, env_name, literal_password, resolve_password, resolve_secret
from services.api.schemas import redact_url
from tests.helpers.capture import eventually, rows_of, source_messages


def test_a_file_in_the_secrets_dir_wins_over_the_environment(tmp_path: Path) -> None:
    (tmp_path / "src1-pw").write_text("from-file\n")
    env = {"SLUICE_SECRET_SRC1_PW": "from-env"}
    assert resolve_secret("src1-pw", str(tmp_path), env) == "from-file"
    assert resolve_secret("src1-pw", str(tmp_path / "none"), env) == "from-env"
    assert env_name("src1-pw.v2") == "SLUICE_SECRET_SRC1_PW_V2"


def test_a_missing_secret_names_where_it_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(SecretError) as err:
        resolve_secret("sink", str(tmp_path), {})
    assert str(tmp_path / "sink") in str(err.value) and "SLUICE_SECRET_SINK" in str(err.value)
    with pytest.raises(SecretError, match="not a name"):
        resolve_password("secret:../etc/passwd", [("h", 1)], environ={})


def test_a_literal_password_passes_through_and_is_detected() -> None:
    assert resolve_password("plain", [("anywhere", 1)], environ={}) == "plain"
    assert literal_password("mysql://u:plain@h:3306/")
    assert not literal_password("mysql://u:secret:x@h:3306/")
    assert not literal_password("mysql://u@h:3306/") and not literal_password("sqlite:///a.db")


def test_database_urls_resolve_their_secret_when_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_SECRET_DOWN", "s3cr3t")
    monkeypatch.setenv("SLUICE_SECRETS_HOSTS", "down=db:5432;missing=h")
    monkeypatch.delenv("SLUICE_SECRETS_DIR", raising=False)
    url = "postgresql://app:secret:down@db:5432/x"
    assert parse_database_url(url).password == "s3cr3t"
    assert parse_database_url(url, resolve_secrets=False).password == "secret:down"
    with pytest.raises(DatabaseUrlError, match="SLUICE_SECRET_MISSING"):
        parse_database_url("mysql://u:secret:missing@h/")
    assert "s3cr3t" not in parse_database_url(url).redacted()


def test_redaction_keeps_a_reference_and_hides_a_password() -> None:
    assert redact_url("mysql://u:secret:src1@h:3306/") == "mysql://u:secret:src1@h:3306/"
    assert redact_url("mysql://u:hunter2@h:3306/") == "mysql://u:***@h:3306/"


CAPTURE_CANARY = "capture-canary-8e2b61"


def _metrics(proc: ServiceProcess) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(proc.base_url + "/metrics", timeout=5) as resp:
        return resp.status, resp.read().decode()


def _gauge(text: str, source: str) -> float:
    prefix = f'sluice_capture_source_failing_since_timestamp_seconds{{source="{source}"}} '
    return next(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


@pytest.mark.integration
async def test_capture_resolves_its_source_secret_from_the_secrets_dir_and_leaks_it_nowhere(
        mariadb: MariaDB, nats_server: NatsServer, js: JetStreamContext, service_env: dict[str, str],
        replica_server_id: int, tmp_path: Path) -> None:
    mariadb.execute("CREATE USER IF NOT EXISTS 'capcanary'@'%' IDENTIFIED BY '" + CAPTURE_CANARY + "'",
                    "GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO 'capcanary'@'%'",
                    "DROP DATABASE IF EXISTS cap_secret", "CREATE DATABASE cap_secret",
                    "CREATE TABLE cap_secret.t (id INT PRIMARY KEY, v VARCHAR(20))")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    # A wrong password first: capture says why and since when, and takes the corrected file at
    # its next attempt, without a restart.
    (secrets / "cap-pw").write_text("not-the-password\n")
    env = {**service_env, "SLUICE_SOURCE_ID": "capsecret", "SLUICE_SOURCE_SERVER_ID": str(replica_server_id),
           "SLUICE_SOURCE_URL": f"mysql://capcanary:secret:cap-pw@127.0.0.1:{mariadb.port}/cap_secret",
           "SLUICE_SECRETS_DIR": str(secrets), "SLUICE_LOG_LEVEL": "DEBUG",
           "SLUICE_SECRETS_HOSTS": f"cap-pw=127.0.0.1:{mariadb.port}"}
    proc = ServiceProcess("services.capture", env, tmp_path / "logs", instance_id="capsecret").start()
    try:
        async def failing() -> bool:
            health = await asyncio.to_thread(proc.health) or {}
            return "Access denied" in str(health.get("problem")) and bool(health.get("problem_since"))

        await eventually(failing, 60, "capture showing why it cannot connect, and since when")
        health = await asyncio.to_thread(proc.health) or {}
        assert health["state"] == "source-error" and health["problem_since_utc"].endswith(" UTC"), health
        status, metrics_text = await asyncio.to_thread(_metrics, proc)
        assert status == 200 and _gauge(metrics_text, "capsecret") == pytest.approx(
            health["problem_since"], abs=1), metrics_text
        pid = proc.proc.pid if proc.proc else None
        (secrets / "cap-pw").write_text(CAPTURE_CANARY + "\n")

        # Reading: connected with the resolved password, its start position taken (a change
        # made before that position would not be captured).
        async def reading() -> bool:
            return (await asyncio.to_thread(proc.health) or {}).get("state") == "reading"

        await eventually(reading, 60, "capture reading the source's binlog once its secret is right")
        assert proc.proc is not None and proc.proc.pid == pid  # the same process: no restart
        health = await asyncio.to_thread(proc.health) or {}
        assert health.get("problem") is None and health.get("problem_since") is None, health
        assert _gauge((await asyncio.to_thread(_metrics, proc))[1], "capsecret") == 0
        mariadb.execute("INSERT INTO cap_secret.t VALUES (1, 'x')")

        async def captured() -> bool:
            return bool(rows_of(await source_messages(js, "capsecret")))

        await eventually(captured, 60, "the insert captured with the resolved secret")
    finally:
        proc.terminate()
    leaks = []
    for info in await js.streams_info():
        assert info.config.name is not None
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
            try:
                msg = await js.get_msg(info.config.name, seq)
            except NotFoundError:
                continue
            if CAPTURE_CANARY.encode() in (msg.data or b"") + str(msg.headers or {}).encode():
                leaks.append((info.config.name, seq))
    assert leaks == []
    assert CAPTURE_CANARY not in proc.log_path.read_text()



def test_passwords_inside_raw_payloads_are_redacted() -> None:
    from services.api.schemas import redact_urls_in_text

    raw = ('{"sink_url": "postgresql://u:p%40ss@db:5432/x", "sources": [{"url": '
           '"mysql://repl:secret:src1@h:3306/"}, {"url": "mysql://root@h/"}]}')
    assert redact_urls_in_text(raw) == (
        '{"sink_url": "postgresql://u:***@db:5432/x", "sources": [{"url": '
        '"mysql://repl:secret:src1@h:3306/"}, {"url": "mysql://root@h/"}]}')


def test_a_secret_resolves_only_for_the_hosts_it_is_bound_to(monkeypatch: pytest.MonkeyPatch) -> None:
    from libs.secret_refs import SecretBindingError, parse_bindings
    from services.sink_worker.sinks.nats_stream import StreamUrlError, parse_stream_url

    monkeypatch.setenv("SLUICE_SECRET_SHOP_PW", "shop-canary")
    monkeypatch.setenv("SLUICE_SECRET_BUS_PW", "bus-canary")
    monkeypatch.setenv("SLUICE_SECRETS_HOSTS",
                       "shop-pw=DB1:3306, [::1]:3307 # the shop\nbus-pw=nats-1,nats-2:4333")
    monkeypatch.delenv("SLUICE_SECRETS_DIR", raising=False)
    assert parse_database_url("mysql://r:secret:shop-pw@db1:3306/").password == "shop-canary"
    assert parse_database_url("mysql://r:secret:shop-pw@[::1]:3307/").password == "shop-canary"
    # capture and the sinks parse their URLs here: another host or port gets no password.
    for url in ("mysql://r:secret:shop-pw@evil:3306/", "mysql://r:secret:shop-pw@db1:3307/",
                "postgresql://r:secret:shop-pw@db1/x"):
        with pytest.raises(DatabaseUrlError, match="may only be sent to db1:3306") as err:
            parse_database_url(url)
        assert "shop-canary" not in str(err.value)
    assert parse_stream_url("nats://u:secret:bus-pw@nats-1:4999,nats-2:4333/S").password == "bus-canary"
    with pytest.raises(StreamUrlError, match="not to evil:4222"):
        parse_stream_url("nats://u:secret:bus-pw@nats-1,evil/S")
    with pytest.raises(SecretBindingError, match="bound to no host"):
        resolve_password("secret:other", [("db1", 3306)])
    # A malformed binding refuses every secret rather than guessing.
    monkeypatch.setenv("SLUICE_SECRETS_HOSTS", "shop-pw db1:3306")
    with pytest.raises(DatabaseUrlError, match="NAME=host:port"):
        parse_database_url("mysql://r:secret:shop-pw@db1:3306/")
    assert parse_bindings("a=h:1;a=g;;b=[fe80::1]:5") == {
        "a": (parse_bindings("a=h:1")["a"][0], parse_bindings("a=g")["a"][0]),
        "b": parse_bindings("b=[fe80::1]:5")["b"]}
    with pytest.raises(SecretError, match="port out of range"):
        parse_bindings("a=h:70000")
