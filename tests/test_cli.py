"""The ``sluice`` CLI against a live api (real nats-server, api and scheduler processes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from contracts.events.scheduling import SetChangedV1
from libs.localservers.common import wait_until
from libs.scheduling.model import Span as WorkerSpan
from libs.streams import SNAPSHOT_BUCKET
from libs.ts import utc_text
from tests.api_stack import CF, TOKEN, ApiStack, lock_view, span_ref
from tests.helpers.cli import sluice, sluice_json

pytestmark = pytest.mark.integration


def later(seconds: float, fn: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    thread.start()
    return thread


def test_status_shows_lag_members_and_locks(api_stack: ApiStack) -> None:
    TS = api_stack.seed_scenario()
    api_stack.ddl.locks[(CF, "shop.z")] = lock_view(CF, "shop.z", "error")
    code, out = sluice(api_stack, "status")
    assert code == 0, out
    assert "orders" in out and "w1" in out and "w2" in out and "shop.z" in out
    lag_line = next(line for line in out.splitlines() if " orders " in f" {line} ")
    # The checkpoint as a UTC time and its lag, never the raw ts (that is for --json). It ages
    # while the session's stack lives, so the unit may be s, min or h.
    assert re.search(re.escape(utc_text(TS)) + r", \d+\.\d (s|min|h) behind", lag_line), lag_line
    assert str(TS) not in out
    body = sluice_json(api_stack, "status")
    assert {m["member_id"] for m in body["members"]} >= {"w1", "w2"}
    assert any(lk["target"] == "shop.z" for lk in body["ddl_locks"])


def test_changefeed_commands(api_stack: ApiStack, tmp_path: Path) -> None:
    rules = [{"tables": ["shop.users"], "ignore_events": ["truncate"],
              "ignore_delete_value_expr": "status = 'archived'", "drop_columns": ["card"],
              "computed": [{"name": "email_masked", "expr": "concat(left(email, 1), '***')"}]}]
    spec = {"id": "cli-cf", "sources": [{"id": "src1", "url": api_stack.source_url}],
            "sink_url": "sqlite:///cli.db", "initial_load": "binlog-only", "table_rules": rules}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    code, out = sluice(api_stack, "changefeed", "create", str(path))
    assert code == 0 and "accepted" in out, out
    assert sluice_json(api_stack, "changefeed", "get", "cli-cf")["state"] == "running"
    code, out = sluice(api_stack, "changefeed", "rules", "cli-cf")
    assert code == 0 and "delete: status = 'archived'" in out and "drop card" in out, out
    assert "email_masked = concat(left(email, 1), '***') (string)" in out, out
    broken = [{**rules[0], "ignore_delete_value_expr": "status = 'x"}]
    path.write_text(json.dumps({**spec, "table_rules": broken}))
    code, out = sluice(api_stack, "changefeed", "update", "cli-cf", str(path))
    assert code == 1 and "422" in out and "unterminated string" in out, out
    code, out = sluice(api_stack, "changefeed", "get", "cli-cf")
    assert code == 0 and "cli-cf" in out and "none yet" in out and "sqlite:///cli.db" in out, out
    code, out = sluice(api_stack, "changefeed", "list")
    assert code == 0 and "cli-cf" in out
    assert sluice(api_stack, "changefeed", "pause", "cli-cf")[0] == 0
    code, out = sluice(api_stack, "changefeed", "pause", "cli-cf")
    assert code == 1 and "409" in out and "paused" in out
    assert sluice(api_stack, "changefeed", "resume", "cli-cf")[0] == 0
    path.write_text(json.dumps({**spec, "sink_url": "ftp://nope"}))
    code, out = sluice(api_stack, "changefeed", "update", "cli-cf", str(path))
    assert code == 1 and "sink_url" in out and "422" in out
    assert sluice(api_stack, "changefeed", "delete", "cli-cf")[0] == 0
    code, out = sluice(api_stack, "changefeed", "get", "cli-cf")
    assert code == 1 and "404" in out
    path.write_text("not json")
    assert sluice(api_stack, "changefeed", "create", str(path))[0] == 2
    path.write_text(json.dumps(spec))
    code, out = sluice(api_stack, "changefeed", "create", str(path), token=None)
    assert code == 1 and "401" in out


def test_create_refused_by_a_check_then_skip_checks(api_stack: ApiStack, tmp_path: Path) -> None:
    spec = {"id": "cli-checks", "sources": [{"id": "src1", "url": api_stack.source_url}],
            "sink_url": "sqlite:///cli.db",
            "routes": [{"database": "nowhere_*", "target_schema": "x", "name": "nowhere"}]}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    code, out = sluice(api_stack, "changefeed", "create", str(path))
    assert code == 1 and "422" in out and "route nowhere matches no table" in out, out
    code, out = sluice(api_stack, "changefeed", "create", str(path), "--skip-checks")
    assert code == 0 and "failed checks" in out, out
    code, out = sluice(api_stack, "changefeed", "list")
    assert code == 0 and "failed checks: route_matches_nothing" in out.replace("\n", " "), out
    assert sluice(api_stack, "changefeed", "delete", "cli-checks")[0] == 0


def test_tables_snapshot_progress_and_move(api_stack: ApiStack) -> None:
    api_stack.seed_scenario()  # initial load copying 500/1000, whatever ran before
    code, out = sluice(api_stack, "changefeed", "tables", CF)
    assert code == 0 and "replicating" in out, out
    assert "500 of about 1,000 rows at 2,500 rows/s, ETA 2m05s" in out, out
    assert "UTC" in out and " behind" in out and "none yet" in out, out
    assert "waiting for" in out and "copied" in out, out
    # Every table, however small the pages it reads them in.
    paged = sluice_json(api_stack, "changefeed", "tables", CF, "--page-size", "2")
    assert sorted(t["table"] for t in paged) == ["a", "b", "c"]
    progress = sluice_json(api_stack, "changefeed", "snapshot", CF)
    assert progress["src1/shop.a"] == {"rows_copied": 500, "rows_estimate": 1000, "state": "copying",
                                       "rows_per_s": 2500.0, "eta_s": 125.0}
    code, out = sluice(api_stack, "changefeed", "snapshot", CF)
    assert code == 0 and "2500" in out and "2m05s" in out, out
    key = WorkerSpan(CF, "src1", "shop", "a").kv_key
    done = later(1.5, lambda: api_stack.kv_put(SNAPSHOT_BUCKET, key, {
        "changefeed": CF, "source": "src1", "database": "shop", "table": "a", "state": "done",
        "rows_copied": 1000, "rows_estimate": 1000}))
    code, out = sluice(api_stack, "changefeed", "snapshot", CF, "--wait", "--timeout", "60")
    done.join()
    assert code == 0 and "src1/shop.a done" in out, out
    code, out = sluice(api_stack, "changefeed", "move", CF, "src1", "shop", "zzz", "--to", "w2")
    assert code == 1 and "404" in out


def test_drain_waits_with_a_progress_bar(api_stack: ApiStack) -> None:
    api_stack.seed_scenario()  # w2 holds table c, whatever ran before
    assert sluice_json(api_stack, "member", "list")
    # w2 holds table c (as secondary); the move off it completes while the CLI waits.
    moved = later(1.5, lambda: api_stack.append("replication", SetChangedV1(
        span=span_ref("c"), state="replicating", primary="w1", members={"w1": "primary"})))
    code, out = sluice(api_stack, "member", "drain", "w2", "--wait", "--timeout", "60")
    moved.join()
    assert code == 0 and "accepted" in out and "w2 is drained" in out, out
    code, out = sluice(api_stack, "member", "drain", "ghost")
    assert code == 1 and "404" in out


def test_ddl_leaders_dead_letters_events(api_stack: ApiStack) -> None:
    api_stack.ddl.locks[(CF, "shop.q")] = lock_view(CF, "shop.q", "error")
    code, out = sluice(api_stack, "ddl", "list")
    assert code == 0 and "shop.q" in out
    assert sluice_json(api_stack, "ddl", "show", CF, "shop.q")["state"] == "error"
    code, out = sluice(api_stack, "ddl", "unlock", CF, "shop.q", "--mode", "skip", "--reason", "dup")
    assert code == 0 and "accepted" in out, out
    assert api_stack.ddl.requests[-1]["mode"] == "skip"
    assert sluice(api_stack, "ddl", "unlock", CF, "shop.q", "--mode", "exec")[0] == 1  # gone: 404
    assert sluice(api_stack, "ddl", "unlock", CF, "shop.z", "--mode", "later")[0] == 2
    assert sluice(api_stack, "ddl", "force-remove", CF, "shop.z")[0] == 0

    # The scheduler's lease may be between two renewals' holders for a moment on a loaded
    # machine (a suite run saw the list without it): the listing is what is checked here.
    wait_until(lambda: any(x["service"] == "scheduler" for x in sluice_json(api_stack, "leader", "list")),
               30, "the scheduler in `sluice leader list`")
    code, out = sluice(api_stack, "leader", "resign", "nobody")
    assert code == 1 and "404" in out
    assert isinstance(sluice_json(api_stack, "dead-letter", "list"), list)
    assert sluice(api_stack, "dead-letter", "replay", "999999")[0] == 1

    code, out = sluice(api_stack, "--json", "events", "--since", "changefeeds:0", "--domain", "changefeeds",
                       "--limit", "2")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [e["seq"] for e in lines] == [1, 2] and lines[1]["cursor"] == "changefeeds:2"


def test_console_script_uses_sluice_api_url(api_stack: ApiStack) -> None:
    script = Path(sys.executable).parent / "sluice"
    env = {**os.environ, "SLUICE_API_URL": api_stack.url, "SLUICE_API_TOKEN": TOKEN}
    proc = subprocess.run([str(script), "--json", "member", "list"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert {m["member_id"] for m in json.loads(proc.stdout)} >= {"w1"}
