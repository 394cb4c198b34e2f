"""A member's heartbeat as NATS messages: one, or several when the report is larger than the
server takes.

A heartbeat carries a span's status for every span its report covers, ~175 bytes each, so a
member holding ~6,000 spans (three workers' share of 10,000 tables after two of them died) wrote
a complete report larger than the server's ``max_payload`` (1 MiB by default): the publish
failed, no heartbeat was confirmed, and the member fenced itself and dropped every span, over and
over. Such a report is cut into parts (``member.heartbeat`` v3, ``part`` of ``parts``, the same
``seq``), each within the server's limit, sent back to back; the header
``HEARTBEAT_PART_HEADER`` says which part of which report a message is, so the
replication-manager collects them without decoding (``ReportParts``) and takes the report only
once all of its parts arrived. Heartbeats are core NATS (at most once): a report with a part
lost is dropped whole when a newer report of the member begins, as a lost heartbeat always was;
the next complete one (about a second later) says everything again.

A report that fits in one message is written as v2, as before, which older readers read; an
``unchanged`` heartbeat (liveness only) is v3, which an older replication-manager leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import ValidationError

from contracts import REGISTRY, ContractError, Envelope
from contracts.events.scheduling import MemberHeartbeatV2, MemberHeartbeatV3
from libs.eventstore.snapshot_chunks import DEFAULT_MAX_PAYLOAD
from libs.streams import HEARTBEAT_PART_HEADER, HEARTBEAT_PARTIAL_HEADER, HEARTBEAT_UNCHANGED_HEADER

T = TypeVar("T")

ENVELOPE_MARGIN = 4096
"""Bytes kept free of a part's encoded report under ``max_payload``: its headers and slack."""

MAX_PARTS = 4096
"""The most parts a reader accepts in a header (a guard against garbage, not a real bound:
4,096 parts of 1 MiB hold some 24 million spans)."""

Message = tuple[bytes, dict[str, str] | None]


class ReportTooLarge(ValueError):
    """A report that cannot be cut to fit: a single span's status is larger than the limit."""


