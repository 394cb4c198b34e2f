"""Contracts: old versions upcast to the newest, schemas match the models, bad input is typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from contracts import REGISTRY, ContractError
from contracts.events.members import MemberJoinedV1, MemberJoinedV2
from contracts.events.rows import RowsChangedV2, RowsChangedV4, parts_of
from contracts.generate import SCHEMA_DIR, render_schemas
from contracts.registry import Registry

FIXTURES = Path(__file__).parent / "fixtures" / "contracts"


def test_every_contract_version_has_a_fixture() -> None:
    wanted = {f"{t}.v{v}.json" for t, v, _ in REGISTRY.contracts()}
    present = {p.name for p in FIXTURES.glob("*.json")}
    assert wanted <= present, f"fixtures missing for {sorted(wanted - present)}"


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.stem)
def test_fixture_decodes_to_newest_version(fixture: Path) -> None:
    raw = fixture.read_bytes()
    decoded = REGISTRY.decode(raw)
    original = json.loads(raw)
    assert decoded.original_version == original["version"]
    assert decoded.envelope.version == REGISTRY.latest_version(original["type"])
    models = {(t, v): m for t, v, m in REGISTRY.contracts()}
    newest_model = models[(original["type"], decoded.envelope.version)]
    assert isinstance(decoded.event, newest_model)
    assert decoded.envelope.id == original["id"]


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.stem)
def test_encode_writes_what_the_envelope_would(fixture: Path) -> None:
    """``encode`` serializes the event once, straight into the envelope's JSON: byte for byte
    what dumping the envelope (the event as a dict inside it) writes, for every contract."""
    original = json.loads(fixture.read_bytes())
    models = {(t, v): m for t, v, m in REGISTRY.contracts()}
    event = models[(original["type"], original["version"])].model_validate(original["data"])
    fast = REGISTRY.encode(event, producer="p/1", epoch=3, event_id="e-1")
    env = REGISTRY.envelope(event, producer="p/1", epoch=3, event_id="e-1")
    written = REGISTRY.decode(fast).envelope
    slow = env.model_copy(update={"time": written.time}).model_dump_json().encode()
    assert fast == slow
    assert REGISTRY.decode(fast).event == REGISTRY.decode(slow).event


def test_member_joined_v1_upcasts_with_unknown_incarnation() -> None:
    raw = REGISTRY.encode(MemberJoinedV1(member_id="w1", address="h:1"), producer="t")
    decoded = REGISTRY.decode(raw)
    assert isinstance(decoded.event, MemberJoinedV2)
    assert decoded.event.incarnation == ""
    assert decoded.event.member_id == "w1"
    assert decoded.original_version == 1


def test_round_trip_keeps_envelope_fields() -> None:
    event = MemberJoinedV2(member_id="w2", incarnation="abc", address="h:2", labels={"z": "1"})
    raw = REGISTRY.encode(event, producer="member/x", epoch=12, event_id="id-1")
    decoded = REGISTRY.decode(raw)
    assert decoded.event == event
    env = decoded.envelope
    assert (env.producer, env.epoch, env.id) == ("member/x", 12, "id-1")


def test_checked_in_schemas_match_models() -> None:
    rendered = render_schemas()
    on_disk = {p.name: p.read_text() for p in SCHEMA_DIR.glob("*.json")}
    assert set(on_disk) == set(rendered), "run `python -m contracts.generate`"
    for name, text in rendered.items():
        assert on_disk[name] == text, f"{name} drifted from its model; run `python -m contracts.generate`"


def _envelope(**over: object) -> bytes:
    body: dict[str, object] = {"type": "member.left", "version": 1, "id": "x", "time": "2026-01-01T00:00:00Z",
                               "producer": "p", "epoch": 0,
                               "data": {"member_id": "w", "incarnation": "i", "reason": "shutdown"}}
    body.update(over)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (b"\x00\xffnot json", "malformed"),
        (b"[1,2,3]", "malformed"),
        (b'{"type": "member.left"}', "malformed"),
        (_envelope(type="no.such.type"), "unknown_type"),
        (_envelope(version=99), "unknown_version"),
        (_envelope(data={"member_id": ""}), "invalid_data"),
        (_envelope(data={"member_id": "w", "incarnation": "i", "reason": "x", "extra": 1}), "invalid_data"),
    ],
)
def test_bad_input_raises_one_typed_error(raw: bytes, kind: str) -> None:
    with pytest.raises(ContractError) as err:
        REGISTRY.decode(raw)
    assert err.value.kind == kind
    assert str(err.value).startswith(kind)


def test_invalid_old_version_is_reported_against_its_own_version() -> None:
    raw = _envelope(type="member.joined", version=1, data={"address": "x"})
    with pytest.raises(ContractError) as err:
        REGISTRY.decode(raw)
    assert err.value.kind == "invalid_data"
    assert err.value.version == 1
    assert "member_id" in err.value.reason


def test_rows_changed_v1_upcasts_with_unknown_ordinals() -> None:
    decoded = REGISTRY.decode((FIXTURES / "rows.changed.v1.json").read_bytes())
    assert isinstance(decoded.event, RowsChangedV2) and decoded.original_version == 1
    assert [r.ordinal for r in decoded.event.rows] == [None]
    assert decoded.envelope.data["rows"][0]["ordinal"] is None


def test_rows_changed_v3_is_a_v4_message_of_one_part() -> None:
    raw = (FIXTURES / "rows.changed.v3.json").read_bytes()
    decoded = REGISTRY.decode(raw)
    assert isinstance(decoded.event, RowsChangedV4) and decoded.original_version == 3
    assert decoded.event.more == [] and decoded.event.event_id is None
    [(event_id, part)] = parts_of(decoded.event, decoded.envelope.id)
    assert event_id == "fx-rows.changed.v3" and part is decoded.event


def test_rows_changed_v4_parts_keep_each_transactions_boundary() -> None:
    raw = (FIXTURES / "rows.changed.v4.json").read_bytes()
    decoded = REGISTRY.decode(raw)
    assert isinstance(decoded.event, RowsChangedV4)
    parts = parts_of(decoded.event, decoded.envelope.id)
    body = json.loads(raw)["data"]
    assert [i for i, _ in parts] == [body["event_id"], *(p["event_id"] for p in body["more"])]
    assert [(p.ts, p.seq, p.position.gtid) for _, p in parts] == [
        (body["ts"], body["seq"], "0-1-41"),
        *((p["ts"], p["seq"], p["position"]["gtid"]) for p in body["more"])]
    assert [len(p.rows) for _, p in parts] == [1, 1, 1]
    for _, part in parts:  # each alone, as the v3 message it would have been
        assert isinstance(part, RowsChangedV4) and part.more == [] and part.event_id is None
        assert part.meta == decoded.event.meta and part.table == "orders"


@pytest.mark.parametrize("change", ["seq_back", "ts_back", "no_first_id"])
def test_rows_changed_v4_refuses_parts_out_of_order(change: str) -> None:
    obj = json.loads((FIXTURES / "rows.changed.v4.json").read_bytes())
    data = obj["data"]
    if change == "seq_back":
        data["more"][1]["seq"] = data["more"][0]["seq"]
    elif change == "ts_back":
        data["more"][0]["ts"] = data["ts"] - 1
    else:
        data["event_id"] = None
    with pytest.raises(ContractError) as err:
        REGISTRY.decode(json.dumps(obj).encode())
    assert err.value.kind == "invalid_data"


@pytest.mark.parametrize(("type_", "old", "new"), [("rows.changed", 3, 4), ("ddl.executed", 2, 3)])
def test_a_geometry_column_needs_the_version_that_has_the_kind(type_: str, old: int, new: int) -> None:
    """``geometry`` came with rows.changed v4 / ddl.executed v3: an older version carrying it is
    invalid against its own schema (as a reader of that version finds it), every older message
    upcasts unchanged, and the new version decodes."""
    fixture = json.loads((FIXTURES / f"{type_}.v{new}.json").read_bytes())
    decoded = REGISTRY.decode(json.dumps(fixture).encode())
    assert decoded.original_version == new
    meta = decoded.event.meta if type_ == "rows.changed" else decoded.event.meta_after  # type: ignore[attr-defined]
    assert meta.columns[-1].kind == "geometry"
    with pytest.raises(ContractError) as err:
        REGISTRY.decode(json.dumps({**fixture, "version": old}).encode())
    assert err.value.kind == "invalid_data" and err.value.version == old
    older = REGISTRY.decode((FIXTURES / f"{type_}.v{old}.json").read_bytes())
    assert older.original_version == old and REGISTRY.key_of(type(older.event)) == (type_, new)


def test_latest_version_follows_registration_in_any_order() -> None:
    """The newest version per type is kept as models register (every decode asks for it)."""
    registry = Registry()

    class V2(BaseModel):
        n: int

    class V1(BaseModel):
        n: int

    registry.register("t.x", 2)(V2)
    registry.register("t.x", 1)(V1)
    assert registry.latest_version("t.x") == 2
    with pytest.raises(ContractError) as caught:
        registry.latest_version("t.y")
    assert caught.value.kind == "unknown_type"
    assert registry.decode_envelope(registry.envelope(V2(n=1), producer="p")).event == V2(n=1)
    assert REGISTRY.latest_version("member.joined") == max(
        v for t, v, _m in REGISTRY.contracts() if t == "member.joined")


def test_member_heartbeat_v1_upcasts_as_a_complete_report() -> None:
    from contracts.events.scheduling import MemberHeartbeatV3

    decoded = REGISTRY.decode((FIXTURES / "member.heartbeat.v1.json").read_bytes())
    assert isinstance(decoded.event, MemberHeartbeatV3) and decoded.event.complete
    assert decoded.event.tables[0].span.table == "orders"
    partial = REGISTRY.decode((FIXTURES / "member.heartbeat.v2.json").read_bytes()).event
    assert isinstance(partial, MemberHeartbeatV3) and not partial.complete
