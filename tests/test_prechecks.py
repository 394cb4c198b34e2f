"""Creation checks: a changefeed that cannot work is refused before 202 with the reason and the
fix; --skip-checks records it anyway and it shows the failed checks (api process, real MariaDB)."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest

from libs.foreign_keys import load_foreign_keys
from services.api.prechecks import missing_mysql_sink_grants, missing_source_grants
from tests.api_stack import CANARY, ApiStack

V1 = "/api/v1"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spec(stack: ApiStack, cf: str, **extra: Any) -> dict[str, Any]:
    return {"id": cf, "sources": [{"id": "src1", "url": stack.source_url}],
            "sink_url": "sqlite:///checked.db", **extra}


def _refusals(resp: httpx.Response) -> dict[str, str]:
    assert resp.status_code == 422, resp.text
    assert CANARY not in resp.text
    return {e["loc"][1]: e["msg"] for e in resp.json()["detail"]}


def test_source_grants_are_read_from_show_grants() -> None:
    ok = "GRANT REPLICATION SLAVE, BINLOG MONITOR, SELECT ON *.* TO `r`@`%`"
    assert missing_source_grants([ok]) == []
    assert missing_source_grants(["GRANT ALL PRIVILEGES ON *.* TO `root`@`%` WITH GRANT OPTION"]) == []
    # SELECT on one database is not global: the initial load and capture read every table.
    weak = ["GRANT USAGE ON *.* TO `u`@`%`", "GRANT SELECT ON `shop`.* TO `u`@`%`"]
    assert missing_source_grants(weak) == ["REPLICATION SLAVE", "REPLICATION CLIENT", "SELECT"]
    sink = ["GRANT SELECT, INSERT ON `t`.* TO `w`@`%`"]
    assert missing_mysql_sink_grants(sink) == ["CREATE", "UPDATE", "DELETE"]


@pytest.mark.integration
def test_unreachable_source_sink_and_empty_route_are_each_refused(api_stack: ApiStack) -> None:
    port = _closed_port()
    with api_stack.client() as c:
        bad_source = _spec(api_stack, "pc-src")
        bad_source["sources"][0]["url"] = f"mysql://repl:secret:down-pw@127.0.0.1:{port}/"
        got = _refusals(c.post(f"{V1}/changefeeds", json=bad_source))
        assert list(got) == ["source_reachable"] and f"127.0.0.1:{port}" in got["source_reachable"]
        assert "Start it" in got["source_reachable"]

        got = _refusals(c.post(f"{V1}/changefeeds", json=_spec(
            api_stack, "pc-sink", sink_url=f"mysql://writer@127.0.0.1:{port}/")))
        assert list(got) == ["sink_reachable"] and f"127.0.0.1:{port}" in got["sink_reachable"]

        got = _refusals(c.post(f"{V1}/changefeeds", json=_spec(api_stack, "pc-route", routes=[
            {"database": "nope_*", "table": "*", "target_schema": "x", "name": "nope"}])))
        assert list(got) == ["route_matches_nothing"] and "nope" in got["route_matches_nothing"]

        missing = _spec(api_stack, "pc-secret")
        missing["sources"][0]["url"] = f"mysql://repl:secret:not-there@127.0.0.1:{api_stack.source.port}/"
        got = _refusals(c.post(f"{V1}/changefeeds", json=missing))
        assert "SLUICE_SECRET_NOT_THERE" in got["source_secret"]

        # A NATS sink (examples/changefeeds/nats-sink.jsonc): checked for a reachable JetStream.
        got = _refusals(c.post(f"{V1}/changefeeds", json=_spec(
            api_stack, "pc-nats", sink_url=f"nats://127.0.0.1:{port}/OUT?subject=out.x")))
        assert list(got) == ["sink_reachable"] and "JetStream" in got["sink_reachable"]
        r = c.post(f"{V1}/changefeeds", json=_spec(api_stack, "pc-nats-bad", sink_url="nats://h:4222/"))
        assert r.status_code == 422 and "stream name" in r.text, r.text
        host = api_stack.nats.plain_url.split("://", 1)[1]
        sink = f"nats://sink-worker:secret:nats-sink-pw@{host}/PC_OUT?subject=pc.out&format=debezium"
        r = c.post(f"{V1}/changefeeds", json=_spec(api_stack, "pc-nats-ok", sink_url=sink))
        assert r.status_code == 202, r.text
        assert c.get(f"{V1}/changefeeds/pc-nats-ok").json()["failed_checks"] == []
        assert c.delete(f"{V1}/changefeeds/pc-nats-ok").status_code == 202

        for cf in ("pc-src", "pc-sink", "pc-route", "pc-secret", "pc-nats", "pc-nats-bad"):
            assert c.get(f"{V1}/changefeeds/{cf}").status_code == 404


@pytest.mark.integration
def test_a_user_without_replication_grants_is_refused_with_the_grant_to_run(api_stack: ApiStack) -> None:
    api_stack.source.execute("CREATE USER IF NOT EXISTS 'weak'@'%' IDENTIFIED BY 'weak-pw'")
    spec = _spec(api_stack, "pc-grants")
    spec["sources"][0]["url"] = f"mysql://weak:secret:src-pw@127.0.0.1:{api_stack.source.port}/"
    with api_stack.client() as c:
        # The secret holds another password than weak's: refused as unreachable (access denied).
        got = _refusals(c.post(f"{V1}/changefeeds", json=spec))
        assert "Access denied" in got["source_reachable"]
    api_stack.source.execute(f"ALTER USER 'weak'@'%' IDENTIFIED BY '{CANARY}'")
    with api_stack.client() as c:
        got = _refusals(c.post(f"{V1}/changefeeds", json=spec))
    assert "GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.*" in got["source_grants"]
    assert "REPLICATION SLAVE" in got["source_grants"].split(";")[0]


@pytest.mark.integration
def test_skip_checks_accepts_and_the_changefeed_shows_its_failed_checks(api_stack: ApiStack) -> None:
    spec = _spec(api_stack, "pc-skipped", routes=[
        {"database": "nope_*", "table": "*", "target_schema": "x", "name": "nope"}])
    with api_stack.client() as c:
        r = c.post(f"{V1}/changefeeds", json=spec, params={"skip_checks": "true"})
        assert r.status_code == 202, r.text
        assert "failed checks" in r.json()["detail"]
        got = c.get(f"{V1}/changefeeds/pc-skipped").json()
        failed = [(f["check"], f["target"]) for f in got["failed_checks"]]
        assert failed == [("route_matches_nothing", "nope")]
        listed = {cf["id"]: cf for cf in c.get(f"{V1}/changefeeds").json()}
        assert listed["pc-skipped"]["failed_checks"] == got["failed_checks"]
        # Fixed by an update that passes the checks: the failures are gone.
        fixed = dict(spec, routes=[{"database": "shop_*", "table": "orders_*", "target_schema": "x"}])
        assert c.put(f"{V1}/changefeeds/pc-skipped", json=fixed).status_code == 202
        assert c.get(f"{V1}/changefeeds/pc-skipped").json()["failed_checks"] == []
        assert c.delete(f"{V1}/changefeeds/pc-skipped").status_code == 202


@pytest.mark.integration
def test_cascading_foreign_keys_are_named_in_the_answer(api_stack: ApiStack) -> None:
    source = api_stack.source
    source.execute(
        "CREATE DATABASE fk_pc",
        "CREATE TABLE fk_pc.orders (shop INT, no INT, PRIMARY KEY (shop, no))",
        "CREATE TABLE fk_pc.items (id INT PRIMARY KEY, shop INT, no INT, CONSTRAINT fk_order"
        " FOREIGN KEY (shop, no) REFERENCES fk_pc.orders (shop, no) ON DELETE CASCADE ON UPDATE CASCADE)",
        "CREATE TABLE fk_pc.audit (id INT PRIMARY KEY, item INT, CONSTRAINT fk_item FOREIGN KEY (item)"
        " REFERENCES fk_pc.items (id) ON DELETE SET NULL)",
        "CREATE TABLE fk_pc.tree (id INT PRIMARY KEY, up INT, CONSTRAINT fk_up FOREIGN KEY (up)"
        " REFERENCES fk_pc.tree (id) ON DELETE CASCADE)",
        "CREATE TABLE fk_pc.notes (id INT PRIMARY KEY, item INT, CONSTRAINT fk_note FOREIGN KEY (item)"
        " REFERENCES fk_pc.items (id))")
    try:
        conn = source.connect()
        try:
            fks = {fk.name: fk for fk in load_foreign_keys(conn, "fk_pc")}
        finally:
            conn.close()
        assert fks["fk_order"].columns == ("shop", "no") and fks["fk_order"].ref_columns == ("shop", "no")
        assert (fks["fk_order"].on_delete, fks["fk_order"].on_update) == ("CASCADE", "CASCADE")
        assert fks["fk_item"].on_delete == "SET NULL" and fks["fk_up"].self_referencing
        assert not fks["fk_note"].cascading
        # The changefeed's user has SELECT only: MariaDB hides REFERENTIAL_CONSTRAINTS from it.
        repl = source.connect(user="repl", password=CANARY)
        try:
            assert load_foreign_keys(repl, "fk_pc") == sorted(fks.values())
        finally:
            repl.close()

        spec = _spec(api_stack, "pc-fk", filter={"include": ["fk_pc.*"], "exclude": ["fk_pc.audit"]})
        with api_stack.client() as c:
            r = c.post(f"{V1}/changefeeds", json=spec)
            assert r.status_code == 202, r.text
            warnings = [w for w in r.json()["warnings"] if "fk_pc." in w]
            assert c.delete(f"{V1}/changefeeds/pc-fk").status_code == 202
        # The keys with both ends selected are carried out downstream: only the one whose child
        # the filter leaves out is named.
        named = sorted(w.split(" ", 3)[2] for w in warnings)
        assert named == ["src1:fk_pc.audit.fk_item"]
        audit = next(w for w in warnings if "fk_item" in w)
        assert "ON DELETE SET NULL" in audit and "leaves out the child fk_pc.audit" in audit
        assert all("below the binlog" in w for w in warnings)
    finally:
        source.execute("DROP DATABASE fk_pc")


@pytest.mark.integration
def test_a_stored_secret_cannot_be_sent_to_a_host_it_is_not_bound_to(api_stack: ApiStack) -> None:
    """An operator token naming the source's secret with its own host (a sink, a source, a NATS
    sink, an update, a registered source) is refused with the reason, and nothing connects to
    that host: a listening socket sees no connection."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.setblocking(False)
        evil = f"127.0.0.1:{listener.getsockname()[1]}"
        with api_stack.client() as c:
            sink = _spec(api_stack, "pc-exfil-sink", sink_url=f"postgresql://x:secret:src-pw@{evil}/db")
            got = _refusals(c.post(f"{V1}/changefeeds", json=sink))
            assert list(got) == ["sink_url"] and "may only be sent to" in got["sink_url"], got
            assert evil in got["sink_url"] and "SLUICE_SECRETS_HOSTS" in got["sink_url"]

            source = _spec(api_stack, "pc-exfil-src")
            source["sources"][0]["url"] = f"mysql://repl:secret:src-pw@{evil}/"
            got = _refusals(c.post(f"{V1}/changefeeds", json=source))
            assert list(got) == ["sources"] and "may only be sent to" in got["sources"], got

            nats_sink = _spec(api_stack, "pc-exfil-nats",
                              sink_url=f"nats://u:secret:src-pw@{evil}/OUT?subject=out.x")
            assert "may only be sent to" in _refusals(c.post(f"{V1}/changefeeds", json=nats_sink))["sink_url"]

            # Mixed in with a good server of the same NATS URL: every server must be bound.
            host = api_stack.nats.plain_url.split("://", 1)[1]
            mixed = _spec(api_stack, "pc-exfil-mixed",
                          sink_url=f"nats://u:secret:nats-sink-pw@{host},{evil}/OUT?subject=out.x")
            assert "may only be sent to" in _refusals(c.post(f"{V1}/changefeeds", json=mixed))["sink_url"]

            # A secret nobody bound is sent nowhere, even to its "own" host.
            unbound = _spec(api_stack, "pc-exfil-unbound",
                            sink_url=f"postgresql://x:secret:unbound-pw@{evil}/db")
            assert "bound to no host" in _refusals(c.post(f"{V1}/changefeeds", json=unbound))["sink_url"]

            # An update of an accepted changefeed cannot move its secret either.
            ok = _spec(api_stack, "pc-exfil-update")
            assert c.post(f"{V1}/changefeeds", json=ok).status_code == 202
            moved = dict(ok, sink_url=f"postgresql://x:secret:src-pw@{evil}/db")
            assert "may only be sent to" in _refusals(c.put(f"{V1}/changefeeds/pc-exfil-update",
                                                          json=moved))["sink_url"]
            assert c.delete(f"{V1}/changefeeds/pc-exfil-update").status_code == 202

            # `sluice source add` with the secret and another host: refused at registration.
            r = c.post(f"{V1}/sources", json={"id": "exfil", "url": f"mysql://repl:secret:src-pw@{evil}/"})
            assert r.status_code == 422 and "may only be sent to" in r.text, r.text
            assert c.get(f"{V1}/sources").status_code == 200
            assert "exfil" not in {s["id"] for s in c.get(f"{V1}/sources").json()}
            for cf in ("pc-exfil-sink", "pc-exfil-src", "pc-exfil-nats", "pc-exfil-mixed",
                       "pc-exfil-unbound"):
                assert c.get(f"{V1}/changefeeds/{cf}").status_code == 404
        # Every refusal above was answered before anything connected: a connection made then
        # would be waiting in the listener's backlog now.
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_a_filter_selecting_no_table_is_a_warning() -> None:
    from contracts.events.changefeeds import ChangefeedSpecV2, SourceRefV1, TableFilterV1
    from services.api.prechecks import filter_warnings

    spec = ChangefeedSpecV2(id="cf", sources=[SourceRefV1(id="s", url="mysql://u@h:3306/")],
                            sink_url="sqlite:///x.db",
                            filter=TableFilterV1(include=["shop.*"], exclude=["shop.a"]))
    assert filter_warnings(spec, {"s": [("shop", "b")]}) == []
    [warning] = filter_warnings(spec, {"s": [("shop", "a"), ("other", "b")]})
    assert "selects no table" in warning and "shop.*" in warning
    assert filter_warnings(spec, {}) == []  # a source not listed: its own failure says why


