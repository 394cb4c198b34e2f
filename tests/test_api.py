"""The operator API against a real nats-server, a real scheduler and the api process itself:
every endpoint's happy path and its 4xx answers (garbage included), auth, the event feed's
resume, and read models rebuilt by replay equal to the live ones."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from nats.js.errors import NotFoundError
from sqlmodel import create_engine

from contracts import REGISTRY
from contracts.events.changefeeds import ChangefeedCreatedV2, ChangefeedSpecV2, SourceRefV1
from contracts.events.rows import ResolvedAdvancedV1, SourcePositionV1
from libs.eventstore import EventStore
from libs.eventstore.deadletter import dead_letter
from libs.localservers.common import wait_until
from libs.scheduling.model import Span as WorkerSpan
from libs.stream_origin import STREAM_ORIGIN_HEADER, StreamOrigin
from libs.streams import PREPARE_BUCKET, ROWS_STREAM, domain_events_subject, resolved_subject
from libs.ts import ts_seconds, utc_text
from services.api.projections import Projections
from services.sink_worker.prepare_progress import entry as prepare_entry
from tests.api_stack import (
    ALICE_TOKEN,
    CANARY,
    CF,
    TOKEN,
    VIEWER_TOKEN,
    ApiStack,
    lock_view,
    stamp,
    wait_ready,
)
from tests.helpers.api import _frames

pytestmark = pytest.mark.integration
V1 = "/api/v1"


def spec(cf: str, **extra: Any) -> dict[str, Any]:
    # binlog-only: the changefeed's tables are the ones the ROWS stream holds (shop.a, b, c),
    # not also the source's others (an initial load lists the source itself), so the scheduler's
    # view stays still while a test compares read models.
    return {"id": cf, "sources": [{"id": "src1", "url": _source["url"]}],
            "sink_url": "sqlite:///out.db", "initial_load": "binlog-only", **extra}


_source = {"url": ""}


@pytest.fixture(autouse=True)
def _source_url(api_stack: ApiStack) -> None:
    _source["url"] = api_stack.source_url


def errors_at(resp: httpx.Response) -> list[tuple[Any, ...]]:
    assert resp.status_code == 422, resp.text
    return [tuple(e["loc"]) for e in resp.json()["detail"]]


def test_reads_need_a_viewer_token_and_mutations_an_operator_token(api_stack: ApiStack) -> None:
    with api_stack.client(token=None) as anon, api_stack.client(token="wrong") as wrong, \
            api_stack.client(token=VIEWER_TOKEN) as viewer:
        for c in (anon, wrong):
            r = c.get(f"{V1}/changefeeds")
            assert r.status_code == 401, r.text
            assert c.get(f"{V1}/events", params={"since": "changefeeds:0", "limit": 1}).status_code == 401
            r = c.post(f"{V1}/changefeeds", json=spec("authcheck"))
            assert r.status_code == 401, r.text
            assert r.headers["www-authenticate"] == "Bearer"
            assert c.post(f"{V1}/rebalance").status_code == 401
            assert c.delete(f"{V1}/dead-letters/1").status_code == 401
        assert viewer.get(f"{V1}/changefeeds").status_code == 200
        assert viewer.get(f"{V1}/changefeeds/authcheck").status_code == 404
        for r in (viewer.post(f"{V1}/changefeeds", json=spec("authcheck")),
                  viewer.post(f"{V1}/rebalance"), viewer.delete(f"{V1}/dead-letters/1"),
                  viewer.post(f"{V1}/changefeeds/{CF}/pause")):
            assert r.status_code == 403, r.text
            assert "operator" in r.json()["detail"]
        assert viewer.get(f"{V1}/changefeeds/{CF}").json()["state"] == "running"
        assert anon.get("/docs").status_code == 200
        spec_doc = anon.get("/openapi.json").json()
        paths = set(spec_doc["paths"])
        assert {f"{V1}/changefeeds", f"{V1}/events", f"{V1}/leaders/{{service}}/resign"} <= paths
        assert "HTTPBearer" in spec_doc["components"]["securitySchemes"]
        schemas = set(spec_doc["components"]["schemas"])
        assert {"ChangefeedSpecIn", "TableRuleV1", "ComputedColumnV1", "ValidationSpecV1"} <= schemas
        assert {"401"} <= set(spec_doc["paths"][f"{V1}/changefeeds"]["get"]["responses"])
        assert {"401", "403", "413"} <= set(spec_doc["paths"][f"{V1}/changefeeds"]["post"]["responses"])
        # Every operation documents what auth and the body limit answer.
        for path, operations in spec_doc["paths"].items():
            if not path.startswith(V1):
                continue
            for method, op in operations.items():
                want = {"401", "413"} | ({"403"} if method not in ("get", "head") else set())
                assert want <= set(op["responses"]), (method, path, sorted(op["responses"]))
    # No token is ever written to the api's log, even at DEBUG.
    log = api_stack.api.log_path.read_text()
    assert TOKEN not in log and VIEWER_TOKEN not in log and ALICE_TOKEN not in log


_ASSET_REFS = re.compile(r"""(?:src|href|spec-url)="([^"]+)"|\burl: '([^']+)'""")


