"""The sink's reader decodes a fetch's messages off the event loop (no servers): the thread's
results are exactly the inline decode's, garbage comes back as ``Garbage`` (dead-lettered by
the caller on the loop), chunk messages are left to the reader; and a long computing loop gives
the event loop turns (``LoopTurns``), so heartbeats are not held behind a decode."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from libs.chunks import CHUNK, CHUNK_DIGEST, CHUNK_OF, CHUNK_TS
from libs.scheduling.model import Span
from libs.streams import rows_subject
from services.sink_worker.round.pull import Garbage, LoopTurns, PulledEvent, decode_fetched, decode_for_span

FIXTURES = Path(__file__).parent / "fixtures" / "contracts"
SPAN = Span.of("cf1", "src1", "shop", "orders")


@dataclass
class _Sequence:
    stream: int


@dataclass
class _Metadata:
    sequence: _Sequence


@dataclass
class Msg:
    subject: str
    data: bytes
    seq: int
    headers: dict[str, str] | None = None
    metadata: _Metadata = field(init=False)

    def __post_init__(self) -> None:
        self.metadata = _Metadata(_Sequence(self.seq))


def test_a_fetch_decoded_in_a_thread_is_the_inline_decode() -> None:
    raw = (FIXTURES / "rows.changed.v4.json").read_bytes()
    good = Msg(rows_subject("src1", "shop", "orders"), raw, 7)
    other_table = Msg(rows_subject("src1", "shop", "customers"), raw, 8)
    not_json = Msg(rows_subject("src1", "shop", "orders"), b"{not json", 9)
    chunk = Msg(rows_subject("src1", "shop", "orders"), b"part", 10,
                {CHUNK_OF: "x", CHUNK: "0/2/4/8", CHUNK_TS: "5", CHUNK_DIGEST: "d"})
    bad_chunk = Msg(rows_subject("src1", "shop", "orders"), b"part", 11, {CHUNK_OF: "x"})

    async def run() -> list[PulledEvent | Garbage | None]:
        return await asyncio.to_thread(decode_fetched, SPAN, [good, other_table, not_json, chunk, bad_chunk])

    out = asyncio.run(run())
    assert len(out) == 5
    assert out[0] == decode_for_span(SPAN, good, 7)
    assert isinstance(out[1], Garbage) and out[1].kind == "unexpected_subject"
    assert isinstance(out[2], Garbage) and out[2].event is None
    assert out[3] is None and out[4] is None  # the reader joins chunks and dead-letters bad ones


def test_a_computing_loop_gives_the_event_loop_turns() -> None:
    async def run(every_s: float) -> tuple[int, bool]:
        beat = asyncio.Event()

        async def heartbeat() -> None:
            beat.set()

        turns = LoopTurns(every_s)
        task = asyncio.ensure_future(heartbeat())
        ran_before_end = False
        for _ in range(50):
            sum(range(2000))  # a decode's worth of computing
            await turns.maybe()
            ran_before_end = ran_before_end or beat.is_set()
        await task
        return turns.turns, ran_before_end

    turns, ran = asyncio.run(run(0.0))
    assert turns == 50 and ran
    turns, ran = asyncio.run(run(3600.0))
    assert turns == 0 and not ran  # no turn asked for: the other task waits for the loop's end
