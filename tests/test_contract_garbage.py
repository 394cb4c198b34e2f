"""Garbage in every contract: each version of each event type (its checked-in fixture), broken
in every field, is refused with the one typed ``ContractError`` (which the consumers turn into a
dead-letter entry with its reason) and never with another exception or a silent accept.

A sweep of the whole class, not one example per event: a contract added later is covered by
its fixture (``test_contracts`` requires one per version).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from contracts import REGISTRY, ContractError

FIXTURES = Path(__file__).parent / "fixtures" / "contracts"
CASES = sorted(FIXTURES.glob("*.json"))

# A value no field of a contract accepts, unless it is typed "anything": a list of objects is
# neither a string, a number, a flag, a list of scalars nor a mapping of named fields.
WRONG = [{"\u0000": [None, {"x": float("inf")}]}]


def _raw(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def _decode_or_refuse(raw: bytes) -> str:
    """'ok' or the refusal's kind; any other exception fails the test."""
    try:
        REGISTRY.decode(raw)
    except ContractError as err:
        assert str(err).startswith(err.kind) and err.reason, err
        return err.kind
    return "ok"


@pytest.mark.parametrize("fixture", CASES, ids=lambda p: p.stem)
def test_every_field_broken_is_refused_with_a_reason(fixture: Path) -> None:
    good = json.loads(fixture.read_bytes())
    assert _decode_or_refuse(_raw(good)) == "ok"
    data: dict[str, Any] = good["data"]
    refused_fields = []
    for name in data:
        broken = {**good, "data": {**data, name: WRONG}}
        kind = _decode_or_refuse(_raw(broken))
        assert kind in ("ok", "invalid_data"), (name, kind)
        if kind == "invalid_data":
            refused_fields.append(name)
        # Without the field: the default where it has one, else refused, never a crash.
        missing = {**good, "data": {k: v for k, v in data.items() if k != name}}
        assert _decode_or_refuse(_raw(missing)) in ("ok", "invalid_data"), name
    # Not vacuous: a typed field of each contract refuses the wrong value.
    assert refused_fields or not data, f"{fixture.stem}: no field refused a list of objects"
    # Unknown fields are refused (extra="forbid"), so a producer's typo is not dropped silently.
    assert _decode_or_refuse(_raw({**good, "data": {**data, "no_such_field": 1}})) == "invalid_data"
    # Data that is not an object at all.
    for not_object in ([data], "data", 7, None):
        assert _decode_or_refuse(_raw({**good, "data": not_object})) in ("malformed", "invalid_data")


@pytest.mark.parametrize("fixture", CASES, ids=lambda p: p.stem)
def test_cut_or_corrupted_bytes_are_malformed(fixture: Path) -> None:
    raw = fixture.read_bytes().rstrip()
    for end in sorted({1, len(raw) // 3, len(raw) // 2, len(raw) - 1}):
        assert _decode_or_refuse(raw[:end]) == "malformed", end
    assert _decode_or_refuse(b"\xff\xfe" + raw) == "malformed"
    envelope = json.loads(raw)
    for field in ("type", "version", "id"):
        kind = _decode_or_refuse(_raw({k: v for k, v in envelope.items() if k != field}))
        assert kind == "malformed", field
    assert _decode_or_refuse(_raw({**envelope, "version": envelope["version"] + 1000})) == "unknown_version"