def test_docs_pages_and_every_asset_they_reference_come_from_the_api(api_stack: ApiStack) -> None:
    """/docs and /redoc work on a machine without internet: every script, style, icon and the
    spec they load are served by the api itself, and nothing points at another host."""
    with api_stack.client(token=None) as anon:
        fetched: dict[str, httpx.Response] = {}
        for page in ("/docs", "/redoc"):
            r = anon.get(page)
            assert r.status_code == 200, (page, r.text)
            assert "://" not in r.text, f"{page} references another host: {r.text}"
            refs = [a or b for a, b in _ASSET_REFS.findall(r.text)]
            assert any(ref.endswith(".js") for ref in refs) and "/openapi.json" in refs, (page, refs)
            for ref in refs:
                assert ref.startswith("/"), (page, ref)
                fetched[ref] = anon.get(ref)
        for ref, resp in fetched.items():
            assert resp.status_code == 200 and resp.content, (ref, resp.status_code)
        assert "javascript" in fetched["/docs-assets/swagger-ui-bundle.js"].headers["content-type"]
        assert "javascript" in fetched["/docs-assets/redoc.standalone.js"].headers["content-type"]
        # The stylesheet loads no fonts or images from elsewhere either.
        assert not re.search(r"url\(\s*['\"]?https?:", fetched["/docs-assets/swagger-ui.css"].text)


def test_a_mutation_is_recorded_as_the_tokens_principal(api_stack: ApiStack) -> None:
    with api_stack.client(token=ALICE_TOKEN) as alice, api_stack.client() as op, \
            api_stack.client(token=VIEWER_TOKEN) as viewer:
        assert alice.post(f"{V1}/changefeeds", json=spec("by-alice")).status_code == 202
        assert op.post(f"{V1}/changefeeds/by-alice/pause").status_code == 202
        assert viewer.post(f"{V1}/changefeeds/by-alice/resume").status_code == 403
    events = _events(api_stack, "changefeeds")
    mine = [e for e in events if (e["data"].get("spec") or {}).get("id") == "by-alice"
            or e["data"].get("id") == "by-alice"]
    assert [(e["type"], e["data"]["requested_by"]) for e in mine] == [
        ("changefeed.created", "alice"), ("changefeed.state_changed", "operator")], mine
    # Every mutation is in the api's log with its principal (the audit trail of changes).
    want = {("alice", "POST", f"{V1}/changefeeds", 202),
            ("operator", "POST", f"{V1}/changefeeds/{{changefeed_id}}/pause", 202),
            # A refused change names who tried, not "unauthenticated".
            ("vic", "POST", f"{V1}/changefeeds/{{changefeed_id}}/resume", 403)}

    def audit() -> set[tuple[Any, ...]]:
        lines = [json.loads(line) for line in api_stack.api.log_path.read_text().splitlines()
                 if '"api mutation"' in line]
        return {(a["principal"], a["method"], a["route"], a["status"]) for a in lines}

    # The line is written once the answer is sent: wait for it rather than race it.
    wait_until(lambda: audit() >= want, 10, f"audit lines {want - audit()}")
    # What the api writes (its read model) is its own: 0600 (the service runtime's umask).
    assert (api_stack.tmp / "state.db").stat().st_mode & 0o777 == 0o600