@pytest.mark.integration
def test_a_changefeed_whose_filter_selects_nothing_is_accepted_with_a_warning(api_stack: ApiStack) -> None:
    with api_stack.client() as c:
        r = c.post(f"{V1}/changefeeds", json=_spec(api_stack, "pc-nothing", filter={"include": ["nope_*.*"]}))
        assert r.status_code == 202, r.text
        assert any("selects no table" in w for w in r.json()["warnings"]), r.json()
        assert c.delete(f"{V1}/changefeeds/pc-nothing").status_code == 202


def test_expression_names_are_the_columns_an_expression_reads() -> None:
    from libs.table_rules import expression_names

    assert expression_names("amount > 100 AND status = 'x'") == {"amount", "status"}
    assert expression_names("cast(price AS DECIMAL(10,2)) > 3 OR `my col` IS NOT NULL") == {"price", "my col"}
    assert expression_names("created < current_date - INTERVAL 1 DAY AND DATE '2026-01-01' < d") == {
        "created", "d"}
    assert expression_names("a.b = 1 AND CASE WHEN flag THEN true ELSE false END") == {"a", "flag"}
    assert expression_names("exists(xs, x -> x > 1)") == set()  # a lambda's own names: not judged


@pytest.mark.integration
def test_table_rules_are_checked_against_the_source_columns_and_unreplicable_tables_warned(
        api_stack: ApiStack) -> None:
    api_stack.source.execute(
        "CREATE DATABASE IF NOT EXISTS pc_rules",
        "CREATE TABLE IF NOT EXISTS pc_rules.items (id INT PRIMARY KEY, status VARCHAR(10), amount INT)",
        "CREATE TABLE IF NOT EXISTS pc_rules.nokey (v INT)",
        "CREATE TABLE IF NOT EXISTS pc_rules.geo (id INT PRIMARY KEY, g INET6)")
    only = {"include": ["pc_rules.*"]}
    bad_rules = [
        {"tables": ["pc_rules.items"], "ignore_insert_value_expr": "statuz = 'x' AND amount > 1"},
        {"tables": ["pc_rules.items"], "drop_columns": ["amont"]},
        {"tables": ["pc_rules.items"], "drop_columns": ["id"]},
    ]
    with api_stack.client() as c:
        got = c.post(f"{V1}/changefeeds",
                     json=_spec(api_stack, "pc-rules", filter=only, table_rules=bad_rules))
        assert got.status_code == 422, got.text
        messages = [e["msg"] for e in got.json()["detail"]]
        assert any(m.startswith("table_rules[0]") and "statuz" in m and "amount" not in m.split("reads")[1]
                   for m in messages), messages
        assert any(m.startswith("table_rules[1]") and "drop_columns" in m and "amont" in m for m in messages)
        assert any(m.startswith("table_rules[2]") and "key column(s) id" in m for m in messages), messages
        assert c.get(f"{V1}/changefeeds/pc-rules").status_code == 404
        # Right rules: accepted, with the tables it will not replicate named as warnings.
        good = [{"tables": ["pc_rules.items"], "ignore_insert_value_expr": "status = 'x'",
                 "drop_columns": ["amount"]}]
        r = c.post(f"{V1}/changefeeds", json=_spec(api_stack, "pc-rules", filter=only, table_rules=good,
                                                     initial_load="binlog-only"))
        assert r.status_code == 202, r.text
        warnings = r.json()["warnings"]
        assert any("pc_rules.nokey" in w and "no primary key" in w for w in warnings), warnings
        assert any("pc_rules.geo" in w and "unsupported column type" in w and "g inet6" in w
                   for w in warnings), warnings
        assert not any("pc_rules.items" in w for w in warnings), warnings
        assert c.delete(f"{V1}/changefeeds/pc-rules").status_code == 202
