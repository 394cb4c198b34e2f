"""A sink-worker's heartbeats go on a connection of their own (``SinkAgent.hb_nc``): the
server's answer to a heartbeat's flush, which is the worker's right to write, does not wait
behind a round's requests and replies on the data connection. Against a real nats-server: the
heartbeats leave on the heartbeat connection only, and the fence is confirmed by its flushes."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.localservers.nats_server import NatsServer
from libs.scheduling import Span
from libs.scheduling.tasks import Dispatch, DispatchAction
from libs.streams import heartbeat_subject
from services.sink_worker.agent import SinkAgent

pytestmark = pytest.mark.integration


async def test_heartbeats_and_their_confirmation_use_the_heartbeat_connection_only(
        nc: Client, nats_server: NatsServer) -> None:
    hb_nc = await nats.connect(nats_server.url)
    try:
        agent = SinkAgent(nc, member_id="w-conn", address="", heartbeat_interval_s=0.2, fence_s=1.0,
                          heartbeat_nc=hb_nc)
        for i in range(50):
            agent.state.handle_dispatch(Dispatch("w-conn", Span("cf", "src", "db", f"t{i}"),
                                                 DispatchAction.ADD_PREPARE, 1_000 + i, 1))
        got: list[int] = []

        async def on_msg(msg: Msg) -> None:
            got.append(len(msg.data))

        sub = await nc.subscribe(heartbeat_subject("w-conn"), cb=on_msg)
        await nc.flush()
        data_out = nc.stats["out_msgs"]
        hb_out = hb_nc.stats["out_msgs"]
        for _ in range(5):
            sent_at = time.monotonic()
            await agent._send_heartbeat()
            fence = agent.fence
            assert fence is not None and fence.may_write()
            assert fence.deadline is not None and fence.deadline >= sent_at + fence.bound_s
        deadline = time.monotonic() + 10
        while len(got) < 5:
            assert time.monotonic() < deadline, f"{len(got)} heartbeats arrived"
            await asyncio.sleep(0.05)  # polling the subscriber's count
        await sub.unsubscribe()
        assert hb_nc.stats["out_msgs"] - hb_out >= 5
        assert nc.stats["out_msgs"] == data_out  # not one heartbeat on the data connection
        assert agent.heartbeats_sent == 5
    finally:
        await hb_nc.close()


async def test_without_a_connection_of_its_own_the_agent_uses_the_workers() -> None:
    agent = SinkAgent(object(), member_id="w", address="", heartbeat_interval_s=1.0)  # type: ignore[arg-type]
    assert agent.hb_nc is agent.nc
