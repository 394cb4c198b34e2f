"""Reading what the NATS sink published."""

from __future__ import annotations

from nats.js import JetStreamContext


async def read_stream(js: JetStreamContext, stream: str) -> list[tuple[str, dict[str, str], bytes]]:
    """Every message of ``stream`` in stream order: (subject, headers, data)."""
    info = await js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(stream, seq)
        out.append((msg.subject, dict(msg.headers or {}), msg.data or b""))
    return out
