"""What a round does alongside its write: the next round's read-ahead, and its checkpoint stores
side by side.

- Read-ahead: while the round's batch is sorted and written (Spark, in a worker thread), every
  span's reader reads on past what it returned, as far as its source's newest resolved mark
  (fetched meanwhile too), keeping up to its next allowance of bodies (``SpanReader.read_ahead``).
  The next round's pull then finds its events in memory. It only fills readers: nothing of the
  next round is applied or checkpointed before this round's checkpoints are decided, because
  the round awaits it before it returns and the next round starts only after that.
- Checkpoint stores: each span's ``_finish`` (a KV compare-and-set on what that span last
  stored) runs concurrently with the other spans' ones, not one after another. The round
  returns only once every one of them has finished or failed, so a span's next store and the
  next round's comparison with the stored checkpoint always see the outcome of the previous
  one. They are not overlapped with the next round's pull: its first step reads the stored
  checkpoints, and read-ahead already takes the reading out of the time between two rounds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass

from nats.js import JetStreamContext

from services.sink_worker.round.pull import SpanReader, latest_resolved

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AheadSpan:
    reader: SpanReader
    source: str
    budget: int
    """Bodies to read ahead: the span's allowance for the next round."""


async def read_ahead(js: JetStreamContext, rows_stream: str, spans: Iterable[AheadSpan]) -> None:
    """Read every span ahead to its source's newest resolved mark. Never raises: what fails
    here is only read again by the next pull."""
    todo = [s for s in spans if s.budget > 0]
    if not todo:
        return
    try:
        sources = sorted({s.source for s in todo})
        found = await asyncio.gather(*(latest_resolved(js, source, rows_stream) for source in sources))
        until = {source: mark.stream_seq if mark is not None else None
                 for source, mark in zip(sources, found, strict=True)}
        await asyncio.gather(*(s.reader.read_ahead(until[s.source], s.budget) for s in todo))
    except Exception:
        log.warning("reading ahead failed; the next round reads from the stream", exc_info=True)


async def settle(steps: Iterable[Awaitable[None]]) -> None:
    """Run ``steps`` concurrently and wait for every one of them; then raise the first failure.

    ``asyncio.gather`` alone would return at the first failure with the others still running:
    a checkpoint store could then land after the next round compared the stored checkpoint."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
