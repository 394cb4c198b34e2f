"""A heartbeat read for liveness only: everything but its tables, validated as the contract says.

A sink-worker's heartbeat carries every span it holds (its complete report, for the
replication-manager): at 3,300 spans about 580 KB, which the full decode validates table by
table (about 20 ms, five times a second per worker). The member service needs only who sent it
and whether it drains or leaves, so it validates the envelope and the heartbeat's other fields
with the contract's own field definitions and leaves the tables unread (1.3 ms for the same
heartbeat). Anything this cannot read (another version, garbage) goes through the registry's
full decode, so upcasting and the ``ContractError`` kinds stay the registry's.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from contracts import REGISTRY
from contracts.events.scheduling import MemberHeartbeatV3

_TYPE, _VERSION = REGISTRY.key_of(MemberHeartbeatV3)
# v2 is v3 without ``part``/``parts`` (a report in one message, still written as v2): the same
# fields with those at their defaults.
_AS_IS = frozenset({2, _VERSION})

# The heartbeat's fields but ``tables``, with their definitions (types, bounds, defaults).
_Fields: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "HeartbeatLivenessFields", __config__=ConfigDict(extra="ignore"),
    **{name: (info.annotation, info) for name, info in MemberHeartbeatV3.model_fields.items()
       if name != "tables"},
)


class _Envelope(BaseModel):
    # Only what says which contract this is; the rest of the envelope is not needed here.
    model_config = ConfigDict(extra="ignore")
    type: str
    version: int
    data: _Fields


def _consistent(fields: dict[str, Any]) -> bool:
    """The contract's own checks but those of the tables (the registry says what fails)."""
    return fields["part"] < fields["parts"] and not (
        fields["unchanged"] and (fields["complete"] or fields["parts"] > 1))


def decode_liveness(data: bytes) -> MemberHeartbeatV3:
    """The heartbeat in ``data`` with its fields validated and ``tables`` left empty.

    Raises ``ContractError`` (from the registry) for anything that is not a valid heartbeat of
    the current version or v2; other versions are decoded in full (and upcast)."""
    try:
        env = _Envelope.model_validate_json(data)
    except ValidationError:
        env = None
    fields = env.data.model_dump() if env is not None else {}
    if env is None or env.type != _TYPE or env.version not in _AS_IS or not _consistent(fields):
        event: Any = REGISTRY.decode(data).event
        return event
    return MemberHeartbeatV3.model_construct(**fields, tables=[])
