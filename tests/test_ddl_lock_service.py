"""The ddl-lock service as real processes (2 replicas) on a real nats-server, driven by the
worker side of the protocol (``ShardDdl``, what the sink-worker runs) for three shards: the
flow, garbage on its subjects, the command interface's errors, and a leader killed while an
exec is in flight (the new leader re-sends it; the worker answers with its done, nothing runs
twice)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from nats.aio.client import Client

from contracts import REGISTRY
from contracts.events.changefeeds import ChangefeedSpecV2, RouteRuleV1, SourceRefV1
from contracts.events.leadership import LeaderElectedV1
from libs.changefeeds import record_changefeed, record_state
from libs.config import Settings
from libs.localservers.service_process import ServiceProcess
from libs.routing import Target
from libs.scheduling.model import Span
from libs.shard_ddl.lock import Operation
from libs.streams import (
    SHARD_DDL_REPORT_SUBJECT,
    command_subject,
    domain_events_subject,
    domain_stream,
    rows_subject,
)
from libs.streams_setup import ensure_rows_stream
from services.sink_worker.ddl.shard import ShardDdl
from tests.helpers.control_plane import eventually

pytestmark = pytest.mark.integration

TARGET = Target("merged", "t")


@pytest.fixture
async def leaders(service_env: dict[str, str], tmp_path: Path) -> AsyncIterator[list[ServiceProcess]]:
    env = {**service_env, "SLUICE_DDL_LOCK_RESEND_S": "1", "SLUICE_DDL_LOCK_DISCOVERY_INTERVAL_S": "0.5"}
    procs = [ServiceProcess("services.ddl_lock", env, tmp_path / "logs", instance_id=f"ddl-lock-{i}").start()
             for i in (1, 2)]
    try:
        for p in procs:
            await asyncio.to_thread(p.wait_healthy, 60)
        yield procs
    finally:
        for p in procs:
            if p.alive():
                p.kill()


async def _command(nc: Client, body: Any) -> dict[str, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg = await nc.request(command_subject("ddl"), raw, timeout=10)
    answer: dict[str, Any] = json.loads(msg.data)
    return answer


async def _events(nc: Client) -> list[tuple[str, dict[str, Any]]]:
    js = nc.jetstream()
    info = await js.stream_info(domain_stream("ddl"))
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await js.get_msg(domain_stream("ddl"), seq)
        if raw.subject == domain_events_subject("ddl"):
            env = REGISTRY.decode(raw.data or b"").envelope
            out.append((env.type, env.data))
    return out


async def _leader(procs: list[ServiceProcess]) -> ServiceProcess | None:
    for p in procs:
        if p.alive():
            h = await asyncio.to_thread(p.health)
            if h and h.get("leader") and "ddl_locks" in h:
                return p
    return None


async def _drive(ddl: ShardDdl, spans: list[Span], position: int, statement: str,
                 on_exec: Any = None) -> dict[Span, Operation]:
    """Every span waits at its DDL until its operation comes; carry each out."""
    got: dict[Span, Operation] = {}

    async def step() -> bool:
        for s in spans:
            if s in got:
                continue
            op = await ddl.at_ddl(s, TARGET, (statement,), position)
            if op is not None:
                if op.kind == "exec" and on_exec is not None and not ddl.already_carried(op):
                    await on_exec(op)
                await ddl.carried_out(op)
                got[s] = op
        return len(got) == len(spans)

    await eventually(step, 60, "every shard to get and carry out its operation", interval=0.05)
    return got


async def test_lock_flow_garbage_commands_and_a_leader_killed_during_exec(
        leaders: list[ServiceProcess], nc: Client, tmp_path: Path) -> None:
    js = nc.jetstream()
    await ensure_rows_stream(js, Settings())
    tag = uuid4().hex[:8]
    cf, source = f"ddl{tag}", f"s{tag}"
    spans = [Span(cf, source, f"db_{i}", "t") for i in range(3)]
    for s in spans:
        await js.publish(rows_subject(s.source, s.database, s.table), b"{}")
    await record_changefeed(js, ChangefeedSpecV2(
        id=cf, sources=[SourceRefV1(id=source, url="mysql://127.0.0.1/")], sink_url=f"sqlite:///{tmp_path}/t.db",
        routes=[RouteRuleV1(database="db_*", table="t", target_schema="merged", target_table="t")]), "test")
    ddl = ShardDdl(nc, producer="test", info_resend_s=0.3)
    try:
        await eventually(lambda: _leader(leaders), 30, "a ddl-lock leader")

        # Garbage on the report and command subjects: refused or answered, the leader keeps going.
        await nc.publish(SHARD_DDL_REPORT_SUBJECT, b"\x00 not json")
        stranger = LeaderElectedV1(service="x", candidate="y", epoch=1)
        await nc.publish(SHARD_DDL_REPORT_SUBJECT, REGISTRY.encode(stranger, producer="test"))
        for body, code in [(b"{nope", 422), ([1, 2], 422), ({"action": "explode"}, 422),
                           ({"action": "show", "changefeed": cf}, 422),
                           ({"action": "show", "changefeed": cf, "target": "merged"}, 422),
                           ({"action": "show", "changefeed": cf, "target": "merged.t"}, 404),
                           ({"action": "force_remove", "changefeed": cf, "target": "merged.t",
                             "requested_by": "a", "reason": "b"}, 404)]:
            answer = await _command(nc, body)
            assert answer["ok"] is False and answer["code"] == code and answer["error"], (body, answer)

        await ddl.start()
        # 1. The flow: one exec to the owner (the first Info), skips to the others after its done.
        statement = "ALTER TABLE `merged`.`t` ADD COLUMN a int"
        first = await ddl.at_ddl(spans[0], TARGET, (statement,), 100)
        assert first is None

        async def waiting() -> bool:
            # The worker's rounds: the Info goes again while no operation came (the leader may
            # not know the changefeed yet and drops an Info from a shard it cannot place).
            assert await ddl.at_ddl(spans[0], TARGET, (statement,), 100) is None
            locks = (await _command(nc, {"action": "list"}))["locks"]
            mine = [lk for lk in locks if lk["changefeed"] == cf]
            return bool(mine) and mine[0]["state"] == "waiting"

        await eventually(waiting, 30, "the lock waiting for the other shards")
        shown = await _command(nc, {"action": "show", "changefeed": cf, "target": "merged.t"})
        assert shown["lock"]["owner"] == spans[0].name
        assert shown["lock"]["ddls"] == [statement] and shown["lock"]["created_at"]
        assert {sh["state"] for sh in shown["lock"]["shards"]} == {"blocked", "waiting_info"}
        ops = await _drive(ddl, spans, 100, statement)
        assert [ops[s].kind for s in spans] == ["exec", "skip", "skip"]
        await eventually(lambda: _no_lock(nc, cf), 30, "the lock resolved")
        # A shard that replays the DDL (restart from an older checkpoint) is told to skip it.
        replay = await _drive(ddl, [spans[2]], 100, statement)
        assert replay[spans[2]].kind == "skip"

        # 2. Kill the leader while the exec is in flight; the worker executes once.
        leader = await _leader(leaders)
        assert leader is not None
        execs: list[str] = []
        statement2 = "ALTER TABLE `merged`.`t` ADD COLUMN b int"

        async def on_exec(op: Operation) -> None:
            execs.append(op.id)
            if len(execs) == 1:
                leader.kill()  # before the done goes out: nobody receives it
                await asyncio.sleep(0.2)  # let the kill land; the done is then published to nobody

        t0 = time.monotonic()
        ops2 = await _drive(ddl, spans, 200, statement2, on_exec)
        assert [ops2[s].kind for s in spans] == ["exec", "skip", "skip"] and len(execs) == 1
        await eventually(lambda: _no_lock(nc, cf), 60, "the new leader to resolve the lock")
        assert time.monotonic() - t0 < 60
        mine = [(t, d) for t, d in await _events(nc) if d.get("changefeed") == cf]
        issued = [d for t, d in mine if t == "shard_ddl.operation_issued" and d["kind"] == "exec"]
        assert len(issued) == 2  # one per DDL: the new leader re-sent, it did not issue again
        assert sum(1 for t, _ in mine if t == "shard_ddl.lock_resolved") == 2
    finally:
        await ddl.close()
        # The session's nats-server is shared: other tests' workers must not pick this one up.
        await record_state(js, cf, "deleted", "test", "test over")


async def _no_lock(nc: Client, cf: str) -> bool:
    try:
        answer = await _command(nc, {"action": "list"})
    except Exception:
        return False
    return not [lk for lk in answer["locks"] if lk["changefeed"] == cf]
