"""The member service reads heartbeats for liveness only (``services/member/liveness.py``):
the same fields as the full decode, the tables left unread, bad input refused the same way."""

from __future__ import annotations

import json

import pytest

from contracts import REGISTRY, ContractError
from contracts.events.members import MemberLeftV1
from contracts.events.scheduling import MemberHeartbeatV3, SpanRefV1, TableStatusV1
from services.member.liveness import decode_liveness


def heartbeat(tables: int, **kw: object) -> MemberHeartbeatV3:
    statuses = [TableStatusV1(span=SpanRefV1(changefeed="cf", source="s", database="d", table=f"t{i}"),
                              state="replicating", checkpoint_ts=10 + i, resolved_ts=20 + i)
                for i in range(tables)]
    fields: dict[str, object] = {"member_id": "w1", "incarnation": "i1", "address": "h:1", "epoch": 7,
                                 "seq": 41, "tables": statuses, **kw}
    return MemberHeartbeatV3(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("flags", [{}, {"draining": True}, {"leaving": True}])
def test_liveness_has_every_field_of_the_full_decode_but_the_tables(flags: dict[str, bool]) -> None:
    raw = REGISTRY.encode(heartbeat(500, **flags), producer="sink-worker/w1")
    full = REGISTRY.decode(raw).event
    assert isinstance(full, MemberHeartbeatV3) and len(full.tables) == 500
    light = decode_liveness(raw)
    assert isinstance(light, MemberHeartbeatV3) and light.tables == []
    assert light.model_dump(exclude={"tables"}) == full.model_dump(exclude={"tables"})


def test_liveness_refuses_what_the_contract_refuses() -> None:
    raw = json.loads(REGISTRY.encode(heartbeat(2), producer="sink-worker/w1"))
    raw["data"]["member_id"] = ""  # min_length=1
    with pytest.raises(ContractError):
        decode_liveness(json.dumps(raw).encode())
    with pytest.raises(ContractError):
        decode_liveness(b"\x00 not json")
    raw["data"]["member_id"] = "w1"
    raw["version"] = 99
    with pytest.raises(ContractError):
        decode_liveness(json.dumps(raw).encode())


def test_another_event_on_the_subject_is_returned_as_itself() -> None:
    raw = REGISTRY.encode(MemberLeftV1(member_id="w1", incarnation="i1", reason="x"), producer="t")
    assert isinstance(decode_liveness(raw), MemberLeftV1)  # the service refuses it by type
