"""The sink's reader and ``rows.changed`` v4 messages of several transactions (no servers): one
reader entry per message, each part an event of its own with its own id, ts and seq sharing
the message's bytes, the batch holding a message once with the parts it takes, parts at or
below a checkpoint ts dropped, a part dead alone."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import orjson
import pytest

from contracts.events.rows import RowsChangedV2, RowsChangedV4
from libs.scheduling.model import Span
from libs.streams import rows_subject
from services.sink_worker.round.apply_job import event_images, event_rows
from services.sink_worker.round.pull import Garbage, _dead_in, decode_for_span
from services.sink_worker.round.sort_job import SpanInput, event_records, run_sort

FIXTURES = Path(__file__).parent / "fixtures" / "contracts"
SPAN = Span.of("cf1", "src1", "shop", "orders")


@dataclass
class Msg:
    subject: str
    data: bytes
    headers: dict[str, str] | None = None


def _msg(obj: dict[str, object]) -> Msg:
    return Msg(rows_subject("src1", "shop", "orders"), json.dumps(obj).encode())


def test_a_message_of_several_transactions_is_one_entry_of_parts() -> None:
    raw = (FIXTURES / "rows.changed.v4.json").read_bytes()
    body = json.loads(raw)
    entry = decode_for_span(SPAN, Msg(rows_subject("src1", "shop", "orders"), raw), 7)
    parts = entry.expanded()
    assert len(parts) == 3 and all(p.stream_seq == 7 for p in parts)
    data = body["data"]
    assert [p.event_id for p in parts] == [data["event_id"], *(m["event_id"] for m in data["more"])]
    assert [(p.ts, p.seq) for p in parts] == [(data["ts"], data["seq"]),
                                              *((m["ts"], m["seq"]) for m in data["more"])]
    assert (entry.ts, entry.ts_last, entry.last_part) == (data["ts"], data["more"][-1]["ts"], True)
    # The parts share the message's bytes (no copy, no re-encoding): counted once.
    assert entry.body_bytes == len(raw) and all(p.data is entry.data for p in parts)
    assert [p.index for p in parts] == [0, 1, 2] and entry.index == -1
    for part in parts:
        assert isinstance(part.event, RowsChangedV2) and isinstance(part.event, RowsChangedV4)
        assert part.event.more == [] and part.event.event_id is None
        # The apply job reads each part from the message's bytes by its index, at its own place.
        [(ts, seq, part_no, images)] = event_images(0, 0, 0, part.data, [part.index])
        assert (ts, seq, part_no) == (part.ts, part.seq, part.part)
        assert images == [r.model_dump(mode="json") for r in part.event.rows]
    # Several picks of one message: parsed once, in the order asked.
    assert [p[:3] for p in event_images(0, 0, 0, raw, [2, 0])] == [
        (parts[2].ts, parts[2].seq, parts[2].part), (parts[0].ts, parts[0].seq, parts[0].part)]
    with pytest.raises(ValueError):
        event_rows(raw)  # a whole message of several without picks would apply only its first part


def test_the_batch_holds_a_message_once_with_the_parts_it_takes() -> None:
    raw = (FIXTURES / "rows.changed.v4.json").read_bytes()
    entry = decode_for_span(SPAN, Msg(rows_subject("src1", "shop", "orders"), raw), 7)
    first, second, third = entry.expanded()
    records = event_records("span", entry.expanded())
    assert all(r[8] is entry.data for r in records) and [r[9] for r in records] == [0, 1, 2]
    # The cut stops after the second part's transaction: one batch event, the message's bytes
    # once, the two parts it takes.
    cut = run_sort(records, [SpanInput("span", first.ts - 1, second.ts)])
    [(span, ts, seq, part, body, picks)] = cut.batch(["span"])
    assert (span, ts, seq, part, body, picks) == ("span", first.ts, first.seq, first.part, raw, [0, 1])
    # Read after a checkpoint inside the message: only what is left of it.
    later = run_sort(event_records("span", entry.expanded()), [SpanInput("span", first.ts, third.ts)])
    assert [e[5] for e in later.batch(["span"])] == [[1, 2]]


def test_parts_at_or_below_the_checkpoint_are_dropped() -> None:
    raw = (FIXTURES / "rows.changed.v4.json").read_bytes()
    entry = decode_for_span(SPAN, Msg(rows_subject("src1", "shop", "orders"), raw), 7)
    first, second, third = entry.expanded()
    assert entry.after(first.ts - 1) is entry
    kept = entry.after(first.ts)
    assert kept is not None and [p.event_id for p in kept.expanded()] == [second.event_id, third.event_id]
    assert kept.ts == second.ts and kept.stream_seq == 7
    assert entry.after(third.ts) is None


def test_one_part_dead_alone_and_a_dead_message_all_dead() -> None:
    raw = (FIXTURES / "rows.changed.v4.json").read_bytes()
    entry = decode_for_span(SPAN, Msg(rows_subject("src1", "shop", "orders"), raw), 7)
    middle = entry.expanded()[1]
    marked = _dead_in(entry, middle)
    assert [p.dead for p in marked.expanded()] == [False, True, False]
    assert all(p.dead for p in replace(entry, dead=True).expanded())


def test_a_bad_part_dead_letters_the_message_and_v4_fields_in_v3_are_garbage() -> None:
    obj = orjson.loads((FIXTURES / "rows.changed.v4.json").read_bytes())
    bad = json.loads(json.dumps(obj))
    bad["data"]["more"][0]["rows"][0]["after"] = {"id": 1, "nope": 2}  # a column not in meta
    with pytest.raises(Garbage) as caught:
        decode_for_span(SPAN, _msg(bad), 8)
    assert caught.value.event is not None and all(p.dead for p in caught.value.event.expanded())
    old = json.loads(json.dumps(obj))
    old["version"] = 3
    with pytest.raises(Garbage) as refused:
        decode_for_span(SPAN, _msg(old), 9)
    assert refused.value.kind == "invalid_data"


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_the_apply_job_reads_every_rows_version_it_can_as_it_is(version: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver validated every event it pulled, so the apply job only parses a body whose rows
    are the newest version's as they are: every older ``rows.changed`` version (capture writes a
    message of one part as v3; it went through the registry, 40 % of the job's Python time,
    once v4 came). Same images as the registry's decode."""
    from contracts import REGISTRY

    raw = (FIXTURES / f"rows.changed.v{version}.json").read_bytes()
    if version == 4:  # a message of several parts is read by its picks
        raw = json.dumps({**json.loads(raw), "data": {**json.loads(raw)["data"], "more": []}}).encode()
    event = REGISTRY.decode(raw).event
    assert isinstance(event, RowsChangedV2)
    want = [r.model_dump(mode="json") for r in event.rows]

    def no_registry(*_: object, **__: object) -> None:
        raise AssertionError("the apply job went through the registry")

    monkeypatch.setattr(REGISTRY, "decode", no_registry)
    got = event_rows(raw)
    # v1 had no ordinal; the Spark path orders by (ts, seq, part, row) and does not read it.
    assert [{k: v for k, v in r.items() if k != "ordinal"} for r in got] == [
        {k: v for k, v in r.items() if k != "ordinal"} for r in want]
