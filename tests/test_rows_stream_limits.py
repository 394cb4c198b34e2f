"""The ROWS stream takes a consumer per table past nats-server's default cap: 2.15 allows a
stream that names no limit 1,000 consumers, and every span (and every span being prepared)
reads through its own, so a changefeed of 1,000 tables failed its pulls. Against a real
nats-server: a stream without a limit refuses the 1,001st consumer; ``SLUICE_ROWS`` takes more."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError

from libs.config import Settings
from libs.streams import ROWS_STREAM, rows_subject
from libs.streams_setup import ensure_rows_stream

_MAX_CONSUMERS_REACHED = 10026


async def _consumers(js: JetStreamContext, stream: str, subject: str, count: int) -> list[str]:
    """Create ``count`` ephemeral consumers on ``stream`` (one subject each); the names of those
    made before the server refused one for its consumer limit."""
    made: list[str] = []
    for start in range(0, count, 100):
        results = await asyncio.gather(*(
            js.add_consumer(stream, api.ConsumerConfig(
                filter_subject=subject.format(n=n), ack_policy=api.AckPolicy.EXPLICIT,
                inactive_threshold=60.0, mem_storage=True))
            for n in range(start, min(count, start + 100))), return_exceptions=True)
        for result in results:
            if isinstance(result, BadRequestError) and result.err_code == _MAX_CONSUMERS_REACHED:
                return made
            if isinstance(result, BaseException):
                raise result
            made.append(result.name)
    return made


async def test_the_rows_stream_takes_more_consumers_than_the_servers_default(js: JetStreamContext) -> None:
    # The cap this guards against, on this server: a stream that names no limit.
    await js.add_stream(api.StreamConfig(name="LIMITS_DEFAULT", subjects=["limits.default.>"],
                                         storage=api.StorageType.MEMORY))
    try:
        assert len(await _consumers(js, "LIMITS_DEFAULT", "limits.default.t{n}", 1_050)) == 1_000
    finally:
        await js.delete_stream("LIMITS_DEFAULT")
    info = await ensure_rows_stream(js, Settings())
    assert info.config.max_consumers == Settings().rows_max_consumers
    subject = rows_subject("limits", "db", "t") + "{n}"
    made = await _consumers(js, ROWS_STREAM, subject, 1_050)
    try:
        assert len(made) == 1_050
        # Other tests' consumers on the shared server come and go (inactive thresholds), so
        # the count is checked against ours alone: past the default cap, and the last one made
        # is there to be read.
        assert (await js.stream_info(ROWS_STREAM)).state.consumer_count >= 1_050
        assert (await js.consumer_info(ROWS_STREAM, made[-1])).name == made[-1]
    finally:
        for start in range(0, len(made), 100):
            await asyncio.gather(*(js.delete_consumer(ROWS_STREAM, name) for name in made[start:start + 100]))
