"""Operator decisions on a table its downstream stopped, through the api process and the CLI:
the table shows the incident, a decision names it (404/409/422 otherwise), lands in the
changefeeds log (the worker's input and the event feed) and clears the table's error."""

from __future__ import annotations

import json
from pathlib import Path

import nats
import nats.errors
import pytest
from typer.testing import CliRunner

from contracts import REGISTRY
from contracts.events.changefeeds import ChangefeedStateChangedV1
from contracts.events.table_incidents import TableActionRequestedV1, TableRefV1, TableStoppedV2
from libs.eventstore import EventStore
from libs.localservers.common import wait_until
from libs.nats_auth import SINK_WORKER
from libs.streams import domain_events_subject, domain_stream, table_incidents_subject
from services.cli.app import app
from tests.api_stack import CF, TOKEN, ApiStack
from tests.helpers.api import _frames

pytestmark = pytest.mark.integration
V1 = "/api/v1"
TABLES = f"{V1}/changefeeds/{CF}/tables/src1/shop"


def _stopped(table: str, incident: str, key: str | None = "[7]") -> TableStoppedV2:
    return TableStoppedV2(
        table=TableRefV1(changefeed=CF, source="src1", database="shop", table=table), incident=incident,
        target=f"shop.{table}", statement="upsert" if key else "batch", key=key, key_columns=["id"],
        error="IntegrityError: CHECK constraint failed: age < 100", code=275, upto_ts=99, worker="w1")


def _cli(api_stack: ApiStack, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["--url", api_stack.url, "--token", TOKEN, *args],
                                env={"COLUMNS": "320"})
    return result.exit_code, result.output


def test_a_stopped_table_shows_its_incident_and_takes_one_decision(api_stack: ApiStack) -> None:
    api_stack.append("changefeeds", _stopped("b", "inc-1"), _stopped("c", "inc-2", key=None),
                     subject=table_incidents_subject())
    with api_stack.client() as c:
        def shown() -> bool:
            return all(c.get(f"{TABLES}/{t}").json().get("incident") is not None for t in "bc")

        wait_until(shown, 30, "the api to show the incidents of tables b and c")
        b = c.get(f"{TABLES}/b").json()
        assert b["state"] == "stopped" and b["incident"]["incident"] == "inc-1"
        assert b["incident"]["key"] == "[7]" and "CHECK" in b["error"] and "[7]" in b["error"]

        code, out = _cli(api_stack, "changefeed", "tables", CF)
        assert code == 0 and "inc-1" in out, out

        assert c.post(f"{TABLES}/b/errors/inc-1/explode").status_code == 422
        assert c.post(f"{TABLES}/b/errors/other/skip").status_code == 409
        assert c.post(f"{TABLES}/a/errors/inc-1/skip").status_code == 409  # a is not stopped
        assert c.post(f"{TABLES}/zzz/errors/inc-1/skip").status_code == 404
        assert c.post(f"{V1}/changefeeds/nope/tables/src1/shop/b/errors/inc-1/skip").status_code == 404
        assert c.post(f"{TABLES}/c/errors/inc-2/skip").status_code == 422  # no single row to skip
        assert c.post(f"{TABLES}/b/errors/inc-1/skip", headers={"Authorization": "Bearer nope"}
                      ).status_code in (401, 403)

        code, out = _cli(api_stack, "changefeed", "table-error", CF, "src1", "shop", "b", "inc-1", "skip")
        assert code == 0, out
        b = c.get(f"{TABLES}/b").json()
        assert b["incident"] is None and b["state"] != "stopped"
        assert c.post(f"{TABLES}/b/errors/inc-1/skip").status_code == 409  # decided already
        accepted = c.post(f"{TABLES}/c/errors/inc-2/resume")
        assert accepted.status_code == 202, accepted.text
        seq = accepted.json()["seq"]

    async def decisions() -> list[TableActionRequestedV1]:
        js = api_stack.nc.jetstream()
        out = []
        for s in range(max(1, seq - 5), seq + 1):
            msg = await js.get_msg(domain_stream("changefeeds"), s)
            if msg.subject == domain_events_subject("changefeeds"):
                event = REGISTRY.decode(msg.data or b"").event
                if isinstance(event, TableActionRequestedV1):
                    out.append(event)
        return out

    found = api_stack.bg.run(decisions())
    assert [(d.table.table, d.incident, d.action) for d in found] == [("b", "inc-1", "skip"),
                                                                      ("c", "inc-2", "resume")]
    assert json.loads(found[0].model_dump_json())["requested_by"]