def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(api_stack: ApiStack) -> None:
    big = b'{"id": "x", "pad": "' + b"a" * (20 * 1024 * 1024) + b'"}'
    began = time.monotonic()
    with api_stack.client() as c:
        r = c.post(f"{V1}/changefeeds", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert "SLUICE_API_MAX_BODY_BYTES" in r.json()["detail"]
    assert time.monotonic() - began < 5, "a 20 MB body must be refused fast"
    # Chunked (no Content-Length): counted as it arrives.
    with api_stack.client() as c:
        r = c.post(f"{V1}/changefeeds", content=iter([b"a" * 65536] * 40),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text


def test_http_request_metrics_by_route_template(api_stack: ApiStack) -> None:
    with api_stack.client() as c:
        assert c.get(f"{V1}/changefeeds/{CF}").status_code == 200
        assert c.get(f"{V1}/changefeeds/nope").status_code == 404
        text = c.get("/metrics").text
    route = f'route="{V1}/changefeeds/{{changefeed_id}}"'
    lines = [ln for ln in text.splitlines() if ln.startswith("sluice_api_http_requests_total{")
             and route in ln and 'method="GET"' in ln]
    assert any('status="200"' in ln for ln in lines) and any('status="404"' in ln for ln in lines), \
        [ln for ln in text.splitlines() if "http_requests_total" in ln]
    assert any(ln.startswith("sluice_api_http_request_seconds_bucket{") and route in ln
               for ln in text.splitlines())


def test_changefeed_lifecycle(api_stack: ApiStack) -> None:
    with api_stack.client() as c:
        r = c.post(f"{V1}/changefeeds", json=spec("life", routes=[
            {"database": "shop_*", "table": "orders_*", "target_schema": "shop", "target_table": "orders"}]))
        assert r.status_code == 202, r.text
        body = r.json()
        assert r.headers["location"] == f"{V1}/changefeeds/life" and body["seq"] >= 1
        assert body["events"] == f"{V1}/events?since=changefeeds:{body['seq'] - 1}"
        got = c.get(f"{V1}/changefeeds/life").json()  # read your own write: no waiting
        assert got["state"] == "running"
        # A secret reference is a name, shown as it is.
        assert got["spec"]["sources"][0]["url"] == api_stack.source_url
        assert got["spec"]["routes"][0]["target_table"] == "orders"
        assert "life" in [cf["id"] for cf in c.get(f"{V1}/changefeeds").json()]

        r = c.post(f"{V1}/changefeeds", json=spec("life"))
        assert r.status_code == 409 and "exists" in r.json()["detail"]

        new = dict(got["spec"], filter={"include": ["shop_*.*"], "exclude": []})
        r = c.put(f"{V1}/changefeeds/life", json=new)
        assert r.status_code == 202, r.text
        assert c.get(f"{V1}/changefeeds/life").json()["spec"]["filter"]["include"] == ["shop_*.*"]
        stored = _stored_specs(api_stack, "life")
        assert stored[-1].sources[0].url == api_stack.source_url

        assert c.post(f"{V1}/changefeeds/life/pause").status_code == 202
        assert c.get(f"{V1}/changefeeds/life").json()["state"] == "paused"
        r = c.post(f"{V1}/changefeeds/life/pause")
        assert r.status_code == 409 and "paused" in r.json()["detail"]
        assert c.post(f"{V1}/changefeeds/life/resume").status_code == 202
        assert c.post(f"{V1}/changefeeds/life/resume").status_code == 409
        assert c.delete(f"{V1}/changefeeds/life").status_code == 202
        assert c.get(f"{V1}/changefeeds/life").status_code == 404
        for method, path in (("DELETE", "life"), ("POST", "life/pause"), ("POST", "nope/resume")):
            assert c.request(method, f"{V1}/changefeeds/{path}").status_code == 404
        assert c.put(f"{V1}/changefeeds/nope", json=spec("nope")).status_code == 404
        # A deleted id can be created again.
        assert c.post(f"{V1}/changefeeds", json=spec("life")).status_code == 202
        # Left behind, its tables would keep the scheduler busy with the stack's fake members
        # and move the answers the replay test compares.
        assert c.delete(f"{V1}/changefeeds/life").status_code == 202


def _stored_specs(stack: ApiStack, cf: str) -> list[ChangefeedSpecV2]:
    async def go() -> list[ChangefeedSpecV2]:
        store = EventStore(stack.nc.jetstream(), "SLUICE_CHANGEFEEDS", producer="test")
        return [ev.event.spec async for ev in store.replay(domain_events_subject("changefeeds"))
                if hasattr(ev.event, "spec") and ev.event.spec.id == cf]

    return stack.bg.run(go())


def test_changefeed_validation_is_field_level(api_stack: ApiStack) -> None:
    with api_stack.client() as c:
        post = c.post
        assert post(f"{V1}/changefeeds", content=b"{not json").status_code == 422
        # Bytes that are not even UTF-8: FastAPI cannot parse the body at all (400, with a message).
        r = post(f"{V1}/changefeeds", content=b"\xff\x00garbage",
                 headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["detail"]
        assert ("body", "id") in errors_at(post(f"{V1}/changefeeds", json={"sources": []}))
        assert ("body", "sink_url") in errors_at(post(f"{V1}/changefeeds", json=spec("v1", sink_url="ftp://x/y")))
        assert ("body", "sources", 0, "url") in errors_at(post(f"{V1}/changefeeds", json=spec(
            "v2", sources=[{"id": "s", "url": "postgresql://u@h/db"}])))
        overlapping = [{"database": "a", "target_schema": "x", "target_table": "t"},
                       {"database": "a", "target_schema": "y", "target_table": "t"}]
        r = post(f"{V1}/changefeeds", json=spec("v3", routes=overlapping))
        assert ("body", "routes") in errors_at(r) and "overlapping_routes" in r.text
        r = post(f"{V1}/changefeeds", json=spec("v4", routes=[{"database": "~(", "target_schema": "x"}]))
        assert ("body", "routes", 0) in errors_at(r) and "regular expression" in r.text
        assert ("body", "filter") in errors_at(post(f"{V1}/changefeeds", json=spec(
            "v5", filter={"include": ["~[z-a]"]})))
        assert ("body", "id") in errors_at(c.put(f"{V1}/changefeeds/{CF}", json=spec("other")))
        assert ("body", "initial_load") in errors_at(post(f"{V1}/changefeeds", json=spec(
            "v6", initial_load="sometimes")))
        for i in range(1, 7):
            assert c.get(f"{V1}/changefeeds/v{i}").status_code == 404


def test_a_start_point_before_the_source_stream_begins_is_refused(api_stack: ApiStack) -> None:
    """Capture began src-early at bin.000002:400: a binlog-only changefeed cannot start before
    that (those changes were never captured), on any field that names a start point."""
    began = stamp()
    origin = StreamOrigin("bin.000002", 400, began)

    async def mark() -> None:
        await EventStore(api_stack.nc.jetstream(), ROWS_STREAM, producer="test-peer").append(
            resolved_subject("src-early"), ResolvedAdvancedV1(
                source="src-early", ts=began, position=SourcePositionV1(binlog_file="bin.000002",
                                                                        binlog_pos=900)),
            headers={STREAM_ORIGIN_HEADER: origin.header()})

    api_stack.bg.run(mark())
    sources = [{"id": "src-early", "url": _source["url"]}]
    before = datetime.fromtimestamp(ts_seconds(began) - 3600, UTC).isoformat()
    after = datetime.fromtimestamp(ts_seconds(began) + 2, UTC).isoformat()
    def at(file: str, pos: int) -> dict[str, Any]:
        return {"start_position": {"src-early": {"binlog_file": file, "binlog_pos": pos}}}

    skip = {"skip_checks": "true"}
    with api_stack.client() as c:
        post = c.post
        for cf, extra, field in (("early1", at("bin.000001", 9000), ("body", "start_position", "src-early")),
                                 ("early2", at("bin.000002", 399), ("body", "start_position", "src-early")),
                                 ("early3", {"start_time": before}, ("body", "start_time"))):
            r = post(f"{V1}/changefeeds", json=spec(cf, sources=sources, **extra), params=skip)
            assert field in errors_at(r) and "bin.000002:400" in r.text, r.text
            assert c.get(f"{V1}/changefeeds/{cf}").status_code == 404
        for cf, extra in (("early4", at("bin.000002", 400)), ("early5", {"start_time": after})):
            r = post(f"{V1}/changefeeds", json=spec(cf, sources=sources, **extra), params=skip)
            assert r.status_code == 202, r.text
            assert c.delete(f"{V1}/changefeeds/{cf}").status_code == 202


def test_syncpoint_settings_are_checked_and_the_last_syncpoint_is_shown(api_stack: ApiStack) -> None:
    with api_stack.client() as c:
        post = c.post
        r = post(f"{V1}/changefeeds", json=spec("sp1", syncpoint_interval=5, syncpoint_hold_s=5))
        assert r.status_code == 422 and "less than syncpoint_interval" in r.text
        assert ("body", "syncpoint_interval") in errors_at(post(f"{V1}/changefeeds", json=spec(
            "sp2", syncpoint_interval=0.1)))
        r = post(f"{V1}/changefeeds", json=spec("sp3", syncpoint_hold_s=2))
        assert r.status_code == 422 and "needs syncpoint_interval" in r.text
        r = post(f"{V1}/changefeeds", json=spec("sp4", syncpoint_interval=10,
                                                sink_url="nats://127.0.0.1:4222/OUT"))
        assert ("body", "syncpoint_interval") in errors_at(r) and "SQL downstream" in r.text
        r = post(f"{V1}/changefeeds", json=spec("sp5", syncpoint_interval=10, syncpoint_hold_s=1.5))
        assert r.status_code == 202, r.text
        got = c.get(f"{V1}/changefeeds/sp5").json()
        assert (got["spec"]["syncpoint_interval"], got["spec"]["syncpoint_hold_s"]) == (10, 1.5)
        sp = c.get(f"{V1}/changefeeds/sp5/syncpoint").json()
        assert sp["changefeed"] == "sp5" and sp["syncpoint_interval"] == 10
        assert "last_ts" in sp and "cap_ts" in sp
        assert c.get(f"{V1}/changefeeds/nope/syncpoint").status_code == 404
        assert c.delete(f"{V1}/changefeeds/sp5").status_code == 202
        for i in range(1, 5):
            assert c.get(f"{V1}/changefeeds/sp{i}").status_code == 404


def test_tables_members_sources(api_stack: ApiStack) -> None:
    # Stamped now and as seeded, whatever ran before on this worker's stack.
    TS = api_stack.seed_scenario()
    # Table c is being prepared on w2, whose Spark is warming up (what its worker records).
    api_stack.kv_put(PREPARE_BUCKET, WorkerSpan(CF, "src1", "shop", "c").kv_key,
                     json.loads(prepare_entry("w2", "spark", time.time() - 5)))
    with api_stack.client() as c:
        tables = {t["table"]: t for t in c.get(f"{V1}/changefeeds/{CF}/tables").json()}
        a = tables["a"]
        assert (a["state"], a["primary"], a["secondary"]) == ("replicating", "w1", None)
        assert a["checkpoint"] == {"stream_seq": 42, "ts": TS + 1} and a["checkpoint_ts"] == TS + 1
        assert 9 <= a["lag_s"] < 600
        # For people: the checkpoint's UTC time and how far behind it is (raw values beside it).
        behind = re.escape(utc_text(TS + 1)) + r", \d+\.\d (s|min) behind"
        assert re.fullmatch(behind, a["checkpoint_time"]), a
        assert tables["b"]["checkpoint_time"] is None or "behind" in tables["b"]["checkpoint_time"]
        assert a["snapshot"]["rows_copied"] == 500 and a["snapshot"]["rows_estimate"] == 1000
        assert a["snapshot"]["rows_per_s"] == 2500.0 and a["snapshot"]["eta_s"] == 125.0
        assert tables["b"]["snapshot"] is None and tables["b"]["checkpoint"] is None
        assert (tables["c"]["state"], tables["c"]["secondary"]) == ("prepare", "w2")
        warming = r"Spark warming up \(.*\) on w2, \d+\.\d s"
        assert re.fullmatch(warming, tables["c"]["waiting_for"]), tables["c"]
        assert a["waiting_for"] == "initial load copying: 500 of about 1,000 rows copied", a
        assert tables["b"]["waiting_for"] is None
        assert c.get(f"{V1}/changefeeds/{CF}/tables/src1/shop/a").json()["key"] == a["key"]
        assert c.get(f"{V1}/changefeeds/{CF}/tables/src1/shop/zzz").status_code == 404
        assert c.get(f"{V1}/changefeeds/nope/tables").status_code == 404
        # Paged: three tables in pages of two, by key; the cursor of the next page in a header.
        first = c.get(f"{V1}/changefeeds/{CF}/tables", params={"limit": 2})
        keys = sorted(t["key"] for t in tables.values())
        assert [t["key"] for t in first.json()] == keys[:2]
        assert first.headers["X-Next-After"] == keys[1] and 'rel="next"' in first.headers["Link"]
        last = c.get(f"{V1}/changefeeds/{CF}/tables",
                     params={"limit": 2, "after": first.headers["X-Next-After"]})
        assert [t["key"] for t in last.json()] == keys[2:] and "X-Next-After" not in last.headers
        assert "X-Next-After" not in c.get(f"{V1}/changefeeds/{CF}/tables").headers  # one page of 500
        assert c.get(f"{V1}/changefeeds/{CF}/tables", params={"limit": 0}).status_code == 422

        cf = c.get(f"{V1}/changefeeds/{CF}").json()
        assert cf["checkpoint_ts"] == TS and cf["tables"] == 3
        assert re.fullmatch(re.escape(utc_text(TS)) + r", .* behind", cf["checkpoint_time"]), cf
        assert cf["tables_by_state"] == {"prepare": 1, "replicating": 2}

        members = {m["member_id"]: m for m in c.get(f"{V1}/members").json()}
        assert (members["w1"]["tables"], members["w1"]["primary"]) == (2, 3)
        assert (members["w2"]["tables"], members["w2"]["secondary"]) == (1, 1)
        assert c.get(f"{V1}/members/w2").json()["address"] == "10.0.0.2"
        assert c.get(f"{V1}/members/nobody").status_code == 404

        sources = c.get(f"{V1}/sources").json()
        src = next(s for s in sources if s["id"] == "src1")
        assert CF in src["changefeeds"] and "hunter2" not in json.dumps(sources)
        assert src["resolved_ts"] == TS and 9 <= src["resolved_lag_s"] < 600
        assert src["resolved_time"].startswith(utc_text(TS) + ", ")
        assert c.get(f"{V1}/sources/src1").status_code == 200
        assert c.get(f"{V1}/sources/nope").status_code == 404


def _move_once_settled(c: Any, url: str, dest: str, within: float = 30.0) -> Any:
    """Ask for a move until the scheduler's answer is not a passing refusal (a task in flight,
    the replication view rebuilding after a leader change): an operator would retry those."""
    deadline = time.monotonic() + within
    while True:
        r = c.post(url, json={"dest": dest})
        passing = any(w in r.text for w in ("task in flight", "rebuilding", "try again"))
        if r.status_code != 409 or not passing or time.monotonic() > deadline:
            return r
        time.sleep(0.5)


def test_move_drain_rebalance_go_to_the_scheduler(api_stack: ApiStack) -> None:
    api_stack.seed_scenario()  # c prepared on w2, a on w1, nobody draining, whatever ran before
    with api_stack.client() as c:
        move = f"{V1}/changefeeds/{CF}/tables/src1/shop"
        r = c.post(f"{move}/c/move", json={"dest": "w2"})
        assert r.status_code == 409 and "not replicating" in r.json()["detail"]
        assert c.post(f"{move}/a/move", json={"dest": "ghost"}).status_code == 404
        assert c.post(f"{move}/zzz/move", json={"dest": "w2"}).status_code == 404
        assert c.post(f"{move}/a/move", json={"dest": ""}).status_code == 422
        assert c.post(f"{move}/a/move", json={"dest": "w2", "extra": 1}).status_code == 422
        assert c.post(f"{move}/a/move", content=b"[[[").status_code == 422
        # The scheduler refuses a move to where the table already runs: 409 with its reason.
        r = _move_once_settled(c, f"{move}/a/move", "w1")
        assert r.status_code == 409 and "already replicates on w1" in r.json()["detail"], r.text
        r = _move_once_settled(c, f"{move}/a/move", "w2")
        assert r.status_code == 202, r.text
        assert "accepted by scheduler leader" in r.json()["detail"]
        r = c.post(f"{move}/a/move", json={"dest": "w2"})
        assert r.status_code == 409 and "already" in r.json()["detail"]
        assert c.post(f"{V1}/rebalance").status_code == 202
        assert c.post(f"{V1}/members/nobody/drain").status_code == 404
        assert c.post(f"{V1}/members/w2/drain").status_code == 202
    events = _events(api_stack, "schedule")
    types = [e["type"] for e in events]
    assert "schedule.move_requested" in types and "schedule.drain_requested" in types, types


def _events(stack: ApiStack, domain: str) -> list[dict[str, Any]]:
    with stack.client() as c, c.stream("GET", f"{V1}/events", params={"domain": domain,
                                                                         "since": f"{domain}:0"}) as r:
        out = []
        deadline = time.monotonic() + 30
        for frame in _frames(r):
            if frame["event"] == "event":
                out.append(frame["data"])
                if frame["data"]["seq"] >= _last_seq(stack, domain) or time.monotonic() > deadline:
                    break
        return out


def _last_seq(stack: ApiStack, domain: str) -> int:
    async def go() -> int:
        return int((await stack.nc.jetstream().stream_info(f"SLUICE_{domain.upper()}")).state.last_seq)

    return stack.bg.run(go())


def test_ddl_locks_through_the_leader(api_stack: ApiStack) -> None:
    ddl = api_stack.ddl
    with api_stack.client() as c:
        locks = c.get(f"{V1}/ddl-locks").json()
        assert {lk["target"] for lk in locks} >= {"shop.t", "shop.u"}
        assert c.get(f"{V1}/ddl-locks/{CF}/shop.t").json()["state"] == "error"
        r = c.get(f"{V1}/ddl-locks/{CF}/shop.zzz")
        assert r.status_code == 404 and "no lock" in r.json()["detail"]
        r = c.post(f"{V1}/ddl-locks/{CF}/shop.u/unlock", json={"mode": "skip"})
        assert r.status_code == 409 and "not in error" in r.json()["detail"]
        assert c.post(f"{V1}/ddl-locks/{CF}/shop.t/unlock", json={"mode": "maybe"}).status_code == 422
        assert c.post(f"{V1}/ddl-locks/{CF}/shop.t/unlock", content=b"mode=exec").status_code == 422
        r = c.post(f"{V1}/ddl-locks/{CF}/shop.t/unlock",
                   json={"mode": "exec", "owner": f"{CF}/src1/shop.t", "reason": "checked by hand"})
        assert r.status_code == 202, r.text
        sent = ddl.requests[-1]
        assert sent == {"action": "unlock", "changefeed": CF, "target": "shop.t", "mode": "exec",
                        "owner": f"{CF}/src1/shop.t", "requested_by": sent["requested_by"],
                        "reason": "checked by hand"}
        assert sent["requested_by"] == "operator"
        assert c.post(f"{V1}/ddl-locks/{CF}/shop.u/force-remove", json={"reason": "x"}).status_code == 202
        assert ddl.requests[-1]["action"] == "force_remove"
        assert c.get(f"{V1}/ddl-locks").json() == []
        ddl.locks[(CF, "shop.v")] = lock_view(CF, "shop.v", "waiting")
        status = c.get(f"{V1}/status").json()
        assert [lk["target"] for lk in status["ddl_locks"]] == ["shop.v"]
        assert {m["member_id"] for m in status["members"]} >= {"w1", "w2"}
        assert any(cf["id"] == CF and cf["lag_s"] is not None for cf in status["changefeeds"])
        # Without a ddl-lock leader: 503 with a message, and status says why it has no locks.
        api_stack.bg.run(ddl.stop())
        try:
            r = c.get(f"{V1}/ddl-locks")
            assert r.status_code == 503 and "no ddl-lock leader" in r.json()["detail"]
            assert "no ddl-lock leader" in c.get(f"{V1}/status").json()["ddl_locks_error"]
        finally:
            api_stack.bg.run(ddl.start(api_stack.nc))


@dataclass
class _Parked:
    subject: str
    data: bytes
    headers: dict[str, str] | None


def test_dead_letters_list_replay_discard(api_stack: ApiStack) -> None:
    js = api_stack.nc.jetstream()
    subject = domain_events_subject("changefeeds")

    async def park_valid_event() -> None:
        # A valid event that a consumer could not handle: parked with its reason.
        payload = REGISTRY.encode(ChangefeedCreatedV2(spec=ChangefeedSpecV2(
            id="from-dl", sources=[SourceRefV1(id="s9", url="mysql://u@h:3306/")],
            sink_url="sqlite:///dl.db")), producer="test")
        parked = _Parked(subject, payload, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
                                            "Nats-Expected-Last-Sequence": "7"})
        await dead_letter(js, parked, "sink unavailable", "handler_error", "SLUICE_CHANGEFEEDS",
                          seq=10**9, ack=False)

    with api_stack.client() as c:
        # Garbage on a domain stream: the api's own projection dead-letters it and carries on.
        api_stack.bg.run(js.publish(subject, b"\x00 not an event"))
        wait_until(lambda: any(d["kind"] == "malformed" for d in c.get(f"{V1}/dead-letters").json()), 30,
                   "garbage dead-lettered")
        garbage = next(d for d in c.get(f"{V1}/dead-letters").json() if d["kind"] == "malformed")
        # The bad event is the newest on the changefeeds subject: commands still go through at once.
        started = time.monotonic()
        assert c.post(f"{V1}/changefeeds", json=spec("after-garbage")).status_code == 202
        assert time.monotonic() - started < 4
        assert garbage["original_subject"] == subject and garbage["origin_stream"] == "SLUICE_CHANGEFEEDS"
        assert c.get(f"{V1}/dead-letters/{garbage['seq']}").json()["reason"]
        assert c.delete(f"{V1}/dead-letters/{garbage['seq']}").status_code == 200
        assert c.get(f"{V1}/dead-letters/{garbage['seq']}").status_code == 404
        assert c.delete(f"{V1}/dead-letters/{garbage['seq']}").status_code == 404

        api_stack.bg.run(park_valid_event())
        parked = next(d for d in c.get(f"{V1}/dead-letters").json() if d["kind"] == "handler_error")
        assert c.get(f"{V1}/changefeeds/from-dl").status_code == 404
        r = c.post(f"{V1}/dead-letters/{parked['seq']}/replay")
        assert r.status_code == 202, r.text
        wait_until(lambda: c.get(f"{V1}/changefeeds/from-dl").status_code == 200, 30, "replayed event folded")
        assert c.get(f"{V1}/dead-letters/{parked['seq']}").status_code == 404
        assert c.post(f"{V1}/dead-letters/{parked['seq']}/replay").status_code == 404
        # The original headers went back with it, the server-interpreted ones did not.
        replayed = api_stack.bg.run(js.get_msg("SLUICE_CHANGEFEEDS", seq=r.json()["seq"]))
        assert replayed.headers is not None and replayed.headers["traceparent"].startswith("00-1111")
        assert not any(k.startswith(("Sluice-Dead-Letter", "Sluice-Original-", "Nats-Expected"))
                       for k in replayed.headers)
        assert c.get(f"{V1}/dead-letters/0").status_code == 422
        assert c.get(f"{V1}/dead-letters", params={"limit": 0}).status_code == 422
        assert c.get(f"{V1}/dead-letters/abc").status_code == 422


def test_event_feed_resumes_from_since(api_stack: ApiStack) -> None:
    with api_stack.client() as c:
        for i in range(3):
            assert c.post(f"{V1}/changefeeds", json=spec(f"feed{i}")).status_code == 202
        params = {"domain": "changefeeds", "since": "changefeeds:0"}
        with c.stream("GET", f"{V1}/events", params={**params, "limit": 2}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            frames = list(_frames(r))
        assert frames[0]["event"] == "cursor" and frames[0]["id"] == "changefeeds:0"
        first = [f for f in frames if f["event"] == "event"]
        assert [f["data"]["seq"] for f in first] == [1, 2]
        assert first[0]["data"]["type"] == "changefeed.created"
        assert first[-1]["id"] == "changefeeds:2"
        # Resume with since, and with Last-Event-ID: the next event, nothing twice.
        with c.stream("GET", f"{V1}/events", params={"since": first[-1]["id"], "limit": 1,
                                                      "domain": "changefeeds"}) as r:
            nxt = [f for f in _frames(r) if f["event"] == "event"]
        with c.stream("GET", f"{V1}/events", params={"limit": 1, "domain": "changefeeds"},
                      headers={"Last-Event-ID": first[-1]["id"]}) as r:
            same = [f for f in _frames(r) if f["event"] == "event"]
        assert [f["data"]["seq"] for f in nxt] == [3] == [f["data"]["seq"] for f in same]
        # Without a cursor the feed starts at the end: only new events arrive.
        with c.stream("GET", f"{V1}/events", params={"limit": 1, "domain": "changefeeds"}) as r:
            frames_iter = _frames(r)
            start = next(frames_iter)
            assert c.post(f"{V1}/changefeeds", json=spec("feed-new")).status_code == 202
            new = next(frames_iter)
        assert new["data"]["data"]["spec"]["id"] == "feed-new"
        assert new["data"]["seq"] == int(start["id"].split(":")[1]) + 1
        # Removed for the same reason as "life" in the lifecycle test.
        assert c.delete(f"{V1}/changefeeds/feed-new").status_code == 202
        for bad in ("changefeeds", "nope:1", "changefeeds:-1", "changefeeds:x"):
            assert c.get(f"{V1}/events", params={"since": bad}).status_code == 422
        assert c.get(f"{V1}/events", params={"domain": "nope"}).status_code == 422


def test_leader_resign(api_stack: ApiStack) -> None:
    with api_stack.client() as c:
        wait_until(lambda: c.get(f"{V1}/leaders/scheduler").status_code == 200, 30, "scheduler leader")
        before = c.get(f"{V1}/leaders/scheduler").json()
        assert before["leader"] == api_stack.scheduler.instance_id and before["epoch"] >= 1
        assert any(x["service"] == "scheduler" for x in c.get(f"{V1}/leaders").json())
        # 404 while the scheduler is between leases (no leader listens): wait for one.
        deadline = time.monotonic() + 30
        while True:
            r = c.post(f"{V1}/leaders/scheduler/resign", json={"epoch": before["epoch"] + 1000})
            if r.status_code != 404 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 409 and "epoch" in r.json()["detail"]
        assert c.post(f"{V1}/leaders/scheduler/resign", json={"epoch": "x"}).status_code == 422
        assert c.post(f"{V1}/leaders/nobody/resign", json={}).status_code == 404
        assert c.get(f"{V1}/leaders/nobody").status_code == 404
        r = c.post(f"{V1}/leaders/scheduler/resign", json={"epoch": before["epoch"], "reason": "test"})
        assert r.status_code == 202, r.text

        def new_term() -> bool:
            now = c.get(f"{V1}/leaders/scheduler")
            return now.status_code == 200 and now.json()["epoch"] > before["epoch"]

        # The only replica sits out one TTL and then wins again with a higher epoch.
        try:
            wait_until(new_term, 30, "a new scheduler term")
        except TimeoutError as exc:
            # Seen once in a fresh-clone run and never reproduced: keep what the scheduler said.
            raise AssertionError(f"{exc}; leaders: {c.get(f'{V1}/leaders').text}\n"
                                 f"scheduler health: {api_stack.scheduler.health()}\n"
                                 f"{api_stack.scheduler.tail_log(40)}") from exc
    resigned = [e for e in _events(api_stack, "schedule") if e["type"] == "leader.resigned"]
    assert resigned and "operator" in resigned[-1]["data"]["reason"]
    assert resigned[-1]["data"]["epoch"] == before["epoch"]


def test_read_models_rebuilt_by_replay_equal_the_live_ones(api_stack: ApiStack) -> None:
    engine = create_engine(f"sqlite:///{api_stack.tmp / 'replayed.db'}")
    fresh = Projections(api_stack.nc.jetstream(), engine, name="replay_test")
    live = Projections(api_stack.nc.jetstream(), create_engine(f"sqlite:///{api_stack.tmp / 'state.db'}"))

    def same() -> bool:
        api_stack.bg.run(fresh.load())
        return fresh.dump() == live.dump()

    # The scheduler keeps trying to place the other tests' tables on the stack's fake members,
    # and each try changes the answers compared below for reasons other than replay: hold it
    # still (SIGSTOP) while the api is killed and rebuilt, once the live api has folded all it
    # published.
    api_stack.scheduler.pause()
    try:
        # Both sides read the same streams; the live api may be a flush behind a moment.
        wait_until(same, 30, "replayed read models equal the live ones")
        dump = fresh.dump()
        assert {r["id"] for r in dump["changefeeds"]} >= {CF, "from-dl"}
        assert {r["member_id"] for r in dump["members"]} == {"w1", "w2"}
        with api_stack.client() as c:
            before = c.get(f"{V1}/changefeeds").json()
            tables_before = c.get(f"{V1}/changefeeds/{CF}/tables").json()
        # kill -9 and start: the api rebuilds its read models from the streams.
        api_stack.api.kill()
        api_stack.api.start()
        api_stack.api.wait_healthy(60)
        with api_stack.client() as c:
            wait_ready(c)
            assert _strip_lag(c.get(f"{V1}/changefeeds").json()) == _strip_lag(before)
            assert _strip_lag(c.get(f"{V1}/changefeeds/{CF}/tables").json()) == _strip_lag(tables_before)
    finally:
        api_stack.scheduler.resume()


def _strip_lag(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("lag_s", "checkpoint_time", "waiting_for")}
            for item in items]


def test_a_literal_password_is_refused_and_never_echoed(api_stack: ApiStack) -> None:
    literal = spec("literal", sink_url=f"postgresql://u:{CANARY}@127.0.0.1:5432/x")
    literal["sources"][0]["url"] = f"mysql://repl:{CANARY}@127.0.0.1:{api_stack.source.port}/"
    with api_stack.client() as c:
        r = c.post(f"{V1}/changefeeds", json=literal)
        assert r.status_code == 422, r.text
        msgs = {tuple(e["loc"]): e["msg"] for e in r.json()["detail"]}
        assert set(msgs) >= {("body", "sink_url"), ("body", "sources", 0, "url")}, msgs
        assert all("secret:NAME" in m and "SLUICE_SECRET_NAME" in m for m in msgs.values()), msgs
        # A body the model itself refuses is not echoed either (no "input" in the errors).
        r = c.post(f"{V1}/changefeeds", json={**literal, "unknown": CANARY})
        assert r.status_code == 422 and CANARY not in r.text
        r = c.put(f"{V1}/changefeeds/{CF}", json={**spec(CF), "sink_url": f"sqlite:///{CANARY}.db",
                                                     "key_policy": CANARY})
        assert r.status_code == 422 and CANARY not in r.text
        assert c.get(f"{V1}/changefeeds/literal").status_code == 404


def test_a_v2_changefeed_with_a_stored_password_still_works_and_is_never_shown(api_stack: ApiStack) -> None:
    legacy_pw = "legacy-pw-31c9"
    api_stack.append("changefeeds", ChangefeedCreatedV2(spec=ChangefeedSpecV2(
        id="legacy", sources=[SourceRefV1(id="src1", url=f"mysql://repl:{legacy_pw}@127.0.0.1:3306/")],
        sink_url="sqlite:///legacy.db")))
    with api_stack.client() as c:
        wait_until(lambda: c.get(f"{V1}/changefeeds/legacy").status_code == 200, 30,
                   "legacy in the read model")
        got = c.get(f"{V1}/changefeeds/legacy").json()
        assert got["spec"]["sources"][0]["url"] == "mysql://repl:***@127.0.0.1:3306/"
        assert legacy_pw not in c.get(f"{V1}/changefeeds").text
        # Sending the redacted URL back keeps the stored password (the changefeed keeps working).
        r = c.put(f"{V1}/changefeeds/legacy", json=dict(got["spec"], key_policy="unique"),
                  params={"skip_checks": "true"})
        assert r.status_code == 202, r.text
    assert _stored_specs(api_stack, "legacy")[-1].sources[0].url.startswith(f"mysql://repl:{legacy_pw}@")
    feed = json.dumps(_events(api_stack, "changefeeds"))
    assert "legacy" in feed and legacy_pw not in feed
    assert legacy_pw not in (api_stack.tmp / "state.db").read_bytes().decode("latin-1")
    with api_stack.client() as c:
        assert c.delete(f"{V1}/changefeeds/legacy").status_code == 202


def _all_stream_bytes(stack: ApiStack) -> list[tuple[str, int, bytes]]:
    """Every message (data and headers) of every stream on the server, KV buckets included."""
    async def go() -> list[tuple[str, int, bytes]]:
        js = stack.nc.jetstream()
        out: list[tuple[str, int, bytes]] = []
        for info in await js.streams_info():
            name = info.config.name
            assert name is not None
            for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
                try:
                    msg = await js.get_msg(name, seq)
                except NotFoundError:
                    continue  # deleted or purged
                headers = json.dumps(msg.headers or {}).encode()
                out.append((name, seq, (msg.data or b"") + headers))
        return out

    return stack.bg.run(go())


def test_zz_the_canary_password_appears_nowhere(api_stack: ApiStack) -> None:
    """Runs last in this module: every changefeed the tests made names the source's password
    as a secret, and the api resolved it to connect; the password itself is nowhere."""
    with api_stack.client() as c:
        assert c.post(f"{V1}/changefeeds", json=spec("canary")).status_code == 202
        assert c.get(f"{V1}/changefeeds/canary").json()["failed_checks"] == []
        assert c.get(f"{V1}/sources").status_code == 200
        assert c.get(f"{V1}/status").status_code == 200
    feed = json.dumps(_events(api_stack, "changefeeds"))
    assert "canary" in feed and CANARY not in feed
    messages = _all_stream_bytes(api_stack)
    assert {n for n, _, _ in messages} >= {"SLUICE_CHANGEFEEDS", "SLUICE_ROWS"}
    leaks = [(n, seq) for n, seq, data in messages if CANARY.encode() in data]
    assert leaks == [], f"the canary password is in these stream messages: {leaks}"
    assert api_stack.responses, "the clients recorded no answers"
    assert not [r for r in api_stack.responses if CANARY in r], "an api answer holds the password"
    logs = list((api_stack.tmp / "logs").iterdir())
    assert logs
    assert not [p.name for p in logs if CANARY in p.read_text(errors="replace")]
    assert CANARY not in (api_stack.tmp / "state.db").read_bytes().decode("latin-1")
