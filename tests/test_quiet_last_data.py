"""What lets a quiet span skip its consumer (``services.sink_worker.round.quiet``): the stream's
newest data message of the span's source, against a real nats-server. Every data subject of
the source counts, whoever published on it; its marks and other sources do not."""

from __future__ import annotations

import pytest
from nats.js import JetStreamContext

from libs.config import Settings
from libs.streams import ROWS_STREAM, ddl_subject, rejected_subject, resolved_subject, rows_subject
from libs.streams_setup import ensure_rows_stream
from services.sink_worker.round.pull import last_data_seq

pytestmark = pytest.mark.integration

SOURCE, OTHER = "quietdata", "quietdata2"


async def test_the_last_data_message_of_a_source_is_any_publishers_and_never_a_mark(
        js: JetStreamContext) -> None:
    await ensure_rows_stream(js, Settings())
    for source in (SOURCE, OTHER):
        for subject in (rows_subject(source, "d", "t"), ddl_subject(source, "d", "t"),
                        rejected_subject(source), resolved_subject(source)):
            await js.purge_stream(ROWS_STREAM, subject=subject)
    assert await last_data_seq(js, SOURCE) == 0  # nothing yet
    row = await js.publish(rows_subject(SOURCE, "d", "t"), b"not even an event")
    assert await last_data_seq(js, SOURCE) == row.seq
    await js.publish(resolved_subject(SOURCE), b"mark")
    await js.publish(rows_subject(OTHER, "d", "t"), b"other source")
    await js.publish(resolved_subject(OTHER), b"other mark")
    assert await last_data_seq(js, SOURCE) == row.seq  # marks and other sources are not its data
    for subject in (ddl_subject(SOURCE, "d", "t2"), rejected_subject(SOURCE), rows_subject(SOURCE, "e", "u")):
        ack = await js.publish(subject, b"x")
        assert await last_data_seq(js, SOURCE) == ack.seq, subject
    await js.publish(resolved_subject(SOURCE), b"mark")
    assert await last_data_seq(js, OTHER) < ack.seq