def test_creating_a_merge_without_origin_column_answers_with_a_warning(api_stack: ApiStack,
                                                                       tmp_path: Path) -> None:
    # No such source runs: the creation checks fail and skip_checks accepts it anyway, so the
    # answer is about the routes alone.
    spec = {"id": "merge-warn", "sources": [{"id": "src1", "url": "mysql://root@127.0.0.1:9/"}],
            "sink_url": "sqlite:///out.db",
            "routes": [{"database": "shop_*", "table": "users", "target_schema": "m",
                        "target_table": "users"}]}
    with api_stack.client() as c:
        answer = c.post(f"{V1}/changefeeds?skip_checks=true", json=spec)
        assert answer.status_code == 202, answer.text
        assert any("origin_column" in w and "m.users" in w for w in answer.json()["warnings"])
        got = c.get(f"{V1}/changefeeds/merge-warn").json()
        assert got["spec"]["on_unique_conflict"] == "error"
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**spec, "id": "merge-warn-cli"}))
    code, out = _cli(api_stack, "changefeed", "create", str(path), "--skip-checks")
    assert code == 0 and "warning" in out and "origin_column" in out, out


def test_a_sink_worker_records_incidents_but_cannot_forge_changefeed_events(api_stack: ApiStack) -> None:
    """With a sink-worker's credentials: a changefeed event is refused by the server; a table
    incident on the incidents subject is taken and shown; anything else there (a changefeed
    event, an operator's decision) is dead-lettered with its reason and changes nothing."""
    stream = domain_stream("changefeeds")
    table_a = TableRefV1(changefeed=CF, source="src1", database="shop", table="a")
    errors: list[str] = []

    async def as_worker() -> list[int]:
        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        client = await nats.connect(**api_stack.nats.client_options(SINK_WORKER), error_cb=on_error,
                                    allow_reconnect=False)
        try:
            js = client.jetstream()
            pause = REGISTRY.encode(ChangefeedStateChangedV1(id=CF, state="paused", requested_by="w9"),
                                    producer="sink-worker/w9")
            with pytest.raises(nats.errors.TimeoutError):
                await js.publish(domain_events_subject("changefeeds"), pause, timeout=1)
            store = EventStore(js, stream, producer="sink-worker/w9")
            return [await store.append(table_incidents_subject(), _stopped("a", "inc-w")),
                    await store.append(table_incidents_subject(),
                                       ChangefeedStateChangedV1(id=CF, state="paused", requested_by="w9")),
                    await store.append(table_incidents_subject(), TableActionRequestedV1(
                        table=table_a, incident="inc-w", action="skip", requested_by="w9"))]
        finally:
            await client.close()

    seqs = api_stack.bg.run(as_worker())
    assert any("permissions violation" in e.lower() and domain_events_subject("changefeeds") in e
               for e in errors), errors
    with api_stack.client() as c:
        def parked() -> list[dict[str, object]]:
            return [d for d in c.get(f"{V1}/dead-letters", params={"limit": 1000}).json()
                    if d["original_subject"] == table_incidents_subject() and d["original_seq"] in seqs[1:]]

        wait_until(lambda: {d["original_seq"] for d in parked()} == set(seqs[1:]), 30,
                   "the api to dead-letter the changefeed event and the decision on the incidents subject")
        assert all("not accepted on" in str(d["reason"]) for d in parked()), parked()
        a = c.get(f"{TABLES}/a").json()
        # Still stopped: the skip a worker slipped onto the incidents subject did nothing.
        assert a["state"] == "stopped" and a["incident"]["incident"] == "inc-w", a
        assert c.get(f"{V1}/changefeeds/{CF}").json()["state"] == "running"
        # The event feed shows the incident and, for the other two, why they are not events.
        since = {"domain": "changefeeds", "since": f"changefeeds:{seqs[0] - 1}", "limit": 3}
        with c.stream("GET", f"{V1}/events", params=since) as r:
            fed = [f["data"] for f in _frames(r) if f["event"] == "event"]
        assert [(f["seq"], f["type"]) for f in fed] == [(seqs[0], "table.stopped"), (seqs[1], None),
                                                        (seqs[2], None)], fed
        assert all("not accepted on" in f["error"] for f in fed[1:]), fed
        # The operator's own decision, through the api, clears it.
        assert c.post(f"{TABLES}/a/errors/inc-w/resume").status_code == 202
        assert c.get(f"{TABLES}/a").json()["incident"] is None
    # No service of the stack (api, scheduler) was refused anything all session long.
    assert not api_stack.nats.service_violations()