def heartbeat_messages(hb: MemberHeartbeatV3, *, max_payload: int | None, producer: str) -> list[Message]:
    """``hb`` encoded as the messages to publish, in order, each with its headers;
    ``max_payload``: the server's (None or 0: not known yet, NATS' default)."""
    flags = {} if hb.complete else {HEARTBEAT_PARTIAL_HEADER: "1"}
    if hb.unchanged:
        flags[HEARTBEAT_UNCHANGED_HEADER] = "1"
    max_payload = max_payload or DEFAULT_MAX_PAYLOAD
    budget = max_payload - ENVELOPE_MARGIN
    whole = REGISTRY.encode(hb if hb.unchanged else _as_v2(hb), producer=producer)
    tables = hb.tables
    if len(whole) <= budget:
        return [(whole, flags or None)]
    if len(tables) < 2:
        raise ReportTooLarge(f"a heartbeat of {len(whole):,} bytes with {len(tables)} span(s) "
                             f"does not fit the server's max_payload of {max_payload:,} bytes")
    parts = min(len(tables), -(-len(whole) // budget) + 1)  # one more than the size says: slack
    while True:
        encoded = [REGISTRY.encode(hb.model_copy(update={"part": i, "parts": parts, "tables": chunk}),
                                   producer=producer)
                   for i, chunk in enumerate(_slices(tables, parts))]
        if all(len(data) <= budget for data in encoded):
            return [(data, {**flags, HEARTBEAT_PART_HEADER: f"{hb.seq}/{i}/{parts}"})
                    for i, data in enumerate(encoded)]
        if parts == len(tables):
            raise ReportTooLarge(f"a span's status alone does not fit the server's max_payload of "
                                 f"{max_payload:,} bytes")
        parts = min(len(tables), parts * 2)


def _slices(items: Sequence[T], parts: int) -> list[list[T]]:
    n = len(items)
    return [list(items[i * n // parts:(i + 1) * n // parts]) for i in range(parts)]


def _as_v2(hb: MemberHeartbeatV3) -> MemberHeartbeatV2:
    fields = {name: getattr(hb, name) for name in MemberHeartbeatV2.model_fields}
    return MemberHeartbeatV2.model_construct(**fields)


def parse_part_header(value: str) -> tuple[int, int, int] | None:
    """``(seq, part, parts)`` of a ``HEARTBEAT_PART_HEADER`` value; None for anything else."""
    try:
        seq, part, parts = (int(x) for x in value.split("/"))
    except ValueError:
        return None
    if seq < 0 or not 0 <= part < parts <= MAX_PARTS:
        return None
    return seq, part, parts


@dataclass
class _Open:
    key: tuple[int, bool, int]
    got: dict[int, bytes] = field(default_factory=dict)


@dataclass
class ReportParts:
    """The parts of each member's report being collected, by heartbeat subject: one report at
    a time per member (a member sends a report's parts back to back, on one connection, so a
    message of another report means the open one lost a part)."""

    _open: dict[str, _Open] = field(default_factory=dict)
    dropped: int = 0
    """Reports given up with parts missing."""

    def add(self, subject: str, data: bytes, partial: bool, header: str) -> list[bytes] | None:
        """Every part of the report, in order, once ``data`` completes it; else None (also for a
        header that is not a part's)."""
        parsed = parse_part_header(header)
        if parsed is None:
            return None
        seq, part, parts = parsed
        key = (seq, partial, parts)
        open_ = self._open.get(subject)
        if open_ is None or open_.key != key:
            if open_ is not None:
                self.dropped += 1
            open_ = self._open[subject] = _Open(key)
        open_.got[part] = data
        if len(open_.got) < parts:
            return None
        del self._open[subject]
        return [open_.got[i] for i in range(parts)]

    def single(self, subject: str) -> None:
        """A report of one message arrived on ``subject``: the open one there lost a part."""
        if self._open.pop(subject, None) is not None:
            self.dropped += 1


def joined(parts: list[MemberHeartbeatV3]) -> MemberHeartbeatV3 | None:
    """The report the decoded ``parts`` make together, or None when they are not the parts of
    one report (a forged or mixed-up header)."""
    first = parts[0]
    same = (first.member_id, first.incarnation, first.seq, first.complete, first.epoch, len(parts))
    if any((p.member_id, p.incarnation, p.seq, p.complete, p.epoch, p.parts) != same or p.part != i
           for i, p in enumerate(parts)):
        return None
    if len(parts) == 1:
        return first
    return first.model_copy(update={"part": 0, "parts": 1, "tables": [t for p in parts for t in p.tables]})


class _HeartbeatEnvelope(Envelope):
    """The envelope of a heartbeat, its body validated as the newest version in one pass."""

    data: MemberHeartbeatV3  # type: ignore[assignment]


_TYPE, _VERSION = REGISTRY.key_of(MemberHeartbeatV3)
_V3_ONLY = frozenset(MemberHeartbeatV3.model_fields) - frozenset(MemberHeartbeatV2.model_fields)


def decode_heartbeat(data: bytes) -> MemberHeartbeatV3:
    """A heartbeat as the registry decodes it, raising ``ContractError`` as it does.

    A report in one message is v2, which the registry validates as v2, upcasts (a dump and a
    copy) and validates again as v3: three passes over every span, for a complete report of
    thousands of them once a second per worker, on the replication-manager leader's loop. A v2
    body is a v3 body without ``part``, ``parts`` and ``unchanged``, whose defaults are what the
    upcaster sets, so v2 and v3 are validated here in one pass from the bytes; anything else
    (another version, a v2 body with v3's fields, garbage) goes the registry's way, which says
    what is wrong with it."""
    try:
        env: _HeartbeatEnvelope | None = _HeartbeatEnvelope.model_validate_json(data)
    except ValidationError:
        env = None
    if (env is not None and env.type == _TYPE
            and (env.version == _VERSION or (env.version == 2 and not env.data.model_fields_set & _V3_ONLY))):
        return env.data
    event = REGISTRY.decode(data).event
    if not isinstance(event, MemberHeartbeatV3):
        raise ContractError("invalid_data", f"{type(event).__name__} is not a heartbeat")
    return event
