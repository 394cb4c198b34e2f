"""``flush_within`` against a real nats-server: a flush that times out leaves the connection
reading (nats-py's read loop stops for good when a PONG meets a cancelled PING future, which is
what ``asyncio.wait_for(nc.flush(), t)`` leaves behind), and one in time returns."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from libs.nats_client import flush_within

pytestmark = pytest.mark.integration


async def test_a_flush_that_timed_out_leaves_the_connection_reading(nc: Client) -> None:
    await flush_within(nc, 5.0)  # in time: returns
    timed_out = 0
    for _ in range(20):
        try:
            await flush_within(nc, 1e-6)  # shorter than any PING round trip can be
        except TimeoutError:
            timed_out += 1
    assert timed_out > 0
    await flush_within(nc, 5.0)  # every late PONG has arrived by now (PONGs come in order)
    assert nc._reading_task is not None and not nc._reading_task.done()
    sub = await nc.subscribe("sluice.test.flush")
    await nc.publish("sluice.test.flush", b"still reading")
    msg = await sub.next_msg(timeout=5)
    assert msg.data == b"still reading"
    await sub.unsubscribe()
