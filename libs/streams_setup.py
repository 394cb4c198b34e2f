"""Creating the shared streams with the settings every producer and consumer agrees on."""

from __future__ import annotations

from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError

from libs.config import Settings
from libs.streams import ROWS_STREAM, ROWS_SUBJECTS

_STREAM_IN_USE = 10058


def rows_stream_config(settings: Settings) -> api.StreamConfig:
    """``SLUICE_ROWS``: file storage, the settings' dedup window, rollup headers allowed.

    Rollup is what keeps a single resolved mark per source (``Nats-Rollup: sub``); the dedup
    window is what makes a capture's re-read after a crash publish nothing twice.
    """
    return api.StreamConfig(
        name=ROWS_STREAM,
        subjects=list(ROWS_SUBJECTS),
        storage=api.StorageType.FILE,
        duplicate_window=settings.dedup_window_s,
        allow_rollup_hdrs=True,
        num_replicas=settings.stream_replicas,
        # Every span reads through its own consumer: nats-server 2.15 caps a stream that names
        # no limit at 1,000 consumers, which a changefeed of 1,000 tables passed (its spans'
        # pulls and prepares then failed, "maximum consumers limit reached", and lag grew).
        max_consumers=settings.rows_max_consumers,
    )


async def ensure_rows_stream(js: JetStreamContext, settings: Settings) -> api.StreamInfo:
    """Create the ROWS stream, or bring an existing one to this config."""
    config = rows_stream_config(settings)
    try:
        return await js.add_stream(config)
    except BadRequestError as exc:
        if exc.err_code != _STREAM_IN_USE:
            raise
    return await js.update_stream(config)
