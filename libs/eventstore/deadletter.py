"""Dead letters: a message nobody can process is parked with its reason, never dropped.

The original payload goes to ``deadletter_subject(origin_stream)`` in the dead-letter stream
with the original headers plus ``Sluice-Dead-Letter-*`` headers that say why and where from.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError

from libs.config import Settings, get_settings
from libs.streams import DEADLETTER_STREAM, DEADLETTER_SUBJECTS, deadletter_subject
from libs.telemetry.metrics import DEAD_LETTERS

log = logging.getLogger(__name__)

H_REASON = "Sluice-Dead-Letter-Reason"
H_KIND = "Sluice-Dead-Letter-Kind"
H_SUBJECT = "Sluice-Dead-Letter-Original-Subject"
H_SEQ = "Sluice-Dead-Letter-Original-Seq"
# Server-interpreted headers of the original are kept under this prefix instead of verbatim:
# re-sending Nats-Rollup would purge the dead-letter subject, Nats-Expected-* would make the
# publish fail and the original Nats-Msg-Id would be deduplicated against unrelated messages.
RENAMED_PREFIX = "Sluice-Original-"

_MAX_HEADER_VALUE = 2000


class DeadLetterable(Protocol):
    """What ``dead_letter`` needs of a message: a JetStream ``Msg`` or a stored message."""

    @property
    def subject(self) -> str: ...

    @property
    def data(self) -> bytes: ...

    @property
    def headers(self) -> dict[str, str] | None: ...


def _header_value(value: str) -> str:
    # NATS headers are line based: a newline in a validation message would corrupt the frame.
    flat = " ".join(str(value).split())
    return flat[:_MAX_HEADER_VALUE]


def dead_letter_headers(headers: Mapping[str, str] | None, *, reason: str, kind: str, subject: str,
                        seq: int | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in (headers or {}).items():
        if name.lower().startswith("nats-"):
            out[RENAMED_PREFIX + name] = _header_value(value)
        else:
            out[name] = _header_value(value)
    out[H_REASON] = _header_value(reason) or kind
    out[H_KIND] = kind
    out[H_SUBJECT] = subject
    if seq is not None:
        out[H_SEQ] = str(seq)
    return out


async def ensure_deadletter_stream(js: JetStreamContext, settings: Settings | None = None) -> None:
    """Create the dead-letter stream if it is missing; an existing one is left as configured."""
    settings = settings or get_settings()
    try:
        await js.stream_info(DEADLETTER_STREAM)
        return
    except NotFoundError:
        pass
    try:
        await js.add_stream(api.StreamConfig(
            name=DEADLETTER_STREAM, subjects=list(DEADLETTER_SUBJECTS),
            storage=api.StorageType.FILE, num_replicas=settings.stream_replicas,
            duplicate_window=settings.dedup_window_s,
        ))
    except BadRequestError as exc:
        # Another process created it first with a slightly different config: use theirs.
        if exc.err_code != 10058:
            raise


def _seq_of(msg: Any) -> int | None:
    seq = getattr(msg, "seq", None)
    if isinstance(seq, int):
        return seq
    try:
        return int(msg.metadata.sequence.stream)
    except Exception:  # core NATS messages have no JetStream metadata
        return None


async def dead_letter(js: JetStreamContext, msg: DeadLetterable, reason: str, kind: str,
                      origin_stream: str, *, seq: int | None = None, ack: bool = True) -> int:
    """Park ``msg`` in the dead-letter stream, then ack the original so consumption goes on.

    Returns the dead-letter stream sequence. ``ack=False`` is for messages read without an ack
    (replays). The publish carries ``Nats-Msg-Id = dl:<stream>:<seq>`` so that replaying the same
    bad message again (every new leader replays its log) does not park it twice.
    """
    if seq is None:
        seq = _seq_of(msg)
    headers = dead_letter_headers(msg.headers, reason=reason, kind=kind, subject=msg.subject, seq=seq)
    if seq is not None:
        headers[api.Header.MSG_ID.value] = f"dl:{origin_stream}:{seq}"
    ack_ = await js.publish(deadletter_subject(origin_stream), msg.data or b"", headers=headers)
    if not ack_.duplicate:
        DEAD_LETTERS.labels(origin_stream, kind).inc()
    log.warning("dead-lettered message", extra={"stream": origin_stream, "subject": msg.subject,
                                                "seq": seq, "kind": kind, "reason": reason})
    if ack:
        ack_fn = getattr(msg, "ack", None)
        if ack_fn is not None:
            await ack_fn()
    return int(ack_.seq)
