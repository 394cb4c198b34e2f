"""Validation in the api and the CLI against a live api (real nats-server and api process):
the status workers record per table, added up; an on-demand compare requested and followed."""

from __future__ import annotations

import json
import time

import pytest

from libs.scheduling.model import Span as WorkerSpan
from libs.streams import VALIDATION_BUCKET
from libs.validation import CompareProgress, ReportedRow, SpanValidation
from tests.api_stack import CF, VIEWER_TOKEN, ApiStack
from tests.helpers.cli import sluice, sluice_json

pytestmark = pytest.mark.integration
V1 = "/api/v1"


def _status(table: str, **kw: object) -> SpanValidation:
    span = WorkerSpan(CF, "src1", "shop", table)
    return SpanValidation(changefeed=CF, span=span.name, source="src1", database="shop", table=table,
                          mode="full", worker="w1", checked_at=time.time(), **kw)  # type: ignore[arg-type]


def test_validation_status_and_an_on_demand_compare(api_stack: ApiStack) -> None:
    row = ReportedRow(key={"id": 4}, kind="different", columns=["name"], since=time.time())
    status = _status("a", rows_checked=40, mismatches=1, found_total=2, repaired_total=1, reported=[row])
    api_stack.kv_put(VALIDATION_BUCKET, WorkerSpan(CF, "src1", "shop", "a").kv_key,
                     json.loads(status.model_dump_json()))
    api_stack.kv_put(VALIDATION_BUCKET, WorkerSpan(CF, "src1", "shop", "b").kv_key,
                     json.loads(_status("b", rows_checked=2).model_dump_json()))
    with api_stack.client() as op, api_stack.client(token=VIEWER_TOKEN) as viewer:
        assert op.get(f"{V1}/changefeeds/nope/validation").status_code == 404
        r = viewer.get(f"{V1}/changefeeds/{CF}/validation")
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["rows_checked"], body["mismatches"], body["repaired_total"]) == (42, 1, 1), body
        assert body["mismatched_rows"] == [{"table": "src1/shop.a", **row.model_dump(mode="json")}]
        tables = {t["table"]: t for t in body["tables"]}
        assert tables["src1/shop.a"]["mismatches"] == 1 and tables["src1/shop.b"]["rows_checked"] == 2
        assert body["compare"]["state"] == "none"
        limited = op.get(f"{V1}/changefeeds/{CF}/validation", params={"limit": 0}).json()
        assert limited["mismatched_rows"] == []

        assert viewer.post(f"{V1}/changefeeds/{CF}/validation/compare").status_code == 403
        assert op.post(f"{V1}/changefeeds/nope/validation/compare").status_code == 404
        r = op.post(f"{V1}/changefeeds/{CF}/validation/compare")
        assert r.status_code == 202, r.text
        compare = op.get(f"{V1}/changefeeds/{CF}/validation").json()["compare"]
        assert compare["state"] == "running" and compare["request"]["id"], compare
        # A worker reports its table compared for that request.
        done = CompareProgress(request_id=compare["request"]["id"], state="done", rows_checked=40,
                               rows_estimate=40, chunks_done=1, candidates=1)
        api_stack.kv_put(VALIDATION_BUCKET, WorkerSpan(CF, "src1", "shop", "a").kv_key,
                         json.loads(status.model_copy(update={"compare": done}).model_dump_json()))
        # The api reads the bucket through a watcher of its own connection: wait until the
        # report is among what it reads, with a deadline.
        deadline = time.monotonic() + 15
        while True:
            compare = op.get(f"{V1}/changefeeds/{CF}/validation").json()["compare"]
            if compare["tables_done"] == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert compare["tables_done"] == 1 and compare["rows_checked"] == 40, compare

    code, out = sluice(api_stack, "validation", "status", CF)
    assert code == 0, out
    assert "1 mismatched" in out and "src1/shop.a" in out and '{"id": 4}' in out and "name" in out, out
    assert sluice_json(api_stack, "validation", "status", CF)["mismatches"] == 1
    code, out = sluice(api_stack, "validation", "compare", CF)
    assert code == 0 and "accepted" in out, out
    code, out = sluice(api_stack, "validation", "status", "nope")
    assert code == 1 and "404" in out, out
