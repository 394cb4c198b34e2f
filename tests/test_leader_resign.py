"""An operator asks a leader to resign (request/reply on ``sluice.cmd.leader.<service>``): it
records ``leader.resigned``, gives up its lease and another candidate takes over."""

from __future__ import annotations

import asyncio
import json
from uuid import uuid4

import pytest
from nats.aio.client import Client

from libs.election import Election, run_leader_loop
from libs.eventstore import EventStore
from libs.streams import LEADER_BUCKET, domain_events_subject, domain_stream, leader_command_subject

pytestmark = pytest.mark.integration
TTL = 1.5


async def _leader(nc: Client, service: str) -> tuple[str, int]:
    kv = await nc.jetstream().key_value(LEADER_BUCKET)
    entry = await kv.get(service)
    info = Election._decode(entry.value or b"{}", int(entry.revision or 0))
    return info.candidate, info.epoch


async def _wait(cond: object, within_s: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while asyncio.get_running_loop().time() < deadline:
        try:
            if await cond():  # type: ignore[operator]
                return
        except Exception:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def test_resign_request_hands_the_lease_to_another_candidate(nc: Client) -> None:
    service = f"resign-{uuid4().hex[:8]}"
    domain = f"rt{uuid4().hex[:8]}"
    stopping = asyncio.Event()
    status = {c: {} for c in ("a", "b")}
    js = nc.jetstream()
    loops = [asyncio.create_task(run_leader_loop(
        js, service=service, candidate=c, domain=domain, producer=c, ttl=TTL,
        work=lambda lead, log: asyncio.Event().wait(), stopping=stopping, status=status[c], nc=nc))
        for c in ("a", "b")]
    try:
        await _wait(lambda: _has_leader(status))
        first, epoch = await _leader(nc, service)
        subject = leader_command_subject(service)
        wrong = json.loads((await nc.request(subject, json.dumps(
            {"action": "resign", "epoch": epoch + 5}).encode(), timeout=5)).data)
        assert wrong["ok"] is False and wrong["code"] == 409
        garbage = json.loads((await nc.request(subject, b"\x00garbage", timeout=5)).data)
        assert garbage["ok"] is False and garbage["code"] == 422
        assert (await _leader(nc, service)) == (first, epoch)  # neither made it step down

        answer = json.loads((await nc.request(subject, json.dumps(
            {"action": "resign", "epoch": epoch, "requested_by": "ops", "reason": "maintenance"}
        ).encode(), timeout=5)).data)
        assert answer == {"ok": True, "service": service, "leader": first, "epoch": epoch}

        async def other_leads() -> bool:
            who, new_epoch = await _leader(nc, service)
            return who != first and new_epoch > epoch

        # The resigning candidate sits out one TTL, so the other one wins.
        await _wait(other_leads)
        store = EventStore(js, domain_stream(domain), producer="test")
        events = [e.event async for e in store.replay(domain_events_subject(domain))]
        resigned = [e for e in events if type(e).__name__ == "LeaderResignedV1"]
        assert [(e.candidate, e.epoch) for e in resigned] == [(first, epoch)]  # type: ignore[attr-defined]
        assert "operator: ops: maintenance" in resigned[0].reason  # type: ignore[attr-defined]
    finally:
        stopping.set()
        await asyncio.gather(*loops, return_exceptions=True)


async def _has_leader(status: dict[str, dict[str, object]]) -> bool:
    return any(s.get("leader") for s in status.values())
