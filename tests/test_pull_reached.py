"""A span's reader counts the resolved mark as reached only when nothing of the span before
the mark is left unread. A consumer counts what is pending in the store of the server that
holds it, which in a NATS cluster may be a replica still catching up with the leader: a suite
run lost two deletes of one table that way (the horizon went to the mark, and the messages
were dropped as applied when they came). On a replicated stream the reader asks the stream's
leader before it trusts "nothing pending". Against a real nats-server, with the consumer's
count made to lag."""

from __future__ import annotations

import pytest
from nats.js import JetStreamContext

from libs.eventstore import EventStore
from libs.scheduling.model import Span
from libs.streams import ROWS_STREAM, ROWS_SUBJECTS
from services.sink_worker.round.pull import SpanReader, latest_resolved
from tests.helpers.harness import Source, ins

pytestmark = pytest.mark.integration


@pytest.fixture
async def rows_js(js: JetStreamContext) -> JetStreamContext:
    await EventStore(js, ROWS_STREAM, "test").ensure(ROWS_SUBJECTS, allow_rollup_hdrs=True)
    return js


class _LaggingReader(SpanReader):
    """Its consumer first reports nothing pending, as one on a replica behind the leader."""

    lag = True

    async def _pending(self) -> int:
        if self.lag:
            self.lag = False
            return 0
        return await super()._pending()


@pytest.mark.parametrize("confirm", [True, False])
async def test_nothing_pending_before_the_mark_is_confirmed_with_the_streams_leader(
        rows_js: JetStreamContext, confirm: bool) -> None:
    src = Source(rows_js)
    span = Span.of("cf", src.name, "shop", "people")
    for i in range(3):
        await src.txn("shop", "people", [ins(i, f"n{i}", i)])
    await src.resolve()
    mark = await latest_resolved(rows_js, src.name)
    assert mark is not None
    reader = _LaggingReader(rows_js, span)
    reader.confirm_reached = confirm
    try:
        lagging = await reader.pull((0, 0), 100, mark.stream_seq)
        if confirm:
            # The leader holds the three transactions before the mark: not reached, so the
            # horizon stays at the checkpoint and nothing is passed over.
            assert not lagging.reached and lagging.horizon(0, mark.ts) == 0
        else:
            # What the reader did before: the consumer's word, and the horizon at the mark's ts
            # with none of the three read.
            assert lagging.reached and lagging.horizon(0, mark.ts) == mark.ts and not lagging.events
        caught_up = await reader.pull((0, 0), 100, mark.stream_seq)
        assert caught_up.reached and len(caught_up.events) == 3
        assert caught_up.horizon(0, mark.ts) == mark.ts
    finally:
        await reader.close()


async def test_a_single_server_stream_is_taken_at_its_consumers_word(rows_js: JetStreamContext) -> None:
    src = Source(rows_js)
    await src.txn("shop", "people", [ins(1, "a", 1)])
    await src.resolve()
    reader = SpanReader(rows_js, Span.of("cf", src.name, "shop", "people"))
    try:
        mark = await latest_resolved(rows_js, src.name)
        assert mark is not None
        assert (await reader.pull((0, 0), 100, mark.stream_seq)).reached
        assert reader.confirm_reached is False  # R1: no request to the leader
    finally:
        await reader.close()
