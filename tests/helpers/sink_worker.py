"""A standalone sink-worker process's helpers: its changefeeds, its HTTP endpoints, waiting on it."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from libs.eventstore import EventStore
from libs.streams import domain_stream, domain_subjects


async def _changefeeds(js: JetStreamContext) -> EventStore:
    store = EventStore(js, domain_stream("changefeeds"), "test-api")
    try:
        await js.stream_info(store.stream)  # whoever made it first (api, other tests) keeps its config
    except NotFoundError:
        await store.ensure(domain_subjects("changefeeds"))
    return store


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


async def _wait(check: Any, within_s: float, what: str) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)  # polling a condition with a deadline, not a fixed wait
